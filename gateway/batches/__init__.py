"""The OpenAI Batch API: files, batches and the runner that plays their lines."""
