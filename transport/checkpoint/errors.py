"""Checkpoint errors, in two families that an ``except`` clause can tell apart.

- :class:`~muxworker.transport.errors.CheckpointRejected` (wire code ``checkpoint_rejected``): a
  checkpoint's contents are not acceptable. :class:`CheckpointMalformed` and
  :class:`CheckpointRetentionError`, defined here, are raised by the data model on either end; they
  have no code of their own, so a worker that refuses a restore sends them as
  ``checkpoint_rejected``, and the client raises that class.
- :class:`CheckpointError`: a checkpoint file, the session store or an identity check failed: the
  file is missing, damaged, made for another model, too large, at an unsafe path, or the system
  refused a read or write (:class:`CheckpointWriteError`, :class:`CheckpointReadError`, whose
  ``reason`` says why: :func:`os_failure`). A worker that reads or writes a file passed to it
  sends each with its own code, and the reason with it. It is not a ``CheckpointRejected``, so
  ``except CheckpointRejected`` around a restore does not also catch a missing file.

The file errors are defined in :mod:`muxworker.transport.errors`, with every other class that has a
code and the table of codes (docs/PROTOCOL.md); import them from there (or from
:mod:`muxworker.transport.checkpoint`, the checkpoint API).
"""

from __future__ import annotations

import errno

from muxworker.transport.errors import (
    CheckpointRejected,
    _OSFailure,
)

__all__ = ["CheckpointMalformed", "CheckpointRetentionError", "os_failure"]


# The data model's errors: a checkpoint that cannot be accepted (the worker's wire error
# ``checkpoint_rejected``).


class CheckpointMalformed(CheckpointRejected):
    """A checkpoint's manifest or payloads are inconsistent: wrong types, dtypes, shapes or counts."""


class CheckpointRetentionError(CheckpointRejected):
    """A restore position is out of range, or some layer no longer retains the rows it needs."""


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
