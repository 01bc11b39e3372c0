"""Restored sessions are exact: every continuation of a restored sliding-window session equals a cold
run, restored slots hold only finite rows, and a checkpoint with NaN/inf KV never enters the cache.

The model is the tiny Mistral with a window of 16 and prompts of 40+ tokens, so every ring has
wrapped. Float32, greedy: a continuation is compared token for token with a cold engine that
prefills the same prompt from nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.engine import greedy, prompt_ids, run

from muxworker.transport.checkpoint import CPUCheckpoint, LayerState
from muxworker.transport.errors import CheckpointRejected, InternalError, SessionNotFound
from muxworker.worker.build import load_engine
from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.engine.sampling import SamplingParams

WINDOW = 16
BACKEND = "torch"  # the backend make() builds; the ``backend`` fixture switches it per test


def make(model_dir, **cfg):
    cfg.setdefault("max_session_tokens", 512)
    return load_engine(model_dir, EngineConfig(**cfg), dtype="float32", backend=BACKEND, progress=None)


@pytest.fixture(params=["torch", "mlx"])
def backend(request, monkeypatch):
    """Run the test on both backends: checkpoints are exported by torch and restored by either."""
    if request.param == "mlx":
        pytest.importorskip("mlx.core")
    monkeypatch.setattr(f"{__name__}.BACKEND", request.param)
    return request.param


@pytest.fixture(scope="module")
def mistral(tiny_model_factory):
    return tiny_model_factory("mistral")


def cold(model_dir, prompt, n=8, *, same_kv_as=None):
    """Greedy tokens of a fresh session prefilling ``prompt``; with ``same_kv_as=(engine, sid)``
    also check that session's KV rows equal the cold ones (tokens alone can hide a wrong row)."""
    eng = make(model_dir)
    eng.open_session("cold")
    eng.submit(1, "cold", prompt, greedy(n))
    tokens = run(eng)[1][1]["generated_token_ids"]
    if same_kv_as is not None:
        other, sid = same_kv_as
        want, got = eng.export_checkpoint("cold"), other.export_checkpoint(sid)
        assert got.token_ids.tolist() == want.token_ids.tolist()
        for a, b in zip(got.layers, want.layers):
            assert a.start == b.start
            np.testing.assert_allclose(a.keys, b.keys, atol=1e-4)
            np.testing.assert_allclose(a.values, b.values, atol=1e-4)
    return tokens


def turn(eng, rid, sid, prompt, n=8):
    eng.submit(rid, sid, prompt, greedy(n))
    return run(eng)[rid][1]


@pytest.fixture(scope="module")
def saved(mistral):
    """A checkpoint of a 43-token history (40 prompt + 3 generated + 1 sampled without KV), by torch."""
    eng = load_engine(mistral, EngineConfig(max_session_tokens=512), dtype="float32", progress=None)
    eng.open_session("s")
    turn(eng, 1, "s", prompt_ids(40, 21), n=4)
    ck = eng.export_checkpoint("s")
    assert ck.position == 43 and ck.geometry["windows"] == [WINDOW] * len(ck.layers)
    return ck


def test_export_keeps_the_rows_retained_claims(saved):
    # W rows: what a slot of length 43 says it retains, so a restore can claim the same.
    assert all((layer.start, layer.rows) == (43 - WINDOW, WINDOW) for layer in saved.layers)


def test_full_restore_continues_like_cold(mistral, saved, backend):
    eng = make(mistral)
    eng.restore_checkpoint("r", saved)
    prompt = saved.token_ids.tolist() + prompt_ids(5, 22)
    res = turn(eng, 1, "r", prompt)
    assert res["reused_prompt_tokens"] == saved.position
    assert res["generated_token_ids"] == cold(mistral, prompt, same_kv_as=(eng, "r"))


def test_exact_retry_restores_n_minus_1_and_prefills_one(mistral, saved, backend):
    """The seed's recipe on a sliding-window model: retrying exactly the N saved tokens."""
    eng = make(mistral)
    eng.restore_checkpoint("r", saved)
    prompt = saved.token_ids.tolist()
    res = turn(eng, 1, "r", prompt)
    assert (res["reused_prompt_tokens"], res["prefilled_prompt_tokens"]) == (saved.position - 1, 1)
    assert res["generated_token_ids"] == cold(mistral, prompt, same_kv_as=(eng, "r"))


def test_earliest_partial_restore_continues_like_cold(mistral, saved, backend):
    eng = make(mistral)
    with pytest.raises(CheckpointRejected):
        eng.restore_checkpoint("r", saved, saved.position - 2)
    with pytest.raises(SessionNotFound):
        eng.session_tokens("r")
    eng.restore_checkpoint("r", saved, saved.position - 1)
    # The restored slot holds one row fewer than a slot of its length would: nothing may reuse more.
    prompt = saved.token_ids.tolist()[: saved.position - 1] + prompt_ids(5, 23)
    res = turn(eng, 1, "r", prompt)
    assert res["reused_prompt_tokens"] == saved.position - 1
    assert res["generated_token_ids"] == cold(mistral, prompt, same_kv_as=(eng, "r"))
    # Truncating the partially restored slot by one more row would need a row it never imported.
    eng2 = make(mistral)
    eng2.restore_checkpoint("r", saved, saved.position - 1)
    retry = saved.token_ids.tolist()[: saved.position - 1]
    res = turn(eng2, 1, "r", retry)
    assert res["reused_prompt_tokens"] == 0  # prefilled cold rather than attending to a missing row
    assert res["generated_token_ids"] == cold(mistral, retry)


def test_re_export_of_a_partial_restore_claims_only_what_it_holds(mistral, saved, backend):
    eng = make(mistral)
    eng.restore_checkpoint("r", saved, saved.position - 1)
    again = eng.export_checkpoint("r")
    assert all(layer.start == saved.position - WINDOW for layer in again.layers)
    with pytest.raises(CheckpointRejected):
        eng.export_checkpoint("r", saved.position - 2)


def test_prefix_cache_entry_from_a_restored_session_is_exact(mistral, saved, backend):
    eng = make(mistral, prefix_cache_entries=1)
    eng.restore_checkpoint("r", saved, saved.position - 1)
    full = saved.token_ids.tolist()[: saved.position - 1]
    # A restored session is filed only once a request has named its cache_salt (here none): one
    # token on top of the restored rows, which it keeps (prompt_ids never yields token 1).
    assert turn(eng, 3, "r", full + [1], n=1)["reused_prompt_tokens"] == saved.position - 1
    eng.close_session("r")  # its history, restored rows and all, becomes a prefix-cache entry
    assert eng.prefix_cache.entries() == [full + [1]]
    eng.open_session("n")
    res = turn(eng, 1, "n", full + prompt_ids(6, 24))
    assert res["reused_prompt_tokens"] == saved.position - 1
    assert res["generated_token_ids"] == cold(mistral, full + prompt_ids(6, 24), same_kv_as=(eng, "n"))
    # A prompt diverging one token earlier would need a row the entry never held: no reuse.
    eng.open_session("m")
    shorter = full[:-1] + prompt_ids(6, 25)
    res = turn(eng, 2, "m", shorter)
    assert res["reused_prompt_tokens"] == 0
    assert res["generated_token_ids"] == cold(mistral, shorter)


def test_cancel_rollback_after_restore_is_exact(mistral, saved, backend):
    """A restored session whose next prompt diverges by one token (a rollback) stays exact."""
    eng = make(mistral)
    eng.restore_checkpoint("r", saved)
    prompt = saved.token_ids.tolist()[:-1] + prompt_ids(3, 26)
    res = turn(eng, 1, "r", prompt)
    assert res["reused_prompt_tokens"] == saved.position - 1
    assert res["generated_token_ids"] == cold(mistral, prompt, same_kv_as=(eng, "r"))


@pytest.mark.parametrize("arch", ["mistral", "llama"])
def test_restore_clears_stale_nan_rows_of_the_slot(tiny_model_factory, arch):
    model = tiny_model_factory(arch)
    src = make(model)
    src.open_session("s")
    turn(src, 1, "s", prompt_ids(24, 27), n=2)
    ck = src.export_checkpoint("s")
    eng = make(model, max_sessions=2)
    slot = eng._free_slots[-1]
    for layer in eng.cache.layers:
        layer.k[slot].fill_(float("nan"))
        layer.v[slot].fill_(float("nan"))
    eng.restore_checkpoint("r", ck)
    assert all(
        torch.isfinite(layer.k[slot]).all() and torch.isfinite(layer.v[slot]).all() for layer in eng.cache.layers
    )
    # A longer session decoding in the same batch makes the restored slot's masked rows part of
    # the padded attention: they must not turn its logits into NaN.
    eng.open_session("long")
    long_prompt = prompt_ids(60, 28)
    prompt = ck.token_ids.tolist() + prompt_ids(3, 29)
    eng.submit(1, "long", long_prompt, greedy(8))
    eng.submit(2, "r", prompt, greedy(8))
    res = run(eng)
    assert res[2][1]["generated_token_ids"] == cold(model, prompt)
    assert res[1][1]["generated_token_ids"] == cold(model, long_prompt)


def _poisoned(ck: CPUCheckpoint, value: float) -> CPUCheckpoint:
    layers = [LayerState(x.start, x.keys.copy(), x.values.copy()) for x in ck.layers]
    layers[1].values[3, 0, 5] = value
    return CPUCheckpoint(ck.format, ck.geometry, ck.position, ck.token_ids, layers)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_checkpoint_with_non_finite_kv_is_rejected_and_others_carry_on(mistral, saved, value):
    """Decided rule: a checkpoint whose KV holds NaN/inf is refused at restore (CRCs catch corruption,
    not tampering), so its rows never enter a slot that later serves another session."""
    eng = make(mistral)
    eng.open_session("other")
    eng.submit(1, "other", prompt_ids(20, 30), greedy(6))
    eng.step()
    with pytest.raises(CheckpointRejected, match="layer 1 values hold NaN or infinite values"):
        eng.restore_checkpoint("r", _poisoned(saved, value))
    with pytest.raises(SessionNotFound):
        eng.session_tokens("r")
    assert run(eng)[1][1]["generated_token_ids"] == cold(mistral, prompt_ids(20, 30), 6)
    eng.restore_checkpoint("r", saved)  # the id and the slot are still usable


def test_non_finite_logits_end_that_request_only(mistral):
    """KV gone bad in a live slot (however it got there): sampling from NaN logits fails that
    request with a clear error; a batched neighbour decodes exactly as alone."""
    eng = make(mistral, max_sessions=2)
    eng.open_session("bad")
    eng.open_session("good")
    eng.submit(1, "bad", prompt_ids(20, 31), greedy(2))
    run(eng)
    slot = eng._sessions["bad"].slot
    for layer in eng.cache.layers:
        layer.v[slot].fill_(float("nan"))
    good_prompt = prompt_ids(20, 32)
    eng.submit(2, "bad", eng.session_tokens("bad") + [5], SamplingParams(max_new_tokens=8, temperature=0.7, seed=1))
    eng.submit(3, "good", good_prompt, greedy(8))
    outs = {}
    while eng.has_work():
        for o in eng.step():
            if o.result is not None:
                outs[o.request_id] = o
    assert outs[2].result["finish_reason"] == "error"
    assert isinstance(outs[2].error, InternalError) and "no finite distribution" in str(outs[2].error)
    assert outs[3].result["generated_token_ids"] == cold(mistral, good_prompt)
    assert eng.session_tokens("bad") == []  # its history was emptied, the engine carries on
    eng.submit(4, "bad", prompt_ids(10, 33), greedy(2))
    assert run(eng)[4][1]["finish_reason"] == "length"


def test_restore_from_a_w_minus_1_file_is_still_exact(mistral, saved, backend):
    """Checkpoints written before the fix keep W - 1 ring rows: they restore, claim only those
    rows, and continue exactly (an exact retry then prefills cold instead of reusing a missing row)."""
    old = CPUCheckpoint(
        saved.format,
        saved.geometry,
        saved.position,
        saved.token_ids,
        [
            LayerState(x.start + 1, np.ascontiguousarray(x.keys[1:]), np.ascontiguousarray(x.values[1:]))
            for x in saved.layers
        ],
    )
    eng = make(mistral)
    eng.restore_checkpoint("r", old)
    prompt = saved.token_ids.tolist() + prompt_ids(4, 34)
    res = turn(eng, 1, "r", prompt)
    assert res["reused_prompt_tokens"] == saved.position
    assert res["generated_token_ids"] == cold(mistral, prompt)
    eng2 = make(mistral)
    eng2.restore_checkpoint("r", old)
    res = turn(eng2, 1, "r", saved.token_ids.tolist())
    assert res["reused_prompt_tokens"] == 0
    assert res["generated_token_ids"] == cold(mistral, saved.token_ids.tolist())
