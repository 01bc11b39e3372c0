"""What a request's tokens become: text deltas with stop strings withheld, the tokens a stop-string
cut keeps, and the result map of a finished request (exactly the client's RESULT_FIELDS).

Pure functions of a request's state; the engine (core.py) calls them and commits what they decide.
"""

from __future__ import annotations

import bisect
from typing import Any

from muxworker.worker.engine.state import EngineOutput, Request

__all__ = ["emit_text", "visible_tokens", "result"]


def emit_text(req: Request, token: int) -> EngineOutput:
    """The output delta ``token`` adds: its text, less any tail that may start a stop string (held
    until the next token decides); sets ``req.stop_cut`` when a stop string appears."""
    delta = req.detok.push(token)
    req.text_ends.append((req.text_ends[-1] if req.text_ends else 0) + len(delta))
    out = _visible(req, delta, token)
    req.emitted += len(out.text)
    return out


def _visible(req: Request, delta: str, token: int) -> EngineOutput:
    text = req.held_text + delta
    stops = req.params.stop
    if not stops:
        req.held_text = ""
        return EngineOutput(req.rid, text, [token])
    cut = -1
    for st in stops:
        i = text.find(st)
        if i != -1 and (cut == -1 or i < cut):
            cut = i
    if cut != -1:
        req.stop_cut = True
        req.held_text = ""
        return EngineOutput(req.rid, text[:cut], [token])
    hold = 0
    for st in stops:
        for k in range(min(len(st) - 1, len(text)), 0, -1):
            if text.endswith(st[:k]):
                hold = max(hold, k)
                break
    req.held_text = text[len(text) - hold :] if hold else ""
    return EngineOutput(req.rid, text[: len(text) - hold], [token])


def visible_tokens(req: Request) -> int:
    """How many generated tokens have their text wholly inside the output sent so far (after a
    stop-string cut: the ones the session keeps)."""
    keep = bisect.bisect_right(req.text_ends, req.emitted)
    # A trailing token with no text of its own (a partial UTF-8 sequence) belongs to what follows.
    while keep and req.text_ends[keep - 1] == (req.text_ends[keep - 2] if keep > 1 else 0):
        keep -= 1
    return keep


def result(req: Request, reason: str, now: float) -> dict[str, Any]:
    """The ``done`` result of a request that has just finished with ``reason``."""
    t_first = req.t_first_token if req.t_first_token is not None else now
    return {
        "finish_reason": reason,
        "prompt_tokens": len(req.prompt),
        "reused_prompt_tokens": req.reused,
        "prefilled_prompt_tokens": len(req.prompt) - req.reused,
        "completion_tokens": len(req.generated),
        "committed_tokens": max(0, len(req.session.tokens) - len(req.prompt)),
        "generated_token_ids": list(req.generated),
        "prefill_time_s": t_first - req.t_submit,
        "decode_time_s": now - t_first,
        "draft_proposed_tokens": req.draft_proposed,
        "draft_accepted_tokens": req.draft_accepted,
    }
