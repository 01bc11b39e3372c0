"""The single-token decodes of one forward pass, planned once for every layer (torch backend).

Owner: the engine thread, for the duration of one forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from muxworker.worker.backends.interface import SeqSpan


@dataclass
class DecodeBatch:
    """The single-token decodes of one forward pass, planned once and shared by every layer.

    Sorted by slot. When the slots are consecutive (sessions usually hold neighbouring slots) the
    layers read their cache rows as one strided view, with no copy; otherwise they gather them.
    When the packed rows are consecutive too, ``take`` is a slice, not an index.
    """

    size: int
    slots: list[int]
    positions: list[int]
    rows: torch.Tensor | slice  # packed rows, in slot order
    slot_index: torch.Tensor  # [B]
    position_index: torch.Tensor  # [B]
    consecutive: bool  # slots[i] == slots[0] + i
    masks: dict[tuple, torch.Tensor | None] = field(default_factory=dict)  # per cache geometry

    @classmethod
    def of(cls, spans: Sequence[SeqSpan], device: torch.device) -> DecodeBatch | None:
        decode = sorted((s for s in spans if s.length == 1), key=lambda s: s.slot)
        if not decode:
            return None
        slots = [s.slot for s in decode]
        positions = [s.start for s in decode]
        offsets = [s.offset for s in decode]
        b = len(decode)
        rows: torch.Tensor | slice
        if offsets == list(range(offsets[0], offsets[0] + b)):
            rows = slice(offsets[0], offsets[0] + b)
        else:
            rows = torch.tensor(offsets, device=device)
        return cls(
            b,
            slots,
            positions,
            rows,
            torch.tensor(slots, device=device),
            torch.tensor(positions, device=device),
            slots == list(range(slots[0], slots[0] + b)),
        )

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The decode rows of a packed [N, ...] tensor, in slot order."""
        return x[self.rows]

    def mask(self, key: tuple, build: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """The valid-row mask for one cache geometry, built by the first layer that asks."""
        if key not in self.masks:
            self.masks[key] = build()
        return self.masks[key]

    def read(self, cache: torch.Tensor, n: int) -> torch.Tensor:
        """Rows [0, n) of every decoding slot of ``cache`` [slots, KV, T, D]: [B, KV, n, D]."""
        if self.consecutive:
            first = self.slots[0]
            return cache[first : first + self.size, :, :n]  # a view
        return cache[:, :, :n][self.slot_index]  # slice first so only n rows per slot are gathered

    def write(self, cache: torch.Tensor, rows: torch.Tensor | list[int], new: torch.Tensor) -> None:
        """Write ``new`` [B, KV, D] at row ``rows[b]`` of each decoding slot."""
        if self.size == 1:
            cache[self.slots[0], :, int(rows[0])] = new[0]
        else:
            cache[self.slot_index, :, rows] = new
