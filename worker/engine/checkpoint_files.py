"""Saving a session into a segment file and restoring one from segment files, in the worker.

The client's store vets and opens the files and passes them as open file descriptors
(transport/fdpass.py); the worker never opens a path. A save gathers the slot's rows straight into
the file (``writev`` of views of the cache); a restore reads them straight into a free slot
(``preadv``), checks every CRC and that every row is finite, and only then publishes the session.
Backends that cannot lend host views of their cache (a GPU, MLX) go through ``export_layers`` /
``import_layers`` and host copies, with the same files and the same checks.

Each is a job in three parts, so that no other session waits for a disk: the engine thread plans
it (:func:`plan_save` lends the rows of a session the engine marks busy; a :class:`RestoreJob`
gets a slot the engine reserved), the worker's I/O thread moves the bytes and runs the checks
(:meth:`SaveJob.write`, :meth:`RestoreJob.read`), and the engine thread finishes it
(``Engine.finish_save`` / ``Engine.finish_restore``: the durable base, the published session).

Incremental saves: a session remembers ``durable = (tag, rows)``, meaning rows ``[0, rows)`` of
its slot are exactly what the store's save ``tag`` holds (set by a save or a restore, dropped when
the history is cut below ``rows``). A save whose base is that tag and a position ``p <= rows``
writes only positions ``[p, kv_len)`` (from the base's ``block_start`` instead when a block store's
new rows cross a block boundary); any other base gets a full save.

Owner: the engine thread plans and finishes (Engine methods only). Between the two a job belongs
to the I/O thread, which touches only what the plan lent it: the rows of a session that is busy
(read, never written) or the reserved slot of a session not yet published.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from muxworker.native import all_finite
from muxworker.transport.checkpoint import CheckpointRetentionError, LayerState, numpy_storage_dtype, retained_from
from muxworker.transport.checkpoint.errors import os_failure
from muxworker.transport.checkpoint.segments import (
    DraftRows,
    LayerRows,
    SegmentHeader,
    SegmentRef,
    byte_view,
    check_payload,
    head_major_bytes,
    host_layer_rows,
    layer_import_range,
    read_draft_layers,
    read_payload,
    read_payload_into,
    read_segment_header,
    write_segment,
)
from muxworker.transport.checkpoint.state import required_rows, same_layout
from muxworker.transport.errors import (
    CheckpointCorrupt,
    CheckpointIncompatible,
    CheckpointRejected,
    CheckpointTooLarge,
    CheckpointWriteError,
    InvalidArgument,
)
from muxworker.transport.messages import SaveBase, SaveFileReply

if TYPE_CHECKING:
    from muxworker.worker.backends.interface import Executor

    from .checkpoints import EngineCheckpoints
    from .state import Session

__all__ = ["SaveJob", "RestoreJob", "plan_save"]


_CHECK_SLICE = 256 * 1024  # bytes checked for finiteness between two calls of a restore's pace


def _unpaced() -> None:
    """A job's default ``pace``: no pauses (the worker passes its own, server.py)."""


@dataclass
class SaveJob:
    """One segment to write: positions ``[start, position)`` of a session that stays busy (its rows
    and slot unchanged) until ``Engine.finish_save``. ``layers`` are views of its cache slot, or
    host copies on a backend without direct KV I/O; nothing is written when ``start == position``."""

    session: Session
    fd: int
    tag: str | None  # None: not a store's save (an export), so no durable base is recorded
    session_id: str
    identity: str
    format: dict[str, Any]
    geometry: dict[str, Any]
    start: int
    position: int
    token_ids: np.ndarray  # int32, positions [start, position)
    layers: list[LayerRows]
    payload_bytes: int
    draft: DraftRows | None = None  # a draft model's state (all of it, host copies)
    file_length: int = 0  # set by write()
    header_crc: int = 0

    def write(self, pace: Callable[[], None] = _unpaced) -> None:
        """Write the segment into ``fd`` and fsync it (the I/O thread; ``write_segment`` calls
        ``pace`` after each slice). Raises :class:`CheckpointWriteError` naming the reason when the
        system fails."""
        if self.start == self.position:
            return
        try:
            self.file_length, self.header_crc = write_segment(
                self.fd,
                session_id=self.session_id,
                identity=self.identity,
                format=self.format,
                geometry=self.geometry,
                start=self.start,
                token_ids=self.token_ids,
                layers=self.layers,
                draft=self.draft,
                pace=pace,
            )
        except OSError as e:
            raise os_failure(
                CheckpointWriteError, e, f"cannot save session {self.session_id!r} (writing its segment)"
            ) from None

    def reply(self) -> SaveFileReply:
        """What the store records of the segment written (token ids and KV rows in
        ``payload_bytes``; ``start == position``: nothing new, nothing written)."""
        return SaveFileReply(
            self.start, self.position, self.file_length, self.header_crc, self.payload_bytes, self.format, self.geometry
        )


def plan_save(
    engine: EngineCheckpoints,
    s: Session,
    fd: int,
    *,
    tag: str | None,
    base: SaveBase | None,
    session_id: str,
    identity: str,
    max_bytes: int,
    position: int,
) -> SaveJob:
    """The session's rows up to ``position`` since its durable base (all of them without one), to
    be written into ``fd`` by :meth:`SaveJob.write`. Engine thread; copies nothing of the target's
    rows on a backend with direct KV I/O (a draft model's rows, a few percent, are copied)."""
    executor = engine.executor
    start = 0
    if position != s.kv_len and base is not None:
        raise InvalidArgument("a save at an earlier position than the session's is a whole one (no base)")
    if base is not None and s.durable is not None and s.durable[0] == base.tag and base.position <= s.durable[1]:
        # The store's save base.tag holds rows [0, s.durable[1]) of this slot, so [0, base.position) too.
        start = base.position
        if base.block_tokens and position // base.block_tokens > start // base.block_tokens:
            if base.block_start is None or base.block_start > start:
                raise InvalidArgument(f"base.block_start {base.block_start} is after base.position {start}")
            start = base.block_start  # the store cuts blocks from its last one's end
    geometry = engine.geometry()
    job = SaveJob(
        session=s,
        fd=fd,
        tag=tag,
        session_id=session_id,
        identity=identity,
        format=engine.executor_format(),
        geometry=geometry,
        start=start,
        position=position,
        token_ids=np.asarray(s.tokens[start:position], dtype=np.int32),
        layers=[],
        payload_bytes=0,
    )
    if start == position:
        return job
    draft_bytes = 0
    if engine.draft_model is not None:
        draft = engine.draft_model.export_state(s, position)
        at = max(layer.start + layer.rows for layer in draft["layers"])
        job.draft = DraftRows(draft["geometry"], at, host_layer_rows(draft["layers"]))
        draft_bytes = sum(layer.nbytes for layer in draft["layers"])
    storage = numpy_storage_dtype(executor.dtype_name)
    held: list[int] = []  # per layer, the first position the session holds (a full save's start)
    if executor.direct_kv_io:
        for i in range(geometry["num_layers"]):
            held.append(executor.export_start(s.slot, i, s.kv_len, position, s.kv_floor))
            lo = max(held[-1], start)
            keys, values = executor.kv_views(s.slot, i, lo, position)
            job.layers.append(LayerRows(lo, position - lo, keys, values))
    else:
        for state in executor.export_layers(s.slot, s.kv_len, position, s.kv_floor):
            held.append(state.start)
            lo = max(state.start, start)
            a = lo - state.start
            job.layers.append(
                LayerRows(lo, position - lo, [head_major_bytes(state.keys[a:])], [head_major_bytes(state.values[a:])])
            )
    # The bound is on the saved session, all of its segments: what a full save would write.
    row_bytes = 2 * geometry["num_kv_heads"] * geometry["head_dim"] * storage.itemsize
    whole = 4 * position + sum((position - lo) * row_bytes for lo in held) + draft_bytes
    if whole > max_bytes:
        raise CheckpointTooLarge(
            f"session {session_id!r} holds {whole} payload bytes, over the store's limit of {max_bytes}"
        )
    job.payload_bytes = (
        job.token_ids.nbytes + sum(sum(v.nbytes for v in layer.keys) * 2 for layer in job.layers) + draft_bytes
    )
    return job


@dataclass
class RestoreJob:
    """A saved session's segments to read into ``slot``, which the engine reserved for session
    ``sid`` until ``Engine.finish_restore`` publishes it (or frees the slot)."""

    sid: str
    slot: int
    tag: str | None  # the store's save the segments are (None: a host checkpoint, no durable base)
    executor: Executor
    fds: Sequence[int]
    refs: Sequence[SegmentRef]
    saved_id: str  # the session the segments hold
    identity: str
    max_bytes: int
    format: dict[str, Any]
    geometry: dict[str, Any]
    vocab_size: int
    draft_geometry: dict[str, Any] | None = None  # the worker's draft model's, None without one
    # Set by read():
    tokens: list[int] = field(default_factory=list)
    position: int = 0
    floor: int = 0
    staged: list[LayerState] | None = None  # host rows for import_layers (no direct KV I/O)
    draft_layers: list[LayerState] | None = None  # the draft model's host rows, up to draft_position
    draft_position: int = 0

    def read(self, pace: Callable[[], None] = _unpaced) -> None:
        """Read and check everything (the I/O thread): each segment against its manifest entry,
        the chain, identity, format, geometry, size, CRCs, finiteness. The rows land in the slot
        (with direct KV I/O) or in :attr:`staged`; on any failure the slot is zeroed and the error
        raised, so nothing is published. ``pace`` is called after each 256 KiB read or checked."""
        executor, fds, refs = self.executor, self.fds, self.refs
        if len(fds) != len(refs) or not refs:
            raise CheckpointCorrupt(f"{len(fds)} files for {len(refs)} segments")
        names = [f"segment {ref.name} of saved session {self.saved_id!r}" for ref in refs]
        headers = [read_segment_header(fd, name, ref) for fd, ref, name in zip(fds, refs, names)]
        fmt, geometry = self.format, self.geometry
        for h, name, ref in zip(headers, names, refs):
            if h.session_id != self.saved_id and not ref.shared:  # a shared block is bound by its ref
                raise CheckpointCorrupt(f"{name} holds session {h.session_id!r}")
            if h.identity != self.identity:
                raise CheckpointIncompatible(f"{name} was saved under another model/configuration identity")
            if h.format["layout_version"] != fmt["layout_version"]:
                raise CheckpointRejected(
                    f"checkpoint layout version {h.format['layout_version']} is not {fmt['layout_version']} ({name})"
                )
            if not same_layout(h.format, fmt):
                raise CheckpointRejected(
                    f"checkpoint dtype {h.format['dtype']} does not match the worker's {fmt['dtype']} ({name})"
                )
            if h.geometry != geometry:
                raise CheckpointRejected(f"{name} has geometry {h.geometry}, not the model's {geometry}")
        position = headers[-1].end
        total = sum(length for h in headers for _, length, _ in h.payloads)
        if total > self.max_bytes:
            raise CheckpointTooLarge(
                f"session {self.saved_id!r} holds {total} payload bytes, over the limit of {self.max_bytes}"
            )
        tokens = np.empty(position, dtype=np.int32)
        for fd, h, name in zip(fds, headers, names):
            read_payload_into(fd, h, 0, [byte_view(tokens[h.start : h.end])], name)
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
            raise CheckpointRejected(f"session {self.saved_id!r}: token ids outside the vocabulary ({self.vocab_size})")
        storage = numpy_storage_dtype(fmt["dtype"])
        bf16 = fmt["dtype"] == "bfloat16"
        kv, d = geometry["num_kv_heads"], geometry["head_dim"]
        row_bytes = d * storage.itemsize
        slot = self.slot
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
                        f"layer {i} (window {window}) needs positions [{needed_lo}, {position}) but the segments "
                        f"hold only [{lo}, {position})"
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
                            read_payload(fd, h, h.payload_index(i, part), views, name, pace)
                            reads.append((h, h.payload_index(i, part), views, name))
                    what = f"checkpoint layer {i} {('keys', 'values')[part]}"
                    _check(reads, targets[part], storage, bf16, what, pace)
                if not executor.direct_kv_io:
                    k, v = (a.transpose(1, 0, 2) for a in arrays)
                    staged.append(LayerState(lo, np.ascontiguousarray(k), np.ascontiguousarray(v)))
        except BaseException:
            if executor.direct_kv_io:  # rows may have landed in the slot: none may reach attention
                executor.kv_zero_slot(slot)
            raise
        self.tokens, self.position, self.floor = tokens.tolist(), position, floor
        self.staged = None if executor.direct_kv_io else staged
        try:
            self._read_draft(fds[-1], headers[-1], names[-1], storage, bf16)
        except BaseException:
            if executor.direct_kv_io:
                executor.kv_zero_slot(slot)
            raise

    def _read_draft(self, fd: int, header: SegmentHeader, name: str, storage: np.dtype, bf16: bool) -> None:
        """The draft model's rows from the last segment, checked like the target's (host copies)."""
        state = header.draft
        if self.draft_geometry is None:
            if state is not None:
                raise CheckpointRejected(
                    f"{name} carries draft-model state but this worker runs no draft model; "
                    "restore it into a worker started with the same --draft"
                )
            return
        if state is None:
            raise CheckpointRejected(
                f"this worker runs a draft model but the checkpoint has no draft state ({name} was saved "
                "without one); restore it into a worker without --draft"
            )
        if state.geometry != self.draft_geometry:
            raise CheckpointRejected(
                f"{name}: draft geometry {state.geometry} does not match the draft model's {self.draft_geometry}"
            )
        for i, (window, (lo, _)) in enumerate(zip(state.geometry["windows"], state.layers)):
            need = required_rows(window, state.position)[0]
            if lo > need:
                raise CheckpointRetentionError(
                    f"draft layer {i} (window {window}) needs positions [{need}, {state.position}) but the "
                    f"segment holds only [{lo}, {state.position})"
                )
        layers = read_draft_layers(fd, header, name)
        for layer in layers:
            for rows in (layer.keys, layer.values):
                if not all_finite(rows.reshape(-1), bfloat16=bf16):
                    raise CheckpointRejected("checkpoint draft layers hold NaN or infinite values")
        self.draft_layers, self.draft_position = layers, state.position

    def import_staged(self) -> int:
        """Engine thread, after :meth:`read`: write the staged host rows into the slot (a backend
        without direct KV I/O) and return the restored session's kv floor."""
        if self.staged is not None:
            self.floor = self.executor.import_layers(self.slot, self.position, self.staged)
            self.staged = None
        return self.floor


def _check(
    reads: Sequence[tuple[SegmentHeader, int, list[memoryview], str]],
    rows: Sequence[memoryview],
    storage: np.dtype,
    bf16: bool,
    what: str,
    pace: Callable[[], None],
) -> None:
    """The CRC32C of every payload read for one layer's keys or values, then that its rows are
    finite, calling ``pace`` after each 256 KiB checked."""
    for header, index, views, name in reads:
        check_payload(header, index, views, name, pace)
    for view in rows:
        for lo in range(0, view.nbytes, _CHECK_SLICE):
            if not all_finite(np.frombuffer(view[lo : lo + _CHECK_SLICE], dtype=storage), bfloat16=bf16):
                raise CheckpointRejected(f"{what} hold NaN or infinite values")
            pace()


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
