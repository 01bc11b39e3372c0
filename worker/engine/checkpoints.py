"""The engine's checkpoint calls, on the engine thread (a part of :class:`~.core.Engine`).

- Files (the worker's path, checkpoint_files.py): :meth:`begin_save` plans writing a session's
  rows into a segment file and :meth:`finish_save` records its new durable base once the worker's
  I/O thread has written them; :meth:`begin_restore` reserves a slot for segments the I/O thread
  reads in, and :meth:`finish_restore` publishes the session.
- Host memory (in-process callers and tests): :meth:`export_checkpoint` and
  :meth:`restore_checkpoint` run the same jobs on a memory file, on this thread, so a restore has
  one path and one set of checks.

Ownership: the engine thread, as for the rest of the engine (core.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from muxworker.transport.checkpoint import LAYOUT_VERSION, CPUCheckpoint
from muxworker.transport.checkpoint.container import memory_file
from muxworker.transport.checkpoint.file import checkpoint_from_memory, checkpoint_to_memory
from muxworker.transport.checkpoint.segments import SegmentRef
from muxworker.transport.errors import (
    CapacityExhausted,
    CheckpointRejected,
    ContextOverflow,
    InvalidArgument,
    SessionExists,
    Unsaveable,
)
from muxworker.transport.messages import SaveBase, SaveFileReply
from muxworker.worker.backends.interface import Executor, geometry
from muxworker.worker.engine import checkpoint_files
from muxworker.worker.engine.state import Session

if TYPE_CHECKING:
    from muxworker.worker.engine.config import EngineConfig
    from muxworker.worker.engine.speculative import DraftProposer

__all__ = ["EngineCheckpoints"]


class EngineCheckpoints:
    """The checkpoint half of :class:`~.core.Engine` (which supplies what is declared here)."""

    if TYPE_CHECKING:
        executor: Executor
        cache: Any
        config: EngineConfig
        vocab_size: int
        _draft_model: DraftProposer | None
        _sessions: dict[str, Session]
        _free_slots: list[int]
        _restoring: set[str]

        @property
        def draft(self) -> Executor | None: ...

        @property
        def draft_model(self) -> DraftProposer | None: ...

        def _idle_session(self, sid: str) -> Session: ...

        def _check_ready(self) -> None: ...

        @staticmethod
        def _check_session_id(sid: object) -> str: ...

        def _check_not_restoring(self, sid: str) -> None: ...

    def executor_format(self) -> dict[str, Any]:
        return {"backend": self.executor.backend, "dtype": self.executor.dtype_name, "layout_version": LAYOUT_VERSION}

    def geometry(self) -> dict[str, Any]:
        return geometry(self.executor)

    def draft_geometry(self) -> dict[str, Any] | None:
        return None if self._draft_model is None else self._draft_model.geometry

    @staticmethod
    def _check_saveable(s: Session) -> None:
        if s.request is not None:
            raise Unsaveable(f"session {s.sid!r} is busy generating (request {s.request.rid})")
        if s.unsaveable is not None:
            raise Unsaveable(f"session {s.sid!r} cannot be saved: {s.unsaveable}")
        if s.kv_len == 0:
            raise Unsaveable(f"session {s.sid!r} cannot be saved: empty")

    def export_checkpoint(self, sid: str, position: int | None = None) -> CPUCheckpoint:
        """An independent host copy of a session's committed state at ``position`` (default: the
        committed boundary, every token whose KV the cache holds), draft-model state included.

        The same path as a save: the rows are written as one segment into a memory file and read
        back with every check a restore makes (checkpoint_files.py), on this thread.
        """
        fd = memory_file("export")
        try:
            job = self.begin_save(sid, fd, tag=None, base=None, identity="", max_bytes=1 << 62, position=position)
            error = None
            try:
                job.write()
            except BaseException as e:
                error = e
            return checkpoint_from_memory(fd, self.finish_save(job, error), sid)
        finally:
            os.close(fd)

    def restore_checkpoint(self, sid: str, checkpoint: CPUCheckpoint, position: int | None = None) -> None:
        """Publish a new session ``sid`` continuing from ``position`` of ``checkpoint`` (default:
        all of it). Everything is validated before the session exists; a rejected restore leaves
        ``sid`` unused. The same path as a restore from the store: the checkpoint is written as
        one segment into a memory file and read into a free slot with every check, on this thread.
        """
        fd, ref = checkpoint_to_memory(sid, checkpoint, position)
        try:
            identity = checkpoint.identity or ""
            job = self.begin_restore(sid, [fd], [ref], tag=None, identity=identity, max_bytes=1 << 62)
            error = None
            try:
                job.read()
            except BaseException as e:
                error = e
            self.finish_restore(job, error)
        finally:
            os.close(fd)

    # ----------------------------------------------------------------- checkpoint files

    def begin_save(
        self,
        sid: str,
        fd: int,
        *,
        tag: str | None,
        base: SaveBase | None,
        identity: str,
        max_bytes: int,
        position: int | None = None,
    ) -> checkpoint_files.SaveJob:
        """Plan writing session ``sid`` at ``position`` (default: its committed boundary) as one
        segment into the open, empty file ``fd`` (checkpoint_files.py): only the rows after
        ``base.position`` when the session's slot still holds what the store's save ``base.tag``
        does up to there, else all of them; a draft model's state goes with them. The session is
        busy from here (SessionBusy) until :meth:`finish_save`; the caller runs ``job.write()`` on
        another thread, which reads the rows straight from the slot. ``tag`` None: not a store's
        save (an export), which records no durable base."""
        s = self._idle_session(sid)
        self._check_saveable(s)
        if position is None:
            position = s.kv_len
        if isinstance(position, bool) or not isinstance(position, int) or not 1 <= position <= s.kv_len:
            raise InvalidArgument(f"export position must be in [1, {s.kv_len}], got {position!r}")
        if not self.cache.can_truncate(s.kv_len, position, s.kv_floor):
            raise CheckpointRejected(
                f"session {sid!r} no longer retains the history position {position} needs "
                f"(earliest is {self.cache.earliest_position(s.kv_len, s.kv_floor)})"
            )
        job = checkpoint_files.plan_save(
            self, s, fd, tag=tag, base=base, session_id=sid, identity=identity, max_bytes=max_bytes, position=position
        )
        s.saving = True
        return job

    def finish_save(self, job: checkpoint_files.SaveJob, error: BaseException | None) -> SaveFileReply:
        """Once ``job.write()`` has returned (``error`` None) or raised ``error``: the session is
        idle again and, when the write succeeded, its rows are durable under the save's tag; return
        what the store records (``SaveJob.reply``), or raise ``error`` (the durable base unchanged)."""
        s = job.session
        s.saving = False
        if error is not None:
            raise error
        if job.tag is not None:
            s.durable = (job.tag, job.position)
        return job.reply()

    def begin_restore(
        self,
        sid: str,
        fds: Sequence[int],
        refs: Sequence[SegmentRef],
        *,
        tag: str | None,
        identity: str,
        max_bytes: int,
        saved_id: str | None = None,
    ) -> checkpoint_files.RestoreJob:
        """Reserve a free slot for a new session ``sid`` restored from the open segment files of the
        saved session ``saved_id`` (default ``sid``: the segments must hold it), all of its history.
        The caller runs ``job.read()`` on another thread, which reads the rows into the slot and
        checks them, then :meth:`finish_restore`; meanwhile ``sid`` is busy (SessionBusy)."""
        self._check_ready()
        self._check_session_id(sid)
        if sid in self._sessions:
            raise SessionExists(f"session {sid!r} is already open; restore needs an unused session id")
        self._check_not_restoring(sid)
        if refs and refs[-1].end >= self.config.max_session_tokens:
            raise ContextOverflow(
                f"restore position {refs[-1].end} leaves no room in max_session_tokens ({self.config.max_session_tokens})"
            )
        if not self._free_slots:
            raise CapacityExhausted(f"all {self.config.max_sessions} session slots are in use (max_sessions)")
        job = checkpoint_files.RestoreJob(
            sid=sid,
            slot=self._free_slots.pop(),
            tag=tag,
            executor=self.executor,
            fds=fds,
            refs=refs,
            saved_id=sid if saved_id is None else saved_id,
            identity=identity,
            max_bytes=max_bytes,
            format=self.executor_format(),
            geometry=self.geometry(),
            vocab_size=self.vocab_size,
            draft_geometry=self.draft_geometry(),
        )
        self._restoring.add(sid)
        return job

    def finish_restore(self, job: checkpoint_files.RestoreJob, error: BaseException | None) -> int:
        """Once ``job.read()`` has returned (``error`` None) or raised ``error``: publish the
        session and return its position, or free the slot and raise (``sid`` stays unused)."""
        self._restoring.remove(job.sid)
        try:
            if error is not None:
                raise error
            floor = job.import_staged()
            draft_floor = 0
            draft_len = job.draft_position
            if job.draft_layers is not None and draft_len:
                assert self.draft is not None
                draft_floor = self.draft.import_layers(job.slot, draft_len, job.draft_layers)
        except BaseException:
            self._free_slots.append(job.slot)
            raise
        self._sessions[job.sid] = Session(
            job.sid,
            job.slot,
            job.tokens,
            job.position,
            unsaveable=None,
            draft_len=draft_len,
            kv_floor=floor,
            draft_floor=draft_floor,
            durable=None if job.tag is None else (job.tag, job.position),
            salt_known=False,
        )
        return job.position
