"""The local session store's directory: created 0700 and checked (owner, mode, no symlink) on every
open, its lock files, removing a tree without following links, and what a failed manifest read
means. Only the store (local.py) uses these."""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from muxworker.transport.checkpoint import CheckpointReadError, CheckpointWriteError
from muxworker.transport.checkpoint.errors import os_failure

from .binding import COMMIT_LOCK, OWNER_LOCK, StoreBusy, StorePermissionError, StoreUnavailable

__all__ = ["prepare_directory", "open_dir", "locked", "flock", "hold_store", "remove_tree", "reading_manifest"]

#: Holders an owner lock's file lists at most (shared holders on other hosts cannot be checked).
_MAX_HOLDERS = 32


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


def hold_store(path: Path, *, shared: bool, role: str) -> int:
    """The fd of the store's owner lock, :data:`OWNER_LOCK`, held until it is closed or this
    process ends (an ``flock``: the kernel releases it with its holder, so the lock of a killed
    server is free at once and is taken over here). ``shared`` False: this process alone (a
    server, by default); True: with other shared writers (``--shared-store`` servers, the chat
    app, the sessions command), never beside an exclusive holder. The file names its holders
    (pid, host, start time, ``role``), rewritten by every holder that takes it. A holder that
    cannot have it raises :class:`StoreBusy` naming them. flock is not reliable on NFS (some
    clients lock only locally): there, run one server per store, or use an object store. In a
    directory where no lock file can be created (read-only, immutable), a shared holder holds
    none (-1): it cannot write there either."""
    dir_fd = open_dir(path)
    try:
        writable = True
        try:
            fd = os.open(OWNER_LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_CREAT, 0o600, dir_fd=dir_fd)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise os_failure(CheckpointWriteError, e, f"cannot open the store's lock file {OWNER_LOCK!r}") from None
            # A directory nothing can be written to (read-only, immutable): its existing lock
            # still locks (read-only); without one, a shared writer writes nothing there anyway.
            writable = False
            try:
                fd = os.open(OWNER_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError:
                if shared:
                    return -1
                raise os_failure(
                    CheckpointWriteError, e, f"cannot create the store's lock file {OWNER_LOCK!r}"
                ) from None
        try:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreBusy(_busy(path, _holders(fd), shared)) from None
            except OSError as e:
                raise os_failure(CheckpointWriteError, e, f"cannot lock the store's lock file {OWNER_LOCK!r}") from None
            me = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "mode": "shared" if shared else "exclusive",
                "role": role,
            }
            if not writable:
                return fd
            # Under the commit lock, so that shared holders starting at once do not interleave.
            with locked(path, dir_fd, COMMIT_LOCK, fcntl.LOCK_EX):
                others = [h for h in _holders(fd) if h.get("mode") == "shared"] if shared else []
                lines = [json.dumps(h, sort_keys=True) for h in [*others[-(_MAX_HOLDERS - 1) :], me]]
                data = ("\n".join(lines) + "\n").encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(dir_fd)
    return fd


def _holders(fd: int) -> list[dict]:
    """The live holders an owner lock's file names (those on this host that are gone are left out)."""
    try:
        raw = os.pread(fd, 1 << 16, 0).decode("utf-8", "replace")
    except OSError:
        return []
    out = []
    for line in raw.splitlines():
        try:
            holder = json.loads(line)
        except ValueError:
            continue
        if isinstance(holder, dict) and isinstance(holder.get("pid"), int) and _alive(holder):
            out.append(holder)
    return out


def _alive(holder: dict) -> bool:
    if holder.get("host") != socket.gethostname():
        return True  # another machine's: cannot tell
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _busy(path: Path, holders: list[dict], shared: bool) -> str:
    """Why a process cannot hold the store ``path``, naming who does."""
    named = "; ".join(
        f"pid {h['pid']} on {h.get('host', '?')} since {h.get('started', '?')} ({h.get('role', '?')}"
        + (", shared" if h.get("mode") == "shared" else "")
        + ")"
        for h in holders
    )
    who = named or "another process (its record is not written yet)"
    if shared:
        return (
            f"the session store {str(path)!r} is held by a server that owns it alone: {who}; stop it, or run "
            "every server on this store with --shared-store"
        )
    if holders and all(h.get("mode") == "shared" for h in holders):
        return (
            f"the session store {str(path)!r} is in use by shared writers: {who}; stop them, or start this "
            "server with --shared-store too"
        )
    return (
        f"the session store {str(path)!r} is in use by another server: {who}; two servers writing one "
        "store would overwrite each other's sessions: stop it, use another --store, or run both with --shared-store"
    )


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
