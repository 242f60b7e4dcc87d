"""What runs on Ray: the engine, the consumer loop that claims work from Redis, the
publisher that streams chunks back, and the Ray Serve deployment that hosts them."""
