"""The checkpoint file container, shared by session manifests, segments and blocks (file version 3).

The layout is documented byte by byte in docs/CHECKPOINT_FORMAT.md. In short::

    header   magic "MUXCKPT\\0" | u32 version | u32 manifest_len        16 bytes
    manifest msgpack map (payload table + what the file holds)          manifest_len bytes
    hcrc     u32 CRC32C of header + manifest                            4 bytes
    (zero padding to 4 KiB)
    payload i at its 4 KiB-aligned offset, each with its own CRC32C     (token ids, KV rows)
    trailer  magic "MUXEND\\0\\0" | u64 file length | u32 hcrc | u32 CRC32C of the 20 bytes before

Readers verify every checksum before using a byte, bound every size before allocating, and never
touch device state. Checksums detect corruption, not tampering: load only trusted files. Every
failure is a :class:`~..errors.CheckpointError` (never a raw OSError). Versions 1 and 2 (one file
per checkpoint) are read only by ``python -m muxworker.sessions DIR migrate``.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
import struct
from collections.abc import Sequence
from typing import Any

import msgpack

from muxworker.native import crc32c

from ..errors import (
    CheckpointCorrupt,
    CheckpointIncompatible,
    CheckpointNotFound,
    CheckpointReadError,
    CheckpointTooLarge,
    CheckpointUnsafePath,
    CheckpointWriteError,
)
from .errors import CheckpointMalformed, os_failure
from .identity import IdentityInputs
from .state import _MAX_LAYERS

__all__ = [
    "DEFAULT_MAX_BYTES",
    "FILE_VERSION",
    "MAX_PAYLOADS",
    "file_version",
    "memory_file",
    "replace_file",
    "fstat_regular",
]

#: Default bound on a checkpoint's payload bytes, on save and on load.
DEFAULT_MAX_BYTES = 16 * 2**30
#: The one file version written: session manifests, segments and blocks. Versions 1 and 2 (one
#: file per checkpoint) are converted by ``python -m muxworker.sessions DIR migrate``.
FILE_VERSION = 3
MAGIC = b"MUXCKPT\0"
TRAILER_MAGIC = b"MUXEND\0\0"
ALIGN = 4096
MAX_MANIFEST = 16 * 2**20
MAX_DEPTH = 16
#: Most payloads one file may have: token ids, keys and values of every target and draft layer.
MAX_PAYLOADS = 4 * _MAX_LAYERS + 64
_HEADER = struct.Struct("<8sII")  # magic, version, manifest_len
_CRC = struct.Struct("<I")
_TRAILER = struct.Struct("<8sQII")  # magic, file length, header crc, crc of the 20 bytes before
_ZEROS = bytes(ALIGN)
MIGRATE_HINT = "convert it with `python -m muxworker.sessions DIR migrate`"


# ----------------------------------------------------------------------------------------------
# Writer (shared with SessionStore)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def memory_file(name: str) -> int:
    """A new, empty file in memory, open for reading and writing (close it when done): a memfd on
    Linux, else an unlinked temporary file. A checkpoint in host memory travels to and from a worker
    as one of these, over the file channel like any saved segment."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, os.MFD_CLOEXEC)
    import tempfile

    with tempfile.TemporaryFile(prefix=f"muxworker-{name}-") as f:
        return os.dup(f.fileno())


def _write_all(fd: int, buffers: Sequence[memoryview | bytes]) -> None:
    """writev every buffer completely (writev may write less than asked)."""
    pending = [memoryview(b) for b in buffers if len(b)]
    while pending:
        _advance(pending, os.writev(fd, pending[:512]))


def _advance(pending: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of a list of views (what a short gather read or write moved)."""
    while n:
        if n >= pending[0].nbytes:
            n -= pending.pop(0).nbytes
        else:
            pending[0] = pending[0][n:]
            n = 0


def _check_regular_or_absent(name: str, dir_fd: int | None) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointUnsafePath(f"{name!r} exists and is not a regular file; refusing to replace it")


def replace_file(
    dir_fd: int, name: str, buffers: Sequence[memoryview | bytes], *, temp_prefix: str, display: str | None = None
) -> None:
    """Atomically replace ``name`` in ``dir_fd`` with the concatenation of ``buffers``.

    Writes ``.<temp_prefix>.<random>.tmp`` (O_EXCL, O_NOFOLLOW, mode 0600), fsyncs it, renames it
    over ``name`` and fsyncs the directory. On failure the temp file is removed when possible and
    the previous ``name`` is untouched; a failure of the system raises :class:`CheckpointWriteError`.
    """
    what = f"cannot save {display or name!r}"
    keep = "; the previous file, if any, is unchanged"
    step = "checking the target"
    try:
        _check_regular_or_absent(name, dir_fd)
        temp = f".{temp_prefix}.{secrets.token_hex(8)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        step = "creating its temporary file"
        fd = os.open(temp, flags, 0o600, dir_fd=dir_fd)
    except OSError as e:
        raise os_failure(CheckpointWriteError, e, f"{what} ({step})", after=keep) from None
    try:
        try:
            step = "writing"
            _write_all(fd, buffers)
            step = "flushing it to disk"
            os.fsync(fd)
        finally:
            os.close(fd)
        step = "checking the target"
        _check_regular_or_absent(name, dir_fd)
        step = "renaming it over the previous file"
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as exc:
        try:
            os.unlink(temp, dir_fd=dir_fd)
        except OSError:
            pass  # e.g. the file system went read-only; a stray .tmp is documented and harmless
        if isinstance(exc, OSError):
            raise os_failure(CheckpointWriteError, exc, f"{what} ({step})", after=keep) from None
        raise
    try:
        os.fsync(dir_fd)
    except OSError as e:
        raise os_failure(
            CheckpointWriteError,
            e,
            f"{what} (flushing the directory)",
            after="; the new file replaced the previous one but may not survive a crash",
        ) from None


# ----------------------------------------------------------------------------------------------
# Reader (shared with SessionStore)


def _open_regular(path: str, dir_fd: int | None) -> tuple[int, os.stat_result]:
    # O_NONBLOCK so that opening a FIFO returns at once (and is then rejected) instead of hanging.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise CheckpointNotFound(f"no checkpoint file at {path!r}") from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK, errno.ENXIO, errno.EOPNOTSUPP):
            raise CheckpointUnsafePath(f"{path!r} is a symlink or not a regular file") from None
        raise os_failure(CheckpointReadError, e, f"cannot open {path!r}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointUnsafePath(f"{path!r} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def fstat_regular(fd: int, path: str) -> os.stat_result:
    """``fstat`` of an open file that must be a regular one (a passed fd is checked like a path)."""
    try:
        st = os.fstat(fd)
    except OSError as e:
        raise os_failure(CheckpointReadError, e, f"cannot stat {path!r}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointUnsafePath(f"{path!r} is not a regular file")
    return st


def _read_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < view.nbytes:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise os_failure(CheckpointReadError, e, f"cannot read byte {offset + done} of {path!r}") from None
        if n == 0:
            raise CheckpointCorrupt(f"{path!r} ends early at byte {offset + done}")
        done += n


def _check_depth(obj: Any, depth: int = 1) -> None:
    """Reject maps/arrays nested deeper than MAX_DEPTH (the recursion stops there too)."""
    if depth > MAX_DEPTH:
        raise CheckpointCorrupt(f"manifest nests deeper than {MAX_DEPTH} levels")
    for value in obj.values() if type(obj) is dict else obj:
        if type(value) is dict or type(value) is list:  # msgpack yields exactly these types
            _check_depth(value, depth + 1)


def _read_manifest(
    fd: int, st: os.stat_result, path: str, versions: dict[int, set[str]], optional: frozenset[str] = frozenset()
) -> tuple[dict, int, int]:
    """Verified file manifest, the header CRC and where the header block ends. Reads at most 16 MiB,
    whatever the file says. ``versions``: the readable file versions and each one's manifest fields;
    ``optional``: fields a manifest may also have."""
    size = st.st_size
    if size < _HEADER.size:
        raise CheckpointCorrupt(f"{path!r} is {size} bytes, too short for a checkpoint header")
    header = bytearray(_HEADER.size)
    _read_exact(fd, memoryview(header), 0, path)
    magic, version, manifest_len = _HEADER.unpack(header)
    if magic != MAGIC:
        raise CheckpointCorrupt(f"{path!r} is not a muxworker checkpoint (bad magic)")
    if manifest_len > MAX_MANIFEST or _HEADER.size + manifest_len + _CRC.size > size:
        raise CheckpointCorrupt(
            f"{path!r} declares a {manifest_len}-byte manifest that does not fit the file "
            f"({size} bytes) or the {MAX_MANIFEST}-byte bound"
        )
    block = bytearray(manifest_len + _CRC.size)
    _read_exact(fd, memoryview(block), _HEADER.size, path)
    (stored,) = _CRC.unpack_from(block, manifest_len)
    head_crc = crc32c(memoryview(block)[:manifest_len], crc32c(header))
    if stored != head_crc:
        raise CheckpointCorrupt(f"{path!r}: header/manifest checksum mismatch")
    # Checked after the CRC so that a damaged version field reads as corruption, a real newer
    # file as an incompatible one.
    if version not in versions:
        hint = f"; {MIGRATE_HINT}" if version in (1, 2) else ""
        raise CheckpointIncompatible(
            f"{path!r} is checkpoint file version {version}; this build reads versions "
            f"{', '.join(map(str, versions))} here{hint}"
        )
    try:
        manifest = msgpack.unpackb(memoryview(block)[:manifest_len], raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several types for damaged input
        raise CheckpointCorrupt(f"{path!r}: manifest is not valid msgpack ({e})") from None
    keys = versions[version]
    if not isinstance(manifest, dict):
        raise CheckpointCorrupt(f"{path!r}: manifest must be a map with fields {sorted(keys)}")
    _check_depth(manifest)
    if not keys <= manifest.keys() <= keys | optional:
        raise CheckpointCorrupt(f"{path!r}: manifest must be a map with fields {sorted(keys)}")
    inputs = manifest.get("identity_inputs")  # session manifests (and version 2 files)
    if inputs is not None:
        try:
            manifest["identity_inputs"] = IdentityInputs.from_wire(inputs)
        except ValueError as e:
            raise CheckpointCorrupt(f"{path!r}: {e}") from None
    return manifest, head_crc, _HEADER.size + manifest_len + _CRC.size


def _payload_table(manifest: dict, head_end: int, size: int, max_bytes: int, path: str) -> list[tuple[int, int, int]]:
    """(offset, length, crc) of every payload after checking layout, file size and max_bytes."""
    table = manifest["payloads"]
    file_length = manifest["file_length"]
    if not isinstance(table, list) or not 1 <= len(table) <= MAX_PAYLOADS:
        raise CheckpointCorrupt(f"{path!r}: payload table must list 1 to {MAX_PAYLOADS} payloads")
    out = []
    cursor = _align(head_end)
    for i, entry in enumerate(table):
        if not isinstance(entry, dict) or entry.keys() != {"offset", "length", "crc32c"}:
            raise CheckpointCorrupt(f"{path!r}: payload {i} entry is malformed")
        offset, length, crc = entry["offset"], entry["length"], entry["crc32c"]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (offset, length, crc)):
            raise CheckpointCorrupt(f"{path!r}: payload {i} entry has non-integer fields")
        if offset != cursor or length < 0 or not 0 <= crc <= 0xFFFFFFFF:
            raise CheckpointCorrupt(f"{path!r}: payload {i} is not at its aligned offset {cursor}")
        out.append((offset, length, crc))
        cursor = _align(offset + length)
    total = sum(length for _, length, _ in out)
    if total > max_bytes:
        raise CheckpointTooLarge(f"{path!r} holds {total} payload bytes, over the limit of {max_bytes}")
    expected_length = out[-1][0] + out[-1][1] + _TRAILER.size
    if file_length != expected_length:
        raise CheckpointCorrupt(f"{path!r}: manifest file_length disagrees with its payload table")
    if size != file_length:
        raise CheckpointCorrupt(f"{path!r} is {size} bytes but its manifest says {file_length}: truncated or extended")
    return out


def _identity_mismatch(
    path: str,
    found: Any,
    expected: str,
    found_inputs: IdentityInputs | None,
    expected_inputs: IdentityInputs | None,
    label: str,
) -> str:
    """Say what differs when the inputs of both sides are known; otherwise what is known."""
    head = f"{path!r} was saved for another model or configuration"
    if found is None:
        return f"{path!r} was saved without a model/configuration identity; {label} {expected!r}"
    if found_inputs is not None and expected_inputs is not None:
        differences = found_inputs.differences(expected_inputs, "file", label)
        if differences:
            return f"{head}: " + "; ".join(differences)
    if found_inputs is not None:
        files = ", ".join(f"{f.name} ({f.size} bytes)" for f in found_inputs.files)
        return (
            f"{head}: the file's configuration is {json.dumps(found_inputs.configuration, sort_keys=True)} "
            f"with model files {files or '(none)'} (identity {found!r}, {label} {expected!r})"
        )
    # A store that was not given the inputs records only the digest.
    return f"{head}: identity {found!r}, {label} {expected!r} (the file does not record what it was made from)"


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
    head = _HEADER.pack(MAGIC, FILE_VERSION, len(manifest)) + manifest
    head_crc = crc32c(head)
    return head + _CRC.pack(head_crc), head_crc


def _trailer(file_length: int, head_crc: int) -> bytes:
    trailer = _TRAILER.pack(TRAILER_MAGIC, file_length, head_crc, 0)[: -_CRC.size]
    return trailer + _CRC.pack(crc32c(trailer))
