"""WorkerSpec: one description of a worker gives its command line and its store identity, from
flags parsed once; a worker started with ``--own-process-group`` runs in a group of its own."""

from __future__ import annotations

import os
import sys

import pytest

from muxworker.client import spawn_multiplexed_worker
from muxworker.serve.process import process_table
from muxworker.worker.models.identity import model_identity_files, worker_configuration
from muxworker.worker.options import UsageError
from muxworker.worker.spec import WorkerSpec, flags_of


def test_flags_spell_as_a_command_line():
    assert flags_of(max_sessions=2, dtype="float32", quantize=None, own=False, verbose=True) == [
        "--max_sessions",
        "2",
        "--dtype",
        "float32",
        "--verbose",
    ]


def test_the_command_and_the_store_identity_come_from_the_same_flags(tiny_llama_dir):
    spec = WorkerSpec.of(tiny_llama_dir, dtype="float32", max_sessions=3, own_process_group=True)
    assert spec.command() == [
        sys.executable,
        "-m",
        "muxworker.worker",
        "--model",
        str(tiny_llama_dir),
        "--own-process-group",
        "--dtype",
        "float32",
        "--max_sessions",
        "3",
    ]
    identity = spec.store_identity()
    assert identity["model_files"] == model_identity_files(tiny_llama_dir)
    assert identity["configuration"] == worker_configuration(dtype="float32", model_dir=tiny_llama_dir)
    assert spec.options.config.max_sessions == 3
    # A flag given as a command line gives the same spec.
    assert WorkerSpec(tiny_llama_dir, ("--dtype", "float32", "--max_sessions", "3"), True) == spec


def test_a_bad_flag_is_refused_before_anything_starts(tiny_llama_dir):
    with pytest.raises(UsageError, match="max_sessions"):
        WorkerSpec.of(tiny_llama_dir, max_sessions=0)
    with pytest.raises(UsageError, match="unrecognized"):
        WorkerSpec(tiny_llama_dir, ("--no-such-flag",))


async def test_a_worker_of_its_own_process_group(tiny_llama_dir):
    spec = WorkerSpec.of(tiny_llama_dir, dtype="float32", own_process_group=True)
    async with spawn_multiplexed_worker(spec.command()) as client:
        assert client.pid in process_table()
        assert os.getpgid(client.pid) == client.pid != os.getpgid(0)
    plain = WorkerSpec.of(tiny_llama_dir, dtype="float32")
    async with spawn_multiplexed_worker(plain.command()) as client:
        assert os.getpgid(client.pid) == os.getpgid(0)
