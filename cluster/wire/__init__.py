"""The contract between gateways and workers: messages, every Redis key, the queue, the reply log and the tenant store."""
