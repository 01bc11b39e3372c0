"""Checkpoint operations of one client: export, restore, save and resume, in one FIFO queue.

Owner: :class:`CheckpointQueue` owns the client's checkpoint lock. Every checkpoint operation,
high-level (save/resume through a :class:`~.store.SessionStore`) and advanced (export/restore of a
:class:`CPUCheckpoint`), waits on it in call order (``trio.Lock`` is fair), so two never interleave
their transfers.

Checkpoint calls are cancellable until their transfer starts: while queued behind other checkpoint
operations, while a resume reads its file, and until the first byte of the request frame is
written. From then on a cancel waits for the transfer to settle (so a save never leaves half a
result behind); a worker that stops answering ends it through the liveness rule.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from muxworker.transport.checkpoint import DEFAULT_MAX_BYTES, CheckpointIncompatible, CheckpointNotFound, CPUCheckpoint
from muxworker.transport.checkpoint.container import memory_file
from muxworker.transport.checkpoint.file import checkpoint_from_memory, checkpoint_to_memory
from muxworker.transport.errors import InvalidArgument
from muxworker.transport.messages import RestoreFileRequest, SaveFileReply, SaveFileRequest

from .connection import Connection

if TYPE_CHECKING:
    from muxworker.transport.messages import WorkerInfo

    from .stores import StoreBinding

__all__ = ["CheckpointQueue", "SaveResult"]


@dataclass(frozen=True)
class SaveResult:
    """What a ``save_session`` wrote: positions ``[start, position)`` of the session (``start`` > 0:
    an incremental save on top of the previous one; ``start == position``: nothing was new), their
    token ids and KV rows in ``payload_bytes``, and how many segment files the session now has."""

    position: int
    start: int
    payload_bytes: int
    segments: int

    @property
    def incremental(self) -> bool:
        return self.start > 0


class CheckpointQueue:
    """Export, restore, save and resume over one connection, one at a time, first come first served.

    Every one moves segment files over the worker's file channel: a save or resume the store's
    (the worker writes the rows straight from its cache slot, or reads them straight into a free
    one), an export or restore of a :class:`CPUCheckpoint` one segment in a memory file.
    Arguments are checked by the client before they get here."""

    def __init__(self) -> None:
        self._lock = trio.Lock()

    async def export(
        self, connection: Connection, session_id: str, position: int | None, identity: str | None
    ) -> CPUCheckpoint:
        """The session (up to ``position``) as a host checkpoint stamped with ``identity``."""
        async with self._lock:
            _require_files(connection)
            fd = memory_file("export")
            try:
                request = SaveFileRequest(session_id, identity or "", DEFAULT_MAX_BYTES, position=position)
                written = await _save_file(connection, request, fd)
                with trio.CancelScope(shield=True):
                    checkpoint = await trio.to_thread.run_sync(checkpoint_from_memory, fd, written, session_id)
            finally:
                os.close(fd)
            return checkpoint

    async def restore(
        self, connection: Connection, checkpoint: CPUCheckpoint, session_id: str, position: int | None
    ) -> None:
        """Publish ``checkpoint`` (cut back to ``position``) in the worker as ``session_id``."""
        async with self._lock:
            _require_files(connection)
            fd, ref = await trio.to_thread.run_sync(checkpoint_to_memory, session_id, checkpoint, position)
            try:
                request = RestoreFileRequest(session_id, checkpoint.identity or "", DEFAULT_MAX_BYTES, (ref,))
                await connection.transfer(request.KIND, request.fields(), expect="ok", fds=[fd])
            finally:
                os.close(fd)

    async def save(self, connection: Connection, store: StoreBinding, session_id: str) -> SaveResult:
        """The worker writes the session's rows straight from its cache into a segment the store
        created: only what is new since the last save."""
        async with self._lock:
            _require_files(connection)
            plan = await trio.to_thread.run_sync(store.begin_save, session_id)
            try:
                request = SaveFileRequest(
                    session_id, store.identity, store.max_bytes, tag=plan.tag, base=store.base_of(plan)
                )
                written = await _save_file(connection, request, plan.fd)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(store.abort_save, plan)
                raise
            with trio.CancelScope(shield=True):
                manifest = await trio.to_thread.run_sync(store.commit_save, plan, written)
            return SaveResult(written.position, written.start, written.payload_bytes, len(manifest.segments))

    async def resume(self, connection: Connection, store: StoreBinding, session_id: str) -> None:
        """The store vets and opens the files; the worker reads them straight into a free slot."""
        async with self._lock:
            _require_files(connection)
            try:
                plan = await trio.to_thread.run_sync(store.begin_resume, session_id)
            except CheckpointNotFound:
                store.forget(session_id)  # nothing saved: a save of it now must find nothing either
                raise
            try:
                m = plan.manifest
                request = RestoreFileRequest(session_id, store.identity, store.max_bytes, tuple(m.segments), tag=m.tag)
                await connection.transfer(request.KIND, request.fields(), expect="ok", fds=plan.fds)
            finally:
                plan.close()
            # The worker holds this version now: the session's next save must find it still there.
            store.adopt(session_id, plan.version)


def _require_files(connection: Connection) -> None:
    if connection.files is None:
        raise InvalidArgument(
            "this worker has no file channel (checkpoints travel as files): start it with spawn_multiplexed_worker"
        )


async def _save_file(connection: Connection, request: SaveFileRequest, fd: int) -> SaveFileReply:
    value = await connection.transfer(request.KIND, request.fields(), expect="ok", fds=[fd])
    return SaveFileReply.from_wire(value)


def require_store(store: StoreBinding | None, info: WorkerInfo | None) -> StoreBinding:
    """The client's store, checked against what the worker says it runs."""
    if store is None:
        raise InvalidArgument("this client has no session_store; pass one to spawn_multiplexed_worker")
    if info is not None:  # what the worker says it runs must be what the store declares
        store.check_worker(info)
    return store


def check_position(position: Any, *, optional: bool) -> int | None:
    if position is None and optional:
        return None
    if isinstance(position, bool) or not isinstance(position, numbers.Integral) or position < 0:
        raise InvalidArgument(f"position must be an int >= 0{' or None' if optional else ''}, got {position!r:.200}")
    return int(position)


def check_identity_arg(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a str or None, got {type(value).__name__}")


def check_identity(checkpoint: CPUCheckpoint, expected: str | None) -> None:
    if expected is not None and checkpoint.identity != expected:
        raise CheckpointIncompatible(
            f"checkpoint identity {checkpoint.identity!r} is not the expected {expected!r}: it was made "
            "for another model or configuration"
        )
