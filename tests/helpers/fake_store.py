"""A session store in a dict, and the checkpoints it keeps, for tests over the fake worker
(fake_worker.py): the methods the runtime and tests call on a real store, and a way to hold saves."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import trio

from muxworker.client.params import WorkerInfo
from muxworker.transport.errors import CheckpointNotFound, ConfigurationMismatch

__all__ = ["FakeCheckpoint", "FakeStore", "ROW_BYTES"]

ROW_BYTES = 256  # KV bytes a FakeCheckpoint counts per position (as a tiny model would hold)


@dataclass
class FakeCheckpoint:
    """A session's committed state: its first ``position`` token ids (their KV is implied)."""

    position: int
    token_ids: np.ndarray  # [position] int32
    identity: str | None = None

    @property
    def nbytes(self) -> int:
        return self.position * (4 + ROW_BYTES)


class FakeStore:
    """A session store in a dict, with the methods tests and the runtime call on a real one.

    ``max_bytes``: a save over it fails with CheckpointTooLarge (as the worker refuses a file over
    the store's limit). :meth:`hold_saves` makes each save wait, after the worker's part and before
    the store commits it (where a real store's ``commit_save`` runs), until :meth:`release`."""

    def __init__(self, identity: str = "fake-identity", *, max_bytes: int = 1 << 30, model: str = "fake") -> None:
        self.identity = identity
        self.max_bytes = max_bytes
        self.model = model
        self.files: dict[str, FakeCheckpoint] = {}
        self.saved: list[str] = []  # every committed save, in order
        self.entered: trio.Event | None = None
        self._hold: trio.Event | None = None

    def check_worker(self, info: WorkerInfo) -> None:
        if info.model.name != self.model:
            raise ConfigurationMismatch(
                f"the store holds sessions of {self.model!r}, the worker runs {info.model.name!r}"
            )

    def list(self) -> list[str]:
        return sorted(self.files)

    def load(self, session_id: str) -> FakeCheckpoint:
        try:
            return self.files[session_id]
        except KeyError:
            raise CheckpointNotFound(f"no saved session {session_id!r}") from None

    def delete(self, session_id: str) -> bool:
        return self.files.pop(session_id, None) is not None

    def hold_saves(self) -> None:
        self.entered, self._hold = trio.Event(), trio.Event()

    async def wait_entered(self) -> None:
        """Until a held save has reached the store."""
        assert self.entered is not None, "call hold_saves() first"
        await self.entered.wait()

    def release(self) -> None:
        if self._hold is not None:
            self._hold.set()

    async def _commit(self, session_id: str, checkpoint: FakeCheckpoint) -> None:
        if self._hold is not None:
            assert self.entered is not None
            self.entered.set()
            await self._hold.wait()
        self.files[session_id] = checkpoint
        self.saved.append(session_id)
