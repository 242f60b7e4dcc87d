"""``charserve backfill``: multi-turn character dialogues generated through a gateway."""
