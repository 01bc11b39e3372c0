"""Checkpoint identity: the SHA-256 that binds a checkpoint to model files and settings.

An application computes it once from the worker's model files and the activation-affecting
configuration (backend, dtype, RoPE, draft settings, ...) and passes it to exports and to the
session store; a file saved under one identity does not load under another. The
:class:`IdentityInputs` it was computed from are kept beside it so that a mismatch can say which
file or setting differs. Blocking I/O (it may read every model file): call it from a thread in async code.

Owner of the digest cache: each model file's SHA-256 and CRC32C are remembered, keyed by the
``(st_dev, st_ino, st_size, st_mtime_ns)`` of an fstat of the open file, so that a start with
unchanged weights reads no weight bytes. Two levels: an in-process memo (one lock; any thread may
call) and a small JSON file that later processes read (``model-digests.json`` in
:func:`~muxworker.transport.cache_dir.cache_root`, or ``$MUXWORKER_DIGEST_CACHE``; "off" disables
it). The file is only ever replaced whole (temp file + ``os.replace``; of concurrent writers the
last one wins), holds the 256 most recently used entries, and a missing, unreadable or corrupt one
is ignored and rewritten, never an error. A file modified in place without changing its size or
``mtime_ns`` (written, then touched back) is not re-hashed: the trade-off make and rsync make; a
file written in the last few seconds is not cached at all (``_SETTLE_NS``).
docs/CHECKPOINT_FORMAT.md, "Model identity", says where the file is and how to clear it.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import io
import json
import os
import re
import stat
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from muxworker.native import crc32c
from muxworker.transport.cache_dir import cache_root
from muxworker.transport.errors import InvalidArgument

__all__ = [
    "DIGEST_CACHE_ENV",
    "ModelFileFingerprint",
    "IdentityInputs",
    "checkpoint_identity",
    "checkpoint_identity_inputs",
    "default_digest_cache",
]


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


# -- the identity ------------------------------------------------------------------------------

_IDENTITY_TAG = b"muxworker-checkpoint-identity-v2\0"


class _Default(enum.Enum):
    """The type of ``digest_cache``'s default: $MUXWORKER_DIGEST_CACHE, else the cache directory's file."""

    DEFAULT = "default"


def checkpoint_identity(
    model_files: Iterable[str | os.PathLike[str]],
    configuration: dict,
    *,
    digest_cache: str | os.PathLike[str] | None | _Default = _Default.DEFAULT,
) -> str:
    """SHA-256 hex digest binding checkpoints to model artifacts and activation-affecting settings.

    Identity version 2: SHA-256 over ``b"muxworker-checkpoint-identity-v2\\0"``, the file count
    (u64 LE), then per file, in the given order, its size (u64 LE) and the 32 raw bytes of its own
    SHA-256 (so boundaries and order count; paths do not), then ``b"\\0configuration\\0"``, the
    length (u64 LE) and bytes of the canonical JSON of ``configuration`` (backend, dtype, RoPE,
    draft settings, ...).

    The per-file digests come from the digest cache when a file's device, inode, size and mtime_ns
    are unchanged (see the module docstring). ``digest_cache`` is the cache file's path; ``None``
    keeps only the in-process memo; by default it is :func:`default_digest_cache`.
    Blocking I/O: call it from a worker thread in async code.
    """
    return checkpoint_identity_inputs(model_files, configuration, digest_cache=digest_cache)[0]


def checkpoint_identity_inputs(
    model_files: Iterable[str | os.PathLike[str]],
    configuration: dict,
    *,
    digest_cache: str | os.PathLike[str] | None | _Default = _Default.DEFAULT,
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
    for path in files:
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidArgument(f"model_files must hold paths, got {type(path).__name__} {path!r}")
    try:
        config = json.dumps(
            configuration, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        ).encode("ascii")
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"configuration must be plain JSON data (no NaN or infinity): {e}") from None
    if digest_cache is _Default.DEFAULT:
        cache_file = default_digest_cache()
    elif digest_cache is None or isinstance(digest_cache, (str, os.PathLike)):
        cache_file = None if digest_cache is None else Path(digest_cache)
    else:
        raise InvalidArgument(f"digest_cache must be a path or None, got {type(digest_cache).__name__}")

    lookup = _DigestLookup(cache_file)
    h = hashlib.sha256()
    h.update(_IDENTITY_TAG)
    h.update(struct.pack("<Q", len(files)))
    fingerprints = []
    try:
        for path in files:
            size, digest = lookup.digest(path)
            h.update(struct.pack("<Q", size) + digest.sha256)
            fingerprints.append(ModelFileFingerprint(os.path.basename(os.fspath(path)), size, digest.crc32c))
    finally:
        lookup.write_back()  # what was learned is kept even when a later file fails
    h.update(b"\0configuration\0" + struct.pack("<Q", len(config)) + config)
    return h.hexdigest(), IdentityInputs(tuple(fingerprints), json.loads(config))


# -- the digest cache --------------------------------------------------------------------------

DIGEST_CACHE_ENV = "MUXWORKER_DIGEST_CACHE"
_CACHE_FILE_NAME = "model-digests.json"
_CACHE_FORMAT = "muxworker-model-digests"
_CACHE_VERSION = 1
_MAX_ENTRIES = 256  # the most recently used stay; a model has a few dozen files at most
_MAX_CACHE_FILE_BYTES = 1 << 20  # 256 entries take about 40 KiB; a larger file is not ours
# A file whose mtime is this recent when its hash finishes is not cached: a filesystem's clock
# ticks coarsely (1 s on ext3 and HFS+, 2 s on FAT, a scheduler tick on Linux), so a second write
# within the same tick could leave size and mtime_ns as they were (git's "racily clean" problem).
# Model files are old by the time a server starts; a file written just now is simply hashed again.
_SETTLE_NS = 3_000_000_000
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20


def default_digest_cache() -> Path | None:
    """The digest cache file: $MUXWORKER_DIGEST_CACHE ("off" for none), else
    ``cache_root() / "model-digests.json"``."""
    env = os.environ.get(DIGEST_CACHE_ENV)
    if env == "off":
        return None
    if env:
        return Path(env).expanduser()
    return cache_root() / _CACHE_FILE_NAME


class _Key(NamedTuple):
    """What must be unchanged for a cached digest to stand for a file's bytes."""

    dev: int
    ino: int
    size: int
    mtime_ns: int


class _Digest(NamedTuple):
    sha256: bytes  # 32 raw bytes
    crc32c: int


class _Memo:
    """The in-process digests, least recently used first. Every method takes the lock: identities
    are computed from trio worker threads, possibly several at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[_Key, _Digest] = OrderedDict()

    def get(self, key: _Key) -> _Digest | None:
        with self._lock:
            digest = self._entries.get(key)
            if digest is not None:
                self._entries.move_to_end(key)
            return digest

    def put(self, key: _Key, digest: _Digest) -> None:
        with self._lock:
            self._entries[key] = digest
            self._entries.move_to_end(key)
            while len(self._entries) > _MAX_ENTRIES:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_memo = _Memo()


class _DigestLookup:
    """One identity computation's view of the cache: the memo first, then the cache file (read
    once, only if the memo misses), then the file's bytes. A call that finds every file in the memo
    touches no cache file; otherwise :meth:`write_back` records all the files it used as the most
    recently used entries."""

    def __init__(self, cache_file: Path | None) -> None:
        self._cache_file = cache_file
        self._on_disk: dict[_Key, _Digest] | None = None  # read on the first memo miss
        self._used: dict[_Key, _Digest] = {}  # this call's cacheable files, in order of use
        self._missed = False

    def digest(self, path: str | os.PathLike[str]) -> tuple[int, _Digest]:
        """``(size, digest)`` of one model file; :class:`InvalidArgument` if it cannot be read or
        changes while it is read."""
        name = os.fspath(path)
        try:
            with open(path, "rb", buffering=0) as f:
                before = os.fstat(f.fileno())
                key = _Key(before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns)
                cacheable = stat.S_ISREG(before.st_mode)  # never a FIFO or a device
                if cacheable and (known := self._known(key)) is not None:
                    self._used[key] = known
                    return key.size, known
                digest, seen = _hash_open_file(f)
                after = os.fstat(f.fileno())
        except OSError as e:
            raise InvalidArgument(f"model file {name!r} cannot be read: {e.strerror or e}") from None
        if seen != before.st_size or (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise InvalidArgument(f"model file {name!r} changed while it was being hashed")
        if cacheable and time.time_ns() - before.st_mtime_ns >= _SETTLE_NS:
            _memo.put(key, digest)
            self._used[key] = digest
        return key.size, digest

    def _known(self, key: _Key) -> _Digest | None:
        if (digest := _memo.get(key)) is not None:
            return digest
        self._missed = True
        if self._cache_file is None:
            return None
        if self._on_disk is None:
            self._on_disk = _read_cache_file(self._cache_file) or {}
        if (digest := self._on_disk.get(key)) is not None:
            _memo.put(key, digest)
        return digest

    def write_back(self) -> None:
        """Best effort: a cache that cannot be written is only a slower next start."""
        if self._cache_file is None or not self._missed or not self._used:
            return
        # Read again just before replacing it, so that entries a concurrent process wrote while
        # this one was hashing survive (a write between this read and the replace is lost: the
        # last writer wins, and the loser's files are hashed once more next time).
        current = _read_cache_file(self._cache_file)
        merged = OrderedDict(current or {})
        for key, digest in self._used.items():
            merged.pop(key, None)
            merged[key] = digest
        while len(merged) > _MAX_ENTRIES:
            merged.popitem(last=False)
        if current is not None and list(merged.items()) == list(current.items()):
            return  # already the newest entries, in this order
        _write_cache_file(self._cache_file, merged)


def _hash_open_file(f: io.FileIO) -> tuple[_Digest, int]:
    """SHA-256 and CRC32C of an open unbuffered file from its current offset, and the bytes read."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    seen = crc = 0
    while n := f.readinto(buf):
        h.update(view[:n])
        crc = crc32c(view[:n], crc)
        seen += n
    return _Digest(h.digest(), crc), seen


def _read_cache_file(path: Path) -> dict[_Key, _Digest] | None:
    """The cache file's entries, least recently used first; None if it is missing, unreadable or not
    exactly what :func:`_write_cache_file` writes (then the next write replaces it)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_CACHE_FILE_BYTES + 1)
        if len(raw) > _MAX_CACHE_FILE_BYTES:
            return None
        doc = json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return None
    if (
        type(doc) is not dict
        or doc.keys() != {"format", "version", "entries"}
        or doc["format"] != _CACHE_FORMAT
        or doc["version"] != _CACHE_VERSION
        or type(doc["entries"]) is not list
    ):
        return None
    out: dict[_Key, _Digest] = {}
    for entry in doc["entries"]:
        if type(entry) is not dict or entry.keys() != {*_Key._fields, "sha256", "crc32c"}:
            return None
        if any(type(entry[field]) is not int for field in (*_Key._fields, "crc32c")):
            return None
        # mtime_ns may be negative (a file dated before 1970); the rest may not.
        if min(entry["dev"], entry["ino"], entry["size"], entry["crc32c"]) < 0 or entry["crc32c"] >= 1 << 32:
            return None
        if type(entry["sha256"]) is not str or not _SHA256_HEX.fullmatch(entry["sha256"]):
            return None
        key = _Key(*(entry[field] for field in _Key._fields))
        out.pop(key, None)
        out[key] = _Digest(bytes.fromhex(entry["sha256"]), entry["crc32c"])
    return out


def _write_cache_file(path: Path, entries: dict[_Key, _Digest]) -> None:
    """Replace the cache file whole (temp file in the same directory, then ``os.replace``), so a
    reader sees the old file or the new one; failures are swallowed."""
    doc = {
        "format": _CACHE_FORMAT,
        "version": _CACHE_VERSION,
        "entries": [{**key._asdict(), "sha256": d.sha256.hex(), "crc32c": d.crc32c} for key, d in entries.items()],
    }
    data = json.dumps(doc, separators=(",", ":")).encode("ascii")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
