"""Session and request state, and what the engine hands back (``EngineOutput``).

Owner: the engine thread (see core.py). A session's lengths are the one truth every cache question
is asked against: ``kv_len`` rows of its slot hold KV of ``tokens[:kv_len]``, ring layers from
``kv_floor`` on.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from muxworker.transport.errors import MuxError
from muxworker.transport.messages import TokenLogprob

if TYPE_CHECKING:
    import torch

    from muxworker.worker.engine.constraints import Guide
    from muxworker.worker.engine.sampling import Penalties, SamplingParams

__all__ = ["Readiness", "EngineOutput", "Phase", "Session", "Request", "common_prefix"]


class Readiness(enum.Enum):
    """The engine's initialization state (the seed's Pending / Ready / Failed)."""

    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


@dataclass
class EngineOutput:
    """A text delta for one request; the last one for a request carries ``result``."""

    request_id: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    result: dict[str, Any] | None = None
    error: MuxError | None = None  # set when finish_reason is "error"
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them


class Phase(enum.Enum):
    PREFILL = 1
    DECODE = 2


@dataclass
class Session:
    sid: str
    slot: int
    tokens: list[int] = field(default_factory=list)
    kv_len: int = 0
    request: Request | None = None
    unsaveable: str | None = "empty"  # why it cannot be exported now, None when it can
    # Rows [0, draft_len) of the draft's cache slot hold the draft's KV of tokens[:draft_len];
    # always <= kv_len (0 without a draft). tokens[draft_len:kv_len] are pending for the draft.
    draft_len: int = 0
    # The first position the slot's ring layers really hold when it was filled by a restore (or
    # from a prefix-cache entry that was); 0 when every row was computed here (core.py).
    kv_floor: int = 0
    draft_floor: int = 0
    # (tag, rows): rows [0, rows) of the slot are exactly what the store's save ``tag`` holds, so a
    # save on top of that tag writes only the rows after them (checkpoint_files.py). Set by a save
    # or a restore through files; dropped when the history is cut below ``rows``.
    durable: tuple[str, int] | None = None
    # A save of the slot's rows is in flight (checkpoint_files.SaveJob, written on the worker's I/O
    # thread): until Engine.finish_save nothing may change its history, its rows or its slot, so
    # every call on the session but reading its tokens raises SessionBusy.
    saving: bool = False
    # The cache_salt of the session's latest request: closing the session files its history as a
    # prefix-cache entry under it. A restored session has no known salt (salt_known False) until
    # its first request, and closing it before then adds no entry: a restored history enters no
    # namespace, the shared one included, until a request names one.
    cache_salt: str | None = None
    salt_known: bool = True

    def forget(self) -> None:
        """Empty the history: nothing of the slot is reused any more."""
        self.tokens = []
        self.kv_len = self.kv_floor = self.draft_len = self.draft_floor = 0
        self.durable = None

    def keep_rows(self, rows: int) -> None:
        """The history now keeps only its first ``rows`` rows: a durable base past them is gone."""
        if self.durable is not None and rows < self.durable[1]:
            self.durable = None


@dataclass
class Request:
    rid: int
    session: Session
    prompt: list[int]
    params: SamplingParams
    max_new: int
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    detok: Any
    reused: int
    phase: Phase = Phase.PREFILL
    generated: list[int] = field(default_factory=list)
    held_text: str = ""  # decoded text withheld because it may start a stop string
    stop_cut: bool = False  # a stop string ended the output
    t_submit: float = 0.0
    t_first_token: float | None = None
    finished: bool = False
    fresh: bool = False  # the session had no history: its prefilled prompt may seed the prefix cache
    cache_salt: str | None = None  # the prefix-cache namespace this request matches and seeds
    draft_proposed: int = 0  # tokens the draft proposed for this request
    draft_accepted: int = 0  # of those, tokens the target accepted and the session committed
    penalties: Penalties | None = None  # only when a penalty is on
    guide: Guide | None = None  # only with a constraint: the grammar's state and next mask
    text_ends: list[int] = field(default_factory=list)  # output text length after each generated token
    emitted: int = 0  # characters of output text sent so far


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``."""
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n
