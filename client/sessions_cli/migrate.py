"""``python -m muxworker.sessions DIR migrate``: convert checkpoint files of versions 1 and 2.

Versions 1 and 2 held a checkpoint in one file (a store's ``<hash>.mxckpt``, or a file of
``save_checkpoint``); version 3 holds a saved session as a manifest naming segments, and a single
checkpoint as one segment. This module is the only reader of the old files left: each one in DIR is
read and verified (every CRC), then written again as version 3, by the store (a session) or as one
segment (a standalone file), atomically, under the identity it was saved with. Files of version 3
are left alone, so running it twice converts nothing the second time.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from muxworker.client.stores import SessionStore
from muxworker.client.stores.binding import MANIFEST_NAME, session_hash
from muxworker.native import crc32c
from muxworker.transport.checkpoint import CheckpointCorrupt, CheckpointError, CPUCheckpoint, LayerState
from muxworker.transport.checkpoint.container import (
    _check_trailer,
    _open_regular,
    _payload_table,
    _read_exact,
    _read_manifest,
    file_version,
)
from muxworker.transport.checkpoint.errors import CheckpointMalformed
from muxworker.transport.checkpoint.file import save_checkpoint
from muxworker.transport.checkpoint.identity import IdentityInputs
from muxworker.transport.checkpoint.state import _PAYLOAD_DTYPES

__all__ = ["MigrateResult", "migrate"]

_KEYS_V1 = {"session_id", "checkpoint", "payloads", "file_length"}
_VERSIONS = {1: _KEYS_V1, 2: _KEYS_V1 | {"identity_inputs"}}
_CHECKPOINT_KEYS = {"version", "format", "geometry", "position", "identity", "token_ids", "layers", "draft"}


@dataclass
class MigrateResult:
    """What :func:`migrate` did: the files converted (name, session id or None for a standalone
    checkpoint) and the ones it could not convert (name, why), which it left as they were."""

    converted: list[tuple[str, str | None]] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)


def migrate(directory: str | os.PathLike) -> MigrateResult:
    """Convert every version 1 or 2 checkpoint file (``*.mxckpt``) in ``directory`` to version 3."""
    result = MigrateResult()
    root = Path(directory)
    for path in sorted(root.glob("*.mxckpt")):
        try:
            converted = _migrate_one(root, path)
        except (CheckpointError, OSError) as exc:
            result.failed.append((path.name, " ".join(str(exc).split())))
        else:
            if converted is not None:
                result.converted.append((path.name, converted[0]))
    return result


def _migrate_one(root: Path, path: Path) -> tuple[str | None] | None:
    fd, _ = _open_regular(str(path), None)
    try:
        if file_version(fd, str(path)) not in _VERSIONS:
            return None  # version 3 (or a newer one, which this build does not convert)
        session_id, checkpoint, inputs = read_legacy(fd, str(path))
    finally:
        os.close(fd)
    if session_id is None:
        save_checkpoint(checkpoint, path)  # atomically replaced by one segment
        return (None,)
    if not MANIFEST_NAME.fullmatch(path.name) or session_hash(session_id) + ".mxckpt" != path.name:
        raise CheckpointCorrupt(f"{path.name} holds session {session_id!r}, whose file has another name")
    if checkpoint.identity is None:
        raise CheckpointCorrupt(f"{path.name} records no model identity, so no store can bind it")
    store = SessionStore(root, identity=checkpoint.identity, inputs=inputs, block_tokens=0)
    store.save(session_id, checkpoint)  # the manifest replaces the old file under the same name
    return (session_id,)


def read_legacy(fd: int, path: str) -> tuple[str | None, CPUCheckpoint, IdentityInputs | None]:
    """(session id, checkpoint, identity inputs) of a verified version 1 or 2 file."""
    st = os.fstat(fd)
    manifest, head_crc, head_end = _read_manifest(fd, st, path, _VERSIONS)
    session_id = manifest["session_id"]
    if session_id is not None and not isinstance(session_id, str):
        raise CheckpointCorrupt(f"{path!r}: manifest session_id must be a string or nil")
    table = _payload_table(manifest, head_end, st.st_size, 1 << 62, path)
    _check_trailer(fd, st.st_size, head_crc, path)
    payloads = []
    for i, (offset, length, crc) in enumerate(table):
        buffer = bytearray(length)
        _read_exact(fd, memoryview(buffer), offset, path)
        if crc32c(buffer) != crc:
            raise CheckpointCorrupt(f"{path!r}: payload {i} checksum mismatch")
        payloads.append(buffer)
    try:
        checkpoint = _checkpoint(manifest["checkpoint"], payloads)
    except (CheckpointMalformed, KeyError, TypeError, ValueError) as e:
        raise CheckpointCorrupt(f"{path!r}: {e}") from None
    return session_id, checkpoint, manifest.get("identity_inputs")


def _checkpoint(wire: Any, payloads: Sequence[bytearray]) -> CPUCheckpoint:
    """The checkpoint of a version 1/2 manifest (payload refs ``{"payload", "dtype", "shape"}``).
    Malformed fields raise; :class:`CPUCheckpoint` validates the result."""
    if not isinstance(wire, dict) or wire.keys() != _CHECKPOINT_KEYS or wire["version"] != 1:
        raise CheckpointMalformed(f"the checkpoint map must have the fields {sorted(_CHECKPOINT_KEYS)}, version 1")
    used: set[int] = set()

    def array(ref: Any) -> np.ndarray:
        index, shape = ref["payload"], ref["shape"]
        dtype = _PAYLOAD_DTYPES[ref["dtype"]]
        if index in used or not isinstance(shape, list) or len(payloads[index]) != math.prod(shape) * dtype.itemsize:
            raise CheckpointMalformed(f"payload {index} is reused or does not hold {ref['dtype']} {shape}")
        used.add(index)
        return np.frombuffer(payloads[index], dtype=dtype).reshape(shape)

    def layers(raw: list) -> list[LayerState]:
        return [LayerState(int(e["start"]), array(e["keys"]), array(e["values"])) for e in raw]

    draft = None
    if wire["draft"] is not None:
        d = wire["draft"]
        draft = {"geometry": d["geometry"], "layers": layers(d["layers"])}
        draft.update({name: array(ref) for name, ref in d["arrays"].items()})
    checkpoint = CPUCheckpoint(
        format=wire["format"],
        geometry=wire["geometry"],
        position=wire["position"],
        token_ids=array(wire["token_ids"]),
        layers=layers(wire["layers"]),
        draft=draft,
        identity=wire["identity"],
    )
    if len(used) != len(payloads):
        raise CheckpointMalformed("some payloads are named by no array")
    return checkpoint
