"""How users reach the engine: the offline `LLM`, the `paged-server` CLI, the OpenAI-compatible HTTP server."""
