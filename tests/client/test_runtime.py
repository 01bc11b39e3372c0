"""SessionRuntime over the in-process fake worker (tests/helpers/fake_worker.py), which answers in
milliseconds with the engine's rules; the tests marked ``worker`` also run on a real worker
subprocess on a tiny random model (slow): one per feature, the same assertions. Here: admission,
leases, cancellation, save and resume, and closing; test_runtime_stress.py has random mixes of
operations and checkpoint calls on a hung worker.

Order and overlap are proven by the order of events (request ids, which history a generation
reused, which delta came first), never by durations. trio.fail_after is a hang guard only.
"""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from helpers.fake_worker import FakeStore, FakeWorkerClient
from helpers.params import greedy
from helpers.runtime import BOTH, CONFIG, HANG_GUARD_S, PROMPT, spawn_client

from muxworker.client import (
    CapacityExhausted,
    ClientClosedError,
    GenerationParams,
    GenerationResult,
    InvalidArgument,
    SessionNotFound,
    SessionRuntime,
    SessionStore,
    WorkerDiedError,
)

LONG = 4000  # a generation that runs until it is cancelled (max_session_tokens is 4096)


@pytest.fixture
async def store(backend, tmp_path, request):
    if backend == "fake":
        return FakeStore()
    return await SessionStore.create(
        tmp_path / "s", model_files=request.getfixturevalue("tiny_llama_files"), configuration=CONFIG
    )


@pytest.fixture
async def client(backend, store, request):
    async with spawn_client(backend, store, request) as c:
        yield c


@pytest.fixture
def runtime(client):
    return SessionRuntime(client)


def kill_worker(client) -> None:
    if isinstance(client, FakeWorkerClient):
        client.kill()
    else:
        os.kill(client.pid, signal.SIGKILL)


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
