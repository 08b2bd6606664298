"""The OpenAI-compatible HTTP server: app factory, async engine front, server runner."""

from paged_server.entrypoints.openai.app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
