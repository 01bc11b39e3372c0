"""Saving a session into a segment file and restoring one from segment files, in the worker.

The client's store vets and opens the files and passes them as open file descriptors
(transport/fdpass.py); the worker never opens a path. A save gathers the slot's rows straight into
the file (``pwritev`` of views of the cache); a restore reads them straight into a free slot
(``preadv``), checks every CRC and that every row is finite, and only then publishes the session.
Backends that cannot lend host views of their cache (a GPU, MLX) go through ``export_layers`` /
``import_layers`` and host copies, with the same files and the same checks.

Incremental saves: a session remembers ``durable = (tag, rows)``, meaning rows ``[0, rows)`` of
its slot are exactly what the store's save ``tag`` holds (set by a save or a restore, dropped when
the history is cut below ``rows``). A save whose base is that tag and a position ``p <= rows``
writes only positions ``[p, kv_len)`` (from the base's ``block_start`` instead when a block store's
new rows cross a block boundary); any other base gets a full save.

Owner: the engine thread (these functions are called from Engine methods only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from muxworker.native import all_finite
from muxworker.transport.checkpoint import CheckpointRetentionError, LayerState, numpy_storage_dtype, retained_from
from muxworker.transport.checkpoint.errors import (
    CheckpointCorrupt,
    CheckpointIncompatible,
    CheckpointTooLarge,
    CheckpointWriteError,
    os_failure,
)
from muxworker.transport.checkpoint.segments import (
    LayerRows,
    SegmentHeader,
    SegmentRef,
    byte_view,
    check_payload,
    head_major_bytes,
    layer_import_range,
    read_payload,
    read_payload_into,
    read_segment_header,
    write_segment,
)
from muxworker.transport.errors import CheckpointRejected, InvalidArgument

if TYPE_CHECKING:
    from .core import Engine
    from .state import Session

__all__ = ["SaveBase", "save_segment", "restore_segments"]


class SaveBase(NamedTuple):
    """What a save may build on: rows ``[0, position)`` of the slot are in the store's save ``tag``.
    A store saving blocks of ``block_tokens`` positions (0: none) has its last block end at
    ``block_start``; a save that crosses a block boundary is written from there."""

    tag: str
    position: int
    block_start: int | None = None
    block_tokens: int = 0


def save_segment(
    engine: Engine,
    s: Session,
    fd: int,
    *,
    tag: str,
    base: SaveBase | None,
    session_id: str,
    identity: str,
    max_bytes: int,
) -> dict[str, Any]:
    """Write the session's rows since its durable base (all of them without one) into ``fd``.

    Returns what the store records: ``start``, ``position``, ``file_length``, ``header_crc``,
    ``payload_bytes`` (token ids and KV rows written; ``start == position``: nothing new, nothing
    written), and the ``format`` and ``geometry`` the rows have."""
    executor = engine.executor
    position = s.kv_len
    start = 0
    if base is not None and s.durable is not None and s.durable[0] == base.tag and base.position <= s.durable[1]:
        # The store's save base.tag holds rows [0, s.durable[1]) of this slot, so [0, base.position) too.
        start = base.position
        if base.block_tokens and position // base.block_tokens > start // base.block_tokens:
            if base.block_start is None or base.block_start > start:
                raise InvalidArgument(f"base.block_start {base.block_start} is after base.position {start}")
            start = base.block_start  # the store cuts blocks from its last one's end
    geometry = engine.geometry()
    shape = {"format": engine.executor_format(), "geometry": geometry}
    if start == position:
        s.durable = (tag, position)
        return {"start": start, "position": position, "file_length": 0, "header_crc": 0, "payload_bytes": 0, **shape}
    storage = numpy_storage_dtype(executor.dtype_name)
    direct = executor.direct_kv_io
    layers: list[LayerRows] = []
    held: list[int] = []  # per layer, the first position the session holds (a full save's start)
    if direct:
        for i in range(geometry["num_layers"]):
            held.append(executor.export_start(s.slot, i, s.kv_len, position, s.kv_floor))
            lo = max(held[-1], start)
            keys, values = executor.kv_views(s.slot, i, lo, position)
            layers.append(LayerRows(lo, position - lo, keys, values))
    else:
        for state in executor.export_layers(s.slot, s.kv_len, position, s.kv_floor):
            held.append(state.start)
            lo = max(state.start, start)
            a = lo - state.start
            layers.append(
                LayerRows(lo, position - lo, [head_major_bytes(state.keys[a:])], [head_major_bytes(state.values[a:])])
            )
    nbytes = sum(sum(v.nbytes for v in layer.keys) * 2 for layer in layers)
    # The bound is on the saved session, all of its segments: what a full save would write.
    row_bytes = 2 * geometry["num_kv_heads"] * geometry["head_dim"] * storage.itemsize
    whole = 4 * position + sum((position - lo) * row_bytes for lo in held)
    if whole > max_bytes:
        raise CheckpointTooLarge(
            f"session {session_id!r} holds {whole} payload bytes, over the store's limit of {max_bytes}"
        )
    tokens = np.asarray(s.tokens[start:position], dtype=np.int32)
    try:
        length, head_crc = write_segment(
            fd,
            session_id=session_id,
            identity=identity,
            format=engine.executor_format(),
            geometry=geometry,
            start=start,
            token_ids=tokens,
            layers=layers,
        )
    except OSError as e:
        raise os_failure(CheckpointWriteError, e, f"cannot save session {session_id!r} (writing its segment)") from None
    s.durable = (tag, position)
    payload_bytes = nbytes + tokens.nbytes
    return {
        "start": start,
        "position": position,
        "file_length": length,
        "header_crc": head_crc,
        "payload_bytes": payload_bytes,
        **shape,
    }


def restore_segments(
    engine: Engine,
    slot: int,
    fds: Sequence[int],
    refs: Sequence[SegmentRef],
    *,
    session_id: str,
    identity: str,
    max_bytes: int,
) -> tuple[list[int], int, int]:
    """Read a saved session's segments into the free ``slot``: (token ids, position, kv floor).

    Everything is checked (each segment against its manifest entry, the chain, identity, format,
    geometry, size, CRCs, finiteness) before this returns; on any failure the slot is zeroed and the
    error raised, so the caller publishes nothing."""
    executor = engine.executor
    if len(fds) != len(refs) or not refs:
        raise CheckpointCorrupt(f"{len(fds)} files for {len(refs)} segments")
    names = [f"segment {ref.name} of saved session {session_id!r}" for ref in refs]
    headers: list[SegmentHeader] = [read_segment_header(fd, name, ref) for fd, ref, name in zip(fds, refs, names)]
    fmt, geometry = engine.executor_format(), engine.geometry()
    for h, name, ref in zip(headers, names, refs):
        if h.session_id != session_id and not ref.shared:  # a shared block is bound by its ref
            raise CheckpointCorrupt(f"{name} holds session {h.session_id!r}")
        if h.identity != identity:
            raise CheckpointIncompatible(f"{name} was saved under another model/configuration identity")
        if h.format != fmt:
            raise CheckpointRejected(f"{name} has format {h.format}; this worker runs {fmt}")
        if h.geometry != geometry:
            raise CheckpointRejected(f"{name} has geometry {h.geometry}, not the model's {geometry}")
    position = headers[-1].end
    total = sum(length for h in headers for _, length, _ in h.payloads)
    if total > max_bytes:
        raise CheckpointTooLarge(f"session {session_id!r} holds {total} payload bytes, over the limit of {max_bytes}")
    tokens = np.empty(position, dtype=np.int32)
    for fd, h, name in zip(fds, headers, names):
        read_payload_into(fd, h, 0, [byte_view(tokens[h.start : h.end])], name)
    if int(tokens.min()) < 0 or int(tokens.max()) >= engine.vocab_size:
        raise CheckpointRejected(f"session {session_id!r}: token ids outside the vocabulary ({engine.vocab_size})")
    storage = numpy_storage_dtype(fmt["dtype"])
    bf16 = fmt["dtype"] == "bfloat16"
    kv, d = geometry["num_kv_heads"], geometry["head_dim"]
    row_bytes = d * storage.itemsize
    floor = 0
    staged: list[LayerState] = []
    # The checks (CRC32C and finiteness) run on this thread, after each payload's read. A second
    # thread overlapping them with the next read measured no faster in the worker (its torch
    # threads still spin on the other core after a forward pass) and sometimes slower.
    try:
        for i, window in enumerate(geometry["windows"]):
            keep = retained_from(window, position)
            lo = layer_import_range(headers, i, keep, position)
            needed_lo = 0 if window is None else max(0, position - (window - 1))
            if lo > needed_lo:
                raise CheckpointRetentionError(
                    f"layer {i} (window {window}) needs positions [{needed_lo}, {position}) but the segments hold "
                    f"only [{lo}, {position})"
                )
            if lo > keep:
                floor = max(floor, lo)
            if executor.direct_kv_io:
                executor.kv_clear(slot, i, lo, position)
                targets = executor.kv_views(slot, i, lo, position, writable=True)
            else:
                arrays = [np.empty((kv, position - lo, d), dtype=storage) for _ in range(2)]
                targets = ([byte_view(arrays[0])], [byte_view(arrays[1])])
            for part in (0, 1):
                reads: list[tuple[SegmentHeader, int, list[memoryview], str]] = []
                for fd, h, name in zip(fds, headers, names):
                    seg_lo, rows = h.layers[i]
                    a = max(seg_lo, lo)
                    if rows == 0 or h.end <= lo:
                        # Wholly before what is imported: verified, not kept.
                        views = [memoryview(bytearray(kv * rows * row_bytes))] if rows else []
                    else:
                        views = _payload_targets(targets[part], kv, lo, position, seg_lo, a, h.end, row_bytes)
                    if views:
                        read_payload(fd, h, h.payload_index(i, part), views, name)
                        reads.append((h, h.payload_index(i, part), views, name))
                what = f"checkpoint layer {i} {('keys', 'values')[part]}"
                _check(reads, targets[part], storage, bf16, what)
            if not executor.direct_kv_io:
                k, v = (a.transpose(1, 0, 2) for a in arrays)
                staged.append(LayerState(lo, np.ascontiguousarray(k), np.ascontiguousarray(v)))
        if not executor.direct_kv_io:
            floor = executor.import_layers(slot, position, staged)
    except BaseException:
        if executor.direct_kv_io:  # rows may have landed in the slot: none may reach attention
            executor.kv_zero_slot(slot)
        raise
    return tokens.tolist(), position, floor


def _check(
    reads: Sequence[tuple[SegmentHeader, int, list[memoryview], str]],
    rows: Sequence[memoryview],
    storage: np.dtype,
    bf16: bool,
    what: str,
) -> None:
    """The CRC32C of every payload read for one layer's keys or values, then that its rows are finite."""
    for header, index, views, name in reads:
        check_payload(header, index, views, name)
    if not all(all_finite(np.frombuffer(v, dtype=storage), bfloat16=bf16) for v in rows):
        raise CheckpointRejected(f"{what} hold NaN or infinite values")


def _payload_targets(
    target: Sequence[memoryview], kv: int, lo: int, hi: int, seg_lo: int, a: int, b: int, row_bytes: int
) -> list[memoryview]:
    """Where a segment payload's bytes go: per head, its rows [seg_lo, a) to scratch (read for the
    CRC, not kept) and rows [a, b) into the target's head block, which holds positions [lo, hi).

    ``target`` concatenates to the head-major [KV, hi - lo, D] destination (in one or several
    views per head: the caller's runs), so it is addressed as one flat byte sequence here."""
    flat = _Flat(target)
    views: list[memoryview] = []
    skip = (a - seg_lo) * row_bytes
    per_head = (hi - lo) * row_bytes
    for head in range(kv):
        if skip:
            views.append(memoryview(bytearray(skip)))
        begin = head * per_head + (a - lo) * row_bytes
        views.extend(flat.slice(begin, begin + (b - a) * row_bytes))
    return views


class _Flat:
    """A list of byte views addressed as one byte sequence (slices split at view boundaries)."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.views = list(views)
        self.starts = [0]
        for v in self.views:
            self.starts.append(self.starts[-1] + v.nbytes)

    def slice(self, begin: int, end: int) -> list[memoryview]:
        out = []
        for view, s, e in zip(self.views, self.starts, self.starts[1:]):
            lo, hi = max(begin, s), min(end, e)
            if lo < hi:
                out.append(view[lo - s : hi - s])
        return out
