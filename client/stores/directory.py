"""The local session store's directory: created 0700 and checked (owner, mode, no symlink) on every
open, its lock files, removing a tree without following links, and what a failed manifest read
means. Only the store (local.py) uses these."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from muxworker.transport.checkpoint import CheckpointReadError, CheckpointWriteError
from muxworker.transport.checkpoint.errors import os_failure

from .binding import StoreBusy, StorePermissionError, StoreUnavailable

__all__ = ["prepare_directory", "open_dir", "locked", "flock", "remove_tree", "reading_manifest"]


def prepare_directory(path: Path) -> None:
    """Create the store directory (mode 0700) if it is missing, then check it as :func:`open_dir` does."""
    try:
        os.makedirs(path.parent, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise os_failure(CheckpointWriteError, e, f"cannot create the store directory {str(path)!r}") from None
    else:
        # mkdir's mode is masked by the umask; make it exactly 0700.
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    os.close(open_dir(path))


def open_dir(path: Path) -> int:
    """An fd of the store directory after checking it is safe; every operation goes through it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise StorePermissionError(f"store path {str(path)!r} is a symlink or not a directory") from None
        raise StorePermissionError(f"store directory {str(path)!r} is unusable: {e}") from None
    try:
        st = os.fstat(fd)
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise StorePermissionError(
                f"store directory {str(path)!r} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise StorePermissionError(
                f"store directory {str(path)!r} has mode {stat.filemode(st.st_mode)}: "
                "it must not be writable by group or others (use chmod 0700)"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def locked(path: Path, dir_fd: int, name: str, mode: int) -> Iterator[int]:
    """:func:`flock`, released on exit."""
    fd = flock(path, dir_fd, name, mode)
    try:
        yield fd
    finally:
        os.close(fd)


def flock(path: Path, dir_fd: int, name: str, mode: int) -> int:
    """An fd of lock file ``name`` holding ``flock(mode)`` (closing the fd releases it)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except FileNotFoundError:
            fd = os.open(name, flags | os.O_CREAT, 0o600, dir_fd=dir_fd)
    except OSError as e:
        raise os_failure(CheckpointWriteError, e, f"cannot open the store's lock file {name!r}") from None
    try:
        fcntl.flock(fd, mode)
    except BlockingIOError:
        os.close(fd)
        raise StoreBusy(f"another process is writing to the session store {str(path)!r}") from None
    except OSError as e:
        os.close(fd)
        raise os_failure(CheckpointWriteError, e, f"cannot lock the store's lock file {name!r}") from None
    return fd


def remove_tree(parent_fd: int, name: str) -> None:
    """Remove the directory ``name`` in ``parent_fd`` and everything in it, following no symlink."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    try:
        for entry in os.listdir(fd):
            if stat.S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
                remove_tree(fd, entry)
            else:
                os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


@contextmanager
def reading_manifest(name: str) -> Iterator[None]:
    """The system failing a manifest's read (an I/O or permission error) raises StoreUnavailable:
    the session is not known to be damaged, and a later read may succeed. A file that does not
    exist is let through (FileNotFoundError, CheckpointNotFound), as is every other error."""
    try:
        yield
    except CheckpointReadError as e:
        raise StoreUnavailable(f"{e}; the saved session is not known to be damaged") from None
    except FileNotFoundError:
        raise
    except OSError as e:
        failure = os_failure(CheckpointReadError, e, f"cannot read {name!r}")
        raise StoreUnavailable(f"{failure}; the saved session is not known to be damaged") from None
