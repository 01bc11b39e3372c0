"""The bundled SmolLM2-135M-Instruct end to end in-process, against transformers on the same GGUF."""

from __future__ import annotations

import pytest
import torch
from helpers.chats import CHATS

from muxworker.worker.build import load_engine
from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(smollm2_reference):
    return smollm2_reference


@pytest.fixture(scope="module")
def engine():
    # --weights float --dtype float32: the GGUF's exact values, as transformers loads them.
    config = EngineConfig(max_sessions=4, max_session_tokens=1024)
    return load_engine(None, config, dtype="float32", weights="float", progress=None)


@pytest.fixture(scope="module")
def quantized_engine():
    """The default path: GGUF blocks in the native decode step, bfloat16."""
    config = EngineConfig(max_sessions=4, max_session_tokens=1024)
    return load_engine(None, config, dtype="bfloat16", progress=None)


def _greedy(engine, sid: str, request_id: int, ids: list[int], n: int) -> dict:
    """One greedy turn of ``n`` tokens in a fresh session; its result map."""
    engine.open_session(sid)
    engine.submit(request_id, sid, ids, SamplingParams(max_new_tokens=n, temperature=0, stop_token_ids=[]))
    result = None
    while engine.has_work():
        for out in engine.step():
            if out.result is not None:
                result = out.result
    engine.close_session(sid)
    assert result is not None
    return result


def test_greedy_chat_continuations_match_transformers(engine, reference):
    tok, model = reference
    for i, messages in enumerate(CHATS):
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = engine.tokenizer.encode(text, parse_special=True)
        assert ids == tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
        ref_new = ref[0, len(ids) :].tolist()  # may end early at the model's EOS
        result = _greedy(engine, f"chat{i}", i + 1, ids, 32)
        assert len(ref_new) >= 8
        assert result["generated_token_ids"][: len(ref_new)] == ref_new, (messages, tok.decode(ref_new))


def test_eight_sessions_together_equal_alone(engine):
    """Batching invariance on the real model (greedy, float32)."""
    prompts = [engine.tokenizer.encode(f"Count from {i} to {i + 10}: ") for i in range(4)]
    params = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[])

    def go(batch):
        for j, p in batch:
            engine.open_session(f"b{j}")
            engine.submit(100 + j, f"b{j}", p, params)
        res = {}
        while engine.has_work():
            for out in engine.step():
                if out.result is not None:
                    res[out.request_id - 100] = out.result["generated_token_ids"]
        for j, _ in batch:
            engine.close_session(f"b{j}")
        return res

    alone = {}
    for j, p in enumerate(prompts):
        alone.update(go([(j, p)]))
    together = go(list(enumerate(prompts)))
    assert together == alone


def test_quantized_path_agrees_with_the_float_reference(engine, quantized_engine):
    """Teacher-forced top-1 agreement of the default quantized path with the float32 dequantized
    model over 64 positions of each chat (scripts/bench_quant_accuracy.py measures the same):
    measured 189/192 (the dense prefill copies, bfloat16); the issue asks for at least 97%."""
    from muxworker.worker.backends.interface import SeqSpan

    assert quantized_engine.weights == "quantized" and engine.weights == "float"
    agree = total = 0
    for i, messages in enumerate(CHATS):
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = engine.tokenizer.encode(text, parse_special=True)
        result = _greedy(engine, f"ref{i}", 50 + i, ids, 64)
        full = ids + result["generated_token_ids"]
        rows = list(range(len(ids) - 1, len(full) - 1))
        logits = {}
        for name, eng in (("ref", engine), ("q", quantized_engine)):
            n = len(full)
            logits[name] = eng.executor.forward(full, list(range(n)), [SeqSpan(0, 0, n, 0)], rows)
        agree += int((logits["ref"].argmax(-1) == logits["q"].argmax(-1)).sum())
        total += len(rows)
    assert agree / total >= 0.97, f"{agree}/{total}"


def _logprob_turn(engine, sid: str, ids: list[int], n: int, k: int) -> tuple[list, dict]:
    """One greedy turn of ``n`` tokens with ``logprobs=k``: (the TokenLogprob entries, the result)."""
    engine.open_session(sid)
    engine.submit(1, sid, ids, SamplingParams(max_new_tokens=n, temperature=0, stop_token_ids=[], logprobs=k))
    entries, result = [], None
    while engine.has_work():
        for out in engine.step():
            entries += out.logprobs or []
            if out.result is not None:
                result = out.result
    engine.close_session(sid)
    return entries, result


def test_logprobs_equal_transformers_log_softmax(engine, reference):
    """--dtype float32 --weights float: each token's logprob and its top 5 equal log_softmax of
    transformers' logits on the same GGUF within 1e-4."""
    tok, model = reference
    text = engine.tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True)
    ids = engine.tokenizer.encode(text, parse_special=True)
    entries, result = _logprob_turn(engine, "lp", ids, 12, 5)
    generated = result["generated_token_ids"]
    assert [e.token_id for e in entries] == generated and len(generated) == 12
    with torch.no_grad():
        logits = model(torch.tensor([ids + generated])).logits[0].float()
    ref = torch.log_softmax(logits[len(ids) - 1 : len(ids) - 1 + len(generated)], dim=-1)
    for i, e in enumerate(entries):
        assert abs(e.logprob - float(ref[i, e.token_id])) < 1e-4
        values, top_ids = torch.topk(ref[i], 5)
        assert [t for t, _ in e.top] == top_ids.tolist()
        assert max(abs(lp - float(v)) for (_, lp), v in zip(e.top, values)) < 1e-4


def test_logprobs_on_the_quantized_path_are_sane(quantized_engine):
    ids = quantized_engine.tokenizer.encode("The three primary colours are")
    entries, result = _logprob_turn(quantized_engine, "lpq", ids, 16, 20)
    assert [e.token_id for e in entries] == result["generated_token_ids"]
    for e in entries:
        lps = [lp for _, lp in e.top]
        assert len(lps) == 20 and lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        # Greedy: the chosen token is a most likely one (bfloat16 logits tie now and then), and its
        # entry among the top ones carries its logprob.
        assert e.logprob == lps[0] and dict(e.top)[e.token_id] == e.logprob
