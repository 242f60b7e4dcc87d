"""The contract between gateways and workers: messages, vocabulary, every Redis key, the
queue, the reply log and the tenant store."""
