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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from muxworker.transport.checkpoint import (
    CheckpointIncompatible,
    CPUCheckpoint,
    checkpoint_from_wire,
    checkpoint_to_wire,
)
from muxworker.transport.errors import InvalidArgument

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

    Arguments are checked by the client before they get here."""

    def __init__(self) -> None:
        self._lock = trio.Lock()

    async def export(
        self, connection: Connection, session_id: str, position: int | None, identity: str | None
    ) -> CPUCheckpoint:
        async with self._lock:
            return await _export(connection, session_id, position, identity)

    async def restore(
        self, connection: Connection, checkpoint: CPUCheckpoint, session_id: str, position: int | None
    ) -> None:
        async with self._lock:
            await _restore(connection, checkpoint, session_id, position)

    async def save(
        self, connection: Connection, store: StoreBinding, session_id: str, info: WorkerInfo | None
    ) -> SaveResult:
        """Save through the worker's file channel when it has one (the worker writes the rows
        straight from its cache into a segment the store created; only what is new since the last
        save), else export through the pipe and write the file here."""
        async with self._lock:
            if not _takes_files(connection, info):
                checkpoint = await _export(connection, session_id, None, store.identity)
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(store.save, session_id, checkpoint)
                return SaveResult(checkpoint.position, 0, checkpoint.nbytes, 1)
            plan = await trio.to_thread.run_sync(store.begin_save, session_id)
            try:
                fields = {
                    "session_id": session_id,
                    "fds": 1,
                    "tag": plan.tag,
                    "base": store.base_of(plan),
                    "identity": store.identity,
                    "max_bytes": store.max_bytes,
                }
                written = await connection.transfer("save_file", fields, expect="ok", fds=[plan.fd])
            except BaseException:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(store.abort_save, plan)
                raise
            with trio.CancelScope(shield=True):
                manifest = await trio.to_thread.run_sync(
                    store.commit_save, plan, written, written["format"], written["geometry"]
                )
            return SaveResult(written["position"], written["start"], written["payload_bytes"], len(manifest.segments))

    async def resume(
        self, connection: Connection, store: StoreBinding, session_id: str, info: WorkerInfo | None
    ) -> None:
        """Restore through the worker's file channel when it has one (the store vets and opens the
        files; the worker reads them straight into a free slot), else load here and send them."""
        async with self._lock:
            if not _takes_files(connection, info):
                # A cancel during the read takes effect when it returns, before anything is sent.
                checkpoint = await trio.to_thread.run_sync(store.load, session_id)
                await _restore(connection, checkpoint, session_id, None)
                return
            plan = await trio.to_thread.run_sync(store.begin_resume, session_id)
            try:
                fields: dict[str, Any] = {
                    "session_id": session_id,
                    "fds": len(plan.fds),
                    "identity": store.identity,
                    "max_bytes": store.max_bytes,
                }
                if plan.manifest is None:
                    fields["legacy"] = True
                else:
                    fields["tag"] = plan.manifest.tag
                    fields["segments"] = [ref.to_wire() for ref in plan.manifest.segments]
                await connection.transfer("restore_file", fields, expect="ok", fds=plan.fds)
            finally:
                plan.close()


def _takes_files(connection: Connection, info: WorkerInfo | None) -> bool:
    """Whether checkpoints go through the worker's file channel: it has one, and runs no draft
    model (whose state only the in-memory checkpoint carries)."""
    return connection.files is not None and info is not None and info.files and not runs_draft_model(info)


def runs_draft_model(info: WorkerInfo) -> bool:
    """Whether the worker runs a draft model (``n_draft`` > 0 without ``--speculative ngram``,
    whose proposals come from the history and hold no state of their own)."""
    return bool(info.limits.get("n_draft")) and info.limits.get("speculative") != "ngram"


def require_store(store: StoreBinding | None, info: WorkerInfo | None) -> StoreBinding:
    """The client's store, checked against what the worker says it runs."""
    if store is None:
        raise InvalidArgument("this client has no session_store; pass one to spawn_multiplexed_worker")
    if info is not None:  # what the worker says it runs must be what the store declares
        store.check_worker(info)
    return store


async def _export(connection: Connection, session_id: str, position: int | None, identity: str | None) -> CPUCheckpoint:
    frame = await connection.transfer("export", {"session_id": session_id, "position": position}, expect="checkpoint")
    checkpoint = checkpoint_from_wire(frame.control["checkpoint"], frame.payloads)
    if identity is not None:
        checkpoint.identity = identity
        checkpoint.validate()
    return checkpoint


async def _restore(connection: Connection, checkpoint: CPUCheckpoint, session_id: str, position: int | None) -> None:
    if not isinstance(checkpoint, CPUCheckpoint):
        raise InvalidArgument(f"expected a CPUCheckpoint, got {type(checkpoint).__name__}")
    if position is None:
        position = checkpoint.position
    manifest, payloads = checkpoint_to_wire(checkpoint)
    await connection.transfer(
        "restore",
        {"session_id": session_id, "position": position, "checkpoint": manifest},
        list(payloads),
        expect="ok",
    )


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
