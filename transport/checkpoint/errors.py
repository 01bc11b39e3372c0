"""Checkpoint errors, in two families that an ``except`` clause can tell apart.

- :class:`~muxworker.transport.errors.CheckpointRejected` (wire code ``checkpoint_rejected``): a
  checkpoint's contents are not acceptable. :class:`CheckpointMalformed` and
  :class:`CheckpointRetentionError` are raised by the data model on either end; a worker that
  refuses a restore sends them as ``checkpoint_rejected``, and the client raises that class.
- :class:`CheckpointError` (never on the wire): a checkpoint file, the session store or an identity
  check on this side failed: the file is missing, damaged, made for another model, too large, at an
  unsafe path, or the system refused a read or write. It is not a ``CheckpointRejected``, so
  ``except CheckpointRejected`` around a restore does not also catch a missing file.
"""

from __future__ import annotations

import errno

from muxworker.transport.errors import CheckpointRejected, MuxError, register_error_classes

__all__ = [
    "CheckpointMalformed",
    "CheckpointRetentionError",
    "CheckpointError",
    "CheckpointNotFound",
    "CheckpointCorrupt",
    "CheckpointIncompatible",
    "CheckpointTooLarge",
    "CheckpointUnsafePath",
    "CheckpointWriteError",
    "CheckpointReadError",
    "os_failure",
]


# ----------------------------------------------------------------------------------------------
# The data model's errors: a checkpoint that cannot be accepted (the worker's wire error)


class CheckpointMalformed(CheckpointRejected):
    """A checkpoint's manifest or payloads are inconsistent: wrong types, dtypes, shapes or counts."""


class CheckpointRetentionError(CheckpointRejected):
    """A restore position is out of range, or some layer no longer retains the rows it needs."""


# ----------------------------------------------------------------------------------------------
# The file layer's errors (and the store's, which derive from them)


class CheckpointError(MuxError):
    """Base of the checkpoint file, store and identity errors. A worker that reads or writes a
    file passed to it (save_file, restore_file) sends them with their own codes."""

    code = "checkpoint_error"


class CheckpointNotFound(CheckpointError):
    """No checkpoint file exists at this path (or for this session id)."""

    code = "checkpoint_not_found"


class CheckpointCorrupt(CheckpointError):
    """The file is truncated, damaged or not a checkpoint: a magic, size, structure or checksum failed."""

    code = "checkpoint_corrupt"


class CheckpointIncompatible(CheckpointError):
    """The checkpoint was made for another model/configuration identity, format or file version."""

    code = "checkpoint_incompatible"


class CheckpointTooLarge(CheckpointError):
    """The checkpoint's payload bytes exceed the configured ``max_bytes``."""

    code = "checkpoint_too_large"


class CheckpointUnsafePath(CheckpointError):
    """The path is a symlink, FIFO, directory or other non-regular file, so it is not read or replaced."""

    code = "checkpoint_unsafe_path"


class _OSFailure(CheckpointError):
    """Base of the errors that carry the operating system's reason."""

    def __init__(self, message: str, *, reason: str = "os_error", errno: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason  # "disk_full", "read_only", "permission_denied", ... (see _REASONS)
        self.errno = errno


class CheckpointWriteError(_OSFailure):
    """The system refused or failed a write (disk full, read-only, permission denied); earlier files stay."""

    code = "checkpoint_write_error"


class CheckpointReadError(_OSFailure):
    """The system refused or failed a read of a checkpoint file (permission denied, I/O error)."""

    code = "checkpoint_read_error"


register_error_classes(
    CheckpointError,
    CheckpointNotFound,
    CheckpointCorrupt,
    CheckpointIncompatible,
    CheckpointTooLarge,
    CheckpointUnsafePath,
    CheckpointWriteError,
    CheckpointReadError,
)


# errno -> (reason, what to tell the user). EPERM is what root gets from an immutable (chattr +i)
# file or directory, so it reads as "permission denied" too.
_REASONS: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("disk_full", "disk full"),
    getattr(errno, "EDQUOT", -1): ("disk_full", "disk quota exceeded"),
    errno.EFBIG: ("file_too_large", "file too large for the file system or the process's file size limit"),
    errno.EROFS: ("read_only", "read-only file system"),
    errno.EACCES: ("permission_denied", "permission denied"),
    errno.EPERM: ("permission_denied", "permission denied (operation not permitted; an immutable file or directory?)"),
    errno.ENOENT: ("not_found", "no such file or directory"),
    errno.ENOTDIR: ("not_found", "a path component is not a directory"),
    errno.EIO: ("io_error", "I/O error"),
}


def os_failure(cls: type[_OSFailure], exc: OSError, what: str, *, after: str = "") -> _OSFailure:
    """``cls`` naming the reason of ``exc`` (a raw OSError never leaves this module's file calls)."""
    reason, phrase = _REASONS.get(exc.errno or 0, ("os_error", "operating system error"))
    code = errno.errorcode.get(exc.errno or 0)
    detail = f"{code}: {exc.strerror}" if code and exc.strerror else str(exc)
    return cls(f"{what}: {phrase} [{detail}]{after}", reason=reason, errno=exc.errno)
