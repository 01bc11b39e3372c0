"""Logprobs in the engine on a tiny random model: one entry per generated token (the stop token
included), the model's own distribution whatever picked the token (penalties, a constraint's
mask, temperature), and the same figures with n-gram drafting as without."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.engine import make, prompt_ids

from muxworker.transport.errors import InvalidArgument
from muxworker.worker.backends.interface import SeqSpan
from muxworker.worker.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make(tiny_llama_dir, max_sessions=4)


def _turn(engine, ids, sid="lp", **params):
    engine.open_session(sid)
    try:
        engine.submit(1, sid, ids, SamplingParams(stop_token_ids=[], **params))
        entries, result = [], None
        while engine.has_work():
            for out in engine.step():
                assert out.logprobs is None or len(out.logprobs) == len(out.token_ids)
                entries += out.logprobs or []
                if out.result is not None:
                    result = out.result
        return entries, result
    finally:
        engine.close_session(sid)


def _reference(engine, ids, generated):
    """log_softmax of the engine's own float32 logits over the prompt and the generated tokens."""
    full = ids + generated
    rows = list(range(len(ids) - 1, len(full) - 1))
    logits = engine.executor.forward(full, list(range(len(full))), [SeqSpan(0, 0, len(full), 0)], rows)
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0},
        {"temperature": 1.3, "seed": 4, "top_k": 5},
        {"temperature": 0, "repetition_penalty": 1.8, "presence_penalty": 1.0},
        {"temperature": 0.8, "seed": 2, "constraint": {"regex": "[a-f ]{12}"}},
    ],
)
def test_each_token_gets_the_models_own_logprob_and_top_k(engine, params):
    ids = prompt_ids(10, seed=7)
    entries, result = _turn(engine, ids, max_new_tokens=12, logprobs=3, **params)
    generated = result["generated_token_ids"]
    assert [e.token_id for e in entries] == generated
    ref = _reference(engine, ids, generated)
    for i, e in enumerate(entries):
        assert math.isclose(e.logprob, float(ref[i, e.token_id]), abs_tol=1e-4)
        values, top = torch.topk(ref[i], 3)
        assert [t for t, _ in e.top] == top.tolist()
        assert all(math.isclose(lp, float(v), abs_tol=1e-4) for (_, lp), v in zip(e.top, values))


def test_logprobs_zero_gives_the_chosen_token_only_and_none_gives_nothing(engine):
    entries, _ = _turn(engine, prompt_ids(6), max_new_tokens=4, temperature=0, logprobs=0)
    assert len(entries) == 4 and all(e.top == () and e.logprob <= 0 for e in entries)
    entries, _ = _turn(engine, prompt_ids(6), max_new_tokens=4, temperature=0)
    assert entries == []


def test_out_of_range_logprobs_are_refused(engine):
    engine.open_session("bad")
    try:
        for k in (-1, 21, 2.5, True):
            with pytest.raises(InvalidArgument, match="logprobs"):
                engine.submit(1, "bad", [5, 6], SamplingParams(max_new_tokens=2, logprobs=k))
    finally:
        engine.close_session("bad")


def test_drafted_tokens_get_the_same_logprobs_as_undrafted(tiny_llama_dir, engine):
    drafting = make(tiny_llama_dir, max_sessions=2, speculative="ngram", n_draft=4)
    ids = engine.tokenizer.encode("ab ab ab ab ab ab ab ab ab ab ab ab")
    plain, r1 = _turn(engine, ids, max_new_tokens=24, temperature=0, logprobs=2)
    drafted, r2 = _turn(drafting, ids, max_new_tokens=24, temperature=0, logprobs=2)
    assert r1["generated_token_ids"] == r2["generated_token_ids"]
    assert r2["draft_accepted_tokens"] > 0  # the drafts were used, so the rows differ in origin
    for a, b in zip(plain, drafted):
        assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
