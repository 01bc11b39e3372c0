"""SessionRuntime under stress, over the in-process fake worker (tests/helpers/fake_worker.py) and,
in the slow tier, a real worker subprocess on a tiny random model: random mixes of operations leak
no lease and no capacity; a checkpoint call is cancellable until its transfer starts, and a hung
worker ends the calls stuck behind it. test_runtime.py has the runtime's rules one by one.

Order is proven by the order of events, never by durations. trio.fail_after is a hang guard only.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing
from helpers.fake_worker import FakeStore, FakeWorkerClient, fake_worker_client
from helpers.params import greedy
from helpers.runtime import BOTH, CONFIG, HANG_GUARD_S, LIMITS, PROMPT, spawn_client
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from muxworker.client import (
    CapacityExhausted,
    CheckpointNotFound,
    SessionExists,
    SessionNotFound,
    SessionRuntime,
    SessionStore,
    Unsaveable,
    WorkerDiedError,
    spawn_multiplexed_worker,
)


async def _real_store(path: Path, model_files, cls=SessionStore):
    identity = (await SessionStore.create(path, model_files=model_files, configuration=CONFIG)).identity
    return cls(path, identity=identity)


def stop_worker(client) -> None:
    """SIGSTOP: the worker answers nothing more."""
    if isinstance(client, FakeWorkerClient):
        client.hang()
    else:
        os.kill(client.pid, signal.SIGSTOP)


# ----------------------------------------------------------------------------------------------
# no leaks under random operations


SESSIONS = ("s0", "s1", "s2")
# Weighted so that sessions are open and busy often: that is where leases matter.
KINDS = ("open",) * 2 + ("close", "reset") + ("generate",) * 4 + ("cancel",) + ("save",) * 2 + ("resume",)
# Errors a random mix may meet. session_busy (or "busy" Unsaveable) never: that is what leases prevent.
EXPECTED = (SessionNotFound, SessionExists, Unsaveable, CheckpointNotFound)

operation = st.tuples(
    st.sampled_from(KINDS),
    st.sampled_from(SESSIONS),
    # Cancel after that many later submissions (None: never). Mostly never, so that sessions
    # get open, generate to the end and become saveable often enough.
    st.sampled_from([None, None, None, 0, 1, 4]),
    # What the submitter lets happen before the next one: that many checkpoints (a burst, which
    # may exceed the capacity), or None: until the capacity has room again.
    st.sampled_from([0, 2, None, None]),
)


async def _random_operations(ops, spawn, store) -> None:
    refused = 0
    seen: set[str] = set()

    def check_refusal() -> None:
        nonlocal refused
        refused += 1
        assert runtime.admitted == runtime.capacity  # refused only when really full

    def check_error(exc: BaseException) -> None:
        assert isinstance(exc, EXPECTED), repr(exc)
        assert "busy" not in str(exc), repr(exc)
        seen.add(type(exc).__name__)

    async with spawn() as client:
        runtime = SessionRuntime(client, max_concurrent_requests=4)
        with trio.fail_after(HANG_GUARD_S):
            streams = []
            pending_cancels: list[tuple[int, Callable[[], None]]] = []  # (due step, cancel)

            async def consume(stream, scope) -> None:
                with scope:
                    try:
                        async for _ in stream:
                            pass
                        await stream.wait()
                    except EXPECTED as exc:
                        check_error(exc)

            async def call(kind, sid, scope) -> None:
                with scope:
                    try:
                        await getattr(runtime, f"{kind}_session")(sid)
                        seen.add(f"{kind} ok")
                    except CapacityExhausted:
                        check_refusal()
                    except EXPECTED as exc:
                        check_error(exc)

            async with trio.open_nursery() as nursery:
                for step, (kind, sid, cancel_after, pause) in enumerate(ops):
                    for _, cancel in [c for c in pending_cancels if c[0] <= step]:
                        cancel()
                    pending_cancels = [c for c in pending_cancels if c[0] > step]
                    scope = trio.CancelScope()
                    if kind == "cancel":
                        if streams:
                            streams[(step * 7919) % len(streams)].cancel()
                    elif kind == "generate":
                        try:
                            stream = runtime.generate(sid, [10 + step % 50, 11, 12], greedy(n=1 + step % 4))
                        except CapacityExhausted:
                            check_refusal()
                        else:
                            streams.append(stream)
                            # Odd steps cancel the stream, even ones abandon its consumer instead.
                            target = stream.cancel if step % 2 else scope.cancel
                            if cancel_after is not None:
                                pending_cancels.append((step + cancel_after, target))
                            nursery.start_soon(consume, stream, scope)
                    else:
                        if cancel_after is not None:
                            pending_cancels.append((step + cancel_after, scope.cancel))
                        nursery.start_soon(call, kind, sid, scope)
                    if pause is None:
                        while runtime.admitted >= runtime.capacity:
                            await trio.sleep(0.001)
                    for _ in range(pause or 0):
                        await trio.lowlevel.checkpoint()
                for _, cancel in pending_cancels:
                    cancel()

            # One last operation per session: it runs after every earlier one there has settled.
            # Operations whose callers gave up may still hold the capacity for a moment; a leaked
            # unit would keep refusing, and the hang guard would end the test.
            for sid in SESSIONS:
                while True:
                    try:
                        await runtime.reset_session(sid)
                    except CapacityExhausted:
                        await trio.sleep(0.01)
                        continue
                    except SessionNotFound:
                        pass
                    break
            assert runtime.admitted == 0 and runtime.leased_sessions == 0
            # What the mix reached (--hypothesis-show-statistics).
            event(
                f"refused at capacity: {'none' if not refused else 'under 25%' if refused < len(ops) // 4 else 'more'}"
            )
            for stream in streams:
                try:
                    result = await stream.wait()
                except EXPECTED as exc:
                    seen.add(type(exc).__name__)
                else:
                    seen.add(
                        "generation never sent" if stream.request_id is None else f"generation {result.finish_reason}"
                    )
            for name in sorted(seen):
                event(f"met {name}")

            # The client and the worker are fine: nothing in flight, and a new session works.
            assert client.is_usable
            assert (await client.query_info())["inflight_requests"] == 0
            await runtime.open_session("fresh")
            assert (await runtime.generate("fresh", PROMPT, greedy(n=2)).wait()).completion_tokens == 2
            await runtime.aclose_worker()


RANDOM_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=25, **RANDOM_SETTINGS)
@given(ops=st.lists(operation, min_size=200, max_size=200))
async def test_random_operations_leak_no_lease_or_capacity(ops):
    store = FakeStore()
    await _random_operations(ops, lambda: fake_worker_client(session_store=store, **LIMITS), store)


@pytest.mark.slow
@settings(max_examples=3, **RANDOM_SETTINGS)  # the smoke test: the mix itself runs 25 times above
@given(ops=st.lists(operation, min_size=200, max_size=200))
async def test_random_operations_on_a_worker_leak_no_lease_or_capacity(
    ops, runtime_worker_command, tmp_path_factory, tiny_llama_files
):
    store = await SessionStore.create(
        tmp_path_factory.mktemp("rt") / "s", model_files=tiny_llama_files, configuration=CONFIG
    )
    await _random_operations(ops, lambda: spawn_multiplexed_worker(runtime_worker_command, session_store=store), store)


# ----------------------------------------------------------------------------------------------
# checkpoint calls: cancellable until their transfer starts; a hung worker frees them (items 10, 15)


class _HeldStore(SessionStore):
    """A store whose saves wait until the test releases them; records what was saved. The same
    interface as FakeStore's hold_saves, wait_entered and release."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.saved: list[str] = []
        self.hold = threading.Event()
        self.entered = threading.Event()

    # A save through the worker's file channel ends with commit_save (the worker wrote the segment).
    def commit_save(self, plan, *args):
        self.entered.set()
        self.hold.wait(HANG_GUARD_S)
        manifest = super().commit_save(plan, *args)
        self.saved.append(plan.session_id)
        return manifest

    def hold_saves(self) -> None:
        pass  # always held

    async def wait_entered(self) -> None:
        await trio.to_thread.run_sync(self.entered.wait)

    def release(self) -> None:
        self.hold.set()


@pytest.fixture
async def held_store(backend, tmp_path, request):
    if backend == "fake":
        store = FakeStore()
    else:
        store = await _real_store(tmp_path / "s", request.getfixturevalue("tiny_llama_files"), _HeldStore)
    store.hold_saves()
    return store


async def _with_history(runtime, *sids: str) -> None:
    for sid in sids:
        await runtime.open_session(sid)
        await runtime.generate(sid, PROMPT, greedy(n=4)).wait()


@BOTH
async def test_a_save_cancelled_in_the_clients_checkpoint_queue_never_starts(backend, held_store, request):
    store = held_store
    async with spawn_client(backend, store, request) as client:
        runtime = SessionRuntime(client)
        await _with_history(runtime, "a", "b")
        outcome: dict[str, str] = {}
        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as nursery:
                queued = trio.CancelScope()

                async def save_b() -> None:
                    with queued:
                        await runtime.save_session("b")  # holds b's lease, waits behind a's save
                        outcome["b"] = "saved"
                        return
                    outcome["b"] = "cancelled"

                nursery.start_soon(runtime.save_session, "a")
                await store.wait_entered()  # a holds the client's checkpoint queue
                nursery.start_soon(save_b)
                await trio.testing.wait_all_tasks_blocked()
                assert runtime.admitted == 2
                queued.cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert outcome == {"b": "cancelled"} and runtime.admitted == 1  # b left at once
                store.release()
        assert store.saved == ["a"]  # b never ran, not even after a's save released the queue
        await runtime.export_checkpoint_to_cpu("b")  # b's lane and the queue are free
        assert await trio.to_thread.run_sync(store.list) == ["a"]
        await runtime.aclose_worker()


async def _hung_worker_scenario(client, store, liveness_timeout: float) -> None:
    runtime = SessionRuntime(client, max_concurrent_requests=3)
    await _with_history(runtime, "a", "b", "c")
    stop_worker(client)
    events: list[str] = []
    errors: dict[str, BaseException] = {}

    async def save(sid: str) -> None:
        try:
            await runtime.save_session(sid)
        except WorkerDiedError as exc:
            errors[sid] = exc
            events.append(f"{sid} died")

    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(save, "a")  # its export is written, then nothing comes back
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(liveness_timeout / 6) as deadline:
                await runtime.save_session("b")  # queued behind a's transfer: the deadline works
            assert deadline.cancelled_caught
            events.append("b gave up")
            await trio.testing.wait_all_tasks_blocked()  # b's own task has settled it
            assert runtime.admitted == 1  # only a is still stuck
            nursery.start_soon(save, "c")
    # Every stuck operation ended with the worker's death, and none holds the capacity.
    assert events[0] == "b gave up" and sorted(errors) == ["a", "c"]
    assert all(f"no heartbeat for {liveness_timeout:g} s" in str(exc) for exc in errors.values())
    assert runtime.admitted == 0 and runtime.leased_sessions == 0
    for _ in range(runtime.capacity + 1):  # the worker's death, never CapacityExhausted
        with pytest.raises(WorkerDiedError):
            await runtime.open_session("later")
    assert client.returncode == -signal.SIGKILL
    assert await trio.to_thread.run_sync(store.list) == []
    await runtime.aclose_worker()


async def test_a_hung_worker_ends_stuck_checkpoint_calls_and_caller_deadlines_work_while_queued(autojump_clock):
    # Virtual time: the liveness timeout and the caller's deadline pass as soon as all is blocked.
    store = FakeStore()
    async with fake_worker_client(session_store=store, liveness_timeout=3.0, **LIMITS) as client:
        await _hung_worker_scenario(client, store, 3.0)


@pytest.mark.slow
async def test_a_hung_worker_process_ends_stuck_checkpoint_calls(runtime_worker_command, tiny_llama_files, tmp_path):
    store = await SessionStore.create(tmp_path / "s", model_files=tiny_llama_files, configuration=CONFIG)
    async with spawn_multiplexed_worker(runtime_worker_command, session_store=store, liveness_timeout=3.0) as client:
        await _hung_worker_scenario(client, store, 3.0)
