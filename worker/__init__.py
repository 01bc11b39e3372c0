"""The worker: engine, backends, models (``python -m muxworker.worker``). Importing this package
imports nothing heavy."""

from __future__ import annotations

import os


def passive_openmp() -> None:
    """Let torch's OpenMP threads spin only briefly (10,000 iterations, tens of microseconds) before
    sleeping between parallel regions. libgomp reads this when torch loads it, so call it before
    torch is imported (the worker process does, first thing; so do in-process benchmarks). The
    native decode step runs its own threads right after torch's small parallel ops (sampling, a
    grammar's mask): with libgomp's default spin (300,000 iterations) its threads took one of the
    step's two cores here, a decode step with a JSON schema 10.8 ms against 7.1-7.5 ms; sleeping at
    once (OMP_WAIT_POLICY=PASSIVE) cost a quarter of prefill's speed, which runs torch's ops back
    to back. A value the user set wins."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
