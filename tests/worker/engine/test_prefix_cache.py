"""Prefix cache: shared prompt prefixes are copied, not recomputed, and never leak between sessions."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import greedy, prompt_ids, run

from muxworker.transport.errors import InvalidArgument
from muxworker.worker.build import load_engine
from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.engine.sampling import SamplingParams


def make(model_dir, **cfg):
    cfg.setdefault("max_session_tokens", 2048)
    return load_engine(model_dir, EngineConfig(**cfg), device="cpu", dtype=torch.float32, progress=None)


def test_shared_system_prompt_prefills_only_the_rest_and_matches_cache_off(tiny_llama_dir):
    system = prompt_ids(1000, 1)
    users = [prompt_ids(20 + i, 10 + i) for i in range(3)]
    off = make(tiny_llama_dir)
    expected = []
    for i, u in enumerate(users):
        off.open_session(f"s{i}")
        off.submit(i + 1, f"s{i}", system + u, greedy(8))
        expected.append(run(off)[i + 1][1]["generated_token_ids"])
    on = make(tiny_llama_dir, prefix_cache_entries=2)
    for i, u in enumerate(users):
        on.open_session(f"s{i}")
        on.submit(i + 1, f"s{i}", system + u, greedy(8))
        res = run(on)[i + 1][1]
        if i == 0:
            assert (res["reused_prompt_tokens"], res["prefilled_prompt_tokens"]) == (0, 1000 + len(u))
        else:
            assert res["reused_prompt_tokens"] == 1000
            assert res["prefilled_prompt_tokens"] == len(u)
        assert res["generated_token_ids"] == expected[i]
    assert on.prefix_cache.hits == 2


def test_prompt_equal_to_entry_reruns_last_token(tiny_llama_dir):
    eng = make(tiny_llama_dir, prefix_cache_entries=1)
    p = prompt_ids(50, 2)
    eng.open_session("a")
    eng.submit(1, "a", p, greedy(3))
    run(eng)
    eng.open_session("b")
    eng.submit(2, "b", p, greedy(3))
    res = run(eng)[2][1]
    assert (res["reused_prompt_tokens"], res["prefilled_prompt_tokens"]) == (49, 1)


def test_lru_eviction_order_and_closed_sessions_become_entries(tiny_llama_dir):
    eng = make(tiny_llama_dir, prefix_cache_entries=2)
    a, b, c = prompt_ids(10, 3), prompt_ids(10, 4), prompt_ids(10, 5)
    for i, p in enumerate((a, b)):
        eng.open_session(f"s{i}")
        eng.submit(i + 1, f"s{i}", p, greedy(2))
        run(eng)
    assert eng.prefix_cache.entries() == [a, b]
    # Using a makes b the least recently used (a's extension supersedes a); a third entry evicts b.
    eng.open_session("x")
    eng.submit(10, "x", a + [7, 8], greedy(2))
    assert run(eng)[10][1]["reused_prompt_tokens"] == 10
    eng.open_session("y")
    eng.submit(11, "y", c, greedy(2))
    run(eng)
    assert eng.prefix_cache.entries() == [a + [7, 8], c]
    # Closing a session stores its whole history (a superset of c replaces c).
    hist = eng.session_tokens("y")[:-1]
    eng.close_session("y")
    assert eng.prefix_cache.entries() == [a + [7, 8], hist]


def test_sliding_window_never_reuses_rows_it_no_longer_holds(tiny_mistral_dir):
    eng = make(tiny_mistral_dir, prefix_cache_entries=2)  # window 16
    base = prompt_ids(40, 6)
    eng.open_session("a")
    eng.submit(1, "a", base, greedy(2))
    run(eng)
    eng.open_session("b")
    eng.submit(2, "b", base[:30] + prompt_ids(5, 7), greedy(4))
    res = run(eng)[2][1]
    assert res["reused_prompt_tokens"] == 0  # position 30 needs rows 15..29; the ring holds 24..39
    eng.open_session("c")
    p = base + prompt_ids(5, 8)
    eng.submit(3, "c", p, greedy(4))
    res = run(eng)[3][1]
    assert res["reused_prompt_tokens"] == 40
    cold = make(tiny_mistral_dir)
    cold.open_session("c")
    cold.submit(1, "c", p, greedy(4))
    assert run(cold)[1][1]["generated_token_ids"] == res["generated_token_ids"]


def test_entries_are_isolated_from_sessions(tiny_llama_dir):
    eng = make(tiny_llama_dir, prefix_cache_entries=2)
    p = prompt_ids(30, 9)
    eng.open_session("a")
    eng.submit(1, "a", p, greedy(2))
    run(eng)
    entry_slot = eng.prefix_cache.entry_slot(p)
    layer = eng.cache.layers[0]
    before = layer.k[entry_slot, :, :30].clone()
    eng.open_session("b")
    eng.submit(2, "b", p[:20] + prompt_ids(40, 10), greedy(20))
    assert run(eng)[2][1]["reused_prompt_tokens"] == 20
    assert torch.equal(layer.k[entry_slot, :, :30], before)
    eng.submit(3, "a", p + prompt_ids(5, 11), SamplingParams(max_new_tokens=5, stop_token_ids=[]))
    run(eng)
    assert torch.equal(layer.k[entry_slot, :, :30], before)


# --- cache_salt: entries are scoped by the request's salt ----------------------------------------


def test_only_requests_with_the_same_salt_reuse_an_entry(tiny_llama_dir):
    eng = make(tiny_llama_dir, prefix_cache_entries=4)
    system = prompt_ids(60, 12)
    eng.open_session("a0")
    eng.submit(1, "a0", system + prompt_ids(5, 13), greedy(2), cache_salt="a")
    assert run(eng)[1][1]["reused_prompt_tokens"] == 0
    for rid, salt in ((2, "b"), (3, None)):  # another tenant, and the shared namespace: nothing reused
        eng.open_session(f"s{rid}")
        eng.submit(rid, f"s{rid}", system + prompt_ids(5, 14), greedy(2), cache_salt=salt)
        res = run(eng)[rid][1]
        assert (res["reused_prompt_tokens"], res["prefilled_prompt_tokens"]) == (0, 65)
    eng.open_session("a1")
    eng.submit(4, "a1", system + prompt_ids(5, 15), greedy(2), cache_salt="a")
    res = run(eng)[4][1]
    assert (res["reused_prompt_tokens"], res["prefilled_prompt_tokens"]) == (60, 5)
    # The same tokens are held once per salt; covering and superseding stay within a salt.
    assert eng.prefix_cache.entry_slot(system + prompt_ids(5, 13), salt="a") is not None
    assert eng.prefix_cache.entry_slot(system + prompt_ids(5, 14), salt="b") is not None
    assert eng.prefix_cache.entry_slot(system + prompt_ids(5, 14)) is not None
    assert eng.prefix_cache.entry_slot(system + prompt_ids(5, 14), salt="a") is None
    assert eng.prefix_cache.hits == 1


def test_a_salted_entry_is_not_covered_by_another_salts_entry(tiny_llama_dir):
    eng = make(tiny_llama_dir, prefix_cache_entries=2)
    p = prompt_ids(30, 16)
    eng.open_session("x")
    eng.submit(1, "x", p + [7, 8], greedy(2))
    run(eng)
    eng.open_session("y")
    eng.submit(2, "y", p, greedy(2), cache_salt="t")  # a prefix of the unsalted entry, yet new to "t"
    assert run(eng)[2][1]["reused_prompt_tokens"] == 0
    assert eng.prefix_cache.entries() == [p + [7, 8], p]
    assert eng.prefix_cache.entry_slot(p, salt="t") is not None


def test_a_closed_session_is_filed_under_its_latest_requests_salt(tiny_llama_dir):
    eng = make(tiny_llama_dir, prefix_cache_entries=4)
    eng.open_session("s")
    eng.submit(1, "s", prompt_ids(20, 17), greedy(2), cache_salt="old")
    run(eng)
    prompt = eng.session_tokens("s") + prompt_ids(6, 18)
    eng.submit(2, "s", prompt, greedy(3), cache_salt="t")
    res = run(eng)[2][1]
    assert res["reused_prompt_tokens"] == 21  # its own history, whatever the salt
    hist = eng.session_tokens("s")[:-1]
    eng.close_session("s")
    assert eng.prefix_cache.entry_slot(hist, salt="t") is not None
    assert eng.prefix_cache.entry_slot(hist, salt="old") is None and eng.prefix_cache.entry_slot(hist) is None
    for rid, salt, reused in ((3, None, 0), (4, "old", 20), (5, "t", len(hist))):
        eng.open_session(f"n{rid}")
        eng.submit(rid, f"n{rid}", hist + [9], greedy(1), cache_salt=salt)
        assert run(eng)[rid][1]["reused_prompt_tokens"] == reused, salt


def test_a_restored_session_that_ran_no_request_adds_no_entry(tiny_llama_dir):
    eng = make(tiny_llama_dir, prefix_cache_entries=2)
    eng.open_session("s")
    eng.submit(1, "s", prompt_ids(40, 19), greedy(2), cache_salt="secret")
    run(eng)
    ck = eng.export_checkpoint("s")  # "s" stays open: only its prompt is an entry, under "secret"
    before = eng.prefix_cache.entries()
    eng.restore_checkpoint("r", ck)
    eng.close_session("r")  # whose salt was it? Unknown: its history enters no namespace
    assert eng.prefix_cache.entries() == before
    # Once a request names the namespace (here the shared one), closing files the session there.
    eng.restore_checkpoint("r", ck)
    history = ck.token_ids.tolist()
    eng.submit(2, "r", history + [5], greedy(1))
    assert run(eng)[2][1]["reused_prompt_tokens"] == len(history)  # its own restored rows
    assert eng.prefix_cache.entries() == before  # not fresh: its prompt seeds nothing
    eng.close_session("r")
    assert eng.prefix_cache.entry_slot(history + [5]) is not None


@pytest.mark.parametrize("salt", ["", 7, b"t", "x" * 257])
def test_submit_rejects_a_bad_salt_and_leaves_the_session_as_it_was(tiny_llama_dir, salt):
    eng = make(tiny_llama_dir, prefix_cache_entries=1)
    eng.open_session("s")
    with pytest.raises(InvalidArgument, match="cache_salt"):
        eng.submit(1, "s", prompt_ids(5, 20), greedy(1), cache_salt=salt)
    assert eng.inflight == 0 and eng.session_tokens("s") == []
