"""OpenAI-compatible HTTP server: `build_app` / `serve`, the async engine loop, metrics."""

from jaxserve.server.api_server import JaxserveServer, build_app, format_startup_banner, serve
from jaxserve.server.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "JaxserveServer", "build_app", "format_startup_banner", "serve"]
