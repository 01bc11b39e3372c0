"""KV cache: one small interface, two layouts.

``FullLayerCache`` keeps every row of a slot; ``RingLayerCache`` keeps the last ``window`` rows of a
sliding-window layer (plus optional spare rows for speculative rollback, see ``RingLayerCache``).
Both are preallocated once, for ``slots`` sessions, and both answer the same questions: which
positions does a slot still hold, give me keys/values for attention while writing new rows, export
logical rows ``[positions, KV, D]`` and import them back. Checkpoints are built from that interface
only, so any layout that implements it is saveable.

Owner: the engine thread. Nothing else reads or writes these tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from muxworker.worker.backends.interface import CacheRetention, FullRetention, RingRetention
from muxworker.worker.backends.torch.batch import DecodeBatch


@dataclass(frozen=True)
class AttentionKV:
    """Keys/values a query chunk attends to: rows for positions [lo, lo + L) in order.

    ``ordered`` is False only for single-token decode on a full ring, where every row is inside the
    window and order does not matter for attention.
    """

    k: torch.Tensor  # [KV, L, D]
    v: torch.Tensor  # [KV, L, D]
    lo: int
    ordered: bool = True


class LayerCache:
    """Interface shared by every cache layout."""

    k: torch.Tensor
    v: torch.Tensor

    def retained(self, length: int) -> tuple[int, int]:
        """Positions [lo, hi) a slot holding ``length`` rows still retains."""
        raise NotImplementedError

    def needed(self, position: int) -> int:
        """First position whose row is needed to continue at ``position``."""
        raise NotImplementedError

    def keep(self, position: int) -> int:
        """First position an export at ``position`` writes (what ``retained(position)`` claims)."""
        raise NotImplementedError

    def attention_kv(self, slot: int, start: int, k_new: torch.Tensor, v_new: torch.Tensor) -> AttentionKV:
        """Write rows for positions [start, start+T) and return what those queries attend to."""
        raise NotImplementedError

    def decode_kv(
        self, batch: DecodeBatch, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Batched single-token decode: write position ``batch.positions[b]`` of ``batch.slots[b]``
        ([B, KV, D] each) and return padded keys/values [B, KV, L, D] (read in place where the
        slots allow) with a mask [B, 1, 1, L] of the valid rows, or None when every row is valid."""
        raise NotImplementedError

    def export_rows(
        self, slot: int, length: int, position: int, floor: int = 0
    ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Rows this slot holds below ``position``, from ``keep(position)`` on: (start, k [n, KV, D],
        v [n, KV, D]) on this device. ``floor``: see :class:`CacheRetention`."""
        raise NotImplementedError

    def import_rows(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write logical rows [start, start+n) ([n, KV, D]) into ``slot`` and zero every other row
        of the slot: a stale row (NaN bits included) must not reach attention even masked, since a
        masked probability of 0 times NaN is still NaN."""
        raise NotImplementedError

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy what slot ``src`` retains at ``length`` into slot ``dst`` (an independent copy)."""
        raise NotImplementedError

    def export_start(self, length: int, position: int, floor: int = 0) -> int:
        """The first position :meth:`export_rows` returns (without copying anything)."""
        raise NotImplementedError

    def runs(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Positions ``[lo, hi)`` of a slot as (first row, row count) runs of its row axis."""
        raise NotImplementedError

    def clear_outside(self, slot: int, lo: int, hi: int) -> None:
        """Zero every row of ``slot`` except the ones that will hold positions ``[lo, hi)``."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class FullLayerCache(FullRetention, LayerCache):
    """Full attention: row p of a slot holds position p. Layout [slots, KV, T, D]."""

    def __init__(self, slots: int, max_tokens: int, kv_heads: int, head_dim: int, dtype, device) -> None:
        self.window = None
        self.k = torch.zeros(slots, kv_heads, max_tokens, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def attention_kv(self, slot, start, k_new, v_new):
        # k_new, v_new: [T, KV, D]
        t = k_new.shape[0]
        end = start + t
        if end > self.k.shape[2]:
            raise ValueError(f"position {end - 1} is past the cache's {self.k.shape[2]} rows")
        self.k[slot, :, start:end] = k_new.transpose(0, 1)
        self.v[slot, :, start:end] = v_new.transpose(0, 1)
        return AttentionKV(self.k[slot, :, :end], self.v[slot, :, :end], 0)

    def decode_kv(self, batch, k_new, v_new):
        batch.write(self.k, batch.position_index if batch.size > 1 else batch.positions, k_new)
        batch.write(self.v, batch.position_index if batch.size > 1 else batch.positions, v_new)
        n = max(batch.positions) + 1

        def build() -> torch.Tensor | None:
            if batch.size == 1:
                return None  # rows [0, p] are exactly the session's
            mask = torch.arange(n, device=self.k.device) <= batch.position_index.unsqueeze(1)  # [B, L]
            return mask[:, None, None, :]

        return batch.read(self.k, n), batch.read(self.v, n), batch.mask(("full",), build)

    def export_rows(self, slot, length, position, floor=0):
        return 0, self.k[slot, :, :position].transpose(0, 1), self.v[slot, :, :position].transpose(0, 1)

    def import_rows(self, slot, start, k, v):
        n = k.shape[0]
        for cache, rows in ((self.k, k), (self.v, v)):
            cache[slot, :, :start].zero_()
            cache[slot, :, start : start + n] = rows.transpose(0, 1)
            cache[slot, :, start + n :].zero_()

    def copy_slot(self, src, dst, length):
        self.k[dst, :, :length] = self.k[src, :, :length]
        self.v[dst, :, :length] = self.v[src, :, :length]

    def export_start(self, length, position, floor=0):
        return 0

    def runs(self, lo, hi):
        return [(lo, hi - lo)] if hi > lo else []

    def clear_outside(self, slot, lo, hi):
        for cache in (self.k, self.v):
            cache[slot, :, :lo].zero_()
            cache[slot, :, hi:].zero_()


class RingLayerCache(RingRetention, LayerCache):
    """Sliding-window attention: row ``p % capacity`` holds position p. Layout [slots, KV, C, D].

    ``capacity`` C is ``window`` W plus ``spare`` rows. The spare rows let a slot roll back: a slot
    of length n that writes rows up to L may continue from any length m with n <= m <= L and
    L - m <= spare, because the ring still holds the W positions before m. Speculative decoding
    writes drafted rows and then rolls back past the rejected ones. The stale rows a rollback leaves
    behind may have overwritten positions older than the window, so ``retained`` never counts the
    spare rows: only the last W positions are reported, as without spare rows.
    """

    def __init__(self, slots: int, window: int, kv_heads: int, head_dim: int, dtype, device, spare: int = 0) -> None:
        if spare < 0:
            raise ValueError(f"spare rows must be >= 0, got {spare}")
        self.window = window
        self.spare = spare
        self.capacity = window + spare
        self.k = torch.zeros(slots, kv_heads, self.capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def _ring_index(self, lo: int, hi: int) -> torch.Tensor:
        return torch.arange(lo, hi, device=self.k.device) % self.capacity

    def attention_kv(self, slot, start, k_new, v_new):
        w, c = self.window, self.capacity
        t = k_new.shape[0]
        if t == 1:
            self.k[slot, :, start % c] = k_new[0]
            self.v[slot, :, start % c] = v_new[0]
            lo = max(0, start + 1 - w)
            if c == w:
                n = min(start + 1, w)
                # When start + 1 >= w every ring row is inside the window, in rotated order.
                return AttentionKV(self.k[slot, :, :n], self.v[slot, :, :n], lo, ordered=start < w)
            if start < c:  # not wrapped yet: positions [lo, start] are rows [lo, start]
                return AttentionKV(self.k[slot, :, lo : start + 1], self.v[slot, :, lo : start + 1], lo)
            # The ring holds spare rows outside the window: gather exactly the window, in order.
            idx = self._ring_index(lo, start + 1)
            return AttentionKV(self.k[slot].index_select(1, idx), self.v[slot].index_select(1, idx), lo)
        lo = max(0, start - (w - 1))
        if lo < start:
            idx = self._ring_index(lo, start)
            k = torch.cat([self.k[slot].index_select(1, idx), k_new.transpose(0, 1)], dim=1)
            v = torch.cat([self.v[slot].index_select(1, idx), v_new.transpose(0, 1)], dim=1)
        else:
            k, v = k_new.transpose(0, 1), v_new.transpose(0, 1)
        # Only the last c new rows survive in the ring.
        keep = min(t, c)
        idx = self._ring_index(start + t - keep, start + t)
        self.k[slot].index_copy_(1, idx, k_new[t - keep :].transpose(0, 1))
        self.v[slot].index_copy_(1, idx, v_new[t - keep :].transpose(0, 1))
        return AttentionKV(k, v, lo)

    def decode_kv(self, batch, k_new, v_new):
        w, c = self.window, self.capacity
        rows = batch.position_index % c if batch.size > 1 else [batch.positions[0] % c]
        batch.write(self.k, rows, k_new)
        batch.write(self.v, rows, v_new)
        n = min(max(batch.positions) + 1, c)
        positions = batch.position_index

        def build() -> torch.Tensor | None:
            if c == w:
                if batch.size == 1:
                    return None  # rows [0, min(p + 1, w)) = [0, n) are all inside the window
                # Rows [0, min(p + 1, w)) hold positions inside the window (all w once p >= w - 1).
                valid = torch.clamp(positions + 1, max=w)
                mask = torch.arange(n, device=self.k.device) < valid.unsqueeze(1)
            else:
                # Row i holds position p - back, back = (p - i) mod C: valid when 0 <= p - back and
                # back < W (the spare rows hold positions older than the window, or stale drafts).
                back = (positions.unsqueeze(1) - torch.arange(n, device=self.k.device)) % c  # [B, L]
                mask = (back < w) & (back <= positions.unsqueeze(1))
            return mask[:, None, None, :]

        return batch.read(self.k, n), batch.read(self.v, n), batch.mask(("ring", w, c), build)

    def export_rows(self, slot, length, position, floor=0):
        # Every row the slot holds of the W positions before ``position`` (what ``retained`` at
        # ``position`` claims), so a restore can claim the same and a re-export equals the original.
        lo = max(self.retained(length)[0], floor, self.keep(position))
        idx = self._ring_index(lo, position)
        k = self.k[slot].index_select(1, idx).transpose(0, 1)
        v = self.v[slot].index_select(1, idx).transpose(0, 1)
        return lo, k, v

    def import_rows(self, slot, start, k, v):
        n = k.shape[0]
        keep = min(n, self.capacity)
        idx = self._ring_index(start + n - keep, start + n)
        for cache, rows in ((self.k, k), (self.v, v)):
            cache[slot].zero_()
            cache[slot].index_copy_(1, idx, rows[n - keep :].transpose(0, 1))

    def copy_slot(self, src, dst, length):
        self.k[dst] = self.k[src]
        self.v[dst] = self.v[src]

    def export_start(self, length, position, floor=0):
        return max(self.retained(length)[0], floor, self.keep(position))

    def runs(self, lo, hi):
        if hi - lo > self.capacity:
            raise ValueError(f"positions [{lo}, {hi}) do not fit a ring of {self.capacity} rows")
        if hi <= lo:
            return []
        first = lo % self.capacity
        n = min(hi - lo, self.capacity - first)
        return [(first, n)] + ([(0, hi - lo - n)] if n < hi - lo else [])

    def clear_outside(self, slot, lo, hi):
        self.k[slot].zero_()
        self.v[slot].zero_()


class KVCache(CacheRetention):
    """All layers' caches for ``slots`` sessions, preallocated once."""

    def __init__(
        self,
        windows: list[int | None],
        slots: int,
        max_tokens: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        rollback_rows: int = 0,
    ) -> None:
        """``rollback_rows``: how many rows past a slot's length a caller may write and then drop
        (speculative decoding); ring layers get that many spare rows (capacity W + rollback_rows,
        never more than ``max_tokens``)."""
        if rollback_rows < 0:
            raise ValueError(f"rollback_rows must be >= 0, got {rollback_rows}")
        self.slots = slots
        self.max_tokens = max_tokens
        self.rollback_rows = rollback_rows
        self.layers: list[LayerCache] = [
            FullLayerCache(slots, max_tokens, kv_heads, head_dim, dtype, device)
            if w is None or w >= max_tokens
            else RingLayerCache(slots, w, kv_heads, head_dim, dtype, device, spare=min(rollback_rows, max_tokens - w))
            for w in windows
        ]
        # The logical windows (a window >= max_tokens behaves like full attention but is still
        # reported as the model's window in checkpoint geometry).
        self.windows = list(windows)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        for layer in self.layers:
            layer.copy_slot(src, dst, length)
