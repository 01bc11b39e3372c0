"""``python -m muxworker.serve``: an OpenAI-compatible HTTP server with durable sessions.

Layers, each importable and tested on its own:

- :mod:`.openai_api`: OpenAI's wire format, sans-I/O (request parsing, responses, error objects).
- :mod:`.service`: the model behind it (worker supervision and restart, sessions resumed from and
  saved to the :class:`~muxworker.client.SessionStore`), with no HTTP in it.
- :mod:`.app`: the Starlette ASGI app binding the two, served by hypercorn's trio worker in the
  trio client's own event loop.
- :mod:`.metrics`: the Prometheus metrics behind ``GET /metrics``.

docs/SERVER.md describes the endpoints, sessions, security and flags.
"""

from __future__ import annotations

from .app import AppConfig, create_app
from .metrics import ServerMetrics
from .service import ModelService, SavePolicy, ServiceConfig
from .tenants import Tenant

__all__ = ["AppConfig", "create_app", "ModelService", "SavePolicy", "ServiceConfig", "ServerMetrics", "Tenant"]
