"""The server's eviction saves against a store that stops answering or refuses them (issue 40):
with the S3 store frozen, a turn whose slot needs an eviction save waited the queue's 60 s despite
``--store-timeout 30``, and ``/health`` said ok meanwhile (item 7); an eviction save over another
writer's save must drop the stale copy and tell the session's next request (item 1).

The real ModelService and SessionRuntime over the in-process fake worker (two slots), whose store
holds every save where a real store's commit runs when frozen (the save never returns until
released). ``/health``'s status is "degraded" exactly when ``store_health()`` is not "ok"
(app.py); the HTTP status of StoreUnavailable (503) and SaveConflict (409) is transport/errors.py's
table. trio.fail_after is a hang guard.
"""

from __future__ import annotations

import pytest
import trio
from helpers.fake_worker import FakeStore, fake_worker_client
from helpers.params import greedy

from muxworker.client import SessionRuntime
from muxworker.client.stores import SaveConflict, StoreUnavailable
from muxworker.serve.metrics import ServerMetrics
from muxworker.serve.service import ModelService, ServiceConfig
from muxworker.worker.spec import WorkerSpec

HANG_GUARD_S = 30.0
TIMEOUT_S = 0.2  # --store-timeout
PROMPT = list(range(10, 30))


class OwnedStore(FakeStore):
    """A FakeStore whose saves of the sessions in ``superseded`` fail as a real store's do when
    another writer (a second server) saved them since (client/stores/binding.py): SaveConflict,
    nothing published, the refusal kept for ``take_conflict``."""

    def __init__(self) -> None:
        super().__init__()
        self.superseded: set[str] = set()
        self._conflicts: dict[str, str] = {}

    def take_conflict(self, session_id: str) -> str | None:
        return self._conflicts.pop(session_id, None)

    async def _commit(self, session_id, checkpoint) -> None:
        if session_id in self.superseded:
            self._conflicts[session_id] = f"session {session_id!r} was not saved: another writer saved it"
            raise SaveConflict(self._conflicts[session_id])
        await super()._commit(session_id, checkpoint)


@pytest.fixture
async def served(tmp_path):
    """(the service, its runtime, its frozen-able store): two idle sessions, each with a turn to save,
    fill both slots. The spec names no model: no worker process is started."""
    store = OwnedStore()
    service = ModelService(
        WorkerSpec(tmp_path / "model", ()), store, ServerMetrics(), ServiceConfig(store_timeout_s=TIMEOUT_S)
    )
    async with fake_worker_client(session_store=store, max_sessions=2, max_session_tokens=4096) as client:
        runtime = SessionRuntime(client, evict_idle_to_store=True)
        # What ModelService.run sets up once its worker is ready (no worker process here).
        service._client, service._runtime = client, runtime
        service._ready.set()
        for sid in ("a", "b"):
            await runtime.open_session(sid)
            await runtime.generate(sid, PROMPT, greedy(n=2)).wait()
        yield service, runtime, store


async def test_an_eviction_save_on_a_frozen_store_is_a_503_within_the_store_timeout(served):
    service, runtime, store = served
    with trio.fail_after(HANG_GUARD_S):
        store.hold_saves()
        # A new session needs a slot: the eviction of "a" (used least recently) meets the frozen store.
        with pytest.raises(StoreUnavailable, match="did not answer within 0.2 s"):
            await service._room(lambda: runtime.open_session("c"))
        assert service.store_health()["status"] == "failing"  # /health: degraded
        # The eviction and the open go on under their sessions' leases; once the store answers
        # they complete: a is kept in the store, c is live.
        store.release()
        while runtime.session_state("c") != "live":
            await trio.sleep(0.01)
        assert runtime.session_state("a") == "evicted" and store.list() == ["a"]
        result = await runtime.generate("a", PROMPT, greedy(n=2)).wait()  # evicts b, resumes a
        assert result.resumed_from_store is True
        # The failure is reported until a store call is known to have reached the store: the
        # save after the turn, here.
        assert service.store_health()["status"] == "failing"
        await service._store_call(runtime.save_session("a"))
        assert service.store_health() == {"status": "ok"}


async def test_health_is_degraded_while_a_store_call_runs_past_the_store_timeout(served):
    service, runtime, store = served
    with trio.fail_after(HANG_GUARD_S):
        store.hold_saves()
        async with trio.open_nursery() as nursery:
            # A background save after a turn (unbounded: it completes whenever the store answers).
            nursery.start_soon(service._store_call, runtime.save_session("b"))
            await store.wait_entered()
            assert service.store_health() == {"status": "ok"}  # within the timeout: not yet
            await trio.sleep(TIMEOUT_S * 2)
            health = service.store_health()
            assert health["status"] == "failing" and "has not returned" in health["error"], health
            store.release()
        assert service.store_health() == {"status": "ok"} and store.list() == ["b"]


async def test_an_eviction_save_over_another_writers_drops_the_copy_and_the_next_request_is_told(served):
    service, runtime, store = served
    with trio.fail_after(HANG_GUARD_S):
        store.superseded.add("a")
        # The slot is freed all the same: the stale copy of a is closed, not saved, not kept.
        await service._room(lambda: runtime.open_session("c"))
        assert runtime.session_state("a") is None and store.list() == []
        assert runtime.session_stats["eviction_failures"] == 0
        # a's next request is answered 409 save_conflict, once; the one after resumes the store's.
        with pytest.raises(SaveConflict, match="another writer saved it"):
            await service.ensure_owned(runtime, "a")
        await service.ensure_owned(runtime, "a")
