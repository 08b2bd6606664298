"""paged-server: models, engine and the OpenAI-compatible HTTP server."""
