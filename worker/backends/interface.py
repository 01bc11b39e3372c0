"""What every backend provides the engine, and the rules they all share.

A backend is a model, its KV cache and an executor that runs a packed batch (``SeqSpan`` per
sequence) and moves checkpoint rows as ``LayerState`` (numpy, logical layout). The engine
schedules against :class:`Executor` only; it never touches a backend's tensors. The torch and MLX
backends (``backends/torch/``, ``backends/mlx/``) define the same public names in mirror files
(a test checks it).

The retention rules live here once: which positions a cache slot still holds and which rows
continuing from a position needs (``FullRetention``, ``RingRetention``, ``CacheRetention``), what a
cache of given shape allocates (``planned_nbytes``), and the batch check every executor makes
before it runs a forward (``check_batch``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from muxworker.transport.checkpoint import LayerState, required_rows, retained_from

if TYPE_CHECKING:
    import torch

    from muxworker.worker.models.args import ModelArgs

__all__ = [
    "SeqSpan",
    "Executor",
    "FullRetention",
    "RingRetention",
    "CacheRetention",
    "planned_nbytes",
    "check_batch",
    "geometry",
]


@dataclass(frozen=True)
class SeqSpan:
    """One sequence in a packed batch: rows [offset, offset+length) at positions [start, start+length)."""

    slot: int
    start: int
    length: int
    offset: int


@dataclass(frozen=True)
class WeightGroup:
    """The weights of one type held one way: the start-up line and ``GET /v1/models`` list them."""

    type: str  # a GGML type ("Q5_0", "Q6_K") or a dtype ("bfloat16")
    held: str  # "mapped": GGUF blocks read in place; "packed": blocks quantized at load; "dense"
    runs: str  # which passes use them: "decode" (the native step), "prefill" or "every pass"
    tensors: int
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        return f"{self.type} {self.held} {self.nbytes / 2**20:.0f} MiB ({self.tensors}, {self.runs})"


class Executor(Protocol):
    """A model plus its KV cache, as the engine schedules against them."""

    backend: str
    args: ModelArgs
    cache: Any  # a CacheRetention with slots, windows, max_tokens, nbytes and copy_slot

    @property
    def dtype_name(self) -> str: ...

    @property
    def weight_groups(self) -> list[WeightGroup]:
        """How the model's weights are held, by type (every tensor counted once)."""
        ...

    @property
    def device_name(self) -> str: ...

    def forward(
        self, tokens: Sequence[int], positions: Sequence[int], spans: Sequence[SeqSpan], logits_rows: Sequence[int]
    ) -> torch.Tensor:
        """Run one packed batch; return float32 CPU logits [len(logits_rows), V]."""
        ...

    def export_layers(self, slot: int, length: int, position: int, floor: int = 0) -> list[LayerState]: ...

    def import_layers(self, slot: int, position: int, layers: list[LayerState]) -> int:
        """Write a checkpoint's rows continuing at ``position`` into ``slot`` (every other row of the
        slot zeroed) and return the restored slot's floor: the first position every ring layer
        holds (see engine/core.py), 0 when every claimed row was imported."""
        ...

    # Checkpoint files (engine/checkpoint_files.py). With ``direct_kv_io`` the executor lends byte
    # views of its cache rows, head-major, which files are written from and read into; without it
    # those files go through export_layers / import_layers and host copies.
    @property
    def direct_kv_io(self) -> bool: ...

    def export_start(self, slot: int, layer: int, length: int, position: int, floor: int = 0) -> int:
        """The first position ``export_layers`` holds of ``layer``."""
        ...

    def kv_views(
        self, slot: int, layer: int, lo: int, hi: int, writable: bool = False
    ) -> tuple[list[memoryview], list[memoryview]]:
        """Keys' and values' byte views of positions ``[lo, hi)``, each concatenating to the
        head-major ``[KV, hi - lo, D]`` block."""
        ...

    def kv_clear(self, slot: int, layer: int, lo: int, hi: int) -> None:
        """Zero one layer's rows of ``slot`` except those that will hold positions ``[lo, hi)``."""
        ...

    def kv_zero_slot(self, slot: int) -> None: ...


def check_batch(
    tokens: Sequence[int], positions: Sequence[int], logits_rows: Sequence[int], *, vocab_size: int, max_positions: int
) -> None:
    """Raise ValueError unless a packed batch is in range. Every executor calls it first: some
    kernels (MLX gathers) do not check bounds and would read garbage."""
    if len(tokens) != len(positions):
        raise ValueError(f"{len(tokens)} tokens but {len(positions)} positions")
    if tokens and not 0 <= min(tokens) <= max(tokens) < vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size})")
    if positions and not 0 <= min(positions) <= max(positions) < max_positions:
        raise ValueError(f"positions must lie in [0, {max_positions})")
    if logits_rows and not 0 <= min(logits_rows) <= max(logits_rows) < len(tokens):
        raise ValueError(f"logits rows must lie in [0, {len(tokens)})")


class FullRetention:
    """Full attention keeps every row: any position <= length can be continued from."""

    window: int | None = None

    def retained(self, length: int) -> tuple[int, int]:
        return 0, length

    def needed(self, position: int) -> int:
        return 0

    def keep(self, position: int) -> int:
        return 0


class RingRetention:
    """A sliding window W keeps the last W positions (spare rollback rows are never counted) and
    continuing from p needs rows [p - (W - 1), p): the rule checkpoints use (required_rows)."""

    window: int

    def retained(self, length: int) -> tuple[int, int]:
        return max(0, length - self.window), length

    def needed(self, position: int) -> int:
        return required_rows(self.window, position)[0]

    def keep(self, position: int) -> int:
        """First position a slot of length ``position`` claims to retain (``retained``'s lo): what
        an export at ``position`` writes, so that a restored slot holds every row it claims and can
        still truncate to ``position - 1`` (the exact retry)."""
        return retained_from(self.window, position)


def _held_from(layer, length: int, floor: int) -> int:
    """First position a ring layer of a slot holding ``length`` rows really holds: its retention,
    raised to ``floor`` where a restore wrote fewer rows (the engine's kv_floor)."""
    lo = layer.retained(length)[0]
    return max(lo, floor) if layer.window is not None else lo


class CacheRetention:
    """Whole-cache retention questions, from the layers' own (shared by every backend's KVCache).

    ``floor`` (default 0) is the first position a restored slot's ring layers really hold; full
    layers always hold every row from 0, so it never applies to them.
    """

    layers: list

    def can_truncate(self, length: int, position: int, floor: int = 0) -> bool:
        """Whether a slot holding ``length`` rows can continue from ``position`` <= length."""
        if position > length:
            return False
        return all(_held_from(layer, length, floor) <= layer.needed(position) for layer in self.layers)

    def earliest_position(self, length: int, floor: int = 0) -> int:
        """The smallest position > 0 a slot holding ``length`` rows can continue from."""
        lo = 1
        for layer in self.layers:
            held = _held_from(layer, length, floor)
            if layer.window is not None and held > 0:
                lo = max(lo, held + layer.window - 1)
        return min(lo, length)


def planned_nbytes(
    windows: list[int | None],
    slots: int,
    max_tokens: int,
    kv_heads: int,
    head_dim: int,
    itemsize: int,
    rollback_rows: int = 0,
) -> int:
    """What :class:`KVCache` with these arguments allocates, in bytes, computed before allocating
    (the MLX cache has the same layouts and sizes)."""
    rows = 0
    for w in windows:
        rows += max_tokens if w is None or w >= max_tokens else w + min(rollback_rows, max_tokens - w)
    return 2 * slots * rows * kv_heads * head_dim * itemsize


def geometry(executor: Executor) -> dict[str, Any]:
    """An executor's KV geometry as checkpoints record it."""
    args = executor.args
    return {
        "num_layers": int(args.num_hidden_layers),
        "num_kv_heads": args.num_kv_heads,
        "head_dim": args.head_size,
        "windows": list(executor.cache.windows),
    }
