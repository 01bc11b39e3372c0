"""The worker process layer: spawning over WorkerPipes keeps no fd behind on failure."""

from __future__ import annotations

import os

import pytest

import muxworker.transport.fdio as fdio
from muxworker.client.process import WorkerProcess, heartbeat_args
from muxworker.transport.errors import WorkerStartupError
from muxworker.transport.fdio import WorkerPipes


def _open_fds() -> set[int]:
    return set(map(int, os.listdir("/proc/self/fd"))) if os.path.isdir("/proc/self/fd") else set()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_failing_second_pipe_closes_the_first(monkeypatch):
    made = []
    real = fdio.make_pipe

    def make_pipe(size=fdio.PIPE_SIZE):
        if made:
            raise OSError(24, "Too many open files")
        made.append(real(size))
        return made[-1]

    monkeypatch.setattr(fdio, "make_pipe", make_pipe)
    before = _open_fds()
    with pytest.raises(OSError):
        WorkerPipes.open()
    assert _open_fds() == before and made


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
@pytest.mark.trio
async def test_a_command_that_cannot_start_is_a_startup_error_and_leaks_nothing(tmp_path):
    before = _open_fds()
    process = WorkerProcess([str(tmp_path / "no-such-worker")])
    with pytest.raises(WorkerStartupError, match="cannot start"):
        await process.spawn(heartbeat_args(None))
    assert _open_fds() == before and process.returncode is None


def test_heartbeats_are_several_per_liveness_timeout():
    assert heartbeat_args(None) == ["--heartbeat_ms", "0"]
    assert heartbeat_args(10.0) == ["--heartbeat_ms", "1000"]
    assert heartbeat_args(0.01) == ["--heartbeat_ms", "10"]
