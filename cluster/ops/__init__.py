"""Operating charserve: the ``charserve`` CLI, the embedded stack, Serve configs and deploys."""
