"""The FastAPI gateway: OpenAI-compatible routes, admission, and the relay that streams
replies from Redis back to clients."""
