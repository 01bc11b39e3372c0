"""Generation parameters tests use everywhere."""

from __future__ import annotations

from typing import Any

from muxworker.client import GenerationParams


def greedy(session_id: str | None = None, n: int = 16, **kw: Any) -> GenerationParams:
    """Greedy decoding of ``n`` tokens with no stop tokens, so every generation runs to its length
    unless cancelled. ``session_id`` None: for a SessionRuntime, whose argument sets it."""
    kw.setdefault("temperature", 0.0)
    kw.setdefault("stop_token_ids", [])
    return GenerationParams(session_id=session_id, max_new_tokens=n, **kw)  # type: ignore[arg-type]
