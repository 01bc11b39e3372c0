"""Prompt-lookup (n-gram) drafting: proposals from the session's own token history.

``--speculative ngram --n_draft K``: for each decoding request, the last ``n`` tokens of its
history (``n`` from NGRAM_MAX down to NGRAM_MIN) are looked up earlier in the same history,
most recent occurrence first, and the up to ``K`` tokens that followed there are proposed. Coding
agents and editing workloads copy long spans of their input (a file being rewritten, a diff, quoted
tool output), so such proposals are often accepted whole; no second model, no extra memory, and
nothing to checkpoint beyond the token history (a resumed session drafts from its restored
history).

Verification is the draft model's (core.py, ``sampling.verify_drafts``): greedy keeps drafts while
they equal the target's argmax (the output equals plain decoding); sampling treats a proposal as
a point mass q, for which the speculative acceptance rule accepts token x with probability p(x)
and otherwise draws from p with x removed, so each token is distributed as the target's p.

**Adaptive.** Every row verified costs target forward time, so drafting must not slow down what
it cannot speed up (ordinary chat, where nothing is copied). A request whose proposals are mostly
rejected stops drafting for a while; and while the engine-wide acceptance is low, requests only
probe now and then. Owner: the engine thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from muxworker.transport.errors import InvalidArgument
from muxworker.worker.backends.interface import Executor
from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.engine.speculative import Failures, Proposal, _rollback_rows, draft_budget
from muxworker.worker.engine.state import Request

__all__ = ["NgramProposer", "lookup"]

#: Suffix lengths looked up, longest first. Shorter ones match too often by chance: with 2-token
#: matches allowed, half the proposals on the editing benchmark were rejected (31% with 3).
NGRAM_MIN, NGRAM_MAX = 3, 4
#: Accepted / proposed below this over a request's recent proposals: stop drafting for a while.
MIN_ACCEPTANCE = 0.25
#: Proposed tokens looked at before judging a request's acceptance.
JUDGE_AFTER = 16
#: Steps a request goes without proposals once judged unprofitable (doubling, to MAX_PAUSE).
FIRST_PAUSE, MAX_PAUSE = 16, 256
#: While the engine-wide acceptance (a moving average over verified proposals) is below
#: MIN_ACCEPTANCE, a request proposes only every PROBE_EVERY steps: short replies of a chat, which
#: end before their own judgement, then cost little; a workload that copies lifts the average.
PROBE_EVERY = 8
_EWMA_TOKENS = 64.0  # proposals the moving average remembers, about


def lookup(tokens: np.ndarray, k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix
    of ``tokens`` (``ngram_max`` down to ``ngram_min`` tokens long); [] when none occurs."""
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = tokens[length - n :]
        # Candidate starts: where the suffix's first token occurs, not overlapping the suffix.
        starts = np.flatnonzero(tokens[: length - n] == suffix[0])
        for start in starts[::-1]:  # the most recent first
            if np.array_equal(tokens[start : start + n], suffix):
                follow = tokens[start + n : start + n + k]
                if len(follow):
                    return follow.tolist()
    return []


@dataclass
class _Record:
    proposed: int = 0  # the request's counts at its last judgement
    accepted: int = 0
    paused_until: int = 0
    pause: int = FIRST_PAUSE
    seen_proposed: int = 0  # its counts last folded into the engine-wide average
    seen_accepted: int = 0


class NgramProposer:
    """Prompt lookup over each session's history (module docstring); no model, no state to save."""

    name = "ngram"

    def __init__(self, target: Executor, config: EngineConfig) -> None:
        if config.n_draft < 1:
            raise InvalidArgument("--speculative ngram needs --n_draft N >= 1 (the tokens proposed per step)")
        rollback = _rollback_rows(target.cache)
        if rollback < config.n_draft:
            raise InvalidArgument(
                f"the model's cache cannot roll back {config.n_draft} rejected rows (it keeps {rollback} spare)"
            )
        self.n_draft = config.n_draft
        self.ngram_min, self.ngram_max = NGRAM_MIN, NGRAM_MAX
        self.stats = {"ngram_lookups": 0, "ngram_lookup_time_s": 0.0}
        self._records: dict[int, _Record] = {}
        self._step = 0
        self.acceptance = 0.5  # the engine-wide moving average; neutral before any proposal

    def budget(self, req: Request) -> int:
        return draft_budget(req, self.n_draft)

    def propose(self, decoding: list[Request], chunks: list) -> tuple[dict[int, Proposal], Failures]:
        self._step += 1
        t0 = time.perf_counter()
        live = {r.rid for r in decoding}
        self._records = {rid: rec for rid, rec in self._records.items() if rid in live}
        out: dict[int, Proposal] = {}
        for r in decoding:
            k = self.budget(r)
            if k <= 0:
                continue
            rec = self._records.setdefault(r.rid, _Record())
            self._fold(r, rec)
            self._judge(r, rec)
            if self._step < rec.paused_until:
                continue
            if self.acceptance < MIN_ACCEPTANCE and (self._step + r.rid) % PROBE_EVERY:
                continue  # probing only, while lookups are not paying anywhere
            tokens = np.asarray(r.session.tokens, dtype=np.int64)
            drafted = lookup(tokens, k, self.ngram_min, self.ngram_max)
            self.stats["ngram_lookups"] += 1
            if drafted:
                out[r.rid] = Proposal(drafted, [], point=True)
        self.stats["ngram_lookup_time_s"] += time.perf_counter() - t0
        return out, []

    def _fold(self, r: Request, rec: _Record) -> None:
        """Fold the request's newly verified proposals into the engine-wide acceptance average."""
        proposed, accepted = r.draft_proposed - rec.seen_proposed, r.draft_accepted - rec.seen_accepted
        if proposed > 0:
            weight = min(1.0, proposed / _EWMA_TOKENS)
            self.acceptance += weight * (accepted / proposed - self.acceptance)
            rec.seen_proposed, rec.seen_accepted = r.draft_proposed, r.draft_accepted

    def _judge(self, r: Request, rec: _Record) -> None:
        """Pause a request whose recent proposals were mostly rejected (and back off further each
        time); a profitable one keeps drafting."""
        proposed, accepted = r.draft_proposed - rec.proposed, r.draft_accepted - rec.accepted
        if proposed < JUDGE_AFTER:
            return
        rec.proposed, rec.accepted = r.draft_proposed, r.draft_accepted
        if accepted < MIN_ACCEPTANCE * proposed:
            rec.paused_until = self._step + rec.pause
            rec.pause = min(2 * rec.pause, MAX_PAUSE)
        else:
            rec.pause = FIRST_PAUSE
