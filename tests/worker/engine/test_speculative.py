"""Speculative decoding with a draft model: exactness, the target's distribution, rollback, checkpoints."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.engine import greedy, prompt_ids, run

from muxworker.transport.checkpoint import CheckpointRetentionError, CPUCheckpoint
from muxworker.transport.errors import CheckpointRejected, InvalidArgument, SessionNotFound
from muxworker.worker.backends.interface import SeqSpan
from muxworker.worker.backends.torch.executor import TorchExecutor
from muxworker.worker.backends.torch.model import Transformer
from muxworker.worker.build import load_engine, load_model
from muxworker.worker.engine import Engine
from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.engine.sampling import SamplingParams, processed_probs, speculative_accept
from muxworker.worker.models.args import ModelArgs

REPO = Path(__file__).resolve().parents[3]
N_DRAFT = 4


def make(model_dir, draft=None, n_draft=N_DRAFT, **cfg):
    cfg.setdefault("max_session_tokens", 512)
    config = EngineConfig(n_draft=n_draft if draft is not None else 0, **cfg)
    # Float weights: greedy speculative decoding equals plain decoding only where scoring 1 + k rows
    # and decoding 1 row compute the same numbers (docs/SPECULATIVE.md).
    return load_engine(
        model_dir, config, device="cpu", dtype=torch.float32, progress=None, draft=draft, weights="float"
    )


def make_draft(src: Path, out: Path, layers: int) -> Path:
    """The real script, as a user runs it."""
    subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "make_draft.py"),
            "--model",
            str(src),
            "--layers",
            str(layers),
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def mistral(tiny_model_factory):
    return tiny_model_factory("mistral")  # window 16


@pytest.fixture(scope="module")
def drafts(tiny_model_factory, tmp_path_factory):
    """Draft models per target arch: the early-exit one-layer draft of each tiny model (agrees with
    the target part of the time) and an unrelated random model (almost never agrees)."""
    root = tmp_path_factory.mktemp("drafts")
    out = {}
    for arch in ("llama", "mistral"):
        out[arch, "early-exit"] = make_draft(tiny_model_factory(arch), root / f"{arch}-1", 1)
        out[arch, "random"] = tiny_model_factory(arch, seed=1)
    return out


def turn(eng, rid, sid, prompt, params):
    eng.submit(rid, sid, prompt, params)
    return run(eng)[rid][1]


def scripted_conversations(eng) -> dict[int, dict]:
    """Several sessions decoding together, a late joiner prefilling in chunks beside them, then a
    second turn that extends each history and a third that diverges from it."""
    results = {}
    for i in range(3):
        eng.open_session(f"s{i}")
        eng.submit(i + 1, f"s{i}", prompt_ids(20 + 11 * i, seed=i), greedy(25))
    for _ in range(3):
        for out in eng.step():
            assert out.result is None
    eng.open_session("late")
    eng.submit(4, "late", prompt_ids(45, seed=9), greedy(20))
    results.update({rid: res for rid, (_, res) in run(eng).items()})
    for i, sid in enumerate(["s0", "s1", "s2", "late"]):
        hist = eng.session_tokens(sid)
        eng.submit(10 + i, sid, hist + prompt_ids(7, seed=20 + i), greedy(13 + i))
    results.update({rid: res for rid, (_, res) in run(eng).items()})
    for i, sid in enumerate(["s0", "s1", "s2", "late"]):
        hist = eng.session_tokens(sid)
        eng.submit(20 + i, sid, hist[: len(hist) - 3] + prompt_ids(5, seed=30 + i), greedy(9))
    results.update({rid: res for rid, (_, res) in run(eng).items()})
    return results


# ---------------------------------------------------------------------------------------------
# Greedy: the output is exactly what decoding without a draft produces


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_self_draft_accepts_everything(tiny_model_factory, arch):
    d = tiny_model_factory(arch)
    eng = make(d, draft=d, prefill_chunk_tokens=16)
    plain = make(d, prefill_chunk_tokens=16)
    got, want = scripted_conversations(eng), scripted_conversations(plain)
    for rid, res in want.items():
        assert got[rid]["generated_token_ids"] == res["generated_token_ids"], rid
    proposed = sum(x["draft_proposed_tokens"] for x in got.values())
    assert proposed > 100
    assert sum(x["draft_accepted_tokens"] for x in got.values()) == proposed
    assert all(x["draft_proposed_tokens"] == 0 for x in want.values())
    # With everything accepted a step commits up to n_draft + 1 tokens: far fewer target forwards.
    assert eng.stats["forward_calls"] < plain.stats["forward_calls"] * 0.6


@pytest.mark.parametrize("kind", ["early-exit", "random"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_greedy_with_a_draft_equals_greedy_without(tiny_model_factory, drafts, arch, kind):
    d = tiny_model_factory(arch)
    eng = make(d, draft=drafts[arch, kind], prefill_chunk_tokens=16)
    got = scripted_conversations(eng)
    want = scripted_conversations(make(d, prefill_chunk_tokens=16))
    for rid, res in want.items():
        assert got[rid]["generated_token_ids"] == res["generated_token_ids"], rid
        assert got[rid]["reused_prompt_tokens"] == res["reused_prompt_tokens"], rid
    proposed = sum(x["draft_proposed_tokens"] for x in got.values())
    accepted = sum(x["draft_accepted_tokens"] for x in got.values())
    assert proposed > 100 and accepted < proposed
    if kind == "early-exit":
        assert accepted > 0


def test_stops_inside_accepted_drafts_end_the_turn_there(llama):
    plain = make(llama)
    plain.open_session("s")
    plain.submit(1, "s", prompt_ids(12, 40), greedy(30))
    full_text, full = run(plain)[1]
    ids = full["generated_token_ids"]
    eng = make(llama, draft=llama)  # self-draft: every stop lands among accepted drafts
    eng.open_session("s")
    # A stop token in the middle of a step's accepted drafts.
    stop = ids[6]
    r = turn(eng, 2, "s", prompt_ids(12, 40), SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=[stop]))
    assert r["finish_reason"] == "stop" and r["generated_token_ids"] == ids[: ids.index(stop) + 1]
    assert eng.session_tokens("s") == prompt_ids(12, 40) + r["generated_token_ids"]
    # max_new_tokens that is not a multiple of n_draft + 1.
    for n in (1, 2, 7, 11):
        eng.reset_session("s")
        r = turn(eng, 10 + n, "s", prompt_ids(12, 40), greedy(n))
        assert r["generated_token_ids"] == ids[:n] and r["finish_reason"] == "length"
    # A stop string cut inside a step's output.
    stop_str = full_text[9:11]
    plain.reset_session("s")
    plain.submit(4, "s", prompt_ids(12, 40), greedy(30, stop=[stop_str]))
    want_text, want = run(plain)[4]
    eng.reset_session("s")
    eng.submit(5, "s", prompt_ids(12, 40), greedy(30, stop=[stop_str]))
    got_text, got = run(eng)[5]
    assert (got_text, got["generated_token_ids"]) == (want_text, want["generated_token_ids"])


def test_prefix_cache_hit_leaves_the_draft_to_catch_up(llama, drafts):
    system = prompt_ids(40, 50)
    prompts = [system + prompt_ids(6, 51), system + prompt_ids(9, 52)]
    want = []
    for p in prompts:
        cold = make(llama)
        cold.open_session("c")
        want.append(turn(cold, 1, "c", p, greedy(12))["generated_token_ids"])
    eng = make(llama, draft=drafts["llama", "early-exit"], prefix_cache_entries=2)
    eng.open_session("a")
    assert turn(eng, 1, "a", prompts[0], greedy(12))["generated_token_ids"] == want[0]
    eng.open_session("b")
    eng.submit(2, "b", prompts[1], greedy(12))
    # The target reuses the cached prefix; the draft has none of it: all of it is pending.
    pending = eng.pending_draft_tokens("b")
    r = run(eng)[2][1]
    assert r["reused_prompt_tokens"] >= len(system)
    assert pending == prompts[1][: r["reused_prompt_tokens"]]
    assert eng.pending_draft_tokens("b") != pending
    assert r["generated_token_ids"] == want[1]
    assert r["draft_proposed_tokens"] > 0


# ---------------------------------------------------------------------------------------------
# Sampling: committed tokens follow the target's distribution


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.001 quantile of chi-square (Wilson-Hilferty; z is the normal 0.999 quantile)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expected below 5 are pooled."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = list(counts[~small]) + ([counts[small].sum()] if small.any() else [])
    exp = list(expected[~small]) + ([expected[small].sum()] if small.any() else [])
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    return float(stat), len(obs) - 1


def test_speculative_accept_keeps_the_target_distribution():
    g = torch.Generator().manual_seed(1234)
    vocab, k, trials = 6, 3, 12_000
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.95)
    p = processed_probs(torch.randn(k + 1, vocab, generator=g) * 2, params)
    # A draft that often disagrees: independent logits, processed the same way.
    q = processed_probs(torch.randn(k, vocab, generator=g) * 2, params)
    assert all(0.2 < float(torch.minimum(p[i], q[i]).sum()) < 0.9 for i in range(k))
    counts = np.zeros((k + 1, vocab))
    accepted = 0
    for _ in range(trials):
        drafted = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        out, n = speculative_accept(p, q, drafted, g)
        assert out[:n] == drafted[:n] and len(out) == n + 1
        accepted += n
        for i, token in enumerate(out):
            counts[i, token] += 1  # given that position i is reached, its token is distributed as p[i]
    for i in range(k + 1):
        stat, df = chi2(counts[i], p[i].double().numpy())
        assert counts[i].sum() > 300, i
        assert stat < chi2_critical(df), (i, stat, df, counts[i], p[i])
    # The first draft is accepted with probability sum_x min(p, q).
    first = (counts[1].sum()) / trials
    assert abs(first - float(torch.minimum(p[0], q[0]).sum())) < 0.03


def test_sampled_tokens_follow_the_target_distribution_in_the_engine(llama, drafts):
    """Tokens 2 and 3 of each request come from one speculative step (k = 1): their joint
    distribution with token 1 must be the target's, computed here with transformers."""
    import transformers

    prompt = prompt_ids(8, 60)
    params = dict(temperature=1.5, top_k=3, max_new_tokens=3, stop_token_ids=[])
    ref = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()

    def dist(ids):
        with torch.no_grad():
            logits = ref(torch.tensor([ids])).logits[0, -1] / params["temperature"]
        top = torch.topk(logits, params["top_k"])
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))

    expected = {}
    for t1, p1 in dist(prompt).items():
        for t2, p2 in dist(prompt + [t1]).items():
            expected[t1, t2] = p1 * p2
    eng = make(llama, draft=drafts["llama", "early-exit"], max_sessions=8)
    counts = dict.fromkeys(expected, 0)
    proposed = accepted = 0
    requests = 1600
    for wave in range(requests // 8):
        for i in range(8):
            sid = f"s{i}"
            if wave == 0:
                eng.open_session(sid)
            else:
                eng.reset_session(sid)
            eng.submit(wave * 8 + i + 1, sid, prompt, SamplingParams(seed=wave * 8 + i, **params))
        for _, res in run(eng).values():
            t = res["generated_token_ids"]
            counts[t[0], t[1]] += 1
            proposed += res["draft_proposed_tokens"]
            accepted += res["draft_accepted_tokens"]
    assert proposed == requests and 0 < accepted < proposed  # both acceptance and resampling happen
    keys = list(expected)
    stat, df = chi2(np.array([counts[c] for c in keys], float), np.array([expected[c] for c in keys]))
    assert stat < chi2_critical(df), (stat, df, counts, expected)


# ---------------------------------------------------------------------------------------------
# Rollback in sliding-window rings


@pytest.mark.parametrize("batched", [False, True])
def test_ring_rollback_matches_never_writing_the_rejected_rows(mistral, batched):
    """Write drafted rows past the window several times, drop them, continue: logits equal those of
    a cache that never saw them (single-span and batched-decode attention paths)."""
    model = load_model(mistral, progress=None).model
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 384, (120,), generator=g).tolist() for _ in range(2)]
    spec = TorchExecutor(model, 2, 256, rollback_rows=N_DRAFT)
    plain = TorchExecutor(model, 2, 256)
    for ex in (spec, plain):
        spans = [SeqSpan(0, 0, 10, 0), SeqSpan(1, 0, 14, 10)]
        ex.forward(seqs[0][:10] + seqs[1][:14], [*range(10), *range(14)], spans, [])
    lengths = [10, 14]
    slots = [0, 1] if batched else [0]
    for step in range(40):
        # spec writes 1 + k rows (garbage drafts after the real token), then keeps one of them.
        k = 1 + step % N_DRAFT
        tokens, positions, spans = [], [], []
        for slot in slots:
            n = lengths[slot]
            span = [seqs[slot][n]] + torch.randint(3, 384, (k,), generator=g).tolist()
            spans.append(SeqSpan(slot, n, len(span), len(tokens)))
            tokens += span
            positions += range(n, n + len(span))
        spec.forward(tokens, positions, spans, [])
        tokens = [seqs[slot][lengths[slot]] for slot in slots]
        positions = [lengths[slot] for slot in slots]
        spans = [SeqSpan(slot, lengths[slot], 1, i) for i, slot in enumerate(slots)]
        plain.forward(tokens, positions, spans, [])
        for slot in slots:
            lengths[slot] += 1
        # Now one real decode token on both: same logits.
        tokens = [seqs[slot][lengths[slot]] for slot in slots]
        positions = [lengths[slot] for slot in slots]
        spans = [SeqSpan(slot, lengths[slot], 1, i) for i, slot in enumerate(slots)]
        a = spec.forward(tokens, positions, spans, list(range(len(slots))))
        b = plain.forward(tokens, positions, spans, list(range(len(slots))))
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        for slot in slots:
            lengths[slot] += 1


# ---------------------------------------------------------------------------------------------
# Checkpoints carry the draft's state


def same_checkpoint(a: CPUCheckpoint, b: CPUCheckpoint) -> bool:
    def arrays(c):
        out = [c.token_ids] + [x for layer in c.layers for x in (layer.keys, layer.values)]
        out += [x for layer in c.draft["layers"] for x in (layer.keys, layer.values)]
        out += [c.draft["pending_token_ids"]]
        return out

    starts = lambda c: [x.start for x in c.layers + c.draft["layers"]]  # noqa: E731
    return (
        a.position == b.position
        and a.geometry == b.geometry
        and a.draft["geometry"] == b.draft["geometry"]
        and sorted(a.draft) == sorted(b.draft)
        and starts(a) == starts(b)
        and all(
            x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
            for x, y in zip(arrays(a), arrays(b))
        )
    )


@pytest.mark.parametrize(
    "arch,kind", [("llama", "self"), ("mistral", "self"), ("llama", "early-exit"), ("mistral", "early-exit")]
)
def test_export_restore_with_a_draft_continues_like_a_cold_run(tiny_model_factory, drafts, arch, kind):
    d = tiny_model_factory(arch)
    draft = d if kind == "self" else drafts[arch, kind]
    eng = make(d, draft=draft)
    eng.open_session("s")
    p1 = prompt_ids(40, 70)
    # Self-draft, 6 tokens: the last step accepts all 4 drafts, and the draft has not seen the 4th.
    r1 = turn(eng, 1, "s", p1, greedy(6))
    ck = eng.export_checkpoint("s")
    hist = p1 + r1["generated_token_ids"]
    assert ck.position == len(hist) - 1
    pending = ck.draft["pending_token_ids"]
    assert ck.draft_position + len(pending) == ck.position
    assert pending.tolist() == hist[ck.draft_position : ck.position] == eng.pending_draft_tokens("s")
    if kind == "self":
        assert len(pending) == 1
    other = make(d, draft=draft)
    other.open_session("busy")  # another session takes slot 0
    other.restore_checkpoint("r", ck)
    assert other.pending_draft_tokens("r") == pending.tolist()
    assert same_checkpoint(other.export_checkpoint("r"), ck)
    p2 = hist + prompt_ids(6, 71)
    r2 = turn(other, 1, "r", p2, greedy(12))
    assert r2["prefilled_prompt_tokens"] == len(p2) - ck.position
    cold = make(d, draft=draft)
    cold.open_session("c")
    want = turn(cold, 1, "c", p2, greedy(12))
    assert r2["generated_token_ids"] == want["generated_token_ids"]
    plain = make(d)
    plain.open_session("c")
    assert turn(plain, 1, "c", p2, greedy(12))["generated_token_ids"] == want["generated_token_ids"]


def test_restore_one_position_before_the_drafts_retention_boundary_is_rejected(llama, mistral):
    """Target with full attention, draft with a 16-token window: the draft's ring sets the boundary."""
    eng = make(llama, draft=mistral)
    eng.open_session("s")
    turn(eng, 1, "s", prompt_ids(40, 80), greedy(10))
    ck = eng.export_checkpoint("s")
    # The draft's ring keeps the W rows its length claims: continuing from the draft's position
    # or one before it (the exact retry) works, two before it does not.
    boundary = ck.draft_position - 1
    assert boundary > 16
    other = make(llama, draft=mistral)
    with pytest.raises(CheckpointRetentionError, match="draft layer"):
        other.restore_checkpoint("r", ck, boundary - 1)
    with pytest.raises(SessionNotFound):
        other.session_tokens("r")
    other.restore_checkpoint("r", ck, boundary)
    assert other.export_checkpoint("r").draft_position == boundary
    # The same target rows without a draft restore there fine: it is the draft's limit.
    plain_ck = CPUCheckpoint(ck.format, ck.geometry, ck.position, ck.token_ids, ck.layers)
    make(llama).restore_checkpoint("r", plain_ck, boundary - 1)


def test_draft_and_no_draft_checkpoints_are_rejected_both_ways(llama, mistral, drafts):
    with_draft = make(llama, draft=drafts["llama", "early-exit"])
    without = make(llama)
    for eng in (with_draft, without):
        eng.open_session("s")
        turn(eng, 1, "s", prompt_ids(20, 90), greedy(5))
    ck_draft, ck_plain = with_draft.export_checkpoint("s"), without.export_checkpoint("s")
    assert ck_plain.draft is None
    with pytest.raises(CheckpointRejected, match="carries draft-model state but this worker runs no draft"):
        without.restore_checkpoint("r", ck_draft)
    with pytest.raises(CheckpointRejected, match="runs a draft model but the checkpoint has no draft state"):
        with_draft.restore_checkpoint("r", ck_plain)
    other_draft = make(llama, draft=mistral)
    with pytest.raises(CheckpointRejected, match="draft geometry"):
        other_draft.restore_checkpoint("r", ck_draft)
    # Pending tokens that are not the history after the draft's rows: no such checkpoint is made.
    bad = dict(ck_draft.draft, pending_token_ids=np.append(ck_draft.draft["pending_token_ids"], 5).astype(np.int32))
    c = ck_draft
    with pytest.raises(CheckpointRejected, match="pending_token_ids"):
        CPUCheckpoint(c.format, c.geometry, c.position, c.token_ids, c.layers, bad)
    for eng in (with_draft, without, other_draft):
        with pytest.raises(SessionNotFound):
            eng.session_tokens("r")


# ---------------------------------------------------------------------------------------------
# Configuration


def test_draft_configuration_errors(llama, tmp_path):
    with pytest.raises(InvalidArgument, match="n_draft >= 1"):
        load_engine(llama, EngineConfig(max_session_tokens=128), progress=None, draft=llama)
    with pytest.raises(InvalidArgument, match="no draft model"):
        load_engine(llama, EngineConfig(max_session_tokens=128, n_draft=2), progress=None)
    # Same vocabulary size, different tokens: two token strings swap ids.
    other = tmp_path / "other-tokenizer"
    shutil.copytree(llama, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(InvalidArgument, match="different tokenizer"):
        make(llama, draft=other, max_session_tokens=128)
    # A draft with another vocabulary size, at the engine level.
    target = load_model(llama, progress=None)
    args = ModelArgs(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    small = Transformer(args).eval()
    config = EngineConfig(max_sessions=2, max_session_tokens=128, n_draft=2)
    with pytest.raises(InvalidArgument, match="vocabulary has 100 tokens"):
        Engine(
            TorchExecutor(target.model, 2, 128, 2),
            target.tokenizer,
            config,
            draft=TorchExecutor(small, 2, 128, 2),
        )


def test_sliding_window_draft_needs_spare_ring_rows(mistral):
    target = load_model(mistral, progress=None)
    config = EngineConfig(max_sessions=2, max_session_tokens=128, n_draft=3)
    with pytest.raises(InvalidArgument, match="cannot roll back"):
        Engine(
            TorchExecutor(target.model, 2, 128), target.tokenizer, config, draft=TorchExecutor(target.model, 2, 128, 3)
        )


def test_worker_process_runs_a_draft(llama, drafts, tmp_path):
    """The real worker with --draft/--n_draft: same tokens as the in-process engine, counts reported."""
    from helpers.raw_worker import RawWorker, generate_frame, worker_args

    from muxworker.transport.framing import payload_array

    draft = drafts["llama", "early-exit"]
    prompt = prompt_ids(15, 95)
    eng = make(llama, draft=draft, max_session_tokens=256)
    eng.open_session("a")
    want = turn(eng, 1, "a", prompt, greedy(20))
    with RawWorker(worker_args(str(llama), "--draft", str(draft), "--n_draft", str(N_DRAFT)), tmp_path) as w:
        hello_draft = w.hello.control["model"]["draft"]
        assert hello_draft == eng.model_info()["draft"] == {"name": eng.draft_name, "n_draft": N_DRAFT}
        w.send({"kind": "open", "id": 1, "session_id": "a"})
        assert w.final(1) == {"kind": "ok", "id": 1}
        w.send(*generate_frame(2, "a", prompt, max_new_tokens=20))
        done = w.collect(2)[2][1]
        result = done.control["result"]
        assert payload_array(done, result["generated_token_ids"]).tolist() == want["generated_token_ids"]
        for key in ("draft_proposed_tokens", "draft_accepted_tokens"):
            assert result[key] == want[key]
        assert result["draft_proposed_tokens"] > 0


# ---------------------------------------------------------------------------------------------
# The bundled SmolLM2 with an early-exit draft made by scripts/make_draft.py


@pytest.mark.slow
def test_smollm2_early_exit_draft_greedy_matches(tmp_path):
    from muxworker.worker.models.loader import resolve_model

    draft = make_draft(resolve_model(None, progress=None), tmp_path / "smollm2-draft-8", 8)
    eng = make(None, draft=draft, max_session_tokens=1024)
    plain = make(None, max_session_tokens=1024)
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
    ]
    accepted = 0
    for i, messages in enumerate(chats):
        ids = eng.tokenizer.encode(
            eng.tokenizer.apply_chat_template(messages, add_generation_prompt=True), parse_special=True
        )
        for e in (eng, plain):
            e.open_session(f"c{i}")
            e.submit(i + 1, f"c{i}", ids, greedy(40))
        got, want = run(eng)[i + 1][1], run(plain)[i + 1][1]
        assert got["generated_token_ids"] == want["generated_token_ids"], messages
        accepted += got["draft_accepted_tokens"]
    assert accepted > 0
