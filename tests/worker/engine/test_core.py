"""The in-process engine: sessions, continuous batching, history reuse, limits, cancellation."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.engine import greedy, make, prompt_ids, run

from muxworker.transport.errors import (
    CapacityExhausted,
    CheckpointRejected,
    ContextOverflow,
    InvalidArgument,
    SessionBusy,
    SessionExists,
    SessionNotFound,
    Unsaveable,
)
from muxworker.worker.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def mistral(tiny_model_factory):
    return tiny_model_factory("mistral")


def test_one_forward_batches_several_sessions(llama):
    eng = make(llama)
    seen = []
    eng.on_forward = seen.append
    for i in range(4):
        eng.open_session(f"s{i}")
        eng.submit(i + 1, f"s{i}", prompt_ids(10, i), greedy(4))
    run(eng)
    assert any(len(set(ids)) >= 4 for ids in seen), seen


def test_batching_invariance_8_sessions(llama):
    prompts = [prompt_ids(5 + 7 * i, seed=i) for i in range(8)]
    alone = []
    for p in prompts:
        eng = make(llama)
        eng.open_session("s")
        eng.submit(1, "s", p, greedy(12))
        alone.append(run(eng)[1][1]["generated_token_ids"])
    eng = make(llama, prefill_chunk_tokens=16)
    for i, p in enumerate(prompts):
        eng.open_session(f"s{i}")
        eng.submit(i + 1, f"s{i}", p, greedy(12))
    together = run(eng)
    assert [together[i + 1][1]["generated_token_ids"] for i in range(8)] == alone


def test_history_extension_prefills_only_the_suffix(llama):
    eng = make(llama)
    eng.open_session("s")
    p1 = prompt_ids(20, 1)
    eng.submit(1, "s", p1, greedy(5))
    r1 = run(eng)[1][1]
    assert (r1["reused_prompt_tokens"], r1["prefilled_prompt_tokens"]) == (0, 20)
    history = p1 + r1["generated_token_ids"]
    assert eng.session_tokens("s") == history
    p2 = history + prompt_ids(7, 2)
    eng.submit(2, "s", p2, greedy(5))
    r2 = run(eng)[2][1]
    # The last generated token had no KV yet: it is prefilled with the new suffix.
    assert r2["reused_prompt_tokens"] == len(history) - 1
    assert r2["prefilled_prompt_tokens"] == len(p2) - (len(history) - 1)
    cold = make(llama)
    cold.open_session("c")
    cold.submit(1, "c", p2, greedy(5))
    assert run(cold)[1][1]["generated_token_ids"] == r2["generated_token_ids"]


def test_divergent_prompt_reuses_common_prefix_and_equal_prompt_reruns_last(llama):
    eng = make(llama)
    eng.open_session("s")
    p1 = prompt_ids(30, 3)
    eng.submit(1, "s", p1, greedy(3))
    run(eng)
    p2 = p1[:12] + prompt_ids(9, 4)
    eng.submit(2, "s", p2, greedy(3))
    r2 = run(eng)[2][1]
    assert (r2["reused_prompt_tokens"], r2["prefilled_prompt_tokens"]) == (12, 9)
    # Exactly the history (all with KV): re-run only the last token for logits.
    hist = eng.session_tokens("s")[:-1]
    eng.submit(3, "s", hist, greedy(3))
    r3 = run(eng)[3][1]
    assert (r3["reused_prompt_tokens"], r3["prefilled_prompt_tokens"]) == (len(hist) - 1, 1)


def test_sliding_window_divergence_beyond_window_prefills_cold(mistral):
    eng = make(mistral)  # window 16
    eng.open_session("s")
    p1 = prompt_ids(40, 5)
    eng.submit(1, "s", p1, greedy(3))
    run(eng)
    p2 = p1[:30] + prompt_ids(5, 6)  # diverges 12 tokens back: the window no longer holds that
    eng.submit(2, "s", p2, greedy(3))
    r2 = run(eng)[2][1]
    assert (r2["reused_prompt_tokens"], r2["prefilled_prompt_tokens"]) == (0, 35)
    cold = make(mistral)
    cold.open_session("c")
    cold.submit(1, "c", p2, greedy(3))
    assert run(cold)[1][1]["generated_token_ids"] == r2["generated_token_ids"]


def test_sliding_window_extension_matches_cold(mistral):
    eng = make(mistral, prefill_chunk_tokens=7)
    eng.open_session("s")
    p1 = prompt_ids(40, 7)
    eng.submit(1, "s", p1, greedy(20))
    r1 = run(eng)[1][1]
    p2 = p1 + r1["generated_token_ids"] + prompt_ids(11, 8)
    eng.submit(2, "s", p2, greedy(10))
    r2 = run(eng)[2][1]
    assert r2["reused_prompt_tokens"] == len(p1) + 19
    cold = make(mistral)
    cold.open_session("c")
    cold.submit(1, "c", p2, greedy(10))
    assert run(cold)[1][1]["generated_token_ids"] == r2["generated_token_ids"]


def test_seeded_sampling_is_reproducible(llama):
    outs = []
    for _ in range(2):
        eng = make(llama)
        eng.open_session("s")
        eng.submit(
            1,
            "s",
            prompt_ids(10),
            SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7, stop_token_ids=[]),
        )
        outs.append(run(eng)[1][1]["generated_token_ids"])
    assert outs[0] == outs[1]


def test_stop_string_across_tokens_is_withheld(llama):
    eng = make(llama)
    eng.open_session("s")
    eng.submit(1, "s", prompt_ids(10, 9), greedy(16))
    text, res = run(eng)[1]
    assert len(text) >= 4
    stop = text[2:4]  # some two characters the model produces
    eng2 = make(llama)
    eng2.open_session("s")
    eng2.submit(1, "s", prompt_ids(10, 9), greedy(16, stop=[stop]))
    text2, res2 = run(eng2)[1]
    assert res2["finish_reason"] == "stop"
    assert text2 == text[: text.find(stop)]
    # The session stays warm and saveable: it keeps the tokens whose text is visible.
    committed = res2["committed_tokens"]
    generated = res2["generated_token_ids"]
    assert committed < len(generated)
    assert eng2.session_tokens("s") == prompt_ids(10, 9) + generated[:committed]
    kept = eng2.tokenizer.decode(generated[:committed])
    assert text2.startswith(kept) and eng2.tokenizer.decode(generated[: committed + 1]) != kept
    assert eng2.export_checkpoint("s").position == 10 + committed


def test_eos_stops_and_length_limits(llama):
    eng = make(llama)
    eng.open_session("s")
    eng.submit(1, "s", prompt_ids(10, 10), greedy(6))
    res = run(eng)[1][1]
    assert res["finish_reason"] == "length" and res["completion_tokens"] == 6
    first = res["generated_token_ids"][2]
    eng.reset_session("s")
    eng.submit(2, "s", prompt_ids(10, 10), SamplingParams(max_new_tokens=6, stop_token_ids=[first]))
    res = run(eng)[2][1]
    assert res["finish_reason"] == "stop" and res["generated_token_ids"][-1] == first


def test_max_new_tokens_minus_one_fills_context(llama):
    eng = make(llama, max_session_tokens=64)
    eng.open_session("s")
    eng.submit(1, "s", prompt_ids(50), SamplingParams(max_new_tokens=-1, stop_token_ids=[]))
    res = run(eng)[1][1]
    assert res["completion_tokens"] == 14 and res["finish_reason"] == "length"


def test_cancel_takes_effect_within_one_step_and_spares_others(llama):
    eng = make(llama)
    for s in ("a", "b"):
        eng.open_session(s)
    eng.submit(1, "a", prompt_ids(10, 1), greedy(50))
    eng.submit(2, "b", prompt_ids(10, 2), greedy(20))
    eng.step()
    eng.step()
    assert eng.cancel(1)
    outs = eng.step()
    done = {o.request_id: o.result for o in outs if o.result}
    assert done[1]["finish_reason"] == "cancelled"
    res = run(eng)
    assert res[2][1]["finish_reason"] == "length" and res[2][1]["completion_tokens"] == 20
    # A cancelled turn keeps the prompt and the tokens sampled so far, and stays saveable.
    generated = done[1]["generated_token_ids"]
    assert done[1]["committed_tokens"] == len(generated) > 0
    assert eng.session_tokens("a") == prompt_ids(10, 1) + generated
    ck = eng.export_checkpoint("a")
    assert ck.token_ids.tolist() == (prompt_ids(10, 1) + generated)[: ck.position]
    eng.submit(3, "a", eng.session_tokens("a") + [5], greedy(2))
    assert run(eng)[3][1]["prefilled_prompt_tokens"] == 2  # the last sampled token, then the new one


def test_close_and_reset_cancel_their_own_request_only(llama):
    eng = make(llama)
    for s in ("a", "b", "c"):
        eng.open_session(s)
    eng.submit(1, "a", prompt_ids(10, 1), greedy(30))
    eng.submit(2, "b", prompt_ids(10, 2), greedy(30))
    eng.submit(3, "c", prompt_ids(10, 3), greedy(5))
    eng.step()
    eng.close_session("a")
    eng.reset_session("b")
    res = run(eng)
    assert res[1][1]["finish_reason"] == "cancelled"
    assert res[2][1]["finish_reason"] == "cancelled"
    assert res[3][1]["finish_reason"] == "length"
    assert eng.session_tokens("b") == []
    with pytest.raises(SessionNotFound):
        eng.session_tokens("a")
    eng.open_session("a")  # the slot and id are free again


def test_limits_and_bad_input(llama):
    eng = make(llama, max_session_tokens=64, max_sessions=2, max_inflight_requests=2)
    with pytest.raises(SessionNotFound):
        eng.submit(1, "nope", [1, 2], greedy())
    eng.open_session("a")
    with pytest.raises(SessionExists):
        eng.open_session("a")
    eng.open_session("b")
    with pytest.raises(CapacityExhausted, match="max_sessions"):
        eng.open_session("c")
    with pytest.raises(InvalidArgument):
        eng.open_session("")
    with pytest.raises(InvalidArgument, match="1024"):
        eng.open_session("x" * 1025)
    with pytest.raises(ContextOverflow, match="max_session_tokens"):
        eng.submit(1, "a", prompt_ids(64), greedy())
    with pytest.raises(ContextOverflow, match="max_new_tokens"):
        eng.submit(1, "a", prompt_ids(60), greedy(5))
    with pytest.raises(InvalidArgument, match="temperature"):
        eng.submit(1, "a", [1, 2], SamplingParams(temperature=-0.5))
    for top_p in (0.0, 1.5):
        with pytest.raises(InvalidArgument, match="top_p"):
            eng.submit(1, "a", [1, 2], SamplingParams(top_p=top_p))
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        eng.submit(1, "a", [1, 384], greedy())
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        eng.submit(1, "a", [-1], greedy())
    with pytest.raises(InvalidArgument, match="integers"):
        eng.submit(1, "a", [1, 2.5], greedy())
    with pytest.raises(InvalidArgument, match="empty"):
        eng.submit(1, "a", [], greedy())
    eng.submit(1, "a", [1, 2, 3], greedy(3))
    with pytest.raises(SessionBusy):
        eng.submit(2, "a", [1, 2, 3], greedy(3))
    eng.submit(2, "b", [1, 2, 3], greedy(3))
    eng.close_session("b")
    eng.open_session("b")
    run(eng)
    assert eng.inflight == 0


def test_inflight_admission_limit(llama):
    eng = make(llama, max_inflight_requests=1)
    eng.open_session("a")
    eng.open_session("b")
    eng.submit(1, "a", [1, 2, 3], greedy(3))
    with pytest.raises(CapacityExhausted, match="max_inflight_requests"):
        eng.submit(2, "b", [1, 2, 3], greedy(3))


def test_text_prompt_and_segments(llama):
    eng = make(llama)
    eng.open_session("s")
    ids = eng.tokenizer.encode("Hello, world")
    eng.submit(1, "s", ["Hello, ", [*eng.tokenizer.encode("world")]], greedy(3))
    res = run(eng)[1][1]
    assert res["prompt_tokens"] == len(eng.tokenizer.encode("Hello, ")) + len(eng.tokenizer.encode("world"))
    eng.submit(2, "s", "Hello, world", greedy(3))
    assert run(eng)[2][1]["prompt_tokens"] == len(ids)


def test_shutdown_settles_every_request(llama):
    eng = make(llama)
    eng.open_session("a")
    eng.submit(1, "a", prompt_ids(10), greedy(30))
    eng.step()
    outs = eng.shutdown()
    assert [o.result["finish_reason"] for o in outs if o.result] == ["cancelled"]
    assert eng.shutdown() == []


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_export_restore_continues_like_cold(tiny_model_factory, arch):
    d = tiny_model_factory(arch)
    eng = make(d)
    eng.open_session("s")
    p1 = prompt_ids(40, 11)
    eng.submit(1, "s", p1, greedy(8))
    r1 = run(eng)[1][1]
    ck = eng.export_checkpoint("s")
    assert ck.position == len(p1) + 7
    assert ck.token_ids.tolist() == (p1 + r1["generated_token_ids"])[:-1]
    other = make(d)
    other.open_session("busy")  # another session takes slot 0
    other.restore_checkpoint("r", ck)
    ck2 = other.export_checkpoint("r")
    for a, b in zip(ck.layers, ck2.layers):
        assert a.start == b.start and np.array_equal(a.keys, b.keys) and np.array_equal(a.values, b.values)
    p2 = p1 + r1["generated_token_ids"] + prompt_ids(6, 12)
    other.submit(1, "r", p2, greedy(8))
    r2 = run(other)[1][1]
    assert r2["prefilled_prompt_tokens"] == len(p2) - ck.position
    cold = make(d)
    cold.open_session("c")
    cold.submit(1, "c", p2, greedy(8))
    assert run(cold)[1][1]["generated_token_ids"] == r2["generated_token_ids"]


def test_restore_validation_leaves_id_unused(mistral, llama):
    eng = make(mistral)
    eng.open_session("s")
    eng.submit(1, "s", prompt_ids(40, 13), greedy(4))
    run(eng)
    ck = eng.export_checkpoint("s")  # position 43, window 16: W rows kept, earliest partial restore is 42
    other = make(mistral)
    with pytest.raises(CheckpointRejected):
        other.restore_checkpoint("r", ck, ck.position - 2)
    with pytest.raises(SessionNotFound):
        other.session_tokens("r")
    other.restore_checkpoint("r", ck, ck.position)
    with pytest.raises(SessionExists):
        other.restore_checkpoint("r", ck)
    wrong = make(llama)
    with pytest.raises(CheckpointRejected, match="geometry"):
        wrong.restore_checkpoint("r", ck)
    with pytest.raises(Unsaveable, match="empty"):
        other.open_session("e")
        other.export_checkpoint("e")


def test_generation_right_after_a_cancel_is_accepted(llama):
    """A cancel frees its session at once: the next turn on it is not session_busy."""
    eng = make(llama)
    eng.open_session("a")
    eng.submit(1, "a", prompt_ids(10, 1), greedy(50))
    eng.step()
    eng.step()
    assert eng.cancel(1)
    assert not eng.cancel(1)
    eng.submit(2, "a", eng.session_tokens("a") + [7], greedy(3))
    res = run(eng)
    assert res[1][1]["finish_reason"] == "cancelled"
    assert res[2][1]["finish_reason"] == "length"


def test_the_result_carries_exactly_the_fields_the_client_reads(llama):
    """One contract for a done result: the engine builds every field of the client's GenerationResult
    (draft counts and committed_tokens included), and nothing else."""
    from muxworker.client.params import RESULT_FIELDS, GenerationResult

    eng = make(llama)
    eng.open_session("s")
    eng.submit(1, "s", prompt_ids(8, 40), greedy(3))
    result = run(eng)[1][1]
    assert set(result) == set(RESULT_FIELDS)
    parsed = GenerationResult.from_wire(result, result["generated_token_ids"])
    assert parsed.committed_tokens == 3 and parsed.draft_proposed_tokens == 0
