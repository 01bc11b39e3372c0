"""Host checkpoints as segment files: a :class:`CPUCheckpoint` written as one segment, read back
from segments, and the single-file API (:func:`save_checkpoint` / :func:`load_checkpoint`).

A checkpoint file is one segment from position 0 (segments.py; the same file a store saves), with
its draft-model state if it has one. ``export_checkpoint_to_cpu`` and ``restore_checkpoint_from_cpu``
move a checkpoint to and from a worker the same way: one segment in a memory file
(:func:`~.container.memory_file`) over the worker's file channel.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from muxworker.transport.errors import InvalidArgument

from ..errors import CheckpointIncompatible, CheckpointTooLarge, CheckpointWriteError
from .container import DEFAULT_MAX_BYTES, _identity_mismatch, _open_regular, memory_file, replace_file
from .errors import os_failure
from .identity import IdentityInputs
from .segments import (
    DraftRows,
    SaveFileReply,
    SegmentHeader,
    SegmentRef,
    byte_view,
    host_layer_rows,
    layer_import_range,
    plan_segment,
    read_draft_layers,
    read_payload_into,
    read_segment_header,
    write_segment,
)
from .state import CPUCheckpoint, LayerState, numpy_storage_dtype, retained_from

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "write_checkpoint_segment",
    "assemble_checkpoint",
    "draft_state",
    "checkpoint_to_memory",
    "checkpoint_from_memory",
]


def save_checkpoint(checkpoint: CPUCheckpoint, path: str | os.PathLike, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
    """Atomically write ``checkpoint`` to ``path`` as one segment (temp file, fsync, rename,
    directory fsync).

    Raises :class:`CheckpointTooLarge` before writing anything when its payloads exceed
    ``max_bytes``; :class:`CheckpointUnsafePath` when ``path`` is a symlink or non-regular file. On
    any failure the previous file at ``path``, if any, is left as it was.
    """
    if not isinstance(checkpoint, CPUCheckpoint):
        raise InvalidArgument(f"expected a CPUCheckpoint, got {type(checkpoint).__name__}")
    checkpoint.validate()
    if checkpoint.nbytes > max_bytes:
        raise CheckpointTooLarge(f"checkpoint holds {checkpoint.nbytes} payload bytes, over the limit of {max_bytes}")
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    plan = plan_segment(**_segment_fields("", checkpoint))
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise os_failure(CheckpointWriteError, e, f"cannot save {path!r}: its directory cannot be opened") from None
    try:
        replace_file(dir_fd, name, plan.buffers, temp_prefix=name, display=path)
    finally:
        os.close(dir_fd)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    expected_identity: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    expected_inputs: IdentityInputs | None = None,
) -> CPUCheckpoint:
    """Read and verify a checkpoint file into host memory (numpy only; no device state).

    Raises :class:`CheckpointNotFound`, :class:`CheckpointUnsafePath`, :class:`CheckpointCorrupt`,
    :class:`CheckpointTooLarge`, :class:`CheckpointReadError`, or :class:`CheckpointIncompatible`
    (another file version, or an identity other than ``expected_identity`` when one is given). A
    file of version 1 or 2 names the ``migrate`` command that converts it.
    """
    path = os.fspath(path)
    fd, _ = _open_regular(path, None)
    try:
        header = read_segment_header(fd, path, max_bytes=max_bytes)
        found = header.identity or None
        if expected_identity is not None and found != expected_identity:
            raise CheckpointIncompatible(
                _identity_mismatch(path, found, expected_identity, None, expected_inputs, "expected")
            )
        if header.start != 0:
            raise CheckpointIncompatible(f"{path!r} is a segment from position {header.start}, not a whole checkpoint")
        return assemble_checkpoint([(fd, header, path)])
    finally:
        os.close(fd)


def _segment_fields(session_id: str, checkpoint: CPUCheckpoint) -> dict[str, Any]:
    """What :func:`plan_segment` takes to write ``checkpoint`` whole (validated first: a checkpoint
    changed since it was made is refused with :class:`CheckpointMalformed`)."""
    if not isinstance(checkpoint, CPUCheckpoint):
        raise InvalidArgument(f"expected a CPUCheckpoint, got {type(checkpoint).__name__}")
    checkpoint.validate()
    draft = None
    if checkpoint.draft is not None:
        at = checkpoint.draft_position
        assert at is not None
        draft = DraftRows(checkpoint.draft["geometry"], at, host_layer_rows(checkpoint.draft["layers"]))
    return {
        "session_id": session_id,
        "identity": checkpoint.identity or "",
        "format": checkpoint.format,
        "geometry": checkpoint.geometry,
        "start": 0,
        "token_ids": checkpoint.token_ids,
        "layers": host_layer_rows(checkpoint.layers),
        "draft": draft,
    }


def write_checkpoint_segment(fd: int, session_id: str, identity: str, checkpoint: CPUCheckpoint) -> SaveFileReply:
    """Write a host checkpoint whole, as one segment from position 0 under ``identity``, into the
    empty file ``fd``; return what a worker's ``save_file`` reply says of it, for the store's
    commit. Draft-model state goes with it."""
    fields = _segment_fields(session_id, checkpoint)
    fields["identity"] = identity
    length, head_crc = write_segment(fd, **fields)
    stored = checkpoint.nbytes - (checkpoint.draft["pending_token_ids"].nbytes if checkpoint.draft else 0)
    return SaveFileReply(0, checkpoint.position, length, head_crc, stored, checkpoint.format, checkpoint.geometry)


def draft_state(layers: list[LayerState], geometry: dict, position: int, tokens: np.ndarray) -> dict[str, Any]:
    """A :class:`CPUCheckpoint`'s ``draft``: the draft's rows up to ``position``, and the committed
    tokens after that which it has not been fed (``pending_token_ids``)."""
    return {"geometry": geometry, "layers": layers, "pending_token_ids": np.array(tokens[position:], dtype=np.int32)}


def assemble_checkpoint(segments: Sequence[tuple[int, SegmentHeader, str]]) -> CPUCheckpoint:
    """A session as a :class:`CPUCheckpoint` (owned memory, ``[rows, KV, D]`` rows), from its open,
    verified, chained segments ``(fd, header, path)`` (:func:`check_chain`); every payload's CRC is
    checked on read. The last segment's draft-model state, if any, is the checkpoint's."""
    headers = [h for _, h, _ in segments]
    last = headers[-1]
    position, fmt, geometry = last.end, last.format, last.geometry
    storage = numpy_storage_dtype(fmt["dtype"])
    kv, d = geometry["num_kv_heads"], geometry["head_dim"]
    tokens = np.empty(position, dtype=np.int32)
    for fd, h, path in segments:
        read_payload_into(fd, h, 0, [byte_view(tokens[h.start : h.end])], path)
    layers = []
    for i, window in enumerate(geometry["windows"]):
        keep = retained_from(window, position)
        lo = layer_import_range(headers, i, keep, position)
        parts = []
        for part in (0, 1):
            out = np.empty((position - lo, kv, d), dtype=storage)
            for fd, h, path in segments:
                seg_lo, rows = h.layers[i]
                block = np.empty((kv, rows, d), dtype=storage)
                read_payload_into(fd, h, h.payload_index(i, part), [byte_view(block)], path)
                a, b = max(seg_lo, lo), h.end
                if a < b:
                    out[a - lo : b - lo] = block[:, a - seg_lo : b - seg_lo].transpose(1, 0, 2)
            parts.append(out)
        layers.append(LayerState(lo, parts[0], parts[1]))
    draft = None
    if last.draft is not None:
        fd, _, path = segments[-1]
        draft_layers = read_draft_layers(fd, last, path)
        draft = draft_state(draft_layers, last.draft.geometry, last.draft.position, tokens)
    return CPUCheckpoint(
        format=fmt,
        geometry=geometry,
        position=position,
        token_ids=tokens,
        layers=layers,
        draft=draft,
        identity=last.identity or None,
    )


def checkpoint_to_memory(
    session_id: str, checkpoint: CPUCheckpoint, position: int | None = None
) -> tuple[int, SegmentRef]:
    """``checkpoint`` (cut back to ``position`` when given) as one segment of ``session_id`` in a
    new memory file, under the checkpoint's own identity: the open file (the caller closes it) and
    the ref a ``restore_file`` names it by. How a host checkpoint travels to a worker."""
    if not isinstance(checkpoint, CPUCheckpoint):
        raise InvalidArgument(f"expected a CPUCheckpoint, got {type(checkpoint).__name__}")
    if position is not None:
        checkpoint = checkpoint.truncated(position)
    fd = memory_file("checkpoint")
    try:
        written = write_checkpoint_segment(fd, session_id, checkpoint.identity or "", checkpoint)
    except BaseException:
        os.close(fd)
        raise
    return fd, SegmentRef("checkpoint", 0, written.position, written.file_length, written.header_crc)


def checkpoint_from_memory(fd: int, written: SaveFileReply, session_id: str) -> CPUCheckpoint:
    """The host checkpoint a worker's save wrote into the memory file ``fd`` (``written``: its
    reply), with every check a load makes. How a host checkpoint comes back from a worker."""
    name = f"the export of session {session_id!r}"
    ref = SegmentRef("export", 0, written.position, written.file_length, written.header_crc)
    return assemble_checkpoint([(fd, read_segment_header(fd, name, ref), name)])
