"""SessionRuntime over the in-process fake worker (tests/helpers/fake_worker.py), which answers in
milliseconds with the engine's rules; the tests marked ``worker`` also run on a real worker
subprocess on a tiny random model (slow): one per feature, the same assertions.

Order and overlap are proven by the order of events (request ids, which history a generation
reused, which delta came first), never by durations. trio.fail_after is a hang guard only.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from helpers.fake_worker import FakeStore, FakeWorkerClient, fake_worker_client
from helpers.params import greedy
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from muxworker.client import (
    CapacityExhausted,
    CheckpointNotFound,
    ClientClosedError,
    GenerationParams,
    GenerationResult,
    InvalidArgument,
    SessionExists,
    SessionNotFound,
    SessionRuntime,
    SessionStore,
    Unsaveable,
    WorkerDiedError,
    default_worker_command,
    spawn_multiplexed_worker,
)

HANG_GUARD_S = 60.0
CONFIG = {"backend": "torch", "dtype": "float32"}
PROMPT = list(range(10, 30))  # token ids; the tiny vocabulary has a few hundred
LONG = 4000  # a generation that runs until it is cancelled (max_session_tokens is 4096)
LIMITS = dict(max_sessions=8, max_session_tokens=4096, max_inflight_requests=8)
# A test parametrized with this runs on the fake worker, and on a real one in the slow tier.
BOTH = pytest.mark.parametrize("backend", ["fake", pytest.param("worker", marks=pytest.mark.slow)], indirect=True)


@pytest.fixture
def backend(request) -> str:
    return getattr(request, "param", "fake")


@pytest.fixture(scope="module")
def worker_command(tiny_llama_dir):
    return default_worker_command(tiny_llama_dir, dtype="float32", **LIMITS)


@pytest.fixture(scope="module")
def model_files(tiny_llama_dir):
    return sorted(p for p in Path(tiny_llama_dir).iterdir() if p.is_file())


async def _real_store(path: Path, model_files, cls=SessionStore):
    identity = (await SessionStore.create(path, model_files=model_files, configuration=CONFIG)).identity
    return cls(path, identity=identity)


@pytest.fixture
async def store(backend, tmp_path, request):
    if backend == "fake":
        return FakeStore()
    return await SessionStore.create(
        tmp_path / "s", model_files=request.getfixturevalue("model_files"), configuration=CONFIG
    )


def _spawn(backend: str, store, request, **kw):
    """The client of the test's backend (an async context manager)."""
    if backend == "fake":
        return fake_worker_client(session_store=store, **LIMITS, **kw)
    return spawn_multiplexed_worker(request.getfixturevalue("worker_command"), session_store=store, **kw)


@pytest.fixture
async def client(backend, store, request):
    async with _spawn(backend, store, request) as c:
        yield c


@pytest.fixture
def runtime(client):
    return SessionRuntime(client)


def kill_worker(client) -> None:
    if isinstance(client, FakeWorkerClient):
        client.kill()
    else:
        os.kill(client.pid, signal.SIGKILL)


def stop_worker(client) -> None:
    """SIGSTOP: the worker answers nothing more."""
    if isinstance(client, FakeWorkerClient):
        client.hang()
    else:
        os.kill(client.pid, signal.SIGSTOP)


async def first_delta(stream) -> None:
    """Wait until ``stream`` has produced output, so its generation runs in the worker."""
    await stream.__anext__()


# ----------------------------------------------------------------------------------------------
# admission


async def test_capacity_is_the_smaller_of_the_worker_limit_and_the_argument(client):
    assert SessionRuntime(client).capacity == 8
    assert SessionRuntime(client, max_concurrent_requests=3).capacity == 3
    assert SessionRuntime(client, max_concurrent_requests=100).capacity == 8
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="max_concurrent_requests"):
            SessionRuntime(client, max_concurrent_requests=bad)


@BOTH
async def test_a_request_beyond_capacity_fails_at_once(client):
    runtime = SessionRuntime(client, max_concurrent_requests=3)
    with trio.fail_after(HANG_GUARD_S):
        await runtime.open_session("a")
        await runtime.open_session("b")
        ga = runtime.generate("a", PROMPT, greedy(n=LONG))
        gb = runtime.generate("b", PROMPT, greedy(n=LONG))
        ga2 = runtime.generate("a", PROMPT, greedy(n=4))  # waits behind ga: still admitted
        assert runtime.admitted == 3

        with pytest.raises(CapacityExhausted):
            runtime.generate("c", PROMPT, greedy(n=4))
        # Refused at its first step: in a hidden queue it would have met the cancelled scope
        # instead, and the scope would have swallowed the Cancelled.
        with pytest.raises(CapacityExhausted):
            with trio.CancelScope() as scope:
                scope.cancel()
                await runtime.open_session("c")
        assert runtime.admitted == 3 and not ga.finished and not gb.finished

        ga2.cancel()  # a waiting operation frees its capacity at once
        assert runtime.admitted == 2
        await runtime.open_session("c")
        ga.cancel()
        gb.cancel()
        assert (await ga.wait()).finish_reason == "cancelled"
        assert (await gb.wait()).finish_reason == "cancelled"
        assert (await ga2.wait()) == GenerationResult.cancelled_locally()
        assert runtime.admitted == 0 and runtime.leased_sessions == 0


async def test_closes_and_server_saves_are_never_refused_for_capacity(client, store):
    # A server closes its one-request sessions and saves after each turn on its own: neither may
    # fail when clients fill the capacity (a refused close would hold its slot for good), nor
    # take capacity from them.
    runtime = SessionRuntime(client, max_concurrent_requests=1)
    with trio.fail_after(HANG_GUARD_S):
        for sid in ("a", "b"):
            await runtime.open_session(sid)
        await runtime.generate("b", PROMPT, greedy(n=4)).wait()
        busy = runtime.generate("a", PROMPT, greedy(n=LONG))
        await first_delta(busy)
        assert runtime.admitted == 1
        with pytest.raises(CapacityExhausted):
            await runtime.save_session("b")
        await runtime.save_session("b", outside_capacity=True)
        assert runtime.admitted == 1 and await trio.to_thread.run_sync(store.list) == ["b"]
        await runtime.close_session("b")
        assert runtime.admitted == 1 and runtime.session_state("b") is None
        with pytest.raises(CapacityExhausted):
            runtime.generate("a", PROMPT, greedy(n=4))  # the client's capacity is as it was
        busy.cancel()
        assert (await busy.wait()).finish_reason == "cancelled"
        assert runtime.admitted == 0 and runtime.leased_sessions == 0


async def test_params_naming_another_session_are_refused(runtime):
    with pytest.raises(InvalidArgument, match="'b'"):
        runtime.generate("a", PROMPT, GenerationParams(session_id="b", max_new_tokens=4))
    assert runtime.admitted == 0


# ----------------------------------------------------------------------------------------------
# leases


@BOTH
async def test_one_session_runs_its_operations_in_arrival_order(runtime):
    """Five tasks submit to one session, in a known order, behind a running generation; each
    effect shows what ran before it."""
    results: dict[str, object] = {}
    streams = {}

    async def collect(name: str, stream) -> None:
        try:
            results[name] = await stream.wait()
        except SessionNotFound as exc:
            results[name] = exc

    async def generation(name: str, n: int) -> None:
        streams[name] = stream = runtime.generate("s", PROMPT, greedy(n=n))
        await collect(name, stream)

    async def call(name: str, method) -> None:
        try:
            results[name] = await method("s")
        except SessionNotFound as exc:
            results[name] = exc

    with trio.fail_after(HANG_GUARD_S):
        await runtime.open_session("s")
        async with trio.open_nursery() as nursery:
            # g1 holds the lease until it is cancelled below; its prompt is in the history.
            streams["g1"] = g1 = runtime.generate("s", PROMPT, greedy(n=LONG))
            await first_delta(g1)
            nursery.start_soon(collect, "g1", g1)
            # Each submitter starts only once the one before it is blocked, i.e. admitted.
            for submit in (
                lambda: generation("g2", 4),
                lambda: call("reset", runtime.reset_session),
                lambda: generation("g3", 4),
                lambda: call("close", runtime.close_session),
                lambda: generation("g4", 4),
            ):
                nursery.start_soon(submit)
                await trio.testing.wait_all_tasks_blocked()
            # Six in the lane; the close waits its turn like the rest but counts against no
            # capacity (it frees what the capacity protects).
            assert runtime.admitted == 5 and runtime.leased_sessions == 1
            streams["g1"].cancel()

    g1, g2, g3 = results["g1"], results["g2"], results["g3"]
    # No session_busy: one at a time. And the history each one saw proves the order:
    assert g1.finish_reason == "cancelled" and g1.reused_prompt_tokens == 0  # first on the fresh session
    assert g2.reused_prompt_tokens == len(PROMPT) - 1  # after g1, which left PROMPT in the history
    assert results["reset"] is None
    assert g3.reused_prompt_tokens == 0  # after the reset
    assert results["close"] is None
    assert isinstance(results["g4"], SessionNotFound)  # after the close
    assert streams["g1"].request_id < streams["g2"].request_id < streams["g3"].request_id
    assert runtime.admitted == 0 and runtime.leased_sessions == 0


async def test_two_sessions_generate_at_the_same_time(runtime):
    with trio.fail_after(HANG_GUARD_S):
        await runtime.open_session("a")
        await runtime.open_session("b")
        events: list[str] = []
        ga = runtime.generate("a", PROMPT, greedy(n=LONG))
        await first_delta(ga)
        gb = runtime.generate("b", PROMPT, greedy(n=8))

        async def consume(name, stream):
            async for _ in stream:
                events.append(name)
            events.append(f"{name} done")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume, "a", ga)
            await first_delta(gb)
            events.append("b first")
            # A serializing runtime would only have started b once a had run all LONG tokens.
            assert not ga.finished
            ga.cancel()
        assert events.index("b first") < events.index("a done")
        assert (await ga.wait()).finish_reason == "cancelled"
        assert (await gb.wait()).finish_reason == "length"


# ----------------------------------------------------------------------------------------------
# cancellation


async def test_a_generation_cancelled_while_queued_never_runs(runtime):
    with trio.fail_after(HANG_GUARD_S):
        await runtime.open_session("s")
        g1 = runtime.generate("s", PROMPT, greedy(n=16))
        g2 = runtime.generate("s", [40, 41, 42], greedy(n=16))
        g2.cancel()
        assert runtime.admitted == 1  # left its lane at once
        assert await g2.wait() == GenerationResult.cancelled_locally()
        assert [d async for d in g2] == [] and g2.request_id is None  # never sent
        r1 = await g1.wait()
        assert r1.finish_reason == "length"

        # The same for a lifecycle call whose caller is cancelled while it waits.
        g3 = runtime.generate("s", PROMPT, greedy(n=16))
        with trio.CancelScope() as scope:
            scope.cancel()
            await runtime.reset_session("s")
        assert scope.cancelled_caught and runtime.admitted == 1
        r3 = await g3.wait()
        history = PROMPT + r3.generated_token_ids
        r4 = await runtime.generate("s", history, greedy(n=1)).wait()
        assert r4.reused_prompt_tokens == len(history) - 1  # no reset ran in between


async def test_a_generation_cancelled_while_running_ends_only_itself(runtime):
    with trio.fail_after(HANG_GUARD_S):
        await runtime.open_session("a")
        await runtime.open_session("b")
        ga = runtime.generate("a", PROMPT, greedy(n=LONG))
        # Any object with the params' attributes will do, without a session_id (the runtime sets it).
        gb = runtime.generate("b", PROMPT, SimpleNamespace(max_new_tokens=64, temperature=0.0, stop_token_ids=[]))
        await first_delta(ga)
        ga.cancel()
        ra = await ga.wait()
        assert ra.finish_reason == "cancelled" and ra.completion_tokens < LONG
        rb = await gb.wait()
        assert rb.finish_reason == "length" and rb.completion_tokens == 64
        # The lease of a came back with the worker's reply: a new generation there is not busy.
        assert (await runtime.generate("a", PROMPT, greedy(n=2)).wait()).finish_reason == "length"
        assert runtime.admitted == 0 and runtime.leased_sessions == 0


async def test_a_cancelled_lifecycle_call_returns_at_once_and_settles_under_the_lease(runtime, store):
    with trio.fail_after(HANG_GUARD_S):
        await runtime.open_session("s")
        r = await runtime.generate("s", PROMPT, greedy(n=8)).wait()

        # A checkpoint call cancelled before its transfer started never starts, even though it
        # was given the lease at once (issue 13 item 10: it used to run after its caller left).
        with trio.CancelScope() as scope:
            scope.cancel()
            await runtime.save_session("s")
        assert scope.cancelled_caught
        await runtime.export_checkpoint_to_cpu("s")  # behind it on the lane: it has settled by now
        assert await trio.to_thread.run_sync(store.list) == []
        await runtime.save_session("s")
        await runtime.close_session("s")
        assert await trio.to_thread.run_sync(store.list) == ["s"]
        assert await runtime.resume_session("s") == "s"
        history = PROMPT + r.generated_token_ids
        resumed = await runtime.generate("s", history, greedy(n=1)).wait()
        assert resumed.reused_prompt_tokens == len(history) - 1

        with trio.CancelScope() as scope:
            scope.cancel()
            await runtime.close_session("s")
        # It still settles under the lease (its lane is held), outside the capacity.
        assert scope.cancelled_caught and runtime.leased_sessions == 1 and runtime.admitted == 0
        with pytest.raises(SessionNotFound):
            await runtime.generate("s", PROMPT, greedy(n=1)).wait()  # ran after the close
        await runtime.open_session("s")  # no SessionExists: the close ran first
        assert runtime.admitted == 0 and runtime.leased_sessions == 0


# ----------------------------------------------------------------------------------------------
# save and resume


@BOTH
async def test_a_save_submitted_during_a_generation_waits_for_it(runtime, store):
    with trio.fail_after(HANG_GUARD_S):
        await runtime.open_session("s")
        g = runtime.generate("s", PROMPT, greedy(n=200))
        await first_delta(g)
        await runtime.save_session("s")  # no Unsaveable "busy generating"
        assert g.finished
        r = await g.wait()
        assert r.finish_reason == "length" and r.completion_tokens == 200

        checkpoint = await trio.to_thread.run_sync(store.load, "s")
        history = PROMPT + r.generated_token_ids
        # Everything the generation committed: its last token has no KV yet.
        assert checkpoint.position == len(history) - 1
        assert checkpoint.token_ids.tolist() == history[:-1]

        await runtime.close_session("s")
        await runtime.resume_session("s")
        resumed = await runtime.generate("s", history, greedy(n=1)).wait()
        assert resumed.reused_prompt_tokens == len(history) - 1


# ----------------------------------------------------------------------------------------------
# closing


async def test_aclose_worker_settles_work_in_flight(runtime, client, store):
    outcomes: dict[str, object] = {}
    with trio.fail_after(HANG_GUARD_S):
        await runtime.open_session("a")
        await runtime.open_session("b")
        await runtime.generate("b", PROMPT, greedy(n=4)).wait()
        ga = runtime.generate("a", PROMPT, greedy(n=1000))

        async def save_a() -> None:
            outcomes["save a"] = await runtime.save_session("a")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(save_a)
            await trio.testing.wait_all_tasks_blocked()
            with trio.CancelScope() as scope:
                scope.cancel()
                await runtime.save_session("b")  # its caller gives up before it started: it never runs
            await runtime.aclose_worker()
            assert runtime.admitted == 0 and runtime.leased_sessions == 0
        # Ran to the end, and the save behind it completed before the worker closed.
        assert ga.finished and (await ga.wait()).completion_tokens == 1000
        (saved,) = outcomes.values()  # the save of all of a's history, whole
        assert list(outcomes) == ["save a"] and saved.start == 0 and saved.position >= 1000, outcomes
        assert await trio.to_thread.run_sync(store.list) == ["a"]
        assert not client.is_usable and client.returncode == 0
        with pytest.raises(ClientClosedError):
            runtime.generate("a", PROMPT, greedy(n=1))
        with pytest.raises(ClientClosedError):
            await runtime.open_session("c")

        await runtime.aclose_worker()  # idempotent
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runtime.aclose_worker)
            nursery.start_soon(runtime.aclose_worker)


@BOTH
async def test_concurrent_aclose_worker_calls_all_wait_for_the_close(runtime, client):
    with trio.fail_after(HANG_GUARD_S):
        await runtime.open_session("a")
        g = runtime.generate("a", PROMPT, greedy(n=100))
        returned = []

        async def close(name):
            await runtime.aclose_worker()
            returned.append((name, g.finished, client.returncode))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close, 1)
            nursery.start_soon(close, 2)
        # Neither returned before the work settled and the worker was reaped; the generation
        # was let run to its end.
        assert sorted(returned) == [(1, True, 0), (2, True, 0)]
        assert (await g.wait()).finish_reason == "length"


async def test_a_cancelled_aclose_worker_cancels_generations_and_still_closes(runtime, client):
    with trio.fail_after(HANG_GUARD_S):
        await runtime.open_session("a")
        await runtime.open_session("b")
        ga = runtime.generate("a", PROMPT, greedy(n=LONG))
        ga2 = runtime.generate("a", PROMPT, greedy(n=4))  # waits behind ga
        await first_delta(ga)
        outcomes: dict[str, object] = {}

        async def reset_a() -> None:
            try:
                outcomes["reset a"] = await runtime.reset_session("a")
            except ClientClosedError as exc:
                outcomes["reset a"] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reset_a)  # waits behind ga2
            await trio.testing.wait_all_tasks_blocked()
            assert runtime.admitted == 3
            with trio.CancelScope() as scope:
                scope.cancel()
                await runtime.aclose_worker()
            assert scope.cancelled_caught
            # It returned only once everything had settled and the worker was reaped.
            assert runtime.admitted == 0 and runtime.leased_sessions == 0
            assert client.returncode is not None
        assert (await ga.wait()).finish_reason == "cancelled"
        assert await ga2.wait() == GenerationResult.cancelled_locally() and ga2.request_id is None
        assert isinstance(outcomes["reset a"], ClientClosedError)


@BOTH
async def test_a_dead_worker_fails_every_operation_and_frees_every_lease(runtime, client):
    with trio.fail_after(HANG_GUARD_S):
        await runtime.open_session("a")
        ga = runtime.generate("a", PROMPT, greedy(n=LONG))
        await first_delta(ga)
        outcomes: dict[str, BaseException] = {}

        async def save_a() -> None:
            try:
                await runtime.save_session("a")
            except WorkerDiedError as exc:
                outcomes["save a"] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(save_a)  # waits behind ga
            await trio.testing.wait_all_tasks_blocked()
            kill_worker(client)
        with pytest.raises(WorkerDiedError) as died:
            await ga.wait()
        assert died.value.returncode == -signal.SIGKILL
        assert outcomes["save a"].returncode == -signal.SIGKILL
        assert runtime.admitted == 0 and runtime.leased_sessions == 0
        with pytest.raises(WorkerDiedError):
            await runtime.open_session("b")
        await runtime.aclose_worker()


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
    ops, worker_command, tmp_path_factory, model_files
):
    store = await SessionStore.create(
        tmp_path_factory.mktemp("rt") / "s", model_files=model_files, configuration=CONFIG
    )
    await _random_operations(ops, lambda: spawn_multiplexed_worker(worker_command, session_store=store), store)


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
        store = await _real_store(tmp_path / "s", request.getfixturevalue("model_files"), _HeldStore)
    store.hold_saves()
    return store


async def _with_history(runtime, *sids: str) -> None:
    for sid in sids:
        await runtime.open_session(sid)
        await runtime.generate(sid, PROMPT, greedy(n=4)).wait()


@BOTH
async def test_a_save_cancelled_in_the_clients_checkpoint_queue_never_starts(backend, held_store, request):
    store = held_store
    async with _spawn(backend, store, request) as client:
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
async def test_a_hung_worker_process_ends_stuck_checkpoint_calls(worker_command, model_files, tmp_path):
    store = await SessionStore.create(tmp_path / "s", model_files=model_files, configuration=CONFIG)
    async with spawn_multiplexed_worker(worker_command, session_store=store, liveness_timeout=3.0) as client:
        await _hung_worker_scenario(client, store, 3.0)
