"""Saved sessions in segments (file version 3): incremental saves, read and written at disk speed.

A session the store saves is one small **session manifest** (``<hash>.mxckpt``) that names an
ordered list of immutable **segment** files (``<hash>.<random>.mxseg``). Segment ``i`` holds the
token ids of positions ``[start_i, end_i)`` and, for every layer, the KV rows of positions
``[lo, end_i)`` (``lo >= start_i``; a sliding-window layer keeps only its last rows). Segments are
contiguous: ``start_0 == 0``, ``start_{i+1} == end_i``, and the last ``end`` is the session's
position. A save after a turn writes one new segment holding only the new positions and replaces
the manifest; a full save (or a compaction) writes one segment from position 0.

KV rows are stored **head-major**, ``[KV heads, rows, head_dim]`` per layer and for keys and values
separately, which is how the worker's cache slot lays them out: a worker writes them straight from
its slot and reads them straight back into a free one, with no transposition and no copy through
the client or the pipe. Both file kinds use the container of file versions 1 and 2 (header, msgpack
manifest, header CRC, 4 KiB-aligned payloads with a CRC32C each, trailer; docs/CHECKPOINT_FORMAT.md).

Only numpy and the file container here; the worker (worker/engine/checkpoint_files.py) and the
client's store (client/store.py) both build on it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from muxworker.native import crc32c

from ..errors import CheckpointCorrupt, CheckpointIncompatible, CheckpointReadError
from .errors import CheckpointMalformed, os_failure
from .file import (
    _CRC,
    _HEADER,
    _TRAILER,
    _ZEROS,
    ALIGN,
    MAGIC,
    MAX_MANIFEST,
    TRAILER_MAGIC,
    _advance,
    _align,
    _payload_table,
    _read_exact,
    _read_manifest,
    fstat_regular,
)
from .identity import IdentityInputs
from .state import CPUCheckpoint, LayerState, _check_format, _check_geometry, numpy_storage_dtype, retained_from

__all__ = [
    "SEGMENTED_VERSION",
    "MAX_SEGMENTS",
    "SegmentRef",
    "SegmentHeader",
    "SessionManifest",
    "LayerRows",
    "byte_view",
    "head_major_bytes",
    "file_version",
    "write_segment",
    "plan_segment",
    "SegmentPlan",
    "read_segment_header",
    "read_payload_into",
    "read_payload",
    "check_payload",
    "check_chain",
    "layer_import_range",
    "encode_session_manifest",
    "read_session_manifest",
    "assemble_checkpoint",
]

#: File version of session manifests and segments (versions 1 and 2 are single checkpoint files).
SEGMENTED_VERSION = 3
#: Most segments one session manifest may name (a store compacts well before: client/store.py).
MAX_SEGMENTS = 256
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
_SESSION_KEYS = {
    "kind",
    "session_id",
    "identity",
    "identity_inputs",
    "format",
    "geometry",
    "position",
    "tag",
    "created",
    "saved",
    "segments",
    "file_length",
}
_REF_KEYS = {"name", "start", "end", "file_length", "header_crc"}
_SHARED_REF_KEYS = _REF_KEYS | {"shared"}
_MAX_NAME = 255
_MAX_POSITION = (1 << 31) - 1
_SLICE = 256 * 1024  # bytes checksummed, written or read at a time (then a caller's pace is called)


def _int(value: Any, where: str, lo: int = 0, hi: int = 1 << 63) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise CheckpointCorrupt(f"{where} must be an integer in [{lo}, {hi}], got {value!r:.80}")
    return value


def _text(value: Any, where: str, max_len: int = 1024) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise CheckpointCorrupt(f"{where} must be a nonempty string of at most {max_len} characters")
    return value


def _time(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise CheckpointCorrupt(f"{where} must be a finite nonnegative number (seconds since the epoch)")
    return float(value)


def _checked_format_geometry(fmt: Any, geometry: Any, path: str) -> tuple[dict, dict]:
    try:
        _check_format(fmt)
        _check_geometry(geometry, "geometry")
    except CheckpointMalformed as e:
        raise CheckpointCorrupt(f"{path!r}: {e}") from None
    return fmt, geometry


def file_version(fd: int, path: str) -> int:
    """The file version in a checkpoint file's header (read before dispatching on it)."""
    try:
        header = os.pread(fd, _HEADER.size, 0)
    except OSError as e:
        raise os_failure(CheckpointReadError, e, f"cannot read {path!r}") from None
    if len(header) < _HEADER.size:
        raise CheckpointCorrupt(f"{path!r} is {len(header)} bytes, too short for a checkpoint header")
    magic, version, _ = _HEADER.unpack(header)
    if magic != MAGIC:
        raise CheckpointCorrupt(f"{path!r} is not a muxworker checkpoint (bad magic)")
    return int(version)


def _check_trailer(fd: int, size: int, head_crc: int, path: str) -> None:
    trailer = bytearray(_TRAILER.size)
    _read_exact(fd, memoryview(trailer), size - _TRAILER.size, path)
    magic, length, trailer_head_crc, trailer_crc = _TRAILER.unpack(trailer)
    if (
        magic != TRAILER_MAGIC
        or length != size
        or trailer_head_crc != head_crc
        or trailer_crc != crc32c(memoryview(trailer)[: -_CRC.size])
    ):
        raise CheckpointCorrupt(f"{path!r}: trailer is damaged or does not match the header")


def _head(fields: dict[str, Any]) -> tuple[bytes, int]:
    """Header + manifest + header CRC of a version 3 file, and that CRC."""
    manifest = msgpack.packb(fields, use_bin_type=True)
    if len(manifest) > MAX_MANIFEST:
        raise CheckpointMalformed(f"manifest is {len(manifest)} bytes, over {MAX_MANIFEST}")
    head = _HEADER.pack(MAGIC, SEGMENTED_VERSION, len(manifest)) + manifest
    head_crc = crc32c(head)
    return head + _CRC.pack(head_crc), head_crc


def _trailer(file_length: int, head_crc: int) -> bytes:
    trailer = _TRAILER.pack(TRAILER_MAGIC, file_length, head_crc, 0)[: -_CRC.size]
    return trailer + _CRC.pack(crc32c(trailer))


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
class SegmentHeader:
    """A verified segment manifest: what the segment holds and where each payload lies."""

    session_id: str
    identity: str
    format: dict
    geometry: dict
    start: int
    end: int
    layers: list[tuple[int, int]]  # per layer (lo, rows): positions [lo, lo + rows), lo + rows == end
    payloads: list[tuple[int, int, int]]  # (offset, length, crc32c): token ids, then K, V per layer
    file_length: int
    header_crc: int

    def payload_index(self, layer: int, part: int) -> int:
        """Index of layer ``layer``'s keys (``part`` 0) or values (1)."""
        return 1 + 2 * layer + part


@dataclass
class LayerRows:
    """One layer's rows to write: positions ``[lo, lo + rows)``, keys and values each as byte views
    that concatenate, in order, to the head-major ``[KV, rows, D]`` payload."""

    lo: int
    rows: int
    keys: Sequence[memoryview]
    values: Sequence[memoryview]


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
    pace: Callable[[], None] | None = None,
) -> tuple[int, int]:
    """Write one segment into the empty file ``fd`` and fsync it; return (file length, header CRC).

    ``token_ids`` are positions ``[start, end)`` (int32). Every view is written as it is, from the
    caller's memory (gather writes, no concatenation), 256 KiB at a time. ``pace``:
    called after each slice checksummed or written, for a writer that shares the cores with work
    that must not wait (the worker's I/O thread pauses there while sessions decode). Raises OSError
    as the system does (the caller names the file) and :class:`CheckpointMalformed` for rows that
    contradict the geometry.
    """
    plan = plan_segment(
        session_id=session_id,
        identity=identity,
        format=format,
        geometry=geometry,
        start=start,
        token_ids=token_ids,
        layers=layers,
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
    for i, layer in enumerate(layers):
        if layer.lo < start or layer.lo + layer.rows != end:
            raise CheckpointMalformed(f"layer {i} rows [{layer.lo}, {layer.lo + layer.rows}) do not end at {end}")
        for part in (layer.keys, layer.values):
            if _views_nbytes(part) != kv * layer.rows * d * item:
                raise CheckpointMalformed(f"layer {i} holds {_views_nbytes(part)} bytes for {layer.rows} rows")
            payloads.append(part)
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


def write_checkpoint_segment(fd: int, session_id: str, identity: str, checkpoint: CPUCheckpoint) -> dict[str, Any]:
    """Write a host checkpoint whole, as one segment from position 0, into the empty file ``fd``;
    return what a worker's ``save_file`` reply says of a segment (start, position, file_length,
    header_crc), for the store's commit."""
    layers = [
        LayerRows(state.start, state.rows, [head_major_bytes(state.keys)], [head_major_bytes(state.values)])
        for state in checkpoint.layers
    ]
    length, head_crc = write_segment(
        fd,
        session_id=session_id,
        identity=identity,
        format=checkpoint.format,
        geometry=checkpoint.geometry,
        start=0,
        token_ids=checkpoint.token_ids,
        layers=layers,
    )
    return {"start": 0, "position": checkpoint.position, "file_length": length, "header_crc": head_crc}


def read_segment_header(fd: int, path: str, expected: SegmentRef | None = None) -> SegmentHeader:
    """The verified manifest of the segment open as ``fd``; with ``expected``, it must be that one."""
    st = fstat_regular(fd, path)
    if expected is not None and st.st_size != expected.file_length:
        raise CheckpointCorrupt(
            f"{path!r} is {st.st_size} bytes but its session manifest says {expected.file_length}: "
            "the segment was truncated, extended or replaced"
        )
    manifest, head_crc, head_end = _read_manifest(fd, st, path, {SEGMENTED_VERSION: _SEGMENT_KEYS})
    if manifest["kind"] != "segment":
        raise CheckpointCorrupt(f"{path!r} is a {manifest['kind']!r} file, not a segment")
    if expected is not None and head_crc != expected.header_crc:
        raise CheckpointCorrupt(f"{path!r} is not the segment its session manifest names (header checksum differs)")
    fmt, geometry = _checked_format_geometry(manifest["format"], manifest["geometry"], path)
    start = _int(manifest["start"], f"{path!r}: start", 0, _MAX_POSITION)
    end = _int(manifest["end"], f"{path!r}: end", start + 1, _MAX_POSITION)
    if expected is not None and (start, end) != (expected.start, expected.end):
        raise CheckpointCorrupt(f"{path!r} holds positions [{start}, {end}), not [{expected.start}, {expected.end})")
    layers_in = manifest["layers"]
    if not isinstance(layers_in, list) or len(layers_in) != geometry["num_layers"]:
        raise CheckpointCorrupt(f"{path!r}: layers must list {geometry['num_layers']} (lo, rows) pairs")
    layers = []
    for i, pair in enumerate(layers_in):
        if not isinstance(pair, list) or len(pair) != 2:
            raise CheckpointCorrupt(f"{path!r}: layer {i} must be a (lo, rows) pair")
        lo = _int(pair[0], f"{path!r}: layer {i} lo", start, end)
        rows = _int(pair[1], f"{path!r}: layer {i} rows", 0, end)
        if lo + rows != end:
            raise CheckpointCorrupt(f"{path!r}: layer {i} rows [{lo}, {lo + rows}) do not end at {end}")
        layers.append((lo, rows))
    if len(manifest["payloads"]) != 1 + 2 * len(layers):
        raise CheckpointCorrupt(f"{path!r}: expected {1 + 2 * len(layers)} payloads")
    table = _payload_table(manifest, head_end, st.st_size, 2**63, path)
    kv, d = geometry["num_kv_heads"], geometry["head_dim"]
    item = numpy_storage_dtype(fmt["dtype"]).itemsize
    if table[0][1] != 4 * (end - start):
        raise CheckpointCorrupt(f"{path!r}: token payload has {table[0][1]} bytes for {end - start} positions")
    for i, (_, rows) in enumerate(layers):
        for part in (0, 1):
            if table[1 + 2 * i + part][1] != kv * rows * d * item:
                raise CheckpointCorrupt(f"{path!r}: layer {i} payload size disagrees with its {rows} rows")
    _check_trailer(fd, st.st_size, head_crc, path)
    return SegmentHeader(
        _text(manifest["session_id"], f"{path!r}: session_id", 1 << 16),
        _text(manifest["identity"], f"{path!r}: identity", 256),
        fmt,
        geometry,
        start,
        end,
        layers,
        table,
        manifest["file_length"],
        head_crc,
    )


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


# ----------------------------------------------------------------------------------------------
# Session manifests


@dataclass
class SessionManifest:
    """A saved session: its identity, shape, position and the segments that hold it.

    ``tag`` names this save (random, new for every save): a worker that exported it, or restored
    from it, knows which rows are already in the store and writes only the rest next time.
    ``created`` is when the session was first saved, ``saved`` when this manifest was written
    (seconds since the epoch).
    """

    session_id: str
    identity: str
    format: dict
    geometry: dict
    position: int
    tag: str
    created: float
    saved: float
    segments: list[SegmentRef] = field(default_factory=list)
    identity_inputs: IdentityInputs | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of all its segments (the manifest itself is a few hundred bytes)."""
        return sum(s.file_length for s in self.segments)

    def validate(self, where: str) -> None:
        if not self.segments or len(self.segments) > MAX_SEGMENTS:
            raise CheckpointCorrupt(f"{where}: a session names 1 to {MAX_SEGMENTS} segments")
        if self.segments[0].start != 0:
            raise CheckpointCorrupt(f"{where}: the first segment must start at position 0")
        for a, b in zip(self.segments, self.segments[1:]):
            if b.start != a.end:
                raise CheckpointCorrupt(
                    f"{where}: segments [{a.start}, {a.end}) and [{b.start}, {b.end}) are not contiguous"
                )
        if self.segments[-1].end != self.position:
            raise CheckpointCorrupt(
                f"{where}: the segments end at {self.segments[-1].end}, not at position {self.position}"
            )
        if len({s.name for s in self.segments}) != len(self.segments):
            raise CheckpointCorrupt(f"{where}: a segment is named twice")


def encode_session_manifest(m: SessionManifest) -> bytes:
    """The bytes of a session manifest file (header, manifest, header CRC, trailer; no payloads)."""
    m.validate("session manifest")
    fields: dict[str, Any] = {
        "kind": "session",
        "session_id": m.session_id,
        "identity": m.identity,
        "identity_inputs": None if m.identity_inputs is None else m.identity_inputs.to_wire(),
        "format": m.format,
        "geometry": m.geometry,
        "position": m.position,
        "tag": m.tag,
        "created": m.created,
        "saved": m.saved,
        "segments": [s.to_wire() for s in m.segments],
        "file_length": 0,
    }
    # file_length is a fixed-size field only once its value is known: iterate to the fixed point.
    length = 0
    while True:
        fields["file_length"] = length
        head, head_crc = _head(fields)
        if len(head) + _TRAILER.size == length:
            return head + _trailer(length, head_crc)
        length = len(head) + _TRAILER.size


def read_session_manifest(fd: int, path: str) -> SessionManifest:
    """The verified session manifest open as ``fd`` (a version 3 file of kind ``session``)."""
    st = fstat_regular(fd, path)
    manifest, head_crc, head_end = _read_manifest(fd, st, path, {SEGMENTED_VERSION: _SESSION_KEYS})
    if manifest["kind"] != "session":
        raise CheckpointCorrupt(f"{path!r} is a {manifest['kind']!r} file, not a session manifest")
    if manifest["file_length"] != st.st_size or head_end + _TRAILER.size != st.st_size:
        raise CheckpointCorrupt(f"{path!r} is {st.st_size} bytes but its manifest says {manifest['file_length']}")
    _check_trailer(fd, st.st_size, head_crc, path)
    fmt, geometry = _checked_format_geometry(manifest["format"], manifest["geometry"], path)
    inputs = manifest["identity_inputs"]  # parsed by the container reader
    assert inputs is None or isinstance(inputs, IdentityInputs)
    refs = manifest["segments"]
    if not isinstance(refs, list):
        raise CheckpointCorrupt(f"{path!r}: segments must be a list")
    m = SessionManifest(
        session_id=_text(manifest["session_id"], f"{path!r}: session_id", 1 << 16),
        identity=_text(manifest["identity"], f"{path!r}: identity", 256),
        format=fmt,
        geometry=geometry,
        position=_int(manifest["position"], f"{path!r}: position", 1, _MAX_POSITION),
        tag=_text(manifest["tag"], f"{path!r}: tag", 64),
        created=_time(manifest["created"], f"{path!r}: created"),
        saved=_time(manifest["saved"], f"{path!r}: saved"),
        segments=[SegmentRef.from_wire(r, f"{path!r}: segment {i}") for i, r in enumerate(refs)],
        identity_inputs=inputs,
    )
    m.validate(repr(path))
    return m


def check_chain(m: SessionManifest, headers: Sequence[SegmentHeader], path: str) -> None:
    """Each segment belongs to this session, identity and shape (the refs already matched)."""
    for ref, h in zip(m.segments, headers):
        if h.session_id != m.session_id and not ref.shared:
            raise CheckpointCorrupt(
                f"segment {ref.name} of {path!r} holds session {h.session_id!r}, not {m.session_id!r}"
            )
        if h.identity != m.identity:
            raise CheckpointIncompatible(f"segment {ref.name} of {path!r} was saved under another identity")
        if h.format != m.format or h.geometry != m.geometry:
            raise CheckpointCorrupt(f"segment {ref.name} of {path!r} has another format or geometry than its session")


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


# ----------------------------------------------------------------------------------------------
# Host memory (the client's in-memory API): a CPUCheckpoint from a segmented session


def assemble_checkpoint(m: SessionManifest, segments: Sequence[tuple[int, SegmentHeader, str]]) -> CPUCheckpoint:
    """The session as a :class:`CPUCheckpoint` (owned memory, ``[rows, KV, D]`` rows), from its
    open, verified segments ``(fd, header, path)``; every payload's CRC is checked on read."""
    storage = numpy_storage_dtype(m.format["dtype"])
    kv, d = m.geometry["num_kv_heads"], m.geometry["head_dim"]
    headers = [h for _, h, _ in segments]
    tokens = np.empty(m.position, dtype=np.int32)
    for fd, h, path in segments:
        read_payload_into(fd, h, 0, [byte_view(tokens[h.start : h.end])], path)
    layers = []
    for i, window in enumerate(m.geometry["windows"]):
        keep = retained_from(window, m.position)
        lo = layer_import_range(headers, i, keep, m.position)
        parts = []
        for part in (0, 1):
            out = np.empty((m.position - lo, kv, d), dtype=storage)
            for fd, h, path in segments:
                seg_lo, rows = h.layers[i]
                block = np.empty((kv, rows, d), dtype=storage)
                read_payload_into(fd, h, h.payload_index(i, part), [byte_view(block)], path)
                a, b = max(seg_lo, lo), h.end
                if a < b:
                    out[a - lo : b - lo] = block[:, a - seg_lo : b - seg_lo].transpose(1, 0, 2)
            parts.append(out)
        layers.append(LayerState(lo, parts[0], parts[1]))
    return CPUCheckpoint(
        format=m.format, geometry=m.geometry, position=m.position, token_ids=tokens, layers=layers, identity=m.identity
    )
