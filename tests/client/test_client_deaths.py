"""A worker that dies, hangs or fails is never a normal finish: the client fails every stream and
call with WorkerDiedError and reaps the process (real workers on a tiny random model; slow tier).

Timeouts here (trio.fail_after) are hang guards, not timing assertions: the machine is shared.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest
import trio
from helpers.params import greedy  # no stop tokens: every stream runs to its length
from helpers.procs import child_pids

from muxworker.client import (
    MuxError,
    WorkerDiedError,
    spawn_multiplexed_worker,
)

HANG_GUARD_S = 60.0


# ----------------------------------------------------------------------------------------------
# a dying worker


@pytest.mark.slow
async def test_worker_killed_mid_stream_fails_every_stream_and_call_and_is_reaped(client):
    for i in range(4):
        await client.open_session(f"s{i}")
    streams = [client.generate([5 + i, 6], greedy(f"s{i}", 400)) for i in range(4)]
    for stream in streams:
        await stream.__anext__()
    errors: list[BaseException] = []

    async def consume(stream) -> None:
        try:
            async for _ in stream:
                pass
            await stream.wait()
        except WorkerDiedError as exc:
            errors.append(exc)

    async def call() -> None:
        try:
            await client.tokenize("pending while the worker is stopped")
        except WorkerDiedError as exc:
            errors.append(exc)

    pid = client.pid
    os.kill(pid, signal.SIGSTOP)  # frozen: the tokenize below stays pending
    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(consume, stream)
            nursery.start_soon(call)
            await trio.sleep(0.2)
            os.kill(pid, signal.SIGKILL)
    assert len(errors) == 5
    for exc in errors:
        assert exc.returncode == -signal.SIGKILL
        assert "killed by SIGKILL" in str(exc)
    assert client.returncode == -signal.SIGKILL
    assert pid not in child_pids()
    with pytest.raises(WorkerDiedError):
        await client.open_session("later")
    with pytest.raises(WorkerDiedError):
        await client.generate("later", greedy("s0")).wait()
    with pytest.raises(WorkerDiedError):
        await streams[0].wait()
    await client.close()  # still fine, and idempotent


@pytest.mark.slow
async def test_worker_breaking_the_protocol_is_a_death(model_dir):
    # A worker that writes garbage on its reply pipe when asked to tokenize: the client stops it.
    wrapper = (
        "import os, runpy, sys\n"
        "fd = int(sys.argv[sys.argv.index('--reply-fd') + 1])\n"
        "import muxworker.worker.models.tokenizer as t\n"
        "def garbage(self, *a, **k):\n"
        "    os.write(fd, b'this is not a frame, not at all')\n"
        "    return []\n"
        "t.Tokenizer.encode = garbage\n"
        "runpy.run_module('muxworker.worker', run_name='__main__', alter_sys=True)\n"
    )
    command = [sys.executable, "-c", wrapper, "--model", str(model_dir), "--max_session_tokens", "256"]
    async with spawn_multiplexed_worker(command) as client:
        await client.open_session("a")
        with trio.fail_after(HANG_GUARD_S):
            stream = client.generate([5, 6], greedy("a", 250))
            await stream.__anext__()
            with pytest.raises(WorkerDiedError, match="protocol error") as info:
                await client.tokenize("the worker writes garbage instead of the reply")
            with pytest.raises(WorkerDiedError, match="protocol error"):
                await stream.wait()
    assert "bad magic" in str(info.value)
    assert client.returncode is not None


# ----------------------------------------------------------------------------------------------
# liveness: a hung worker is a dead worker (issue 13 item 6)


async def _outcome(call) -> BaseException | str:
    try:
        await call()
    except MuxError as exc:
        return exc
    return "returned"


@pytest.mark.slow
async def test_a_stopped_worker_fails_streams_info_and_saves_after_the_liveness_timeout(
    worker_command, model_dir, tmp_path
):
    from muxworker.client import SessionStore

    store = await SessionStore.create(
        tmp_path / "store",
        model_files=[model_dir / "model.safetensors", model_dir / "tokenizer.json"],
        configuration={"backend": "torch", "dtype": "float32"},
    )
    async with spawn_multiplexed_worker(worker_command, session_store=store, liveness_timeout=2.0) as client:
        assert client.info.readiness == "ready"
        await client.open_session("saved")
        await client.generate([5, 6], greedy("saved", 4)).wait()
        await client.open_session("a")
        stream = client.generate([5, 6, 7], greedy("a", 400))
        await stream.__anext__()
        pid = client.pid
        os.kill(pid, signal.SIGSTOP)  # hung: alive, silent, and deaf to SIGTERM
        outcomes: dict[str, BaseException | str] = {}

        async def run(name: str, call) -> None:
            outcomes[name] = await _outcome(call)

        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "stream", stream.wait)
                nursery.start_soon(run, "info", client.query_info)
                nursery.start_soon(run, "save", lambda: client.save_session("saved"))
        for name, exc in outcomes.items():
            assert isinstance(exc, WorkerDiedError), (name, exc)
            assert "no heartbeat for 2 s" in str(exc) and exc.returncode == -signal.SIGKILL
        assert client.returncode == -signal.SIGKILL and pid not in child_pids()
        with pytest.raises(WorkerDiedError, match="no heartbeat"):
            await client.open_session("later")
    assert await trio.to_thread.run_sync(store.list) == []


@pytest.mark.slow
async def test_a_long_forward_pass_is_not_silence(model_dir):
    # Every forward pass takes 1.5 s, longer than the 1 s liveness timeout: the worker's heartbeat
    # thread keeps it alive (heartbeats between steps would not).
    wrapper = (
        "import runpy, time\n"
        "import muxworker.worker.engine as e\n"
        "step = e.Engine.step\n"
        "def slow(self):\n"
        "    time.sleep(1.5)\n"
        "    return step(self)\n"
        "e.Engine.step = slow\n"
        "runpy.run_module('muxworker.worker', run_name='__main__', alter_sys=True)\n"
    )
    command = [sys.executable, "-c", wrapper, "--model", str(model_dir), "--max_session_tokens", "256"]
    async with spawn_multiplexed_worker(command, liveness_timeout=1.0) as client:
        await client.open_session("a")
        with trio.fail_after(HANG_GUARD_S):
            result = await client.generate([5, 6], greedy("a", 3)).wait()
        assert result.completion_tokens == 3
        assert (await client.query_info())["readiness"] == "ready"
    assert client.returncode == 0


# ----------------------------------------------------------------------------------------------
# a dead worker is never a normal finish (issue 13 item 11)

_FAILING_ENGINE = (
    "import runpy\n"
    "import muxworker.worker.engine as e\n"
    "submit, step = e.Engine.submit, e.Engine.step\n"
    "armed = []\n"
    "def arm(self, rid, sid, *a, **k):\n"
    "    submit(self, rid, sid, *a, **k)\n"
    "    if sid == 'boom':\n"
    "        armed.append(rid)\n"
    "def failing(self):\n"
    "    if armed:\n"
    "        raise RuntimeError('injected engine failure')\n"
    "    return step(self)\n"
    "e.Engine.submit, e.Engine.step = arm, failing\n"
    "runpy.run_module('muxworker.worker', run_name='__main__', alter_sys=True)\n"
)


@pytest.mark.slow
async def test_an_engine_loop_failure_fails_every_live_stream_with_worker_died(model_dir):
    command = [sys.executable, "-c", _FAILING_ENGINE, "--model", str(model_dir), "--max_session_tokens", "512"]
    async with spawn_multiplexed_worker(command) as client:
        streams = {}
        for sid in ("a", "b", "boom"):
            await client.open_session(sid)
        for sid in ("a", "b"):
            streams[sid] = client.generate([5, 6], greedy(sid, 400))
            await streams[sid].__anext__()
        streams["boom"] = client.generate([5, 6], greedy("boom", 4))  # its first step fails the loop
        with trio.fail_after(HANG_GUARD_S):
            for sid, stream in streams.items():
                with pytest.raises(WorkerDiedError) as info:  # never a result with finish_reason "cancelled"
                    async for _ in stream:
                        pass
                assert "engine loop failed" in str(info.value) and info.value.returncode == 4, sid
                with pytest.raises(WorkerDiedError):
                    await stream.wait()
    assert client.returncode == 4
