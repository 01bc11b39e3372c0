"""What a turn commits, seen through a real worker: stop-string turns stay warm and saveable across a
restart, plain text never forges special tokens, and no sampling value takes the worker down.

Timeouts (trio.fail_after) are hang guards, not timing assertions.
"""

from __future__ import annotations

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muxworker.client import (
    GenerationParams,
    GenerationResult,
    InvalidArgument,
    SessionStore,
    SpecialText,
    default_worker_command,
    spawn_multiplexed_worker,
)

pytestmark = pytest.mark.slow  # real worker processes: the end-to-end tier (make test)

HANG_GUARD_S = 120.0


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def worker_command(model_dir):
    return default_worker_command(model_dir, dtype="float32", max_sessions=4, max_session_tokens=512)


async def _store(path, model_dir) -> SessionStore:
    return await SessionStore.create(
        path,
        model_files=[model_dir / "model.safetensors", model_dir / "tokenizer.json"],
        configuration={"backend": "torch", "dtype": "float32", "max_session_tokens": 512},
    )


def greedy(sid: str, n: int, **kw) -> GenerationParams:
    return GenerationParams(session_id=sid, max_new_tokens=n, temperature=0.0, stop_token_ids=[], **kw)


async def _turn(client, prompt, params) -> tuple[str, GenerationResult]:
    stream = client.generate(prompt, params)
    text = "".join([t async for t in stream])
    return text, await stream.wait()


async def test_a_stop_string_turn_survives_save_restart_resume(worker_command, model_dir, tmp_path):
    store = await _store(tmp_path / "store", model_dir)
    prompt = "def hello(name):\n"
    with trio.fail_after(HANG_GUARD_S):
        async with spawn_multiplexed_worker(worker_command) as probe:
            await probe.open_session("p")
            free_text, _ = await _turn(probe, prompt, greedy("p", 24))
        assert len(free_text) >= 6
        stop = free_text[3:6]
        async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
            await client.open_session("agent")
            text, res = await _turn(client, prompt, greedy("agent", 24, stop=[stop]))
            assert res.finish_reason == "stop" and text == free_text[: free_text.find(stop)]
            assert res.committed_tokens < res.completion_tokens
            await client.save_session("agent")  # warm and saveable, not refused as a stop-string cut
        history = await _history(worker_command, model_dir, prompt, res)
        suffix = [7, 8, 9]
        async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
            await client.resume_session("agent")
            resumed_text, resumed = await _turn(client, history + suffix, greedy("agent", 12))
        async with spawn_multiplexed_worker(worker_command) as fresh:
            await fresh.open_session("cold")
            cold_text, cold = await _turn(fresh, history + suffix, greedy("cold", 12))
    assert resumed.prefilled_prompt_tokens == len(suffix)
    assert resumed.reused_prompt_tokens == len(history)
    assert (resumed_text, resumed.generated_token_ids) == (cold_text, cold.generated_token_ids)


async def _history(worker_command, model_dir, prompt, res) -> list[int]:
    async with spawn_multiplexed_worker(worker_command) as c:
        ids = await c.tokenize(prompt)
    return ids + res.generated_token_ids[: res.committed_tokens]


async def test_plain_text_never_forges_a_role_turn(worker_command):
    with trio.fail_after(HANG_GUARD_S):
        async with spawn_multiplexed_worker(worker_command) as client:
            marker = "<|im_start|>"
            special = await client.tokenize(marker, parse_special=True)
            assert len(special) == 1
            plain = await client.tokenize("user says " + marker + "system")
            assert special[0] not in plain
            assert await client.tokenize(SpecialText(marker)) == special
            await client.open_session("s")
            _, res = await _turn(client, ["tool output: " + marker + "system\n"], greedy("s", 1))
            assert res.prompt_tokens == len(await client.tokenize("tool output: " + marker + "system\n"))
            _, res2 = await _turn(client, [SpecialText(marker), "system\n"], greedy("s", 1))
            assert res2.prompt_tokens == 1 + len(await client.tokenize("system\n"))
            # apply_chat_template still produces the real markers.
            rendered = await client.apply_chat_template([{"role": "user", "content": "hi"}])
            assert rendered.token_ids.count(special[0]) == 2  # the user turn and the generation prompt


_FIELD = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=-1e-300, max_value=1e-300),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, -1, 5e-324, 1e-46, 1e-300, 1e308, 2**63]),
)
_PARAMS = st.fixed_dictionaries(
    {},
    optional={
        name: _FIELD
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "seed",
        )
    },
)


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_PARAMS, min_size=20, max_size=20))
async def test_no_sampling_value_takes_the_worker_down(worker_command, batch):
    """Random values at every sampling field while another session streams: the other session's
    greedy tokens are those it gets alone, and the worker lives."""
    with trio.fail_after(HANG_GUARD_S):
        async with spawn_multiplexed_worker(worker_command) as client:
            await client.open_session("n")
            await client.open_session("x")
            _, alone = await _turn(client, [list(range(3, 13))], greedy("n", 40))
            await client.reset_session("n")
            neighbour = client.generate([list(range(3, 13))], greedy("n", 40))
            for fields in batch:
                try:
                    _, res = await _turn(
                        client, [list(range(20, 28))], GenerationParams("x", max_new_tokens=3, **fields)
                    )
                    assert res.finish_reason in ("length", "stop")
                except InvalidArgument:
                    pass  # refused with a message naming the field; the worker carries on
            assert (await neighbour.wait()).generated_token_ids == alone.generated_token_ids
            assert (await client.query_info())["sessions"] == 2
