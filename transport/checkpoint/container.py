"""Checkpoint files: save and load one checkpoint (the session store builds on the same calls).

The file layout is documented byte by byte in docs/CHECKPOINT_FORMAT.md. In short::

    header   magic "MUXCKPT\\0" | u32 version | u32 manifest_len        16 bytes
    manifest msgpack map (payload table + the wire manifest)            manifest_len bytes
    hcrc     u32 CRC32C of header + manifest                            4 bytes
    (zero padding to 4 KiB)
    payload i at its 4 KiB-aligned offset, each with its own CRC32C     (token ids, KV rows, draft)
    trailer  magic "MUXEND\\0\\0" | u64 file length | u32 hcrc | u32 CRC32C of the 20 bytes before

Loading verifies every checksum before returning, bounds every size before allocating, and never
touches device state. Checksums detect corruption, not tampering: load only trusted files. Every
failure is a :class:`~.errors.CheckpointError` (never a raw OSError).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import secrets
import stat
import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from muxworker.native import crc32c
from muxworker.transport.errors import InvalidArgument

from ..errors import (
    CheckpointCorrupt,
    CheckpointIncompatible,
    CheckpointNotFound,
    CheckpointReadError,
    CheckpointTooLarge,
    CheckpointUnsafePath,
    CheckpointWriteError,
)
from .codec import MANIFEST_VERSION, MAX_PAYLOADS, checkpoint_from_wire, checkpoint_to_wire
from .errors import CheckpointMalformed, os_failure
from .identity import IdentityInputs
from .state import LAYOUT_VERSION, CPUCheckpoint

__all__ = [
    "DEFAULT_MAX_BYTES",
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint_file",
    "write_checkpoint_file",
]

#: Default bound on a checkpoint's payload bytes, on save and on load.
DEFAULT_MAX_BYTES = 16 * 2**30

MAGIC = b"MUXCKPT\0"
FILE_VERSION = 2  # 2 adds "identity_inputs" to the file manifest; version 1 files still load
TRAILER_MAGIC = b"MUXEND\0\0"
ALIGN = 4096
MAX_MANIFEST = 16 * 2**20
MAX_DEPTH = 16
_HEADER = struct.Struct("<8sII")  # magic, version, manifest_len
_CRC = struct.Struct("<I")
_TRAILER = struct.Struct("<8sQII")  # magic, file length, header crc, crc of the 20 bytes before
_ZEROS = bytes(ALIGN)
_FILE_KEYS_V1 = {"session_id", "checkpoint", "payloads", "file_length"}
_FILE_KEYS = {1: _FILE_KEYS_V1, 2: _FILE_KEYS_V1 | {"identity_inputs"}}


# ----------------------------------------------------------------------------------------------
# Public file API


def save_checkpoint(
    checkpoint: CPUCheckpoint,
    path: str | os.PathLike,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    identity_inputs: IdentityInputs | None = None,
) -> None:
    """Atomically write ``checkpoint`` to ``path`` (temp file, fsync, rename, directory fsync).

    ``identity_inputs`` (from :func:`checkpoint_identity_inputs`) are recorded in the file so that
    loading it under another identity can say which model file or setting differs.

    Raises :class:`CheckpointTooLarge` before writing anything when its payloads exceed
    ``max_bytes``; :class:`CheckpointUnsafePath` when ``path`` is a symlink or non-regular file. On
    any failure the previous file at ``path``, if any, is left as it was.
    """
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise os_failure(CheckpointWriteError, e, f"cannot save {path!r}: its directory cannot be opened") from None
    try:
        write_checkpoint_file(
            checkpoint,
            dir_fd,
            name,
            temp_prefix=name,
            session_id=None,
            max_bytes=max_bytes,
            display=path,
            identity_inputs=identity_inputs,
        )
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
    (another file version or layout, or an identity other than ``expected_identity`` when one is
    given; with ``expected_inputs`` the error names each model file and setting that differs).
    """
    _, checkpoint = read_checkpoint_file(
        os.fspath(path),
        expected_identity=expected_identity,
        max_bytes=max_bytes,
        expected_inputs=expected_inputs,
    )
    assert checkpoint is not None  # not manifest_only, so the payloads were read
    return checkpoint


# ----------------------------------------------------------------------------------------------
# Writer (shared with SessionStore)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _byte_view(array: np.ndarray) -> memoryview:
    view = array.data  # arrays written here are C-contiguous
    return view.cast("B") if view.nbytes else memoryview(b"")


def _encode(
    checkpoint: CPUCheckpoint, session_id: str | None, max_bytes: int, inputs: IdentityInputs | None
) -> tuple[bytes, list[tuple[int, memoryview]], bytes]:
    """Header block, (offset, bytes) of each payload, trailer. Nothing is copied but the manifest."""
    if not isinstance(checkpoint, CPUCheckpoint):
        raise InvalidArgument(f"expected a CPUCheckpoint, got {type(checkpoint).__name__}")
    wire, arrays = checkpoint_to_wire(checkpoint)  # validates
    views = [_byte_view(a) for a in arrays]
    total = sum(v.nbytes for v in views)
    if total > max_bytes:
        raise CheckpointTooLarge(f"checkpoint holds {total} payload bytes, over the limit of {max_bytes}")
    crcs = [crc32c(v) for v in views]
    # The manifest records the payload offsets, which depend on the manifest's length: grow the
    # header block in 4 KiB steps until the manifest fits in front of the first payload.
    base = ALIGN
    while True:
        offsets, end = [], base
        for v in views:
            offsets.append(end)
            end = _align(end + v.nbytes)
        data_end = offsets[-1] + views[-1].nbytes
        file_length = data_end + _TRAILER.size
        manifest = msgpack.packb(
            {
                "session_id": session_id,
                "checkpoint": wire,
                "payloads": [{"offset": o, "length": v.nbytes, "crc32c": c} for o, v, c in zip(offsets, views, crcs)],
                "file_length": file_length,
                "identity_inputs": None if inputs is None else inputs.to_wire(),
            },
            use_bin_type=True,
        )
        head_len = _HEADER.size + len(manifest) + _CRC.size
        if head_len <= base:
            break
        base = _align(head_len)
    if len(manifest) > MAX_MANIFEST:
        raise CheckpointTooLarge(f"checkpoint manifest is {len(manifest)} bytes, over {MAX_MANIFEST}")
    head = _HEADER.pack(MAGIC, FILE_VERSION, len(manifest)) + manifest
    head_crc = crc32c(head)
    head += _CRC.pack(head_crc)
    trailer = _TRAILER.pack(TRAILER_MAGIC, file_length, head_crc, 0)[: -_CRC.size]
    trailer += _CRC.pack(crc32c(trailer))
    return head, list(zip(offsets, views)), trailer


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


def write_checkpoint_file(
    checkpoint: CPUCheckpoint,
    dir_fd: int,
    name: str,
    *,
    temp_prefix: str,
    session_id: str | None,
    max_bytes: int,
    display: str | None = None,
    identity_inputs: IdentityInputs | None = None,
) -> None:
    """Atomically replace ``name`` in the directory ``dir_fd`` with a checkpoint file.

    Writes ``.<temp_prefix>.<random>.tmp`` (O_EXCL, O_NOFOLLOW, mode 0600), fsyncs it, renames it
    over ``name`` and fsyncs the directory. On failure the temp file is removed when possible and
    the previous ``name`` is untouched. A failure of the system (disk full, read-only file system,
    permission denied, ...) raises :class:`CheckpointWriteError` naming it; ``display`` is how the
    file is named in that message (default ``name``).
    """
    head, payloads, trailer = _encode(checkpoint, session_id, max_bytes, identity_inputs)
    buffers: list[memoryview | bytes] = [head]
    position = len(head)
    for offset, view in payloads:
        buffers.append(memoryview(_ZEROS)[: offset - position])
        buffers.append(view)
        position = offset + view.nbytes
    buffers.append(trailer)
    replace_file(dir_fd, name, buffers, temp_prefix=temp_prefix, display=display)


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


def _owned_buffer(nbytes: int) -> memoryview:
    """Fresh writable host memory for ``nbytes`` of payloads, read into directly (no zero-fill pass).

    One anonymous mapping advised for transparent huge pages: the kernel then faults the memory in
    2 MiB at a time while the read fills it. Measured on a 90 MiB file (scripts/bench_checkpoint_file.py
    and the numbers in docs/CHECKPOINT_FORMAT.md): about 19 ms, against 26 ms for one np.empty, 53 ms
    for one np.empty per payload and 56 ms for copying out of a file mapping.
    """
    block = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            block.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP disabled or unsupported: 4 KiB pages, same result, somewhat slower
    return memoryview(block)[:nbytes]


def _check_depth(obj: Any, depth: int = 1) -> None:
    """Reject maps/arrays nested deeper than MAX_DEPTH (the recursion stops there too)."""
    if depth > MAX_DEPTH:
        raise CheckpointCorrupt(f"manifest nests deeper than {MAX_DEPTH} levels")
    for value in obj.values() if type(obj) is dict else obj:
        if type(value) is dict or type(value) is list:  # msgpack yields exactly these types
            _check_depth(value, depth + 1)


def _read_manifest(
    fd: int, st: os.stat_result, path: str, versions: dict[int, set[str]] | None = None
) -> tuple[dict, int, int]:
    """Verified file manifest, the header CRC and where the header block ends. Reads at most 16 MiB,
    whatever the file says. ``versions``: the readable file versions and each one's manifest fields
    (default: checkpoint files, versions 1 and 2)."""
    versions = _FILE_KEYS if versions is None else versions
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
        raise CheckpointIncompatible(
            f"{path!r} is checkpoint file version {version}; this build reads versions "
            f"{', '.join(map(str, versions))} here"
        )
    try:
        manifest = msgpack.unpackb(memoryview(block)[:manifest_len], raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several types for damaged input
        raise CheckpointCorrupt(f"{path!r}: manifest is not valid msgpack ({e})") from None
    keys = versions[version]
    if not isinstance(manifest, dict):
        raise CheckpointCorrupt(f"{path!r}: manifest must be a map with fields {sorted(keys)}")
    _check_depth(manifest)
    if manifest.keys() != keys:
        raise CheckpointCorrupt(f"{path!r}: manifest must be a map with fields {sorted(keys)}")
    session_id = manifest.get("session_id")
    if session_id is not None and not isinstance(session_id, str):
        raise CheckpointCorrupt(f"{path!r}: manifest session_id must be a string or nil")
    inputs = manifest.get("identity_inputs")  # absent from version 1 files
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


def _check_format_supported(wire: Any, path: str) -> None:
    """Tell a file from another format/layout version apart from a damaged one."""
    if not isinstance(wire, dict):
        return  # the full validation below reports it as corrupt
    if wire.get("version") != MANIFEST_VERSION:
        raise CheckpointIncompatible(
            f"{path!r} uses checkpoint manifest version {wire.get('version')!r}; this build reads {MANIFEST_VERSION}"
        )
    fmt = wire.get("format")
    if isinstance(fmt, dict) and fmt.get("layout_version") != LAYOUT_VERSION:
        raise CheckpointIncompatible(
            f"{path!r} uses KV layout version {fmt.get('layout_version')!r}; this build reads {LAYOUT_VERSION}"
        )


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
    # Files written before the inputs were recorded (file version 1) carry only the digest.
    return f"{head}: identity {found!r}, {label} {expected!r} (the file does not record what it was made from)"


def read_checkpoint_file(
    path: str,
    *,
    dir_fd: int | None = None,
    expected_identity: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    manifest_only: bool = False,
    expected_inputs: IdentityInputs | None = None,
    expected_label: str = "expected",
    fd: int | None = None,
) -> tuple[str | None, CPUCheckpoint | None]:
    """(session id, checkpoint) of a verified file; the checkpoint is None when ``manifest_only``.

    An identity other than ``expected_identity`` raises :class:`CheckpointIncompatible` naming what
    differs between the file's recorded inputs and ``expected_inputs`` (called ``expected_label``).
    ``fd``: read this open file (which stays open) instead of opening ``path``, which then only
    names it in messages.
    """
    owned = fd is None
    if fd is None:
        fd, st = _open_regular(path, dir_fd)
    else:
        st = fstat_regular(fd, path)
    try:
        manifest, head_crc, head_end = _read_manifest(fd, st, path)
        wire = manifest["checkpoint"]
        _check_format_supported(wire, path)
        if expected_identity is not None:
            found = wire.get("identity") if isinstance(wire, dict) else None
            if found != expected_identity:
                raise CheckpointIncompatible(
                    _identity_mismatch(
                        path,
                        found,
                        expected_identity,
                        manifest.get("identity_inputs"),
                        expected_inputs,
                        expected_label,
                    )
                )
        table = _payload_table(manifest, head_end, st.st_size, max_bytes, path)
        trailer = bytearray(_TRAILER.size)
        _read_exact(fd, memoryview(trailer), st.st_size - _TRAILER.size, path)
        magic, length, trailer_head_crc, trailer_crc = _TRAILER.unpack(trailer)
        if (
            magic != TRAILER_MAGIC
            or length != st.st_size
            or trailer_head_crc != head_crc
            or trailer_crc != crc32c(memoryview(trailer)[: -_CRC.size])
        ):
            raise CheckpointCorrupt(f"{path!r}: trailer is damaged or does not match the header")
        if manifest_only:
            return manifest["session_id"], None
        # Payloads are read into memory this load owns, never mapped from the file: a mapping would
        # let a later in-place write to the file (`cp other path`) change the loaded checkpoint and
        # a truncation kill the process with SIGBUS. CRCs are computed on the owned bytes, so a
        # change racing with the read fails the check instead of passing it.
        # Each payload starts 64-byte aligned in the block, so every array is aligned for its dtype.
        starts = [0]
        for _, length, _ in table:
            starts.append(starts[-1] + -(-length // 64) * 64)
        buffer = _owned_buffer(starts[-1])
        buffers = []
        for i, ((offset, length, expected_crc), start) in enumerate(zip(table, starts)):
            view = buffer[start : start + length]
            _read_exact(fd, view, offset, path)
            if crc32c(view) != expected_crc:
                raise CheckpointCorrupt(f"{path!r}: payload {i} checksum mismatch")
            buffers.append(view)
    finally:
        if owned:
            os.close(fd)
    try:
        checkpoint = checkpoint_from_wire(wire, buffers)
    except CheckpointMalformed as e:
        raise CheckpointCorrupt(f"{path!r}: {e}") from e
    return manifest["session_id"], checkpoint
