"""Token selection: greedy, temperature, top-k, top-p, min-p, penalties, seeded; and speculative verification.

The fields and their ranges are defined once, in :mod:`muxworker.transport.sampling`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from muxworker.transport.messages import TokenLogprob
from muxworker.transport.sampling import SamplingFields

if TYPE_CHECKING:
    from muxworker.worker.engine.constraints import Guide

SamplingParams = SamplingFields  # the worker's name for the one definition in transport/sampling.py


class Penalties:
    """Per-request penalty state: which tokens the prompt and output hold, and how often the output
    holds each (float32 [V] on the logits' device). Only built when a penalty is on."""

    def __init__(self, params: SamplingFields, prompt: list[int], vocab_size: int) -> None:
        self.params = params
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)
        if prompt:
            self.seen[torch.tensor(prompt, dtype=torch.long)] = True
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)

    def push(self, token: int) -> None:
        self.seen[token] = True
        self.counts[token] += 1

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalized float32 logits [V] (a new tensor).

        Only the penalized tokens change (an extreme penalty times a zero count must not turn the
        other logits into NaN), and the result is clamped to float32's finite range: an absurd but
        valid penalty pushes a token to the top or bottom of the distribution, never to inf (which
        softmax turns into NaN). NaN logits of the model itself stay NaN, for sample() to refuse."""
        p = self.params
        out = logits.clone()
        if p.repetition_penalty != 1.0:
            seen = out[self.seen].double()
            out[self.seen] = _finite(torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty))
        if p.presence_penalty or p.frequency_penalty:
            hit = self.counts > 0
            penalty = p.frequency_penalty * self.counts[hit].double() + p.presence_penalty
            out[hit] = _finite(out[hit].double() - penalty)
        return out


_F32_MAX = float(torch.finfo(torch.float32).max)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """float32 of ``x`` clamped to the finite range (NaN stays NaN)."""
    return x.clamp(-_F32_MAX, _F32_MAX).float()


def processed_probs(logits: torch.Tensor, params: SamplingFields) -> torch.Tensor:
    """The distribution a sampling (not greedy) request samples from: float32 logits [..., V] ->
    probabilities [..., V] after temperature, top-k, top-p and min-p.

    Speculative decoding builds the target's p and the draft's q with this one function, so the
    acceptance test compares distributions processed the same way.
    """
    if params.greedy:
        raise ValueError("processed_probs needs a sampling temperature (greedy picks the argmax)")
    scores = _finite(logits.double() / float(params.temperature))  # a tiny temperature: large, not inf
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        # Drop tokens once the mass before them reaches top_p; always keep the first.
        drop = (cum - probs) >= params.top_p
        drop[..., 0] = False  # a top_p below float32's smallest value compares as 0 >= 0
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    if params.min_p > 0:
        # Keep tokens at least min_p times as likely as the most likely one (always that one).
        floor = params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = torch.where(probs >= floor, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(
    logits: torch.Tensor,
    params: SamplingFields,
    generator: torch.Generator | None,
    penalties: Penalties | None = None,
    guide: Guide | None = None,
) -> int:
    """Pick the next token from one row of float32 logits [V]: penalties, then the constraint's
    mask (``guide``), then greedy or the processed distribution.

    Raises :class:`SamplingError` when the logits hold no usable distribution (NaN everywhere, say,
    from a checkpoint whose KV was tampered with); the engine ends that request only.
    """
    if penalties is not None:
        logits = penalties.apply(logits)
    if guide is not None:
        allowed = guide.allowed(logits.device)
        if not bool(allowed.any()):
            raise SamplingError(f"the constraint allows no token here ({guide.error or 'the grammar is exhausted'})")
        logits = logits.masked_fill(~allowed, float("-inf"))
    if params.greedy:
        return int(torch.argmax(logits))
    probs = processed_probs(logits, params)
    _check_distribution(probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """``token``'s log-probability under the model's own distribution (log_softmax of the raw
    float32 logits [V], before penalties, masks and temperature) and the ``k`` most likely tokens'."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        values, ids = torch.topk(lp, k)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(lp[token]), top)


class SamplingError(ValueError):
    """The logits of a request hold no distribution to sample from (NaN or inf)."""


def _check_distribution(probs: torch.Tensor) -> None:
    total = float(probs.sum())
    if not math.isfinite(total) or total <= 0 or not bool(torch.isfinite(probs).all()):
        raise SamplingError("the model's logits hold no finite distribution to sample from (NaN or inf)")


def sample_draft(
    logits: torch.Tensor, params: SamplingFields, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """A draft model's proposal from one row of logits [V]: (token, q [V]); q is None when greedy."""
    if params.greedy:
        return int(torch.argmax(logits)), None
    q = processed_probs(logits, params)
    _check_distribution(q)
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
    params: SamplingFields,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """The tokens to commit after the target scored ``drafted``, and how many are accepted drafts.

    Greedy keeps drafts while they equal the target's argmax and ends with the target's argmax, so
    the output is exactly what greedy decoding without a draft produces. Sampling uses
    :func:`speculative_accept` on distributions processed as :func:`sample` would.
    """
    if params.greedy:
        best = torch.argmax(logits, dim=-1).tolist()
        for i, x in enumerate(drafted):
            if best[i] != x:
                return list(drafted[:i]) + [best[i]], i
        return list(drafted) + [best[len(drafted)]], len(drafted)
    if draft_probs is None:
        raise ValueError("sampling verification needs the draft's probabilities")
    p = processed_probs(logits, params)
    _check_distribution(p)
    return speculative_accept(p, draft_probs, drafted, generator)
