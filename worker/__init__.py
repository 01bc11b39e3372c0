"""The worker: engine, backends, models (``python -m muxworker.worker``). Importing this package
imports nothing heavy."""

from __future__ import annotations

import os


def passive_openmp() -> None:
    """Let torch's OpenMP threads sleep between parallel regions instead of spinning. libgomp reads
    this when torch loads it, so call it before torch is imported (the worker process does, first
    thing; so do in-process benchmarks). The native decode step runs its own threads right after
    torch's small parallel ops (sampling, a grammar's mask): spinning OpenMP threads took one of its
    two cores here, a decode step with a JSON schema 10.8 ms against 7.1 ms with them passive. A
    value the user set wins."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
