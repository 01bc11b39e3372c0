"""What the SessionRuntime tests over the fake worker and a real one share (tests/client/
test_runtime.py, test_runtime_stress.py): their limits and prompt, the ``BOTH`` parametrization, and
the client of a test's backend. The fixtures they use (``backend``, ``runtime_worker_command``,
``tiny_llama_files``) are in tests/client/conftest.py."""

from __future__ import annotations

from typing import Any

import pytest

from muxworker.client import spawn_multiplexed_worker

from .fake_worker import fake_worker_client

HANG_GUARD_S = 60.0
CONFIG = {"backend": "torch", "dtype": "float32"}
PROMPT = list(range(10, 30))  # token ids; the tiny vocabulary has a few hundred
LIMITS = dict(max_sessions=8, max_session_tokens=4096, max_inflight_requests=8)
# A test parametrized with this runs on the fake worker, and on a real one in the slow tier.
BOTH = pytest.mark.parametrize("backend", ["fake", pytest.param("worker", marks=pytest.mark.slow)], indirect=True)


def spawn_client(backend: str, store: Any, request: pytest.FixtureRequest, **kw: Any) -> Any:
    """The client of the test's backend (an async context manager)."""
    if backend == "fake":
        return fake_worker_client(session_store=store, **LIMITS, **kw)
    return spawn_multiplexed_worker(request.getfixturevalue("runtime_worker_command"), session_store=store, **kw)
