"""SessionStore: one directory of saved session checkpoints bound to one model/configuration.

Configure it once at start-up with the worker's artifacts and settings; after that every call needs
only a session id::

    store = await SessionStore.create("./saved-sessions", model_files=[...], configuration={...})
    await trio.to_thread.run_sync(store.save, "chat-42", checkpoint)
    checkpoint = await trio.to_thread.run_sync(store.load, "chat-42")

The methods are blocking and thread-safe (each opens, checks and closes what it uses), so callers run
them in worker threads. Nothing is evicted or swept implicitly: a writer killed mid-save can leave a
``.<session-hash>.<random>.tmp`` file, which :meth:`list` ignores and which may be removed once no
writer is running.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from muxworker.transport.checkpoint import (
    DEFAULT_MAX_BYTES,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointIncompatible,
    CheckpointNotFound,
    CheckpointReadError,
    CheckpointUnsafePath,
    CheckpointWriteError,
    CPUCheckpoint,
    IdentityInputs,
    checkpoint_identity_inputs,
)
from muxworker.transport.checkpoint.errors import os_failure
from muxworker.transport.checkpoint.file import read_checkpoint_file, write_checkpoint_file
from muxworker.transport.errors import InvalidArgument
from muxworker.transport.schema import MAX_SESSION_ID_BYTES

if TYPE_CHECKING:
    from .params import WorkerInfo

__all__ = ["SessionStore", "StorePermissionError", "ConfigurationMismatch"]

SUFFIX = ".mxckpt"
_NAME = re.compile(r"[0-9a-f]{64}\.mxckpt")


class StorePermissionError(CheckpointError):
    """The store directory is missing, a symlink, not a directory, not owned by this user, or
    writable by group or others."""


class ConfigurationMismatch(CheckpointIncompatible):
    """The worker (or a checkpoint) does not run the configuration the store was created with."""


# Configuration keys the worker's hello reports, and where. Keys it does not report (rope, ...)
# are bound by the identity alone; the engine limits (info.limits) are matched by their own names.
_WORKER_FACTS = {
    "backend": lambda info: info.backend,
    "dtype": lambda info: info.dtype,
    "weights": lambda info: info.weights,
    "device": lambda info: info.device,
    "architecture": lambda info: info.model.architecture,
    "vocab_size": lambda info: info.model.vocab_size,
    "context_length": lambda info: info.model.context_length,
}


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _session_hash(session_id: str) -> str:
    if not isinstance(session_id, str) or not session_id:
        raise InvalidArgument(f"session id must be a nonempty string, got {session_id!r}")
    try:
        raw = session_id.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"session id {session_id!r} is not valid Unicode text") from None
    # The wire's limit, so that every id the worker accepts can be saved and no saved id is one
    # the worker would refuse to resume.
    if len(raw) > MAX_SESSION_ID_BYTES:
        raise InvalidArgument(f"session id is longer than {MAX_SESSION_ID_BYTES} UTF-8 bytes")
    return hashlib.sha256(raw).hexdigest()


class SessionStore:
    """Saved checkpoints of named sessions in one directory, bound to one checkpoint identity.

    ``identity`` is :func:`checkpoint_identity` of the worker's model files and configuration; a
    file saved under another identity raises :class:`CheckpointIncompatible` on load. ``max_bytes``
    bounds a checkpoint's payload bytes on save (the previous file stays) and on load.
    ``inputs`` (what :meth:`create` passes) are what the identity was computed from: saved files
    record them, so a mismatch names the differing file or setting, and :meth:`check_worker`
    compares the declared configuration with what a worker reports.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        identity: str,
        max_bytes: int = DEFAULT_MAX_BYTES,
        inputs: IdentityInputs | None = None,
    ) -> None:
        if not isinstance(identity, str) or not identity:
            raise InvalidArgument("identity must be a nonempty string")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise InvalidArgument(f"max_bytes must be a positive integer, got {max_bytes!r}")
        if inputs is not None and not isinstance(inputs, IdentityInputs):
            raise InvalidArgument(f"inputs must be IdentityInputs or None, got {type(inputs).__name__}")
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.identity = identity
        self.max_bytes = max_bytes
        self.inputs = inputs
        self._prepare_directory()

    @property
    def configuration(self) -> dict[str, Any] | None:
        """The configuration the store was created with (canonical JSON data), if known."""
        return None if self.inputs is None else self.inputs.configuration

    @classmethod
    async def create(
        cls,
        path: str | os.PathLike,
        *,
        model_files: Iterable[str | os.PathLike],
        configuration: dict,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> SessionStore:
        """Hash ``model_files`` and ``configuration`` off the event loop and open the directory.

        The directory is created with mode 0700 when missing. An existing one must be owned by
        this user and not writable by group or others (an owned 0755 directory is fine).
        """

        def build() -> SessionStore:
            identity, inputs = checkpoint_identity_inputs(model_files, configuration)
            return cls(path, identity=identity, max_bytes=max_bytes, inputs=inputs)

        return await trio.to_thread.run_sync(build)

    def __repr__(self) -> str:
        return f"SessionStore({str(self.path)!r}, identity={self.identity[:12]}...)"

    # -- directory ------------------------------------------------------------------------------

    def _prepare_directory(self) -> None:
        try:
            os.makedirs(self.path.parent, exist_ok=True)
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise os_failure(CheckpointWriteError, e, f"cannot create the store directory {str(self.path)!r}") from None
        else:
            # mkdir's mode is masked by the umask; make it exactly 0700.
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
        os.close(self._open_dir())

    def _open_dir(self) -> int:
        """An fd of the store directory after checking it is safe; every operation goes through it."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise StorePermissionError(f"store path {str(self.path)!r} is a symlink or not a directory") from None
            raise StorePermissionError(f"store directory {str(self.path)!r} is unusable: {e}") from None
        try:
            st = os.fstat(fd)
            if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
                raise StorePermissionError(
                    f"store directory {str(self.path)!r} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
                )
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise StorePermissionError(
                    f"store directory {str(self.path)!r} has mode {stat.filemode(st.st_mode)}: "
                    "it must not be writable by group or others (use chmod 0700)"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- what the worker runs -------------------------------------------------------------------

    def check_worker(self, info: WorkerInfo) -> None:
        """Refuse a worker that does not run what this store's configuration declares.

        Compares each declared key that the worker's hello reports: ``backend``, ``dtype``,
        ``device`` (``cuda`` matches ``cuda:0``), the model's ``architecture``, ``vocab_size`` and
        ``context_length``, every engine limit by name (``max_session_tokens``, ``n_draft``, ...),
        and ``draft`` as present or absent. Undeclared keys, and keys the hello does not report,
        are not compared (the model files' bytes are bound by the identity). A store made without
        ``inputs`` declares nothing. Raises :class:`ConfigurationMismatch` naming every differing
        field, e.g. ``dtype: store float32, worker bfloat16``.
        """
        config = self.configuration
        if not config:
            return
        differences = []
        for key, declared in sorted(config.items()):
            if key in _WORKER_FACTS:
                actual = _WORKER_FACTS[key](info)
                if key == "device" and isinstance(actual, str) and actual.startswith(f"{declared}:"):
                    continue
            elif key == "draft" and "n_draft" in info.limits:
                # The hello reports the draft through its n_draft (0: none); the draft's name is
                # bound by its files in the identity.
                has_draft = bool(info.limits["n_draft"])
                if has_draft != (declared is not None):
                    differences.append(
                        f"draft: store {_show(declared)}, worker "
                        + (f"a draft model (n_draft {info.limits['n_draft']})" if has_draft else "none")
                    )
                continue
            elif key in info.limits:
                actual = info.limits[key]
            else:
                continue
            if actual != declared:
                differences.append(f"{key}: store {_show(declared)}, worker {_show(actual)}")
        if differences:
            raise ConfigurationMismatch(
                f"the worker does not run what the session store {str(self.path)!r} declares: " + "; ".join(differences)
            )

    def _check_format(self, checkpoint: CPUCheckpoint) -> None:
        """A checkpoint's own dtype and backend must be the declared ones (it was made by the worker)."""
        config = self.configuration or {}
        differences = [
            f"{key}: store {_show(config[key])}, checkpoint {_show(checkpoint.format.get(key))}"
            for key in ("dtype", "backend")
            if key in config and checkpoint.format.get(key) != config[key]
        ]
        if differences:
            raise ConfigurationMismatch(
                f"the checkpoint was not made by the configuration the session store "
                f"{str(self.path)!r} declares: " + "; ".join(differences)
            )

    # -- sessions --------------------------------------------------------------------------------

    def path_for(self, session_id: str) -> Path:
        """The file that holds ``session_id``'s checkpoint (named by a hash, so any id is safe)."""
        return self.path / (_session_hash(session_id) + SUFFIX)

    def save(self, session_id: str, checkpoint: CPUCheckpoint) -> None:
        """Atomically replace ``session_id``'s saved checkpoint.

        A checkpoint without an identity is stamped with the store's; one with another identity
        raises :class:`CheckpointIncompatible`. Over ``max_bytes`` raises
        :class:`CheckpointTooLarge`; disk full, a read-only file system or denied permission raise
        :class:`CheckpointWriteError` with that ``reason``. On any failure the previous file stays
        loadable.
        """
        digest = _session_hash(session_id)
        if not isinstance(checkpoint, CPUCheckpoint):
            raise InvalidArgument(f"expected a CPUCheckpoint, got {type(checkpoint).__name__}")
        self._check_format(checkpoint)  # first: it can name what differs, two digests cannot
        if checkpoint.identity is None:
            checkpoint = dataclasses.replace(checkpoint, identity=self.identity)
        elif checkpoint.identity != self.identity:
            raise CheckpointIncompatible(
                f"checkpoint identity {checkpoint.identity!r} is not this store's {self.identity!r}"
            )
        dir_fd = self._open_dir()
        try:
            write_checkpoint_file(
                checkpoint,
                dir_fd,
                digest + SUFFIX,
                temp_prefix=digest,
                session_id=session_id,
                max_bytes=self.max_bytes,
                display=f"session {session_id!r} ({self.path / (digest + SUFFIX)})",
                identity_inputs=self.inputs,
            )
        finally:
            os.close(dir_fd)

    def load(self, session_id: str) -> CPUCheckpoint:
        """The verified checkpoint saved for ``session_id`` (host memory only).

        Raises :class:`CheckpointNotFound`, :class:`CheckpointCorrupt`,
        :class:`CheckpointIncompatible`, :class:`CheckpointTooLarge`, :class:`CheckpointUnsafePath`
        or :class:`CheckpointReadError` (the system refused or failed the read).
        """
        name = _session_hash(session_id) + SUFFIX
        try:
            dir_fd = self._open_dir()
        except StorePermissionError:
            if not os.path.lexists(self.path):
                raise CheckpointNotFound(f"no saved checkpoint for session {session_id!r}") from None
            raise
        try:
            found, checkpoint = read_checkpoint_file(
                name,
                dir_fd=dir_fd,
                expected_identity=self.identity,
                max_bytes=self.max_bytes,
                expected_inputs=self.inputs,
                expected_label="store",
            )
        except CheckpointNotFound:
            raise CheckpointNotFound(f"no saved checkpoint for session {session_id!r}") from None
        finally:
            os.close(dir_fd)
        if found != session_id:
            raise CheckpointCorrupt(
                f"{name} holds session {found!r}, not {session_id!r}; the file was renamed or copied"
            )
        assert checkpoint is not None  # not manifest_only, so the payloads were read
        self._check_format(checkpoint)  # files saved before save() checked it
        return checkpoint

    def delete(self, session_id: str) -> bool:
        """Remove ``session_id``'s saved file; return whether one existed. Live sessions are untouched."""
        name = _session_hash(session_id) + SUFFIX
        dir_fd = self._open_dir()
        try:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                return False
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointUnsafePath(f"{name!r} in the store is not a regular file")
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                return False  # a concurrent delete won
            os.fsync(dir_fd)
            return True
        except OSError as e:
            raise os_failure(
                CheckpointWriteError, e, f"cannot delete session {session_id!r} ({self.path / name})"
            ) from None
        finally:
            os.close(dir_fd)

    def list(self) -> list[str]:
        """Session ids with a saved file, sorted; temp files and unreadable files are skipped."""
        dir_fd = self._open_dir()
        try:
            try:
                names = os.listdir(dir_fd)
            except OSError as e:
                raise os_failure(CheckpointReadError, e, f"cannot list {str(self.path)!r}") from None
            ids = []
            for name in names:
                if not _NAME.fullmatch(name):
                    continue
                try:
                    # No size bound here: an oversized file is still a saved session, and
                    # load() reports it as CheckpointTooLarge.
                    found, _ = read_checkpoint_file(name, dir_fd=dir_fd, max_bytes=sys.maxsize, manifest_only=True)
                except CheckpointError:
                    continue  # damaged, foreign or vanished meanwhile: load() reports it precisely
                if found is not None and _session_hash(found) + SUFFIX == name:
                    ids.append(found)
            return sorted(ids)
        finally:
            os.close(dir_fd)
