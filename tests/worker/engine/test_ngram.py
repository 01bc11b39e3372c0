"""Prompt-lookup (n-gram) drafting: --speculative ngram (worker/engine/ngram.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.engine import greedy, prompt_ids, run
from test_speculative import chi2, chi2_critical, scripted_conversations

from muxworker.transport.errors import InvalidArgument
from muxworker.worker.build import load_engine
from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.engine.ngram import JUDGE_AFTER, lookup
from muxworker.worker.engine.sampling import SamplingParams, processed_probs, speculative_accept
from muxworker.worker.engine.speculative import Proposal
from muxworker.worker.options import UsageError, parse_args

N_DRAFT = 4


def make(model_dir, speculative="ngram", n_draft=N_DRAFT, **cfg):
    cfg.setdefault("max_session_tokens", 512)
    config = EngineConfig(n_draft=n_draft if speculative else 0, speculative=speculative, **cfg)
    return load_engine(model_dir, config, device="cpu", dtype=torch.float32, progress=None, weights="float")


def test_lookup_proposes_what_followed_the_most_recent_longest_match():
    t = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3])
    assert lookup(t, 3, 2, 4) == [7, 8, 5]  # "1 2 3" last seen before 7 8 5
    assert lookup(t, 10, 2, 4) == [7, 8, 5, 1, 2, 3]  # never past the end of the history
    assert lookup(np.array([4, 5, 6, 4, 5]), 2, 2, 4) == [6, 4]
    assert lookup(np.array([1, 2, 3, 4]), 3, 2, 4) == []  # the suffix occurs nowhere earlier
    assert lookup(np.array([1, 2, 3, 4, 3]), 3, 1, 4) == [4, 3]  # one token, with ngram_min 1
    assert lookup(np.array([7]), 3, 1, 4) == []


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: sliding-window rings roll back too
def test_greedy_with_ngram_drafting_equals_greedy_without(tiny_model_factory, arch):
    d = tiny_model_factory(arch)
    eng = make(d, prefill_chunk_tokens=16)
    got = scripted_conversations(eng)
    want = scripted_conversations(make(d, speculative=None, prefill_chunk_tokens=16))
    for rid, res in want.items():
        assert got[rid]["generated_token_ids"] == res["generated_token_ids"], rid
    proposed = sum(x["draft_proposed_tokens"] for x in got.values())
    assert proposed > 0 and eng.stats["ngram_lookups"] > 0


def test_a_copying_continuation_is_accepted_and_saves_target_forwards(tiny_model_factory):
    # The tiny random model's greedy output settles into a loop: lookups then predict it exactly.
    d = tiny_model_factory("llama")
    eng, plain = make(d), make(d, speculative=None)
    for e in (eng, plain):
        e.open_session("s")
        e.submit(1, "s", prompt_ids(30, seed=5), greedy(120))
    (_, got), (_, want) = run(eng)[1], run(plain)[1]
    assert got["generated_token_ids"] == want["generated_token_ids"]
    assert got["draft_accepted_tokens"] > 0.25 * got["draft_proposed_tokens"] > 0
    assert eng.stats["forward_calls"] < plain.stats["forward_calls"]


def test_drafting_pauses_for_a_request_whose_proposals_are_rejected(tiny_model_factory):
    proposer = make(tiny_model_factory("llama")).proposer

    def request(rid):
        session = SimpleNamespace(tokens=[5, 6, 7] * 10)
        return SimpleNamespace(
            rid=rid, session=session, params=SimpleNamespace(penalized=False), guide=None, max_new=10_000, generated=[],
            draft_proposed=0, draft_accepted=0,
        )  # fmt: skip

    rejected, accepted = request(1), request(2)
    proposing = {1: 0, 2: 0}
    for _ in range(200):
        out, failures = proposer.propose([rejected, accepted], [])
        assert failures == []
        for r in (rejected, accepted):
            if r.rid in out:
                proposing[r.rid] += 1
                r.draft_proposed += len(out[r.rid].tokens)
                if r is accepted:
                    r.draft_accepted += len(out[r.rid].tokens)
    assert proposing[2] == 200  # accepted: drafts every step
    assert proposing[1] < 40  # rejected: paused after each JUDGE_AFTER proposals, longer each time
    assert rejected.draft_proposed >= JUDGE_AFTER


def test_a_looked_up_token_is_accepted_with_probability_p_and_the_target_distribution_stays():
    # A lookup is a point mass q = one-hot(x): accepted with probability p(x), else a draw from p
    # without x. Every committed token must still follow p.
    g = torch.Generator().manual_seed(99)
    vocab, k, trials = 6, 2, 12_000
    p = processed_probs(torch.randn(k + 1, vocab, generator=g) * 2, SamplingParams(temperature=0.7))
    drafted = [int(torch.argmin(p[0])), int(torch.argmax(p[1]))]  # one unlikely, one likely
    q = torch.nn.functional.one_hot(torch.tensor(drafted), vocab).to(torch.float32)
    counts = np.zeros((k + 1, vocab))
    for _ in range(trials):
        out, n = speculative_accept(p, q, drafted, g)
        for i, token in enumerate(out):
            counts[i, token] += 1
    for i in range(k + 1):
        if counts[i].sum() < 300:
            continue  # rarely reached (behind an unlikely first draft)
        stat, df = chi2(counts[i], p[i].double().numpy())
        assert stat < chi2_critical(df), (i, stat, df)
    assert abs(counts[1].sum() / trials - float(p[0, drafted[0]])) < 0.02


def test_sampling_verifies_looked_up_tokens_as_point_masses_in_the_engine(tiny_model_factory, monkeypatch):
    # Every step proposes the model's own most likely next tokens (so some are accepted) through
    # the engine's sampling path: one-hot q on the logits' device, acceptance, rollback.
    d = tiny_model_factory("llama")
    eng, plain = make(d), make(d, speculative=None)
    plain.open_session("g")
    plain.submit(1, "g", [5, 6, 7, 8, 9] * 4, greedy(80))
    likely = run(plain)[1][1]["generated_token_ids"]
    real = eng.proposer.propose

    def propose(decoding, chunks):
        out, failures = real(decoding, chunks)
        for r in decoding:
            done = len(r.generated)
            if r.rid not in out and done + 3 < len(likely):
                out[r.rid] = Proposal(likely[done : done + 3], [], point=True)
        return out, failures

    monkeypatch.setattr(eng.proposer, "propose", propose)
    eng.open_session("s")
    params = SamplingParams(max_new_tokens=60, temperature=0.001, seed=3, stop_token_ids=[])  # near greedy
    eng.submit(1, "s", [5, 6, 7, 8, 9] * 4, params)
    (_, res) = run(eng)[1]
    assert len(res["generated_token_ids"]) == 60
    assert 0 < res["draft_accepted_tokens"] <= res["draft_proposed_tokens"], (
        res["draft_accepted_tokens"],
        res["draft_proposed_tokens"],
    )
    assert len(eng.session_tokens("s")) == 20 + 60


def test_ngram_sessions_checkpoint_like_plain_ones(tiny_model_factory, tmp_path):
    d = tiny_model_factory("llama")
    eng, plain = make(d), make(d, speculative=None)
    eng.open_session("s")
    eng.submit(1, "s", prompt_ids(40, seed=1), greedy(20))
    run(eng)
    checkpoint = eng.export_checkpoint("s")
    assert checkpoint.draft is None  # nothing but the history: a plain worker restores it
    plain.restore_checkpoint("r", checkpoint)
    assert plain.session_tokens("r") == eng.session_tokens("s")[: checkpoint.position]
    fd = os.memfd_create("seg")
    try:
        job = eng.begin_save("s", fd, tag="t", base=None, identity="id", max_bytes=1 << 30)
        job.write()  # the worker's I/O thread does this
        out = eng.finish_save(job, None)
    finally:
        os.close(fd)
    assert out.position == checkpoint.position  # through the file channel, as a plain worker saves


def test_configuration_errors_name_the_flag(tiny_model_factory):
    d = tiny_model_factory("llama")
    with pytest.raises(InvalidArgument, match="needs --n_draft"):
        make(d, n_draft=0)
    with pytest.raises(UsageError, match="needs --n_draft"):
        parse_args(["--speculative", "ngram"])
    with pytest.raises(UsageError, match="takes no --draft"):
        parse_args(["--speculative", "ngram", "--n_draft", "3", "--draft", str(d)])
    with pytest.raises(UsageError, match="or --speculative ngram"):
        parse_args(["--n_draft", "3"])
    options = parse_args(["--speculative", "ngram", "--n_draft", "3"])
    assert options.config.speculative == "ngram" and options.config.n_draft == 3
