"""Engine.fork_session on a tiny random model: a fork continues exactly as its source would (its
rows copied, not recomputed: the next turn prefills one token), forks sample independently, a
generating source can be forked, and bad forks are refused without touching either session."""

from __future__ import annotations

import pytest
from helpers.engine import make, prompt_ids, run

from muxworker.transport.errors import InvalidArgument, SessionBusy, SessionNotFound
from muxworker.worker.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make(tiny_llama_dir, max_sessions=4)


def _greedy(n=6, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0, stop_token_ids=[], **kw)


def test_a_fork_continues_as_its_source_without_recomputing(engine):
    ids = prompt_ids(20, seed=5)
    for sid in ("src", "dst"):
        engine.open_session(sid)
    try:
        engine.submit(1, "src", ids, _greedy(1))
        run(engine)
        engine.fork_session("src", "dst", len(ids))
        assert engine.session_tokens("dst") == ids
        engine.submit(2, "src", ids, _greedy(8))
        engine.submit(3, "dst", ids, _greedy(8))
        out = run(engine)
        assert out[2][1]["generated_token_ids"] == out[3][1]["generated_token_ids"]
        assert out[3][1]["reused_prompt_tokens"] == len(ids) - 1  # only the last prompt token re-run
        # Sampled with different seeds, the forks go their own ways.
        engine.submit(4, "src", ids, SamplingParams(max_new_tokens=12, temperature=1.5, seed=1, stop_token_ids=[]))
        engine.submit(5, "dst", ids, SamplingParams(max_new_tokens=12, temperature=1.5, seed=2, stop_token_ids=[]))
        out = run(engine)
        assert out[4][1]["generated_token_ids"] != out[5][1]["generated_token_ids"]
    finally:
        for sid in ("src", "dst"):
            engine.close_session(sid)


def test_a_generating_source_can_be_forked_and_bad_forks_are_refused(engine):
    ids = prompt_ids(12, seed=6)
    for sid in ("a", "b"):
        engine.open_session(sid)
    try:
        engine.submit(1, "a", ids, _greedy(1))
        run(engine)
        engine.submit(2, "a", ids, _greedy(30))
        engine.step()
        engine.step()
        engine.fork_session("a", "b", 10)  # rows below a's length do not change while it decodes
        assert engine.session_tokens("b") == ids[:10]
        engine.submit(3, "b", ids[:10] + [7], _greedy(2))
        with pytest.raises(SessionBusy):
            engine.fork_session("a", "b", 5)  # b is generating now
        run(engine)
        before = engine.session_tokens("b")
        for args, error in [
            (("a", "a", 3), InvalidArgument),
            (("a", "b", 10_000), InvalidArgument),
            (("a", "b", -1), InvalidArgument),
            (("nope", "b", 1), SessionNotFound),
            (("a", "nope", 1), SessionNotFound),
        ]:
            with pytest.raises(error):
                engine.fork_session(*args)
        assert engine.session_tokens("b") == before
        engine.fork_session("a", "b", 0)
        assert engine.session_tokens("b") == []
    finally:
        for sid in ("a", "b"):
            engine.close_session(sid)
