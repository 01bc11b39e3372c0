"""Speculative decoding with a draft model: the proposer, and the draft's part of a checkpoint.

``DraftProposer.propose`` runs the draft's forwards for one step and returns the proposals and the
requests whose drafting failed; it never ends a request itself (the engine does, with what it is
told). Verification happens in the target's one forward (core.py) with ``sampling.verify_drafts``.
See docs/SPECULATIVE.md for the whole scheme.

Draft state per session (engine/state.py): ``draft_len <= kv_len`` rows of the draft's slot hold
its KV; committed tokens ``tokens[draft_len:kv_len]`` are pending and fed in its next forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from muxworker.transport.checkpoint import LayerState, numpy_storage_dtype
from muxworker.transport.errors import InternalError, InvalidArgument, MuxError
from muxworker.worker.backends.interface import Executor, SeqSpan, geometry
from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.engine.sampling import sample_draft
from muxworker.worker.engine.state import Request, Session, common_prefix

__all__ = ["DraftProposer", "Proposal"]


@dataclass
class Proposal:
    """The draft's tokens for one decoding request in one step."""

    tokens: list[int]
    probs: list[torch.Tensor]  # q [V] each token was drawn from; empty when greedy
    point: bool = False  # each token's q is a point mass on it (a lookup, not a draw: ngram.py)


Failures = list[tuple[Request, MuxError | Exception]]


def draft_budget(req: Request, n_draft: int) -> int:
    """Tokens to draft for ``req`` this step, whatever proposes them (DraftProposer.budget).

    A constrained request drafts nothing: verifying k drafts needs the grammar's mask at each of the
    k + 1 positions, each computed after the one before it (serially, after the forward pass), which
    costs more than the drafts save at these model sizes."""
    if req.params.penalized or req.guide is not None:
        return 0
    return max(0, min(n_draft, req.max_new - len(req.generated) - 1))


def _rollback_rows(cache: Any) -> int:
    """Rows a slot of ``cache`` may write past its length and then drop (see RingLayerCache)."""
    rows = getattr(cache, "rollback_rows", None)
    if rows is not None:
        return int(rows)
    # A cache without spare ring rows can still roll back when no layer is a ring.
    if all(w is None or w >= cache.max_tokens for w in cache.windows):
        return cache.max_tokens
    return 0


class DraftProposer:
    """A draft model's executor and how many tokens it proposes per session per step."""

    def __init__(self, draft: Executor, target: Executor, config: EngineConfig, name: str = "") -> None:
        self.executor = draft
        self.name = name
        self.n_draft = config.n_draft
        self.stats = {"draft_forward_calls": 0, "draft_forward_time_s": 0.0}
        self._check(target, config)

    def _check(self, target: Executor, config: EngineConfig) -> None:
        draft = self.executor
        if config.n_draft < 1:
            raise InvalidArgument("a draft model needs n_draft >= 1 (tokens proposed per step)")
        draft_vocab, vocab = int(draft.args.vocab_size), int(target.args.vocab_size)
        if draft_vocab != vocab:
            raise InvalidArgument(
                f"the draft model's vocabulary has {draft_vocab} tokens but the target's has {vocab}; "
                "a draft must use the target's tokenizer"
            )
        if draft.dtype_name != target.dtype_name:
            raise InvalidArgument(f"the draft runs in {draft.dtype_name} but the target in {target.dtype_name}")
        if draft.cache.slots < target.cache.slots:
            raise InvalidArgument(
                f"the draft's cache has {draft.cache.slots} slots; the target's has {target.cache.slots}"
            )
        draft_context = int(draft.args.max_position_embeddings)
        if config.max_session_tokens > draft_context:
            raise InvalidArgument(
                f"max_session_tokens ({config.max_session_tokens}) exceeds the draft model's context length "
                f"({draft_context})"
            )
        # Verification writes 1 + k target rows and keeps as few as 1; the draft writes k and keeps 1.
        for who, cache, rows in (("target", target.cache, config.n_draft), ("draft", draft.cache, config.n_draft - 1)):
            if _rollback_rows(cache) < rows:
                raise InvalidArgument(
                    f"the {who}'s KV cache cannot roll back {rows} rows; build its executor with "
                    f"rollback_rows >= {config.n_draft} (sliding-window rings need that many spare rows)"
                )

    @property
    def geometry(self) -> dict[str, Any]:
        return geometry(self.executor)

    def budget(self, req: Request) -> int:
        """Tokens to draft for ``req`` this step: at most n_draft, and never past max_new_tokens
        (the target's token after the drafts must still fit), so drafted positions stay inside the
        session's max_session_tokens. A penalized request drafts nothing: its logits at each drafted
        position would depend on the drafts before it, which one verification pass does not model."""
        return draft_budget(req, self.n_draft)

    def keep_on_submit(self, s: Session, prompt: list[int], reused: int) -> None:
        """A new prompt (before it is committed): the draft keeps what its own rows share with it,
        never more than the target's ``reused``; the rest (a prefix-cache hit included) is pending
        and fed with the first prefill chunk."""
        keep = common_prefix(s.tokens, prompt, min(s.draft_len, reused))
        if keep and not self.executor.cache.can_truncate(s.draft_len, keep, s.draft_floor):
            keep = 0
        s.draft_len = keep
        if not keep:
            s.draft_floor = 0

    # -- one step ------------------------------------------------------------------------

    def _forward(
        self,
        reqs: list[Request],
        tokens: list[int],
        positions: list[int],
        spans: list[SeqSpan],
        rows: list[int],
        failures: Failures,
    ) -> torch.Tensor | None:
        """One draft forward; on failure record ``reqs`` as failed and return None."""
        t0 = time.perf_counter()
        try:
            return self.executor.forward(tokens, positions, spans, rows)
        except Exception as exc:  # a failed forward fails the requests in this batch only
            error = InternalError(f"draft forward pass failed: {type(exc).__name__}: {exc}")
            failures.extend((r, error) for r in reqs)
            return None
        finally:
            self.stats["draft_forward_calls"] += 1
            self.stats["draft_forward_time_s"] += time.perf_counter() - t0

    def propose(
        self, decoding: list[Request], chunks: list[tuple[Request, int]]
    ) -> tuple[dict[int, Proposal], Failures]:
        """Feed the draft pending tokens and this step's prefill chunks, and draft tokens for the
        decoding requests. Returns the proposals by request id and the requests that failed.

        The first draft forward carries, per session, the pending tokens plus either the chunk the
        target prefills this step or the last committed token (whose logits give the first draft
        token); each later forward carries one drafted token per session still drafting.
        """
        failures: Failures = []
        budget = {r.rid: self.budget(r) for r in decoding}
        drafting = [r for r in decoding if budget[r.rid] > 0]
        if not drafting and not chunks:
            return {}, failures
        tokens: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        rows: list[int] = []
        for r in drafting:
            s = r.session
            end = len(s.tokens)  # through the last committed token, which the target has no KV of yet
            spans.append(SeqSpan(s.slot, s.draft_len, end - s.draft_len, len(tokens)))
            tokens.extend(s.tokens[s.draft_len : end])
            positions.extend(range(s.draft_len, end))
            rows.append(len(tokens) - 1)
        for r, n in chunks:
            s = r.session
            end = s.kv_len + n  # the target's rows after this step's chunk
            spans.append(SeqSpan(s.slot, s.draft_len, end - s.draft_len, len(tokens)))
            tokens.extend(s.tokens[s.draft_len : end])
            positions.extend(range(s.draft_len, end))
        logits = self._forward(drafting + [r for r, _ in chunks], tokens, positions, spans, rows, failures)
        if logits is None:
            return {}, failures
        # The chunk sessions' draft rows now reach kv_len + n; the engine sets draft_len with kv_len.
        proposals: dict[int, Proposal] = {r.rid: Proposal([], []) for r in drafting}
        active = drafting
        for j in range(self.n_draft):
            for r, row in zip(active, logits):
                try:
                    token, q = sample_draft(row, r.params, r.generator)
                except Exception as exc:  # the draft's logits hold no distribution: this request fails alone
                    failures.append((r, exc))
                    del proposals[r.rid]
                    continue
                proposals[r.rid].tokens.append(token)
                if q is not None:
                    proposals[r.rid].probs.append(q)
            active = [r for r in active if budget[r.rid] > j + 1 and r.rid in proposals]
            if not active:
                break
            # Feed each session's newest draft token to get the distribution for the next one.
            tokens, positions, spans = [], [], []
            for r in active:
                pos = len(r.session.tokens) + j
                spans.append(SeqSpan(r.session.slot, pos, 1, len(tokens)))
                tokens.append(proposals[r.rid].tokens[-1])
                positions.append(pos)
            logits = self._forward(active, tokens, positions, spans, list(range(len(active))), failures)
            if logits is None:  # those requests fail; the others keep what they drafted
                for r in active:
                    del proposals[r.rid]
                break
        return proposals, failures

    # -- checkpoints ---------------------------------------------------------------------

    def export_state(self, s: Session, position: int) -> dict[str, Any]:
        """The draft's state at ``position``: its rows up to where it is (at most ``position``) and the
        committed tokens after that which it has not been fed (``pending_token_ids``)."""
        at = min(s.draft_len, position)
        if at and not self.executor.cache.can_truncate(s.draft_len, at, s.draft_floor):
            at = 0  # its rings no longer hold what ``at`` needs: the draft restarts from the beginning
        geo = self.geometry
        if at:
            layers = self.executor.export_layers(s.slot, s.draft_len, at, s.draft_floor)
        else:
            empty = np.zeros((0, geo["num_kv_heads"], geo["head_dim"]), numpy_storage_dtype(self.executor.dtype_name))
            layers = [LayerState(0, empty, empty.copy()) for _ in range(geo["num_layers"])]
        return {
            "geometry": geo,
            "layers": layers,
            "pending_token_ids": np.asarray(s.tokens[at:position], dtype=np.int32),
        }
