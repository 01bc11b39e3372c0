"""The engine: named sessions, a continuous-batching scheduler and the KV cache, with no I/O.

``Engine`` (``core.py``) is the facade the worker process and the tests drive: open, close, reset,
submit, cancel, step, export, restore, shutdown.
"""

from __future__ import annotations

from .config import EngineConfig
from .core import Engine, EngineOutput, Readiness

__all__ = ["Engine", "EngineConfig", "EngineOutput", "Readiness"]
