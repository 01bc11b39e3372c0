"""Fixtures the client's real-worker tests share: a tiny random model and a client over it."""

from __future__ import annotations

import pytest

from muxworker.client import default_worker_command, spawn_multiplexed_worker


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def worker_command(model_dir):
    return default_worker_command(model_dir, dtype="float32", max_sessions=20, max_session_tokens=512)


@pytest.fixture
async def client(worker_command):
    async with spawn_multiplexed_worker(worker_command) as c:
        yield c
