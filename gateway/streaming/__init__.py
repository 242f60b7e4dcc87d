"""Replies on their way back: the inbox relay, SSE framing, socket writes, resume."""
