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

    from .store import SessionStore

__all__ = ["CheckpointQueue"]


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

    async def save(self, connection: Connection, store: SessionStore, session_id: str) -> None:
        async with self._lock:
            checkpoint = await _export(connection, session_id, None, store.identity)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(store.save, session_id, checkpoint)

    async def resume(self, connection: Connection, store: SessionStore, session_id: str) -> None:
        async with self._lock:
            # A cancel during the read takes effect when it returns, before anything is sent.
            checkpoint = await trio.to_thread.run_sync(store.load, session_id)
            await _restore(connection, checkpoint, session_id, None)


def require_store(store: SessionStore | None, info: WorkerInfo | None) -> SessionStore:
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
