"""Building an engine: impossible configurations are refused before anything is allocated."""

from __future__ import annotations

import pytest
import torch

from muxworker.transport.errors import InvalidArgument
from muxworker.worker import build
from muxworker.worker.backends.interface import planned_nbytes
from muxworker.worker.backends.torch.cache import KVCache
from muxworker.worker.build import load_engine, weight_nbytes
from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.models.args import ModelArgs
from muxworker.worker.models.loader import load_model_dir


@pytest.mark.parametrize("windows", [[None, None], [16, None], [16, 16], [4096, 16]])
@pytest.mark.parametrize("rollback", [0, 3])
def test_planned_kv_bytes_equal_what_the_cache_allocates(windows, rollback):
    cache = KVCache(windows, 3, 64, 2, 8, torch.bfloat16, "cpu", rollback_rows=rollback)
    assert planned_nbytes(windows, 3, 64, 2, 8, 2, rollback) == cache.nbytes


def test_weight_estimate_equals_the_model(tiny_llama_dir):
    loaded = build.load_model(tiny_llama_dir, progress=None)
    params = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    # Tied embeddings are one tensor; everything else is counted once.
    assert weight_nbytes(loaded.args, 4) == params


@pytest.fixture
def no_weights_loaded(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the weights were loaded before the configuration was checked")

    from muxworker.worker.backends.torch import executor

    monkeypatch.setattr(executor, "load_state_dict", refuse)


def test_a_session_longer_than_the_context_is_refused_before_loading(tiny_llama_dir, no_weights_loaded):
    context = ModelArgs.from_dict(load_model_dir(tiny_llama_dir).config).max_position_embeddings
    with pytest.raises(
        InvalidArgument, match=rf"--max_session_tokens {context + 1} exceeds the model's context length \({context}\)"
    ):
        load_engine(tiny_llama_dir, EngineConfig(max_session_tokens=context + 1), progress=None)


def test_a_cache_larger_than_memory_is_refused_naming_the_flags(tiny_llama_dir, no_weights_loaded, monkeypatch):
    monkeypatch.setattr(build, "available_memory", lambda device: 64 * 2**20)
    with pytest.raises(
        InvalidArgument, match=r"--max_sessions 512 .*--max_session_tokens 4096.*only 0\.1 GiB of cpu memory"
    ):
        load_engine(tiny_llama_dir, EngineConfig(max_sessions=512, max_session_tokens=4096), progress=None)


async def test_the_worker_refuses_at_start(tiny_llama_dir):
    from muxworker.client import WorkerStartupError, default_worker_command, spawn_multiplexed_worker

    with pytest.raises(
        WorkerStartupError, match=r"--max_session_tokens 100000 exceeds the model's context length \(4096\)"
    ):
        async with spawn_multiplexed_worker(default_worker_command(tiny_llama_dir, max_session_tokens=100000)):
            pass
