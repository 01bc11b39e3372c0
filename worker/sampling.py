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


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from one row of float32 logits [V]."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits / float(params.temperature)
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        # Drop tokens once the mass before them reaches top_p; always keep the first.
        drop = (cum - probs) >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
