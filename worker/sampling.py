"""Sampling parameters and token selection (greedy, temperature, top-k, top-p, seeded)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from muxworker.transport.errors import InvalidArgument


_WIRE_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids")


@dataclass
class SamplingParams:
    """What a generation asks for. Validated by ``validate`` before any work."""

    max_new_tokens: int = 256  # -1: the rest of the session's context
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] | None = None  # None: the model's EOS tokens

    @classmethod
    def from_wire(cls, control: dict[str, Any]) -> "SamplingParams":
        kw = {k: control[k] for k in _WIRE_FIELDS if k in control}
        if kw.get("stop") is None:
            kw.pop("stop", None)
        params = cls(**kw)
        params.validate()
        return params

    def validate(self, vocab_size: int | None = None) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or (
            self.max_new_tokens < 1 and self.max_new_tokens != -1
        ):
            raise InvalidArgument(f"max_new_tokens must be a positive integer or -1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) or not math.isfinite(
            self.temperature
        ) or self.temperature < 0:
            raise InvalidArgument(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not (0 < self.top_p <= 1):
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InvalidArgument(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63):
            raise InvalidArgument(f"seed must be an integer in [0, 2**63) or None, got {self.seed!r}")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidArgument(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids
            ):
                raise InvalidArgument(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
            if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
                raise InvalidArgument(f"stop_token_ids must lie in [0, {vocab_size})")


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a temperature > 0 request samples from: float32 logits [..., V] ->
    probabilities [..., V] after temperature, top-k and top-p.

    Speculative decoding builds the target's p and the draft's q with this one function, so the
    acceptance test compares distributions processed the same way.
    """
    if params.temperature <= 0:
        raise ValueError("processed_probs needs temperature > 0 (greedy picks the argmax)")
    scores = logits / float(params.temperature)
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        # Drop tokens once the mass before them reaches top_p; always keep the first.
        drop = (cum - probs) >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    return torch.softmax(scores, dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from one row of float32 logits [V]."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(processed_probs(logits, params), 1, generator=generator))


def sample_draft(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """A draft model's proposal from one row of logits [V]: (token, q [V]); q is None when greedy."""
    if params.temperature == 0:
        return int(torch.argmax(logits)), None
    q = processed_probs(logits, params)
    return int(torch.multinomial(q, 1, generator=generator)), q


def speculative_accept(
    p: torch.Tensor,  # [k + 1, V] target probabilities at the k drafted positions and one past them
    q: torch.Tensor,  # [k, V] draft probabilities the drafted tokens were drawn from
    drafted: list[int],  # [k]
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): the tokens to commit and how
    many of them are accepted drafts.

    Drafted token ``x`` at row i is accepted with probability min(1, p[i, x] / q[i, x]). The first
    rejection ends the run with a token drawn from the residual max(0, p[i] - q[i]), normalized;
    when every draft is accepted a bonus token is drawn from p[k]. Each committed token is then
    distributed exactly as the target's p at its position, whatever q is.
    """
    k = len(drafted)
    if p.shape[0] != k + 1 or q.shape[0] != k:
        raise ValueError(f"need p [k + 1, V] and q [k, V] for k = {k} drafts, got {tuple(p.shape)}, {tuple(q.shape)}")
    out: list[int] = []
    for i, x in enumerate(drafted):
        u = float(torch.rand((), generator=generator))
        px, qx = float(p[i, x]), float(q[i, x])
        if u * qx < px:  # u < p/q without dividing; qx > 0 because x was drawn from q
            out.append(x)
            continue
        residual = (p[i] - q[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: no residual mass, fall back to p
            residual = p[i]
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out, i
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return out, k


def verify_drafts(
    logits: torch.Tensor,  # [k + 1, V] target logits at the drafted positions and one past them
    drafted: list[int],
    draft_probs: torch.Tensor | None,  # [k, V], None when greedy
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """The tokens to commit after the target scored ``drafted``, and how many are accepted drafts.

    Greedy keeps drafts while they equal the target's argmax and ends with the target's argmax, so
    the output is exactly what greedy decoding without a draft produces. Sampling uses
    :func:`speculative_accept` on distributions processed as :func:`sample` would.
    """
    if params.temperature == 0:
        best = torch.argmax(logits, dim=-1).tolist()
        for i, x in enumerate(drafted):
            if best[i] != x:
                return list(drafted[:i]) + [best[i]], i
        return list(drafted) + [best[len(drafted)]], len(drafted)
    if draft_probs is None:
        raise ValueError("sampling verification needs the draft's probabilities")
    return speculative_accept(processed_probs(logits, params), draft_probs, drafted, generator)
