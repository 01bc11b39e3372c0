"""Segments (file version 3): the one file kind that holds KV rows, read and written at disk speed.

A session the store saves is one small session manifest (manifest.py) that names an ordered list
of immutable **segment** files (``<hash>.<random>.mxseg``). Segment ``i`` holds the
token ids of positions ``[start_i, end_i)`` and, for every layer, the KV rows of positions
``[lo, end_i)`` (``lo >= start_i``; a sliding-window layer keeps only its last rows). Segments are
contiguous: ``start_0 == 0``, ``start_{i+1} == end_i``, and the last ``end`` is the session's
position. A save after a turn writes one new segment holding only the new positions and replaces
the manifest; a full save (or a compaction) writes one segment from position 0.

KV rows are stored **head-major**, ``[KV heads, rows, head_dim]`` per layer and for keys and values
separately, which is how the worker's cache slot lays them out: a worker writes them straight from
its slot and reads them straight back into a free one, with no transposition and no copy through
the client or the pipe. A segment may also carry a draft model's state: its rows up to where the
draft is, after the target's payloads (the whole draft, as it is at the segment's end). Every file
kind uses the container of container.py (docs/CHECKPOINT_FORMAT.md).

Only numpy and the file container here; the worker (worker/engine/checkpoint_files.py), the
client's stores (client/stores/) and host checkpoints (file.py) build on it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from muxworker.native import crc32c

from ..errors import CheckpointCorrupt, CheckpointIncompatible, CheckpointReadError, ProtocolError
from .container import (
    _TRAILER,
    _ZEROS,
    ALIGN,
    FILE_VERSION,
    _advance,
    _align,
    _check_trailer,
    _head,
    _payload_table,
    _read_manifest,
    _trailer,
    fstat_regular,
)
from .errors import CheckpointMalformed, os_failure
from .state import LAYOUT_VERSION, LayerState, _check_format, _check_geometry, numpy_storage_dtype

__all__ = [
    "SegmentRef",
    "SaveFileReply",
    "SegmentHeader",
    "LayerRows",
    "byte_view",
    "head_major_bytes",
    "write_segment",
    "plan_segment",
    "SegmentPlan",
    "read_segment_header",
    "read_payload_into",
    "read_payload",
    "check_payload",
    "layer_import_range",
    "DraftHeader",
    "DraftRows",
    "host_layer_rows",
    "read_draft_layers",
]

_SEGMENT_KEYS = {
    "kind",
    "session_id",
    "identity",
    "format",
    "geometry",
    "start",
    "end",
    "layers",
    "payloads",
    "file_length",
}
_DRAFT_KEYS = {"geometry", "position", "layers"}
_REF_KEYS = {"name", "start", "end", "file_length", "header_crc"}
_SHARED_REF_KEYS = _REF_KEYS | {"shared"}
_MAX_NAME = 255
_MAX_POSITION = (1 << 31) - 1
_SLICE = 256 * 1024  # bytes checksummed, written or read at a time (then a caller's pace is called)


def _int(value: Any, where: str, lo: int = 0, hi: int = 1 << 63) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise CheckpointCorrupt(f"{where} must be an integer in [{lo}, {hi}], got {value!r:.80}")
    return value


def _text(value: Any, where: str, max_len: int = 1024, min_len: int = 1) -> str:
    if not isinstance(value, str) or not min_len <= len(value) <= max_len:
        raise CheckpointCorrupt(f"{where} must be a string of {min_len} to {max_len} characters")
    return value


def _time(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise CheckpointCorrupt(f"{where} must be a finite nonnegative number (seconds since the epoch)")
    return float(value)


def _checked_format_geometry(fmt: Any, geometry: Any, path: str) -> tuple[dict, dict]:
    """A file's format and geometry; a newer KV layout is incompatible (not damage)."""
    layout = fmt.get("layout_version") if isinstance(fmt, dict) else None
    if type(layout) is int and layout != LAYOUT_VERSION:
        raise CheckpointIncompatible(f"{path!r} uses KV layout version {layout}; this build reads {LAYOUT_VERSION}")
    try:
        _check_format(fmt)
        _check_geometry(geometry, "geometry")
    except CheckpointMalformed as e:
        raise CheckpointCorrupt(f"{path!r}: {e}") from None
    return fmt, geometry


# ----------------------------------------------------------------------------------------------
# Segments


@dataclass(frozen=True)
class SegmentRef:
    """What a session manifest records of one of its segments (a swapped file fails these).

    ``shared``: a content-addressed block (transport/checkpoint/blocks.py), which any session with
    the same rows may name; its header names no session, and its file length and header CRC bind
    the exact file."""

    name: str
    start: int
    end: int
    file_length: int
    header_crc: int
    shared: bool = False

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "name": self.name,
            "start": self.start,
            "end": self.end,
            "file_length": self.file_length,
            "header_crc": self.header_crc,
        }
        if self.shared:
            wire["shared"] = True
        return wire

    @classmethod
    def from_wire(cls, obj: Any, where: str) -> SegmentRef:
        if not isinstance(obj, dict) or obj.keys() not in (_REF_KEYS, _SHARED_REF_KEYS):
            raise CheckpointCorrupt(f"{where} must be a map with fields {sorted(_REF_KEYS)} (and shared)")
        if obj.get("shared", True) is not True:
            raise CheckpointCorrupt(f"{where}.shared must be true when present")
        name = _text(obj["name"], f"{where}.name", _MAX_NAME)
        if "/" in name or name.startswith("."):
            raise CheckpointCorrupt(f"{where}.name {name!r} is not a plain segment file name")
        start = _int(obj["start"], f"{where}.start", 0, _MAX_POSITION)
        end = _int(obj["end"], f"{where}.end", start + 1, _MAX_POSITION)
        return cls(
            name,
            start,
            end,
            _int(obj["file_length"], f"{where}.file_length"),
            _int(obj["header_crc"], where, 0, 2**32 - 1),
            "shared" in obj,
        )


@dataclass(frozen=True)
class SaveFileReply:
    """What a ``save_file`` wrote (its ``ok`` value): positions ``[start, position)`` in
    ``file_length`` bytes (``start == position``: nothing new, nothing written), the header's CRC,
    the payload bytes, and the ``format`` and ``geometry`` of the rows."""

    start: int
    position: int
    file_length: int
    header_crc: int
    payload_bytes: int
    format: dict[str, Any]
    geometry: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, value: Mapping[str, Any]) -> SaveFileReply:
        try:
            return cls(**{f.name: value[f.name] for f in dataclasses.fields(cls)})
        except KeyError as exc:
            raise ProtocolError(f"a save_file reply lacks {exc}") from None


@dataclass(frozen=True)
class SegmentHeader:
    """A verified segment manifest: what the segment holds and where each payload lies."""

    session_id: str
    identity: str
    format: dict
    geometry: dict
    start: int
    end: int
    layers: list[tuple[int, int]]  # per layer (lo, rows): positions [lo, lo + rows), lo + rows == end
    payloads: list[tuple[int, int, int]]  # (offset, length, crc32c): token ids, K, V per layer, draft's
    file_length: int
    header_crc: int
    draft: DraftHeader | None = None

    def payload_index(self, layer: int, part: int) -> int:
        """Index of layer ``layer``'s keys (``part`` 0) or values (1)."""
        return 1 + 2 * layer + part

    def draft_payload_index(self, layer: int, part: int) -> int:
        """Index of the draft model's layer ``layer``'s keys (``part`` 0) or values (1)."""
        return 1 + 2 * len(self.layers) + 2 * layer + part


@dataclass(frozen=True)
class DraftHeader:
    """A segment's draft-model state: the draft's rows of positions ``[lo, position)`` per layer
    (the whole draft, not only the segment's positions; ``position <= end``, where the draft is)."""

    geometry: dict
    position: int
    layers: list[tuple[int, int]]  # per draft layer (lo, rows), lo + rows == position


@dataclass
class LayerRows:
    """One layer's rows to write: positions ``[lo, lo + rows)``, keys and values each as byte views
    that concatenate, in order, to the head-major ``[KV, rows, D]`` payload."""

    lo: int
    rows: int
    keys: Sequence[memoryview]
    values: Sequence[memoryview]


@dataclass
class DraftRows:
    """A draft model's state to write with a segment: its rows up to ``position`` (where it is)."""

    geometry: dict
    position: int
    layers: Sequence[LayerRows]


def host_layer_rows(states: Sequence[LayerState]) -> list[LayerRows]:
    """Host rows (``[rows, KV, D]`` each) as a segment's head-major layer rows (copies)."""
    return [LayerRows(s.start, s.rows, [head_major_bytes(s.keys)], [head_major_bytes(s.values)]) for s in states]


def byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, as a flat memoryview of its own memory (no copy)."""
    return array.data.cast("B") if array.nbytes else memoryview(b"")


def head_major_bytes(rows: np.ndarray) -> memoryview:
    """Logical rows ``[n, KV, D]`` as the bytes of a head-major ``[KV, n, D]`` copy: a segment's
    payload, for writers that hold host rows instead of a cache slot's views."""
    return byte_view(np.ascontiguousarray(rows.transpose(1, 0, 2)))


def _views_nbytes(views: Sequence[memoryview]) -> int:
    return sum(v.nbytes for v in views)


def _crc_of(views: Sequence[memoryview], pace: Callable[[], None] | None = None) -> int:
    """The CRC32C of the bytes ``views`` concatenate to (byte views), 256 KiB at a time."""
    crc = 0
    for view in views:
        for lo in range(0, view.nbytes, _SLICE):
            crc = crc32c(view[lo : lo + _SLICE], crc)
            if pace is not None:
                pace()
    return crc


def _first_slice(pending: Sequence[memoryview]) -> list[memoryview]:
    """The first 256 KiB of ``pending`` (in at most 512 views): one gather call's worth."""
    batch: list[memoryview] = []
    room = _SLICE
    for view in pending[:512]:
        batch.append(view[:room])
        room -= batch[-1].nbytes
        if not room:
            break
    return batch


def _write_sliced(fd: int, buffers: Sequence[memoryview | bytes], pace: Callable[[], None] | None) -> None:
    """writev every buffer completely, at most 256 KiB a call (writev may also write less)."""
    pending = [memoryview(b) for b in buffers if len(b)]
    while pending:
        _advance(pending, os.writev(fd, _first_slice(pending)))
        if pace is not None:
            pace()


@dataclass
class SegmentPlan:
    """A segment laid out but not written: ``buffers`` concatenate to its bytes (views of the
    caller's memory, zero padding, header and trailer); ``crcs`` are its payloads' CRC32Cs."""

    buffers: list[memoryview | bytes]
    file_length: int
    header_crc: int
    crcs: list[int]


def write_segment(
    fd: int,
    *,
    session_id: str,
    identity: str,
    format: dict,
    geometry: dict,
    start: int,
    token_ids: np.ndarray,
    layers: Sequence[LayerRows],
    draft: DraftRows | None = None,
    pace: Callable[[], None] | None = None,
) -> tuple[int, int]:
    """Write one segment into the empty file ``fd`` and fsync it; return (file length, header CRC).

    ``token_ids`` are positions ``[start, end)`` (int32). Every view is written as it is, from the
    caller's memory (gather writes, no concatenation), 256 KiB at a time. ``pace``:
    called after each slice checksummed or written, for a writer that shares the cores with work
    that must not wait (the worker's I/O thread pauses there while sessions decode). Raises OSError
    as the system does (the caller names the file) and :class:`CheckpointMalformed` for rows that
    contradict the geometry. ``draft``: a draft model's state, written after the target's rows.
    """
    plan = plan_segment(
        session_id=session_id,
        identity=identity,
        format=format,
        geometry=geometry,
        start=start,
        token_ids=token_ids,
        layers=layers,
        draft=draft,
        pace=pace,
    )
    _write_sliced(fd, plan.buffers, pace)
    os.fsync(fd)
    return plan.file_length, plan.header_crc


def plan_segment(
    *,
    session_id: str,
    identity: str,
    format: dict,
    geometry: dict,
    start: int,
    token_ids: np.ndarray,
    layers: Sequence[LayerRows],
    draft: DraftRows | None = None,
    crcs: Sequence[int] | None = None,
    pace: Callable[[], None] | None = None,
) -> SegmentPlan:
    """Lay out one segment (as :func:`write_segment` writes it) without writing it. ``crcs``: the
    payloads' CRC32Cs when the caller has them already (else computed, calling ``pace`` as
    :func:`write_segment` says)."""
    tokens = np.ascontiguousarray(token_ids, dtype=np.int32)
    end = start + int(tokens.shape[0])
    if tokens.shape[0] == 0:
        raise CheckpointMalformed("a segment holds at least one position")
    kv, d = geometry["num_kv_heads"], geometry["head_dim"]
    item = numpy_storage_dtype(format["dtype"]).itemsize
    if len(layers) != geometry["num_layers"]:
        raise CheckpointMalformed(f"{len(layers)} layers for a geometry of {geometry['num_layers']}")
    payloads: list[Sequence[memoryview]] = [[byte_view(tokens)]]
    _add_rows(payloads, layers, kv, d, item, start, end, "layer")
    if draft is not None:
        if len(draft.layers) != draft.geometry["num_layers"] or not 0 <= draft.position <= end:
            raise CheckpointMalformed(f"draft state at {draft.position} does not fit its geometry or the segment")
        g = draft.geometry
        _add_rows(payloads, draft.layers, g["num_kv_heads"], g["head_dim"], item, 0, draft.position, "draft layer")
    lengths = [_views_nbytes(p) for p in payloads]
    crcs = list(crcs) if crcs is not None else [_crc_of(p, pace) for p in payloads]
    fields: dict[str, Any] = {
        "kind": "segment",
        "session_id": session_id,
        "identity": identity,
        "format": format,
        "geometry": geometry,
        "start": start,
        "end": end,
        "layers": [[layer.lo, layer.rows] for layer in layers],
        "payloads": [],
        "file_length": 0,
    }
    if draft is not None:
        fields["draft"] = {
            "geometry": draft.geometry,
            "position": draft.position,
            "layers": [[layer.lo, layer.rows] for layer in draft.layers],
        }
    # The payload offsets depend on the manifest's length: grow the header block in 4 KiB steps.
    base = ALIGN
    while True:
        offsets, cursor = [], base
        for n in lengths:
            offsets.append(cursor)
            cursor = _align(cursor + n)
        file_length = offsets[-1] + lengths[-1] + _TRAILER.size
        fields["payloads"] = [{"offset": o, "length": n, "crc32c": c} for o, n, c in zip(offsets, lengths, crcs)]
        fields["file_length"] = file_length
        head, head_crc = _head(fields)
        if len(head) <= base:
            break
        base = _align(len(head))
    buffers: list[memoryview | bytes] = [head]
    position = len(head)
    for offset, views, n in zip(offsets, payloads, lengths):
        buffers.append(memoryview(_ZEROS)[: offset - position])
        buffers.extend(views)
        position = offset + n
    buffers.append(_trailer(file_length, head_crc))
    return SegmentPlan(buffers, file_length, head_crc, crcs)


def _add_rows(
    payloads: list[Sequence[memoryview]],
    layers: Sequence[LayerRows],
    kv: int,
    d: int,
    item: int,
    start: int,
    end: int,
    what: str,
) -> None:
    for i, layer in enumerate(layers):
        if layer.lo < start or layer.lo + layer.rows != end:
            raise CheckpointMalformed(f"{what} {i} rows [{layer.lo}, {layer.lo + layer.rows}) do not end at {end}")
        for part in (layer.keys, layer.values):
            if _views_nbytes(part) != kv * layer.rows * d * item:
                raise CheckpointMalformed(f"{what} {i} holds {_views_nbytes(part)} bytes for {layer.rows} rows")
            payloads.append(part)


def read_segment_header(
    fd: int, path: str, expected: SegmentRef | None = None, max_bytes: int = 2**63
) -> SegmentHeader:
    """The verified manifest of the segment open as ``fd``; with ``expected``, it must be that one.
    Payloads declared over ``max_bytes`` in all raise :class:`CheckpointTooLarge`."""
    st = fstat_regular(fd, path)
    if expected is not None and st.st_size != expected.file_length:
        raise CheckpointCorrupt(
            f"{path!r} is {st.st_size} bytes but its session manifest says {expected.file_length}: "
            "the segment was truncated, extended or replaced"
        )
    manifest, head_crc, head_end = _read_manifest(fd, st, path, {FILE_VERSION: _SEGMENT_KEYS}, frozenset({"draft"}))
    if manifest["kind"] != "segment":
        raise CheckpointCorrupt(f"{path!r} is a {manifest['kind']!r} file, not a segment")
    if expected is not None and head_crc != expected.header_crc:
        raise CheckpointCorrupt(f"{path!r} is not the segment its session manifest names (header checksum differs)")
    fmt, geometry = _checked_format_geometry(manifest["format"], manifest["geometry"], path)
    start = _int(manifest["start"], f"{path!r}: start", 0, _MAX_POSITION)
    end = _int(manifest["end"], f"{path!r}: end", start + 1, _MAX_POSITION)
    if expected is not None and (start, end) != (expected.start, expected.end):
        raise CheckpointCorrupt(f"{path!r} holds positions [{start}, {end}), not [{expected.start}, {expected.end})")
    layers = _layer_pairs(manifest["layers"], geometry, start, end, f"{path!r}: layer")
    draft = None
    if "draft" in manifest:
        raw = manifest["draft"]
        if not isinstance(raw, dict) or raw.keys() != _DRAFT_KEYS:
            raise CheckpointCorrupt(f"{path!r}: draft must be a map with fields {sorted(_DRAFT_KEYS)}")
        try:
            _check_geometry(raw["geometry"], "draft.geometry")
        except CheckpointMalformed as e:
            raise CheckpointCorrupt(f"{path!r}: {e}") from None
        at = _int(raw["position"], f"{path!r}: draft position", 0, end)
        draft = DraftHeader(
            raw["geometry"], at, _layer_pairs(raw["layers"], raw["geometry"], 0, at, f"{path!r}: draft layer")
        )
    sizes = [(geometry, layers)] + ([(draft.geometry, draft.layers)] if draft is not None else [])
    count = 1 + sum(2 * len(pairs) for _, pairs in sizes)
    if len(manifest["payloads"]) != count:
        raise CheckpointCorrupt(f"{path!r}: expected {count} payloads")
    table = _payload_table(manifest, head_end, st.st_size, max_bytes, path)
    item = numpy_storage_dtype(fmt["dtype"]).itemsize
    if table[0][1] != 4 * (end - start):
        raise CheckpointCorrupt(f"{path!r}: token payload has {table[0][1]} bytes for {end - start} positions")
    index = 1
    for g, pairs in sizes:
        for i, (_, rows) in enumerate(pairs):
            for _part in (0, 1):
                if table[index][1] != g["num_kv_heads"] * rows * g["head_dim"] * item:
                    raise CheckpointCorrupt(f"{path!r}: layer {i} payload size disagrees with its {rows} rows")
                index += 1
    _check_trailer(fd, st.st_size, head_crc, path)
    return SegmentHeader(
        _text(manifest["session_id"], f"{path!r}: session_id", 1 << 16, 0),  # "": a save_checkpoint file
        _text(manifest["identity"], f"{path!r}: identity", 256, 0),  # "": a host checkpoint without one
        fmt,
        geometry,
        start,
        end,
        layers,
        table,
        manifest["file_length"],
        head_crc,
        draft,
    )


def _layer_pairs(raw: Any, geometry: dict, start: int, end: int, where: str) -> list[tuple[int, int]]:
    """A manifest's per-layer ``[lo, rows]`` pairs: rows ``[lo, end)`` with ``lo >= start``."""
    if not isinstance(raw, list) or len(raw) != geometry["num_layers"]:
        raise CheckpointCorrupt(f"{where}s must list {geometry['num_layers']} (lo, rows) pairs")
    layers = []
    for i, pair in enumerate(raw):
        if not isinstance(pair, list) or len(pair) != 2:
            raise CheckpointCorrupt(f"{where} {i} must be a (lo, rows) pair")
        lo = _int(pair[0], f"{where} {i} lo", start, end)
        rows = _int(pair[1], f"{where} {i} rows", 0, end)
        if lo + rows != end:
            raise CheckpointCorrupt(f"{where} {i} rows [{lo}, {lo + rows}) do not end at {end}")
        layers.append((lo, rows))
    return layers


def read_draft_layers(fd: int, header: SegmentHeader, path: str) -> list[LayerState]:
    """The draft model's rows a segment holds, as host rows (``[rows, KV, D]``), CRCs checked."""
    draft = header.draft
    assert draft is not None
    storage = numpy_storage_dtype(header.format["dtype"])
    kv, d = draft.geometry["num_kv_heads"], draft.geometry["head_dim"]
    out = []
    for i, (lo, rows) in enumerate(draft.layers):
        parts = []
        for part in (0, 1):
            block = np.empty((kv, rows, d), dtype=storage)
            read_payload_into(fd, header, header.draft_payload_index(i, part), [byte_view(block)], path)
            parts.append(np.ascontiguousarray(block.transpose(1, 0, 2)))
        out.append(LayerState(lo, parts[0], parts[1]))
    return out


def read_payload_into(fd: int, header: SegmentHeader, index: int, views: Sequence[memoryview], path: str) -> None:
    """Read payload ``index`` of a segment into ``views`` (which concatenate to its length) and
    verify its CRC32C on the bytes as they landed: a change racing with the read fails the check."""
    read_payload(fd, header, index, views, path)
    check_payload(header, index, views, path)


def check_payload(
    header: SegmentHeader,
    index: int,
    views: Sequence[memoryview],
    path: str,
    pace: Callable[[], None] | None = None,
) -> None:
    """Verify the CRC32C of payload ``index`` on the bytes read into ``views`` (256 KiB at a time,
    calling ``pace`` after each, as :func:`write_segment` does)."""
    if _crc_of(views, pace) != header.payloads[index][2]:
        raise CheckpointCorrupt(f"{path!r}: payload {index} checksum mismatch")


def read_payload(
    fd: int,
    header: SegmentHeader,
    index: int,
    views: Sequence[memoryview],
    path: str,
    pace: Callable[[], None] | None = None,
) -> None:
    """Read payload ``index`` of a segment into ``views``, unverified (:func:`check_payload` next),
    256 KiB at a time, calling ``pace`` after each (as :func:`write_segment` does)."""
    offset, length, _ = header.payloads[index]
    if _views_nbytes(views) != length:
        raise CheckpointMalformed(f"payload {index} of {path!r} has {length} bytes, not {_views_nbytes(views)}")
    pending = [v for v in views if v.nbytes]
    done = 0
    while pending:
        try:
            n = os.preadv(fd, _first_slice(pending), offset + done)
        except OSError as e:
            raise os_failure(CheckpointReadError, e, f"cannot read byte {offset + done} of {path!r}") from None
        if n == 0:
            raise CheckpointCorrupt(f"{path!r} ends early at byte {offset + done}")
        done += n
        _advance(pending, n)
        if pace is not None:
            pace()


def layer_import_range(headers: Sequence[SegmentHeader], layer: int, keep: int, position: int) -> int:
    """The first position to import of ``layer``: its rows are contiguous from there to
    ``position`` across the segments, and nothing before ``keep`` is taken."""
    lo = position
    for h in reversed(headers):
        seg_lo, _ = h.layers[layer]
        if h.end != lo:
            break
        lo = seg_lo
        if seg_lo > h.start or lo <= keep:
            break
    return max(lo, keep)
