"""The fabric every charserve process shares: settings, wire protocol, Redis keys and queue,
logging, the bundled model, and bringing an embedded cluster up."""
