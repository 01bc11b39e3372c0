"""The trio client against a real worker subprocess over real pipes, on a tiny random model.

Each worker takes seconds to start, so these are in the slow tier, but for one smoke test of the
client over a real worker (interleaved sessions, checked against the engine in-process) and the
checks that need no model loaded. The client's connection layer is tested over in-memory streams
in test_connection.py.

Timeouts here (trio.fail_after) are hang guards, not timing assertions: the machine is shared.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from types import SimpleNamespace

import pytest
import trio
from helpers.params import greedy  # no stop tokens: every stream runs to its length
from helpers.procs import child_pids

from muxworker import client as api
from muxworker.client import (
    ClientClosedError,
    ContextOverflow,
    GenerationParams,
    GenerationResult,
    InvalidArgument,
    MuxError,
    SessionBusy,
    SessionExists,
    SessionNotFound,
    SlowConsumer,
    WorkerDiedError,
    WorkerStartupError,
    default_worker_command,
    spawn_multiplexed_worker,
)
from muxworker.transport.errors import ERROR_CLASSES

HANG_GUARD_S = 60.0


# ----------------------------------------------------------------------------------------------
# spawning and closing


@pytest.mark.slow
async def test_spawn_with_a_nursery_and_close_is_idempotent(worker_command):
    async with trio.open_nursery() as nursery:
        client = await spawn_multiplexed_worker(worker_command, nursery=nursery)
        info = client.info
        assert info.protocol[0] == 1
        assert info.model.architecture == "LlamaForCausalLM" and info.model.vocab_size == 384
        assert info.model.has_chat_template and info.backend == "torch" and info.dtype == "float32"
        assert info.limits["max_sessions"] == 20
        pid = client.pid
        await client.close()
        await client.close()
        assert client.returncode == 0
        assert pid not in child_pids()
        with pytest.raises(ClientClosedError):
            await client.open_session("late")
        with pytest.raises(ClientClosedError):
            client.generate("late", greedy("late"))


async def test_await_without_a_nursery_is_a_type_error(worker_command):
    with pytest.raises(TypeError, match="nursery="):
        await spawn_multiplexed_worker(worker_command)


@pytest.mark.slow
async def test_close_settles_running_streams(worker_command):
    async with spawn_multiplexed_worker(worker_command) as client:
        await client.open_session("a")
        stream = client.generate([5, 6, 7], greedy("a", 400))
        await stream.__anext__()
        queued = client.generate([5, 6, 7], greedy("b", 4))  # written before the control pipe closes
        await client.close()
        with trio.fail_after(HANG_GUARD_S):
            assert (await stream.wait()).finish_reason == "cancelled"
            with pytest.raises(SessionNotFound):  # it reached the worker, which answered before exiting
                await queued.wait()
    assert client.returncode == 0


async def test_caller_cancelled_during_start_reaps_the_child(worker_command):
    before = child_pids()
    with trio.move_on_after(0.3) as scope:
        async with spawn_multiplexed_worker(worker_command):
            pytest.fail("the worker cannot start in 0.3s")  # pragma: no cover
    assert scope.cancelled_caught
    assert child_pids() <= before


@pytest.mark.slow
async def test_cancelling_the_nursery_reaps_the_child(worker_command):
    async with trio.open_nursery() as nursery:
        client = await spawn_multiplexed_worker(worker_command, nursery=nursery)
        await client.open_session("a")
        stream = client.generate([5, 6], greedy("a", 400))
        await stream.__anext__()
        nursery.cancel_scope.cancel()
    assert client.returncode is not None
    assert client.pid not in child_pids()
    with pytest.raises(ClientClosedError):  # stopped from this side: not a death
        await client.open_session("b")
    with pytest.raises(ClientClosedError):
        await stream.wait()


@pytest.mark.slow
async def test_bad_model_path_fails_spawn_with_the_workers_message(tmp_path):
    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(WorkerStartupError) as info:
            async with spawn_multiplexed_worker(default_worker_command(tmp_path / "missing")):
                pytest.fail("spawned")  # pragma: no cover
    error = info.value
    assert isinstance(error, WorkerDiedError)
    assert "does not exist" in error.reason
    assert error.returncode == 1
    assert any("does not exist" in line for line in error.stderr_tail)


async def test_invalid_flag_fails_spawn_with_the_workers_message(model_dir):
    with trio.fail_after(HANG_GUARD_S):
        with pytest.raises(WorkerStartupError, match="--max_sessions") as info:
            async with spawn_multiplexed_worker(default_worker_command(model_dir, max_sessions=0)):
                pytest.fail("spawned")  # pragma: no cover
    assert info.value.returncode == 2


@pytest.mark.slow
async def test_worker_that_prints_to_stdout_keeps_the_protocol_intact(model_dir, caplog):
    # A wrapper that prints before the worker starts and from inside every tokenize call.
    wrapper = (
        "import runpy, sys\n"
        "print('stdout noise before main ' * 200, flush=True)\n"
        "import muxworker.worker.models.tokenizer as t\n"
        "encode = t.Tokenizer.encode\n"
        "def noisy(self, *a, **k):\n"
        "    print('stdout noise from encode')\n"
        "    return encode(self, *a, **k)\n"
        "t.Tokenizer.encode = noisy\n"
        "runpy.run_module('muxworker.worker', run_name='__main__', alter_sys=True)\n"
    )
    command = [sys.executable, "-c", wrapper, "--model", str(model_dir), "--max_session_tokens", "256"]
    caplog.set_level(logging.INFO, logger="muxworker.worker")
    async with spawn_multiplexed_worker(command) as client:
        await client.open_session("a")
        ids = await client.tokenize("Hello world")
        stream = client.generate("Hello world", greedy("a", 8))
        text = "".join([t async for t in stream])
        result = await stream.wait()
        assert result.prompt_tokens == len(ids)
        assert text == await client.detokenize(result.generated_token_ids)
        with trio.fail_after(HANG_GUARD_S):
            while not any("noise from encode" in line for line in client.stderr_tail):
                await trio.sleep(0.01)
    assert client.returncode == 0
    logged = [r.getMessage() for r in caplog.records if r.name == "muxworker.worker"]
    assert any("stdout noise before main" in m for m in logged)
    assert any("noise from encode" in m for m in logged)


# ----------------------------------------------------------------------------------------------
# multiplexing


async def test_interleaved_sessions_complete_out_of_order_and_match_a_solo_engine(client, model_dir):
    n = 16
    prompts = [[3 + (7 * i + j) % 300 for j in range(5 + i)] for i in range(n)]
    lengths = [40 - 2 * i for i in range(n)]  # the last started finishes first
    finished: list[int] = []
    texts: dict[int, str] = {}
    results: dict[int, GenerationResult] = {}

    async def one(i: int) -> None:
        sid = f"s{i}"
        await client.open_session(sid)
        stream = client.generate(prompts[i], greedy(sid, lengths[i]))
        parts = []
        async for text in stream:
            parts.append(text)
            # Interleave unrelated calls on the same pipe while the streams run.
            if len(parts) == 3:
                assert await client.detokenize(await client.tokenize("abc")) == "abc"
        results[i] = await stream.wait()
        texts[i] = "".join(parts)
        finished.append(i)

    with trio.fail_after(HANG_GUARD_S * 2):
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
    assert sorted(finished) == list(range(n))
    assert finished != list(range(n))  # out of order
    for i in range(n):
        r = results[i]
        assert r.finish_reason == "length" and r.completion_tokens == lengths[i] == len(r.generated_token_ids)
        assert (r.prompt_tokens, r.prefilled_prompt_tokens, r.reused_prompt_tokens) == (
            len(prompts[i]),
            len(prompts[i]),
            0,
        )
        assert texts[i] == await client.detokenize(r.generated_token_ids)

    # The same greedy continuations from the engine in-process, one request at a time.
    from muxworker.worker.build import load_engine
    from muxworker.worker.engine.config import EngineConfig
    from muxworker.worker.engine.sampling import SamplingParams

    engine = await trio.to_thread.run_sync(
        lambda: load_engine(model_dir, EngineConfig(max_sessions=1, max_session_tokens=512), progress=None)
    )
    engine.open_session("solo")
    for i in range(n):
        engine.reset_session("solo")
        engine.submit(1, "solo", prompts[i], SamplingParams(max_new_tokens=lengths[i], stop_token_ids=[]))
        result = None
        while engine.has_work():
            for out in engine.step():
                result = out.result or result
        assert result["generated_token_ids"] == results[i].generated_token_ids


@pytest.mark.slow
async def test_prompt_forms_and_params_objects(client):
    await client.open_session("a")
    ids = await client.tokenize("The quick brown fox")
    outs = []
    for prompt in ("The quick brown fox", ids, [ids[:2], ids[2:]], ["The quick brown fox"], tuple(ids)):
        await client.reset_session("a")
        outs.append(await client.generate(prompt, greedy("a", 6)).wait())
    assert all(o.prompt_tokens == len(ids) for o in outs)
    assert all(o.generated_token_ids == outs[0].generated_token_ids for o in outs)
    # Any object with the attributes works; missing ones take the worker's defaults.
    await client.reset_session("a")
    ns = await client.generate(ids, SimpleNamespace(session_id="a", max_new_tokens=6, stop_token_ids=[])).wait()
    assert ns.generated_token_ids == outs[0].generated_token_ids
    await client.reset_session("a")
    default = await client.generate(ids, SimpleNamespace(session_id="a")).wait()
    assert default.finish_reason in ("stop", "length") and default.completion_tokens <= 256
    with pytest.raises(InvalidArgument, match="session_id"):
        client.generate(ids, SimpleNamespace(max_new_tokens=4))
    with pytest.raises(InvalidArgument, match="prompt"):
        client.generate({"text": "x"}, greedy("a"))
    with pytest.raises(InvalidArgument, match="token ids must lie"):
        client.generate([1, -2], greedy("a"))


@pytest.mark.slow
async def test_errors_end_their_request_only(client):
    await client.open_session("a")
    await client.open_session("b")
    with pytest.raises(SessionExists):
        await client.open_session("a")
    running = client.generate([5, 6], greedy("b", 60))
    with pytest.raises(SessionNotFound):
        await client.generate("x", greedy("nope")).wait()
    with pytest.raises(SessionBusy):
        await client.generate("x", greedy("b")).wait()
    with pytest.raises(ContextOverflow):
        await client.generate("x", greedy("a", 10_000)).wait()
    with pytest.raises(InvalidArgument, match="temperature"):
        await client.generate("x", greedy("a", temperature=-1.0)).wait()
    stream = client.generate("x", greedy("a", top_p=2.0))
    with pytest.raises(InvalidArgument):
        async for _ in stream:
            pass
    with pytest.raises(InvalidArgument):  # and again: the stream remembers
        await stream.wait()
    assert (await running.wait()).completion_tokens == 60


def test_one_exception_class_per_wire_code():
    for code, cls in ERROR_CLASSES.items():
        assert getattr(api, cls.__name__) is cls and issubclass(cls, MuxError) and cls.code == code
    assert issubclass(WorkerDiedError, MuxError) and issubclass(ClientClosedError, MuxError)


@pytest.mark.slow
async def test_tokenize_detokenize_and_chat_template(client):
    ids = await client.tokenize("Hello world")
    assert await client.detokenize(ids) == "Hello world"
    chat = await client.apply_chat_template([{"role": "user", "content": "hi"}])
    text, chat_ids = chat
    assert text == chat.text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat.token_ids == chat_ids == await client.tokenize(text, parse_special=True)
    assert await client.tokenize(text) != chat_ids  # plain text: the markers are characters
    no_prompt = await client.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert no_prompt.text == "<|im_start|>user\nhi<|im_end|>\n"
    with pytest.raises(InvalidArgument):
        await client.apply_chat_template([])
    info = await client.query_info()
    assert info["model"]["name"] == client.info.model.name


# ----------------------------------------------------------------------------------------------
# cancellation and fencing


@pytest.mark.slow
async def test_cancel_ends_only_its_target(client):
    await client.open_session("a")
    await client.open_session("b")
    a = client.generate([5, 6, 7], greedy("a", 300))
    b = client.generate([8, 9], greedy("b", 50))
    await a.__anext__()
    a.cancel()
    a.cancel()  # idempotent
    ra = await a.wait()
    assert ra.finish_reason == "cancelled" and ra.completion_tokens < 300
    assert ra.prompt_tokens == 3  # it reached the worker
    rb = await b.wait()
    assert rb.finish_reason == "length" and rb.completion_tokens == 50
    # The session keeps what was generated before the cancel and takes new work.
    assert (await client.generate([1, 2], greedy("a", 3)).wait()).completion_tokens == 3


@pytest.mark.slow
async def test_cancel_before_the_request_is_sent_stays_local(client):
    await client.open_session("a")
    stream = client.generate([5, 6, 7], greedy("a", 50))
    stream.cancel()  # no checkpoint since generate(): the request is still queued
    assert await stream.wait() == GenerationResult.cancelled_locally()
    assert [t async for t in stream] == []
    info = await client.query_info()
    assert info["stats"]["steps"] == 0 and info["inflight_requests"] == 0  # the worker never saw it
    # A unary call cancelled before it is sent also never reaches the worker.
    with trio.CancelScope() as scope:
        scope.cancel()
        await client.open_session("b")
    await client.open_session("b")  # so "b" was not opened by the cancelled call


@pytest.mark.slow
async def test_aclose_cancels_and_waits_until_settled(client):
    await client.open_session("a")
    async with client.generate([5, 6], greedy("a", 300)) as stream:
        await stream.__anext__()
    assert stream.finished
    assert (await stream.wait()).finish_reason == "cancelled"
    # settled in the worker too: the session takes a new request at once
    assert (await client.generate([1], greedy("a", 2)).wait()).completion_tokens == 2


@pytest.mark.slow
async def test_close_and_reset_fence_their_own_session_only(client):
    for sid in ("a", "b", "c"):
        await client.open_session(sid)
    a = client.generate([5, 6, 7], greedy("a", 300))
    b = client.generate([8, 9, 10], greedy("b", 300))
    c = client.generate([11, 12], greedy("c", 60))
    for stream in (a, b, c):
        await stream.__anext__()
    await client.reset_session("a")
    assert a.finished  # its done arrived before the reset's ok
    assert (await a.wait()).finish_reason == "cancelled"
    await client.close_session("b")
    assert b.finished
    assert (await b.wait()).finish_reason == "cancelled"
    rc = await c.wait()
    assert rc.finish_reason == "length" and rc.completion_tokens == 60
    again = await client.generate([5, 6, 7], greedy("a", 4)).wait()
    assert again.reused_prompt_tokens == 0  # the reset forgot the history
    with pytest.raises(SessionNotFound):
        await client.generate([1], greedy("b", 4)).wait()


@pytest.mark.slow
async def test_a_consumer_that_stops_reading_gets_slow_consumer_and_others_keep_streaming(worker_command):
    async with spawn_multiplexed_worker(worker_command, stream_buffer=4) as client:
        await client.open_session("stalled")
        await client.open_session("reader")
        stalled = client.generate([5, 6], greedy("stalled", 300))
        reader = client.generate([7, 8], greedy("reader", 100))
        texts = [t async for t in reader]
        result = await reader.wait()
        assert result.completion_tokens == 100
        assert "".join(texts) == await client.detokenize(result.generated_token_ids)
        with pytest.raises(SlowConsumer):
            async for _ in stalled:
                pass
        with pytest.raises(SlowConsumer):
            await stalled.wait()
        # The worker was told: the stalled session goes idle and takes new work.
        with trio.fail_after(HANG_GUARD_S):
            while (await client.query_info())["inflight_requests"]:
                await trio.sleep(0.01)
        assert (await client.generate([1], greedy("stalled", 3)).wait()).completion_tokens == 3


# ----------------------------------------------------------------------------------------------
# the bundled SmolLM2-135M-Instruct (slow)

# No assertion on what the replies say: greedy words change with the CPU (--dtype auto, the native
# kernels' instruction set); batching must not change them (tests/worker/test_invariants.py runs
# that on each dtype and instruction set in process).
CHATS = [
    [{"role": "user", "content": "Which city is the capital of France?"}],
    [{"role": "user", "content": "Name three colours of the rainbow."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "Count from one to five."}],
]


@pytest.mark.slow
async def test_smollm2_concurrent_chat_streams_match_solo_runs():
    async with spawn_multiplexed_worker(default_worker_command(max_session_tokens=1024), startup_timeout=600) as client:
        assert client.info.model.vocab_size == 49152 and client.info.model.has_chat_template
        prompts = [(await client.apply_chat_template(chat)).token_ids for chat in CHATS]
        results: dict[int, tuple[str, GenerationResult]] = {}

        async def one(i: int, sid: str) -> None:
            await client.open_session(sid)
            stream = client.generate(prompts[i], GenerationParams(session_id=sid, max_new_tokens=32))
            text = "".join([t async for t in stream])
            results[i] = (text, await stream.wait())

        with trio.fail_after(HANG_GUARD_S * 5):
            async with trio.open_nursery() as nursery:
                for i in range(len(CHATS)):
                    nursery.start_soon(one, i, f"chat{i}")
        for text, result in results.values():
            ids = result.generated_token_ids
            assert result.completion_tokens == len(ids) and 0 < len(ids) <= 32
            assert result.finish_reason == "stop" or (result.finish_reason, len(ids)) == ("length", 32)
            if result.finish_reason == "stop":
                assert ids[-1] in client.info.model.eos_token_ids  # the stop token is committed, not shown
                ids = ids[:-1]
            assert text == await client.detokenize(ids)
        # Continuous batching does not change a greedy continuation.
        for i in range(2):
            await client.open_session(f"solo{i}")
            solo = await client.generate(prompts[i], GenerationParams(session_id=f"solo{i}", max_new_tokens=32)).wait()
            assert solo.generated_token_ids == results[i][1].generated_token_ids


@pytest.mark.slow
async def test_smollm2_worker_killed_mid_stream():
    async with spawn_multiplexed_worker(default_worker_command(max_session_tokens=1024), startup_timeout=600) as client:
        await client.open_session("a")
        stream = client.generate(
            "Tell me a long story.", GenerationParams(session_id="a", max_new_tokens=500, stop_token_ids=[])
        )
        await stream.__anext__()
        os.kill(client.pid, signal.SIGKILL)
        with trio.fail_after(HANG_GUARD_S):
            with pytest.raises(WorkerDiedError) as info:
                await stream.wait()
        assert info.value.returncode == -signal.SIGKILL
        with pytest.raises(WorkerDiedError):
            await client.tokenize("x")
    assert client.returncode == -signal.SIGKILL


# ----------------------------------------------------------------------------------------------
# wrong arguments raise MuxError, never a bare Python error, and never hurt the worker (item 13)

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.one_of(st.integers(min_value=-(2**40), max_value=2**70), st.text(max_size=2), st.none()), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.sampled_from(
        [object(), np.array([[1, 2]]), np.float32(0.5), np.int64(-3), np.array([2**40]), {"role": 1}, [{}]]
    ),
)
PARAM_FIELDS = [f.name for f in dataclasses.fields(GenerationParams)]
CALLS = (
    "open",
    "close",
    "reset",
    "generate_prompt",
    "generate_param",
    "generate_params_object",
    "tokenize",
    "detokenize",
    "chat_template",
    "export",
    "restore",
    "save",
    "resume",
    "rt_open",
    "rt_generate_prompt",
    "rt_generate_param",
    "rt_save",
    "rt_resume",
    "rt_export",
    "rt_restore",
)


async def _each_param(generate, bad) -> None:
    """``bad`` in each field of GenerationParams in turn (every field, the new ones too)."""
    for name in PARAM_FIELDS:
        params = GenerationParams(session_id="s", max_new_tokens=2, stop_token_ids=[])
        setattr(params, name, bad)
        try:
            await generate(params).wait()
        except MuxError:
            pass


async def _bad_call(client, runtime, checkpoint, call: str, slot: int, bad) -> None:
    """One public call with ``bad`` in one argument slot and valid values elsewhere."""

    def pick(*args):
        args = list(args)
        args[slot % len(args)] = bad
        return args

    if call in ("open", "close", "reset", "save", "resume"):
        await getattr(client, f"{call}_session")(bad)
    elif call == "generate_prompt":
        await client.generate(bad, greedy("s", 2)).wait()
    elif call == "generate_param":
        await _each_param(lambda params: client.generate([5, 6], params), bad)
    elif call == "generate_params_object":
        await client.generate([5, 6], bad).wait()
    elif call == "tokenize":
        text, special = pick("hi", False)
        await client.tokenize(text, add_special_tokens=special)
    elif call == "detokenize":
        await client.detokenize(bad)
    elif call == "chat_template":
        messages, prompt = pick([{"role": "user", "content": "hi"}], True)
        await client.apply_chat_template(messages, prompt)
    elif call == "export":
        await client.export_checkpoint_to_cpu(*pick("s", None, None))
    elif call == "restore":
        await client.restore_checkpoint_from_cpu(*pick(checkpoint, "restored", None, None))
    elif call == "rt_open":
        await runtime.open_session(bad)
    elif call == "rt_generate_prompt":
        await runtime.generate("s", bad, greedy("s", 2)).wait()
    elif call == "rt_generate_param":
        await _each_param(lambda params: runtime.generate("s", [5, 6], params), bad)
    elif call in ("rt_save", "rt_resume"):
        await getattr(runtime, f"{call[3:]}_session")(bad)
    elif call == "rt_export":
        await runtime.export_checkpoint_to_cpu(*pick("s", None, None))
    elif call == "rt_restore":
        await runtime.restore_checkpoint_from_cpu(*pick(checkpoint, "restored", None, None))
    else:  # pragma: no cover
        raise AssertionError(call)


@pytest.mark.slow
@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(calls=st.lists(st.tuples(st.sampled_from(CALLS), st.integers(0, 3), WRONG), min_size=30, max_size=30))
async def test_wrong_arguments_to_every_public_call_raise_mux_errors_and_the_worker_lives(
    calls, worker_command, model_dir, tmp_path_factory
):
    from muxworker.client import SessionRuntime, SessionStore

    store = await SessionStore.create(
        tmp_path_factory.mktemp("wrong") / "store",
        model_files=[model_dir / "model.safetensors", model_dir / "tokenizer.json"],
        configuration={"backend": "torch", "dtype": "float32"},
    )
    async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
        runtime = SessionRuntime(client)
        await client.open_session("s")
        await client.generate([5, 6, 7], greedy("s", 3)).wait()
        checkpoint = await client.export_checkpoint_to_cpu("s")
        with trio.fail_after(HANG_GUARD_S * 2):
            for call, slot, bad in calls:
                try:
                    await _bad_call(client, runtime, checkpoint, call, slot, bad)
                except MuxError:
                    pass  # the only kind of error a wrong argument may raise
                assert client.is_usable, (call, slot, bad)
            # The worker lives and serves: a greedy generation on a fresh session is unchanged.
            await client.open_session("after")
            result = await client.generate([5, 6, 7], greedy("after", 3)).wait()
            assert result.completion_tokens == 3
            assert (await client.query_info())["readiness"] == "ready"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(worker_command="python -m muxworker.worker"),
        dict(worker_command=[]),
        dict(worker_command=[1, 2]),
        dict(worker_command=None),
        dict(worker_command=["w"], stream_buffer=0),
        dict(worker_command=["w"], stream_buffer="4"),
        dict(worker_command=["w"], liveness_timeout=0),
        dict(worker_command=["w"], liveness_timeout=float("nan")),
        dict(worker_command=["w"], startup_timeout=None),
        dict(worker_command=["w"], close_timeout=-1),
    ],
)
def test_spawn_arguments_are_checked_at_the_call_with_invalid_argument(kwargs):
    with pytest.raises(InvalidArgument) as info:
        spawn_multiplexed_worker(**kwargs)
    assert isinstance(info.value, ValueError)  # what these checks raised before, for old callers
