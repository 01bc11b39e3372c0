"""muxworker: a Python LLM serving runtime (see README.md).

The code lives in four subpackages, ``muxworker.client`` (the trio client, store and runtime),
``muxworker.transport`` (the wire and checkpoint contracts both ends share), ``muxworker.worker``
(the worker process, engine, backends and model files) and ``muxworker.native`` (C helpers), plus
the terminal chat ``muxworker.chat``. This file only names the version; it imports nothing else.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("muxworker")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
