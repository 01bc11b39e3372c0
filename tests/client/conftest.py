"""Fixtures the client's tests share: a tiny random model and a client over it (the real-worker
tests); the backend, worker and model files of the SessionRuntime tests (test_runtime*.py, whose
constants are helpers/runtime.py's); and moto's S3, the environment that points at it and the
stores of every backend (test_object_store*.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.runtime import LIMITS as RUNTIME_LIMITS
from helpers.s3 import BUCKET, moto_server

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


# -- SessionRuntime over the fake worker or a real one ----------------------------------------------


@pytest.fixture
def backend(request) -> str:
    """The test's backend: "fake", or "worker" where it is parametrized with helpers.runtime.BOTH."""
    return getattr(request, "param", "fake")


@pytest.fixture(scope="module")
def runtime_worker_command(tiny_llama_dir):
    """The real worker of the SessionRuntime tests: the tiny llama, with helpers.runtime.LIMITS."""
    return default_worker_command(tiny_llama_dir, dtype="float32", **RUNTIME_LIMITS)


@pytest.fixture(scope="module")
def tiny_llama_files(tiny_llama_dir):
    return sorted(p for p in Path(tiny_llama_dir).iterdir() if p.is_file())


# -- object storage ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto_s3():
    """moto's S3 for the module's tests; yields its endpoint."""
    with moto_server() as (endpoint, _):
        yield endpoint


@pytest.fixture
def s3_env(moto_s3, monkeypatch):
    env = {
        "AWS_ENDPOINT_URL": moto_s3,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture(params=["local", "memory", "s3"])
def store_url(request, tmp_path):
    """Where a store lives: a directory, obstore's memory store, or a fresh prefix in moto's S3."""
    if request.param == "local":
        return str(tmp_path / "sessions")
    if request.param == "memory":
        return "memory:///"
    request.getfixturevalue("s3_env")
    return f"s3://{BUCKET}/t-{os.urandom(6).hex()}"


@pytest.fixture
def model_files(tmp_path):
    """A model's files as a store fingerprints them (random weights, an empty vocabulary)."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(os.urandom(4096))
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_bytes(b'{"vocab": {}}')
    return [weights, tokenizer]
