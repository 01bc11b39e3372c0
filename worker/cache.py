"""KV cache: one small interface, two layouts.

``FullLayerCache`` keeps every row of a slot; ``RingLayerCache`` keeps the last ``window`` rows of a
sliding-window layer. Both are preallocated once, for ``slots`` sessions, and both answer the same
questions: which positions does a slot still hold, give me keys/values for attention while writing
new rows, export logical rows ``[positions, KV, D]`` and import them back. Checkpoints are built from
that interface only, so any layout that implements it is saveable.

Owner: the engine thread. Nothing else reads or writes these tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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

    window: int | None
    k: torch.Tensor
    v: torch.Tensor

    def retained(self, length: int) -> tuple[int, int]:
        """Positions [lo, hi) a slot holding ``length`` rows still retains."""
        raise NotImplementedError

    def needed(self, position: int) -> int:
        """First position whose row is needed to continue at ``position``."""
        raise NotImplementedError

    def attention_kv(self, slot: int, start: int, k_new: torch.Tensor, v_new: torch.Tensor) -> AttentionKV:
        """Write rows for positions [start, start+T) and return what those queries attend to."""
        raise NotImplementedError

    def export_rows(self, slot: int, length: int, position: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Rows this slot retains below ``position``: (start, k [n, KV, D], v [n, KV, D]) on this device."""
        raise NotImplementedError

    def import_rows(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write logical rows [start, start+n) ([n, KV, D]) into ``slot``."""
        raise NotImplementedError

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy what slot ``src`` retains at ``length`` into slot ``dst`` (an independent copy)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class FullLayerCache(LayerCache):
    """Full attention: row p of a slot holds position p. Layout [slots, KV, T, D]."""

    def __init__(self, slots: int, max_tokens: int, kv_heads: int, head_dim: int, dtype, device) -> None:
        self.window = None
        self.k = torch.zeros(slots, kv_heads, max_tokens, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def retained(self, length: int) -> tuple[int, int]:
        return 0, length

    def needed(self, position: int) -> int:
        return 0

    def attention_kv(self, slot, start, k_new, v_new):
        # k_new, v_new: [T, KV, D]
        t = k_new.shape[0]
        end = start + t
        if end > self.k.shape[2]:
            raise ValueError(f"position {end - 1} is past the cache's {self.k.shape[2]} rows")
        self.k[slot, :, start:end] = k_new.transpose(0, 1)
        self.v[slot, :, start:end] = v_new.transpose(0, 1)
        return AttentionKV(self.k[slot, :, :end], self.v[slot, :, :end], 0)

    def export_rows(self, slot, length, position):
        return 0, self.k[slot, :, :position].transpose(0, 1), self.v[slot, :, :position].transpose(0, 1)

    def import_rows(self, slot, start, k, v):
        n = k.shape[0]
        self.k[slot, :, start : start + n] = k.transpose(0, 1)
        self.v[slot, :, start : start + n] = v.transpose(0, 1)

    def copy_slot(self, src, dst, length):
        self.k[dst, :, :length] = self.k[src, :, :length]
        self.v[dst, :, :length] = self.v[src, :, :length]


class RingLayerCache(LayerCache):
    """Sliding-window attention: row ``p % window`` holds position p. Layout [slots, KV, W, D]."""

    def __init__(self, slots: int, window: int, kv_heads: int, head_dim: int, dtype, device) -> None:
        self.window = window
        self.k = torch.zeros(slots, kv_heads, window, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def retained(self, length: int) -> tuple[int, int]:
        return max(0, length - self.window), length

    def needed(self, position: int) -> int:
        return max(0, position - (self.window - 1))

    def _ring_index(self, lo: int, hi: int) -> torch.Tensor:
        return torch.arange(lo, hi, device=self.k.device) % self.window

    def attention_kv(self, slot, start, k_new, v_new):
        w = self.window
        t = k_new.shape[0]
        if t == 1:
            self.k[slot, :, start % w] = k_new[0]
            self.v[slot, :, start % w] = v_new[0]
            n = min(start + 1, w)
            # When start + 1 >= w every ring row is inside the window, in rotated order.
            return AttentionKV(self.k[slot, :, :n], self.v[slot, :, :n], max(0, start + 1 - w), ordered=start < w)
        lo = max(0, start - (w - 1))
        if lo < start:
            idx = self._ring_index(lo, start)
            k = torch.cat([self.k[slot].index_select(1, idx), k_new.transpose(0, 1)], dim=1)
            v = torch.cat([self.v[slot].index_select(1, idx), v_new.transpose(0, 1)], dim=1)
        else:
            k, v = k_new.transpose(0, 1), v_new.transpose(0, 1)
        # Only the last w new rows survive in the ring.
        keep = min(t, w)
        idx = self._ring_index(start + t - keep, start + t)
        self.k[slot].index_copy_(1, idx, k_new[t - keep :].transpose(0, 1))
        self.v[slot].index_copy_(1, idx, v_new[t - keep :].transpose(0, 1))
        return AttentionKV(k, v, lo)

    def export_rows(self, slot, length, position):
        # Exactly what continuing from ``position`` needs, so a re-export equals the original.
        lo = max(self.retained(length)[0], self.needed(position))
        idx = self._ring_index(lo, position)
        k = self.k[slot].index_select(1, idx).transpose(0, 1)
        v = self.v[slot].index_select(1, idx).transpose(0, 1)
        return lo, k, v

    def import_rows(self, slot, start, k, v):
        n = k.shape[0]
        keep = min(n, self.window)
        idx = self._ring_index(start + n - keep, start + n)
        self.k[slot].index_copy_(1, idx, k[n - keep :].transpose(0, 1))
        self.v[slot].index_copy_(1, idx, v[n - keep :].transpose(0, 1))

    def copy_slot(self, src, dst, length):
        self.k[dst] = self.k[src]
        self.v[dst] = self.v[src]


class KVCache:
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
    ) -> None:
        self.slots = slots
        self.max_tokens = max_tokens
        self.layers: list[LayerCache] = [
            FullLayerCache(slots, max_tokens, kv_heads, head_dim, dtype, device)
            if w is None or w >= max_tokens
            else RingLayerCache(slots, w, kv_heads, head_dim, dtype, device)
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

    def can_truncate(self, length: int, position: int) -> bool:
        """Whether a slot holding ``length`` rows can continue from ``position`` <= length."""
        if position > length:
            return False
        return all(layer.retained(length)[0] <= layer.needed(position) for layer in self.layers)

    def earliest_position(self, length: int) -> int:
        """The smallest position > 0 a slot holding ``length`` rows can continue from."""
        lo = 1
        for layer in self.layers:
            if layer.window is not None and layer.retained(length)[0] > 0:
                lo = max(lo, layer.retained(length)[0] + layer.window - 1)
        return min(lo, length)
