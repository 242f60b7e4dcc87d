"""vLLM's own server and offline ``LLM.chat``, for side-by-side benchmarks only."""
