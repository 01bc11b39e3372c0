"""The engine: named sessions, a continuous-batching scheduler and the KV cache, with no I/O.

``Engine`` (``core.py``) is the facade the worker process and the tests drive: open, close, reset,
submit, cancel, step, export, restore, shutdown.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import EngineConfig

if TYPE_CHECKING:
    from .core import Engine, EngineOutput, Readiness


def __getattr__(name: str) -> Any:
    # core.py imports torch; the worker's flag parsing needs only EngineConfig, and a start reads
    # the model on a thread while torch imports (models/prefetch.py), so core loads on first use.
    if name in ("Engine", "EngineOutput", "Readiness"):
        from . import core

        return getattr(core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Engine", "EngineConfig", "EngineOutput", "Readiness"]
