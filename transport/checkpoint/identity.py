"""Checkpoint identity: the SHA-256 that binds a checkpoint to model files and settings.

An application computes it once from the worker's model files and the activation-affecting
configuration (backend, dtype, RoPE, draft settings, ...) and passes it to exports and to the
session store; a file saved under one identity does not load under another. The
:class:`IdentityInputs` it was computed from are kept beside it so that a mismatch can say which
file or setting differs. Blocking I/O (it reads every model file): call it from a thread in async code.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from muxworker.native import crc32c
from muxworker.transport.errors import InvalidArgument

__all__ = ["ModelFileFingerprint", "IdentityInputs", "checkpoint_identity", "checkpoint_identity_inputs"]


@dataclass(frozen=True)
class ModelFileFingerprint:
    """One model file as an identity saw it: its base name (paths do not count), size and CRC32C."""

    name: str
    size: int
    crc32c: int


@dataclass(frozen=True)
class IdentityInputs:
    """What a checkpoint identity was computed from, kept so that a mismatch can say what differs.

    The identity (a SHA-256) decides compatibility; these only explain a mismatch, so a CRC32C per
    file is enough and costs nearly nothing next to the hash.
    """

    files: tuple[ModelFileFingerprint, ...]
    configuration: dict[str, Any]  # canonical JSON data (what the identity hashed)

    def to_wire(self) -> dict[str, Any]:
        return {
            "files": [{"name": f.name, "size": f.size, "crc32c": f.crc32c} for f in self.files],
            "configuration": self.configuration,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> IdentityInputs:
        """Parse :meth:`to_wire`'s map; ``ValueError`` if it has another shape."""
        if type(obj) is not dict or obj.keys() != {"files", "configuration"}:
            raise ValueError("identity_inputs must be a map of files and configuration")
        files, configuration = obj["files"], obj["configuration"]
        if type(files) is not list or type(configuration) is not dict:
            raise ValueError("identity_inputs.files must be a list and .configuration a map")
        out = []
        for f in files:
            if (
                type(f) is not dict
                or f.keys() != {"name", "size", "crc32c"}
                or type(f["name"]) is not str
                or type(f["size"]) is not int
                or type(f["crc32c"]) is not int
            ):
                raise ValueError("identity_inputs.files entries must be {name, size, crc32c}")
            out.append(ModelFileFingerprint(f["name"], f["size"], f["crc32c"]))
        return cls(tuple(out), configuration)

    def differences(self, other: IdentityInputs, mine: str, theirs: str) -> list[str]:
        """One line per differing input, e.g. ``dtype: store float32, file bfloat16``."""
        out = []
        for key in sorted(self.configuration.keys() | other.configuration.keys()):
            a, b = self.configuration.get(key, _UNSET), other.configuration.get(key, _UNSET)
            if a != b:
                out.append(f"{key}: {mine} {_show(a)}, {theirs} {_show(b)}")
        if len(self.files) != len(other.files):
            out.append(
                f"model files: {mine} {len(self.files)} ({', '.join(f.name for f in self.files)}), "
                f"{theirs} {len(other.files)} ({', '.join(f.name for f in other.files)})"
            )
        for i, (a, b) in enumerate(zip(self.files, other.files)):
            if (a.size, a.crc32c) != (b.size, b.crc32c):
                name = a.name if a.name == b.name else f"{a.name} / {b.name}"
                out.append(
                    f"model file {i + 1} ({name}): {mine} {a.size} bytes, crc32c {a.crc32c:08x}; "
                    f"{theirs} {b.size} bytes, crc32c {b.crc32c:08x}"
                )
        return out


_UNSET = object()


def _show(value: Any) -> str:
    """A configuration value as a person writes it: strings bare, the rest as JSON."""
    if value is _UNSET:
        return "(not set)"
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def checkpoint_identity(model_files: Iterable[str | os.PathLike], configuration: dict) -> str:
    """SHA-256 hex digest binding checkpoints to model artifacts and activation-affecting settings.

    Hashes each file's length and bytes, in the given order (so boundaries and order count; paths do
    not), then the canonical JSON of ``configuration`` (backend, dtype, RoPE, draft settings, ...).
    Blocking I/O: call it from a worker thread in async code.
    """
    return checkpoint_identity_inputs(model_files, configuration)[0]


def checkpoint_identity_inputs(
    model_files: Iterable[str | os.PathLike], configuration: dict
) -> tuple[str, IdentityInputs]:
    """:func:`checkpoint_identity` and the :class:`IdentityInputs` it was computed from, in one pass."""
    if isinstance(model_files, (str, bytes, os.PathLike)):
        raise InvalidArgument("model_files must be a list of paths, not a single path")
    if not isinstance(configuration, dict):
        raise InvalidArgument(f"configuration must be a dict, got {type(configuration).__name__}")
    try:
        files = list(model_files)
    except TypeError:
        raise InvalidArgument(f"model_files must be a list of paths, got {type(model_files).__name__}") from None
    try:
        config = json.dumps(
            configuration, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        ).encode("ascii")
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"configuration must be plain JSON data (no NaN or infinity): {e}") from None
    h = hashlib.sha256()
    h.update(b"muxworker-checkpoint-identity-v1\0")
    h.update(struct.pack("<Q", len(files)))
    buf = bytearray(2**20)
    view = memoryview(buf)
    fingerprints = []
    for path in files:
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidArgument(f"model_files must hold paths, got {type(path).__name__} {path!r}")
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                h.update(b"\0file\0" + struct.pack("<Q", size))
                seen = crc = 0
                while n := f.readinto(buf):
                    h.update(view[:n])
                    crc = crc32c(view[:n], crc)
                    seen += n
        except OSError as e:
            raise InvalidArgument(f"model file {os.fspath(path)!r} cannot be read: {e.strerror or e}") from None
        if seen != size:
            raise InvalidArgument(f"model file {os.fspath(path)!r} changed size while it was being hashed")
        fingerprints.append(ModelFileFingerprint(os.path.basename(os.fspath(path)), size, crc))
    h.update(b"\0configuration\0" + struct.pack("<Q", len(config)) + config)
    return h.hexdigest(), IdentityInputs(tuple(fingerprints), json.loads(config))
