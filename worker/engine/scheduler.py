"""The scheduler: which requests one forward pass serves, as a named, loggable :class:`Batch`.

A step reads schedule -> (propose drafts) -> pack -> execute -> update. The scheduler picks up to
``max_decode_sequences`` decoding requests (round-robin past the cap) and prefill chunks of at most
``prefill_chunk_tokens`` tokens in all (round-robin over requests waiting to prefill), so long
prompts never stall decoding. :meth:`Batch.pack` lays the target's forward out as one flat token
list with a ``SeqSpan`` per sequence: each decoding request's last committed token plus its drafted
tokens (logits for every row), then each chunk (logits for its last row when it ends the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from muxworker.worker.backends.interface import SeqSpan
from muxworker.worker.engine.state import Phase, Request

if TYPE_CHECKING:
    from muxworker.worker.engine.config import EngineConfig

__all__ = ["Batch", "Scheduler"]


@dataclass
class Batch:
    """One forward pass: what was scheduled and, once packed, the target's flat input."""

    decoding: list[Request]
    chunks: list[tuple[Request, int]]  # (request, prompt tokens prefilled this step)
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    spans: list[SeqSpan] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # rows whose logits are returned
    sampled: list[Request] = field(default_factory=list)  # the request of each run of sample rows

    def __bool__(self) -> bool:
        return bool(self.decoding or self.chunks)

    @property
    def requests(self) -> list[Request]:
        return self.decoding + [r for r, _ in self.chunks]

    def drop_finished(self) -> None:
        """Forget requests that ended before the target's forward (a draft failure, a stop)."""
        self.decoding = [r for r in self.decoding if not r.finished]
        self.chunks = [(r, n) for r, n in self.chunks if not r.finished]

    def pack(self, drafted: dict[int, list[int]]) -> None:
        """Lay out the target's forward; ``drafted`` maps a decoding request id to its drafts."""
        self.tokens, self.positions, self.spans, self.sample_rows, self.sampled = [], [], [], [], []
        for r in self.decoding:
            s = r.session
            pos = s.kv_len
            span = [s.tokens[pos]] + drafted.get(r.rid, [])  # the last committed token, then drafts
            self._add(s.slot, pos, span)
            self.sample_rows.extend(range(len(self.tokens) - len(span), len(self.tokens)))
            self.sampled.append(r)
        for r, n in self.chunks:
            pos = r.session.kv_len
            self._add(r.session.slot, pos, r.prompt[pos : pos + n])
            if pos + n == len(r.prompt):
                self.sample_rows.append(len(self.tokens) - 1)
                self.sampled.append(r)

    def _add(self, slot: int, start: int, tokens: list[int]) -> None:
        self.spans.append(SeqSpan(slot, start, len(tokens), len(self.tokens)))
        self.tokens.extend(tokens)
        self.positions.extend(range(start, start + len(tokens)))

    def describe(self) -> str:
        """One log line: the sessions decoded and prefilled, and the rows packed."""
        dec = ",".join(r.session.sid for r in self.decoding) or "-"
        pre = ",".join(f"{r.session.sid}+{n}" for r, n in self.chunks) or "-"
        return f"batch decode[{dec}] prefill[{pre}] rows={len(self.tokens)}"


class Scheduler:
    """Round-robin cursors over decoding and prefilling requests (engine thread only)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._decode_cursor = 0
        self._prefill_cursor = 0

    def schedule(self, requests: list[Request]) -> Batch:
        decoding = [r for r in requests if r.phase is Phase.DECODE]
        prefilling = [r for r in requests if r.phase is Phase.PREFILL]
        cap = self.config.max_decode_sequences
        if len(decoding) > cap:
            start = self._decode_cursor % len(decoding)
            decoding = (decoding[start:] + decoding[:start])[:cap]
            self._decode_cursor += cap
        chunks: list[tuple[Request, int]] = []
        budget = self.config.prefill_chunk_tokens
        if prefilling:
            start = self._prefill_cursor % len(prefilling)
            order = prefilling[start:] + prefilling[:start]
            self._prefill_cursor += 1
            for r in order:
                if budget <= 0:
                    break
                n = min(len(r.prompt) - r.session.kv_len, budget)
                chunks.append((r, n))
                budget -= n
        return Batch(decoding, chunks)
