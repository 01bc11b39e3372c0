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

import builtins
import fcntl
import os
import secrets
import stat
import sys
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import trio

from muxworker.transport.checkpoint import (
    DEFAULT_MAX_BYTES,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    CheckpointReadError,
    CheckpointWriteError,
    IdentityInputs,
    checkpoint_identity_inputs,
)
from muxworker.transport.checkpoint.blocks import (
    Piece,
)
from muxworker.transport.checkpoint.container import _open_regular, _write_all, memory_file, replace_file
from muxworker.transport.checkpoint.errors import os_failure
from muxworker.transport.checkpoint.manifest import SessionManifest, encode_session_manifest, read_session_manifest
from muxworker.transport.checkpoint.segments import SegmentRef, read_payload_into, read_segment_header
from muxworker.transport.errors import InvalidArgument
from muxworker.transport.messages import SaveFileReply

from .binding import (
    _TEMP_NAME,
    COMMIT_LOCK,
    DEFAULT_COMPACT_AFTER,
    LOCAL_BLOCK_TOKENS,
    MANIFEST_NAME,
    MAX_RECORD_BYTES,
    SEGMENT_SUFFIX,
    SUFFIX,
    WRITERS_LOCK,
    CleanResult,
    ResumePlan,
    SavePlan,
    SessionInfo,
    StoreBinding,
    StorePermissionError,
    StoreUnavailable,
    manifest_info,
    seconds,
    session_hash,
)
from .directory import flock, hold_store, locked, open_dir, prepare_directory, reading_manifest, remove_tree

__all__ = ["SessionStore"]

#: The version of a manifest that cannot be read (damaged, another session's): no process owns it.
_UNREADABLE = "(unreadable)"


class SessionStore(StoreBinding):
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
        compact_after: int = DEFAULT_COMPACT_AFTER,
        block_tokens: int = LOCAL_BLOCK_TOKENS,
        share_blocks_across_namespaces: bool = False,
    ) -> None:
        super().__init__(
            identity=identity,
            max_bytes=max_bytes,
            inputs=inputs,
            compact_after=compact_after,
            block_tokens=block_tokens,
            share_blocks_across_namespaces=share_blocks_across_namespaces,
        )
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.location = str(self.path)
        self.owner_fd = -1  # the owner lock this process holds (hold()), -1: none
        prepare_directory(self.path)

    @classmethod
    def inspect(cls, path: str | os.PathLike) -> SessionStore:
        """An existing store opened for maintenance, bound to no model (``python -m
        muxworker.sessions``): :meth:`list_info`, :meth:`info`, :meth:`verify` (every checksum),
        :meth:`delete`, :meth:`prune` and :meth:`clean` work; saving, loading and resuming need the
        model's identity (:meth:`create`). The directory must exist and pass the usual checks."""
        store = cls.__new__(cls)
        store.path = Path(os.path.abspath(os.fspath(path)))
        store.location = str(store.path)
        store.identity = ""
        store.max_bytes = sys.maxsize
        store.inputs = None
        store.compact_after = DEFAULT_COMPACT_AFTER
        store.block_tokens = LOCAL_BLOCK_TOKENS
        store.share_blocks_across_namespaces = False
        store.inspecting = True
        store.owner_fd = -1
        store._init_owned()
        try:
            os.close(store._open_dir())
        except StorePermissionError:
            if not os.path.lexists(store.path):
                raise CheckpointNotFound(f"no session store at {str(store.path)!r}") from None
            raise
        return store

    @classmethod
    async def create(
        cls,
        path: str | os.PathLike,
        *,
        model_files: Iterable[str | os.PathLike],
        configuration: dict,
        max_bytes: int = DEFAULT_MAX_BYTES,
        compact_after: int = DEFAULT_COMPACT_AFTER,
        block_tokens: int = LOCAL_BLOCK_TOKENS,
        share_blocks_across_namespaces: bool = False,
        hold: str | None = None,
        role: str = "muxworker",
    ) -> SessionStore:
        """Hash ``model_files`` and ``configuration`` off the event loop and open the directory.

        The directory is created with mode 0700 when missing. An existing one must be owned by
        this user and not writable by group or others (an owned 0755 directory is fine).
        ``block_tokens``: the size of the content-addressed blocks sessions share (0: none; each
        session's rows in its own segments, written by the worker straight into the file).
        Blocks are shared only within a namespace (the part of a session id before its first
        "/"), unless ``share_blocks_across_namespaces`` (for namespaces that trust each other).
        ``hold``: take the store's owner lock first (:meth:`hold`): ``"exclusive"`` (a server's,
        by default) or ``"shared"``; None: none (a library's caller coordinates its writers).
        """
        if hold not in (None, "exclusive", "shared"):
            raise InvalidArgument(f"hold must be None, 'exclusive' or 'shared', got {hold!r}")

        def build() -> SessionStore:
            owner = -1
            if hold is not None:  # before hashing the model files: a second server fails at once
                where = Path(os.path.abspath(os.fspath(path)))
                prepare_directory(where)
                owner = hold_store(where, shared=hold == "shared", role=role)
            try:
                identity, inputs = checkpoint_identity_inputs(model_files, configuration)
                store = cls(
                    path,
                    identity=identity,
                    max_bytes=max_bytes,
                    inputs=inputs,
                    compact_after=compact_after,
                    block_tokens=block_tokens,
                    share_blocks_across_namespaces=share_blocks_across_namespaces,
                )
            except BaseException:
                if owner >= 0:
                    os.close(owner)
                raise
            store.owner_fd = owner
            return store

        return await trio.to_thread.run_sync(build)

    def hold(self, *, shared: bool, role: str = "muxworker") -> None:
        """Take the store's owner lock (:func:`~.directory.hold_store`) until :meth:`release` or
        this process ends; StoreBusy naming the holder when another process has it. An
        exclusive holder is the store's only writer; shared holders write beside each other,
        their saves guarded by the tag-conditional commit."""
        if self.owner_fd < 0:
            self.owner_fd = hold_store(self.path, shared=shared, role=role)

    def release(self) -> None:
        """Give the owner lock back (if held)."""
        if self.owner_fd >= 0:
            os.close(self.owner_fd)
            self.owner_fd = -1

    def __repr__(self) -> str:
        return f"SessionStore({str(self.path)!r}, identity={self.identity[:12]}...)"

    # -- the directory (directory.py) ------------------------------------------------------------

    def _open_dir(self) -> int:
        return open_dir(self.path)

    def _locked(self, dir_fd: int, name: str, mode: int) -> AbstractContextManager[int]:
        return locked(self.path, dir_fd, name, mode)

    def _flock(self, dir_fd: int, name: str, mode: int) -> int:
        return flock(self.path, dir_fd, name, mode)

    # -- reading what is saved --------------------------------------------------------------------

    def path_for(self, session_id: str) -> Path:
        """The manifest file of ``session_id`` (named by a hash, so any id is safe); its rows are in
        segment files beside it (:meth:`files_of`)."""
        return self.path / (session_hash(session_id) + SUFFIX)

    def _not_found(self, session_id: str) -> CheckpointNotFound:
        return CheckpointNotFound(f"no saved checkpoint for session {session_id!r}")

    def _read_saved(self, dir_fd: int, name: str) -> SessionManifest:
        """The session manifest in the file ``name`` (a file of version 1 or 2 raises
        CheckpointIncompatible naming ``migrate``); checks nothing else."""
        with reading_manifest(name):
            fd, _ = _open_regular(name, dir_fd)
            try:
                return read_session_manifest(fd, name)
            finally:
                os.close(fd)

    def _manifest(self, dir_fd: int, session_id: str) -> SessionManifest:
        """The verified manifest of ``session_id``; raises CheckpointNotFound, CheckpointCorrupt
        (another session's file), CheckpointIncompatible or StoreUnavailable (the system failed the read)."""
        name = session_hash(session_id) + SUFFIX
        with reading_manifest(name):
            try:
                fd, _ = _open_regular(name, dir_fd)
            except CheckpointNotFound:
                raise self._not_found(session_id) from None
            try:
                m = read_session_manifest(fd, name)
            finally:
                os.close(fd)
        self.check_manifest(m, session_id, name)
        return m

    def _open_segments(self, dir_fd: int, m: SessionManifest) -> list[int]:
        """Open every segment of ``m`` (regular files, no symlinks, the recorded sizes)."""
        return self.open_all(m, lambda ref: _open_regular(ref.name, dir_fd)[0])

    def _with_segments(self, session_id: str, body: Any) -> Any:
        """Run ``body(dir_fd, manifest, fds)`` on the vetted open files of ``session_id``.
        A manifest replaced meanwhile (a concurrent compaction deleted a segment) is read again."""
        try:
            dir_fd = self._open_dir()
        except StorePermissionError:
            if not os.path.lexists(self.path):
                raise self._not_found(session_id) from None
            raise
        try:
            for attempt in range(3):
                m = self._manifest(dir_fd, session_id)
                try:
                    fds = self._open_segments(dir_fd, m)
                except CheckpointNotFound:
                    if attempt == 2:
                        raise CheckpointCorrupt(
                            f"a segment of session {session_id!r} is missing (deleted by hand, or by a "
                            "concurrent save three times in a row)"
                        ) from None
                    continue
                return body(dir_fd, m, fds)
        finally:
            os.close(dir_fd)
        raise AssertionError("unreachable")

    def begin_resume(self, session_id: str) -> ResumePlan:
        """Open and vet the files of ``session_id`` for a worker to restore from (the caller closes
        them with :meth:`ResumePlan.close`): the manifest is verified and bound to this store's
        identity, and every segment it names is opened (no symlink, a regular file, the recorded
        size). The worker checks each segment's header against the manifest and every payload's
        CRC before it publishes the session."""
        self._check_bound("resume a session")
        return self._with_segments(session_id, lambda dir_fd, m, fds: ResumePlan(session_id, fds, m, m.tag))

    def verify(self, session_id: str) -> SessionInfo:
        """Read every byte of ``session_id``'s files and check every checksum; raise as :meth:`load`."""
        info = self.info(session_id)

        def body(dir_fd: int, m: SessionManifest, fds: list[int]) -> None:
            try:
                for fd, ref in zip(fds, m.segments):
                    name = f"segment {ref.name} of session {session_id!r}"
                    header = read_segment_header(fd, name, ref)
                    for i, (_, length, _) in enumerate(header.payloads):
                        read_payload_into(fd, header, i, [memoryview(bytearray(length))], name)
            finally:
                for fd in fds:
                    os.close(fd)

        self._with_segments(session_id, body)
        return info

    def info(self, session_id: str) -> SessionInfo:
        """What is saved for ``session_id`` (from its manifest; no payload is read)."""
        dir_fd = self._open_dir()
        try:
            name = session_hash(session_id) + SUFFIX
            try:
                with reading_manifest(name):
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise self._not_found(session_id) from None
            m = self._read_saved(dir_fd, name)
            if m.session_id != session_id:
                raise CheckpointCorrupt(f"{name} holds session {m.session_id!r}, not {session_id!r}")
            return manifest_info(m, st.st_size)
        finally:
            os.close(dir_fd)

    def list_info(self) -> builtins.list[SessionInfo]:
        """:class:`SessionInfo` of every saved session, sorted by id; unreadable ones are skipped
        (:meth:`load` and :meth:`verify` report them precisely)."""
        dir_fd = self._open_dir()
        try:
            try:
                names = os.listdir(dir_fd)
            except OSError as e:
                raise os_failure(CheckpointReadError, e, f"cannot list {str(self.path)!r}") from None
            out = []
            for name in names:
                if not MANIFEST_NAME.fullmatch(name):
                    continue
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    m = self._read_saved(dir_fd, name)
                    if session_hash(m.session_id) + SUFFIX == name:
                        out.append(manifest_info(m, st.st_size))
                except (CheckpointError, OSError):
                    continue  # damaged, foreign or vanished meanwhile
            return sorted(out, key=lambda i: i.session_id)
        finally:
            os.close(dir_fd)

    def unreadable(self) -> builtins.list[tuple[str, str]]:
        """(file name, why) of every manifest file in the store that :meth:`list_info` skips."""
        dir_fd = self._open_dir()
        try:
            out = []
            for name in sorted(os.listdir(dir_fd)):
                if not MANIFEST_NAME.fullmatch(name):
                    continue
                try:
                    sid = self._read_saved(dir_fd, name).session_id
                    if session_hash(sid) + SUFFIX != name:
                        out.append((name, f"holds session {sid!r}, whose file has another name (renamed or copied)"))
                except (CheckpointError, OSError) as e:
                    out.append((name, str(e)))
            return out
        finally:
            os.close(dir_fd)

    # -- saving ---------------------------------------------------------------------------------

    def begin_save(self, session_id: str, *, replace: bool = False) -> SavePlan:
        """Start a save of ``session_id``: take the writers' lock, read the manifest the save may
        append to and check it is the one this process owns (its tag; else SaveConflict, see
        :meth:`~.StoreBinding.expected_version`), and create the new segment file
        (``<hash>.<random>.mxseg``, O_EXCL, 0600) for the worker to write. Finish with
        :meth:`commit_save` or :meth:`abort_save`."""
        self._check_bound("save a session")
        digest = session_hash(session_id)
        dir_fd = self._open_dir()
        try:
            lock_fd = self._flock(dir_fd, WRITERS_LOCK, fcntl.LOCK_SH)
            try:
                found, version, present = self._current(dir_fd, session_id)
                version = self.expected_version(session_id, version, replace=replace, found=present)
                base, compact = self._base_plan(found)
                segment = f"{digest}.{secrets.token_hex(8)}{SEGMENT_SUFFIX}"
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                try:
                    if self.block_tokens:  # staged in memory, cut into blocks and a tail at commit
                        fd = memory_file(segment)
                    else:
                        fd = os.open(segment, flags, 0o600, dir_fd=dir_fd)
                except OSError as e:
                    raise os_failure(
                        CheckpointWriteError,
                        e,
                        f"cannot save session {session_id!r} (creating its segment file)",
                        after="; the previous file, if any, is unchanged",
                    ) from None
            except BaseException:
                os.close(lock_fd)
                raise
        finally:
            os.close(dir_fd)
        plan = SavePlan(session_id, digest, segment, fd, secrets.token_hex(16), base, lock_fd, version)
        plan.staged, plan.compact, plan.replace = bool(self.block_tokens), compact, replace
        return plan

    def _current(self, dir_fd: int, session_id: str) -> tuple[SessionManifest | None, Any, bool]:
        """(``session_id``'s manifest, its version, whether a file is there): the version is its
        tag, or :data:`_UNREADABLE` for a damaged or foreign one (which no process owns)."""
        try:
            m = self._manifest(dir_fd, session_id)
        except StoreUnavailable:
            raise
        except CheckpointNotFound:
            return None, None, False
        except CheckpointError:
            return None, _UNREADABLE, True  # damaged or foreign: a save writes everything
        return m, m.tag, True

    def current_version(self, session_id: str) -> tuple[Any, bool]:
        dir_fd = self._open_dir()
        try:
            _, version, present = self._current(dir_fd, session_id)
        finally:
            os.close(dir_fd)
        return version, present

    def commit_save(self, plan: SavePlan, written: SaveFileReply) -> SessionManifest:
        """Publish what the worker wrote into ``plan``'s segment (its save_file reply ``written``):
        replace the manifest atomically (temp file, fsync, rename, directory fsync) and delete the
        segments it no longer names. The previous save stays loadable until the rename.

        Raises :class:`SaveConflict` when the save appended to a manifest another writer replaced
        meanwhile (nothing is published; save again)."""
        try:
            start, position = written.start, written.position
            dir_fd = self._open_dir()
            try:
                new_refs: builtins.list[SegmentRef] | None = None
                if plan.staged and not (start == position and plan.base is not None):
                    new_refs = self._store_pieces(dir_fd, plan, written)  # before the lock: the big writes
                os.close(plan.fd)
                plan.fd = -1
                with self._locked(dir_fd, COMMIT_LOCK, fcntl.LOCK_EX):
                    # Under the commit lock, the check and the rename are one step for every
                    # writer of the directory (--shared-store servers, the chat app).
                    current, version, present = self._current(dir_fd, plan.session_id)
                    if not plan.replace and version != plan.version:
                        raise self.conflict(plan.session_id, plan.version is None, present)
                    if start == position and plan.base is not None:  # nothing new: no segment
                        self._unlink(dir_fd, plan.segment)
                        new_refs = []
                    elif new_refs is None:
                        new_refs = [SegmentRef(plan.segment, start, position, written.file_length, written.header_crc)]
                    m = self.next_manifest(plan, written, current, new_refs)
                    name = plan.digest + SUFFIX
                    replace_file(
                        dir_fd,
                        name,
                        [encode_session_manifest(m)],
                        temp_prefix=plan.digest,
                        display=f"session {plan.session_id!r} ({self.path / name})",
                    )
                    self.adopt(plan.session_id, m.tag, saved=True)
                    keep = {r.name for r in m.segments}
                    for ref in current.segments if current is not None else []:
                        if ref.name not in keep and not ref.shared:  # blocks go with clean()
                            self._unlink(dir_fd, ref.name)
                    return m
            finally:
                os.close(dir_fd)
        except BaseException:
            self.abort_save(plan)
            raise
        finally:
            self._release(plan)

    def _store_pieces(self, dir_fd: int, plan: SavePlan, written: SaveFileReply) -> builtins.list[SegmentRef]:
        """Write a staged save's pieces: each block not yet in the store (linked in under its key,
        so concurrent writers of one block both succeed) and the tail as the plan's segment file.
        Returns the refs that follow the base's kept segments."""
        _, pieces, memory = self._cut(plan, written)
        try:
            refs, linked = [], False
            for piece in pieces:
                what = f"session {plan.session_id!r} ({self.path / (piece.name or plan.segment)})"
                try:
                    if piece.key is None:
                        self._write_new(dir_fd, plan.segment, piece.plan.buffers)
                    else:
                        linked |= self._put_block(dir_fd, piece)
                except OSError as e:
                    raise os_failure(
                        CheckpointWriteError,
                        e,
                        f"cannot save {what}",
                        after="; the previous file, if any, is unchanged",
                    ) from None
                name = plan.segment if piece.key is None else piece.name
                assert name is not None
                refs.append(
                    SegmentRef(
                        name,
                        piece.start,
                        piece.end,
                        piece.plan.file_length,
                        piece.plan.header_crc,
                        piece.key is not None,
                    )
                )
            if linked:
                os.fsync(dir_fd)  # the blocks' names are durable before a manifest names them
            return refs
        finally:
            del pieces
            memory.close()

    @staticmethod
    def _write_new(dir_fd: int, name: str, buffers: builtins.list[Any]) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            _write_all(fd, buffers)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _put_block(self, dir_fd: int, piece: Piece) -> bool:
        """Store block ``piece`` unless a file of its name with its header is there; returns
        whether it wrote one. A damaged block of that name is replaced."""
        name = piece.name
        assert name is not None
        try:
            fd, _ = _open_regular(name, dir_fd)
        except CheckpointNotFound:
            present = None
        else:
            try:
                present = read_segment_header(fd, name).header_crc == piece.plan.header_crc
            except CheckpointError:
                present = False
            finally:
                os.close(fd)
        if present:
            return False
        temp = f".{piece.key}.{secrets.token_hex(8)}.tmp"
        try:
            self._write_new(dir_fd, temp, piece.plan.buffers)
            if present is None:
                try:
                    os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                except FileExistsError:
                    pass  # another writer stored the same block meanwhile
            else:
                os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            self._unlink(dir_fd, temp)
        return True

    def abort_save(self, plan: SavePlan) -> None:
        """Undo :meth:`begin_save`: remove the new segment (when not published) and release the lock."""
        if plan.fd >= 0:
            os.close(plan.fd)
            plan.fd = -1
        if plan.lock_fd >= 0:
            try:
                dir_fd = self._open_dir()
            except CheckpointError:
                pass
            else:
                try:
                    if not self._names_segment(dir_fd, plan):
                        self._unlink(dir_fd, plan.segment)
                finally:
                    os.close(dir_fd)
        self._release(plan)

    def _names_segment(self, dir_fd: int, plan: SavePlan) -> bool:
        """Whether the session's manifest may name the plan's segment (a failed commit may have
        published it): a manifest the system failed to read keeps the segment."""
        try:
            m = self._manifest(dir_fd, plan.session_id)
        except StoreUnavailable:
            return True  # cannot tell: clean() decides, knowing which manifests it could not read
        except CheckpointError:
            return False  # none, or one this save did not write (it writes a readable one)
        return m is not None and any(r.name == plan.segment for r in m.segments)

    @staticmethod
    def _release(plan: SavePlan) -> None:
        if plan.lock_fd >= 0:
            os.close(plan.lock_fd)
            plan.lock_fd = -1

    @staticmethod
    def _unlink(dir_fd: int, name: str) -> None:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError:
            pass  # a stray segment is what clean() removes; the published state is what counts

    # -- removing -------------------------------------------------------------------------------

    def put_record(self, key: str, data: bytes) -> None:
        name = self.checked_record(key, data)
        dir_fd = self._open_dir()
        try:
            replace_file(dir_fd, name, [data], temp_prefix=name[:64], display=f"record {key!r}")
        finally:
            os.close(dir_fd)

    def get_record(self, key: str) -> bytes:
        name = self.record_name(key)
        dir_fd = self._open_dir()
        try:
            fd, st = _open_regular(name, dir_fd)
            try:
                if st.st_size > MAX_RECORD_BYTES:
                    raise CheckpointCorrupt(f"record {key!r} is {st.st_size} bytes, over {MAX_RECORD_BYTES}")
                return os.pread(fd, st.st_size, 0)
            finally:
                os.close(fd)
        except CheckpointNotFound:
            raise CheckpointNotFound(f"no record {key!r}") from None
        except OSError as e:
            raise os_failure(CheckpointReadError, e, f"cannot read record {key!r}") from None
        finally:
            os.close(dir_fd)

    def delete_record(self, key: str) -> bool:
        dir_fd = self._open_dir()
        try:
            os.unlink(self.record_name(key), dir_fd=dir_fd)
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            raise os_failure(CheckpointWriteError, e, f"cannot delete record {key!r}") from None
        finally:
            os.close(dir_fd)

    def delete(self, session_id: str) -> bool:
        """Remove ``session_id``'s saved files; return whether one existed. Live sessions are untouched.

        Whatever sits at the manifest's path goes: a symlink or FIFO is unlinked (never followed
        or opened) and a directory removed with its contents, so an unusable id becomes usable
        again. The segments of a manifest that cannot be read stay until :meth:`clean`."""
        digest = session_hash(session_id)
        name = digest + SUFFIX
        self.forget(session_id)
        dir_fd = self._open_dir()
        try:
            with self._locked(dir_fd, WRITERS_LOCK, fcntl.LOCK_SH), self._locked(dir_fd, COMMIT_LOCK, fcntl.LOCK_EX):
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    return False
                m = None
                if stat.S_ISREG(st.st_mode):
                    try:
                        m = self._manifest(dir_fd, session_id)
                    except CheckpointError:
                        pass  # damaged, foreign or unreadable: what it names goes with clean()
                try:
                    if stat.S_ISDIR(st.st_mode):
                        remove_tree(dir_fd, name)
                    else:
                        os.unlink(name, dir_fd=dir_fd)
                except FileNotFoundError:
                    return False  # a concurrent delete won
                for ref in m.segments if m is not None else []:
                    if not ref.shared:  # blocks other sessions may name go with clean()
                        self._unlink(dir_fd, ref.name)
                os.fsync(dir_fd)
                return True
        except OSError as e:
            raise os_failure(
                CheckpointWriteError, e, f"cannot delete session {session_id!r} ({self.path / name})"
            ) from None
        finally:
            os.close(dir_fd)

    def clean(self, *, older_than: float = 0.0) -> CleanResult:
        """Remove what killed writers left behind, temporary files and segments no manifest
        names, and the shared blocks no manifest names any more (their sessions were deleted or
        moved on), of those last modified more than ``older_than`` seconds ago.

        Runs only when no writer holds the store (raises :class:`StoreBusy` otherwise), so nothing
        it removes is a save in progress, and no block it removes is about to be named. A manifest
        it cannot read protects what it may name (:meth:`survey`): its session's segments, and
        every block. Returns (the names removed, their bytes), and what was kept for manifests it
        could not read (:class:`CleanResult`)."""
        cutoff = time.time() - seconds("older_than", older_than)
        dir_fd = self._open_dir()
        try:
            with self._locked(dir_fd, WRITERS_LOCK, fcntl.LOCK_EX | fcntl.LOCK_NB):
                names = sorted(os.listdir(dir_fd))
                survey = self.survey(
                    (n for n in names if MANIFEST_NAME.fullmatch(n)), lambda n: self._read_saved(dir_fd, n)
                )
                stray, kept = survey.partition(names)
                removed, nbytes = [], 0
                for name in [*(n for n in names if _TEMP_NAME.fullmatch(n)), *stray]:
                    try:
                        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode) and st.st_mtime <= cutoff:
                            os.unlink(name, dir_fd=dir_fd)
                            removed.append(name)
                            nbytes += st.st_size
                    except FileNotFoundError:
                        continue
                if removed:
                    os.fsync(dir_fd)
                return CleanResult(sorted(removed), nbytes, kept=kept, unreadable=survey.unreadable)
        except OSError as e:
            raise os_failure(CheckpointWriteError, e, f"cannot clean the session store {str(self.path)!r}") from None
        finally:
            os.close(dir_fd)

    def files_of(self, session_id: str) -> builtins.list[Path]:
        """The files holding ``session_id`` now: its manifest, then its segments in order."""
        dir_fd = self._open_dir()
        try:
            m = self._manifest(dir_fd, session_id)
        finally:
            os.close(dir_fd)
        return [self.path_for(session_id), *(self.path / r.name for r in (m.segments if m is not None else []))]
