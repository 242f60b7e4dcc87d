"""``POST /v1/chat/completions``: validate, render, admit and enqueue."""
