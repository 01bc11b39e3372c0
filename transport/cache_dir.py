"""The muxworker cache directory, defined once for every layer.

Owner: nothing; the directory is only named here. Its users each keep their own subtree or file in
it: the worker's GGUF conversions (``models/``, worker/models/loader.py) and the model files' digest
cache (``model-digests.json``, transport/checkpoint/identity.py). It lives in transport, the layer
both ends may import; ``muxworker.worker.models.loader.cache_root`` re-exports it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """$MUXWORKER_CACHE, else $XDG_CACHE_HOME/muxworker, else ~/.cache/muxworker."""
    if env := os.environ.get("MUXWORKER_CACHE"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "muxworker"
