"""The model behind the HTTP server: one worker, its session runtime and the session store.

:class:`ModelService` supervises the worker (spawn, watch, restart after a death), keeps sessions
durable (resume from the store on first use, save after each turn or on eviction, save everything
live at shutdown) and runs one generation for the HTTP layer. It knows nothing of HTTP: errors are
muxworker's exceptions, and :mod:`.app` maps them.

Session ids here are *internal*: ``<tenant>/<id>`` (see :func:`internal_id`), so two API keys never
address the same session, file or prefix-cache namespace.

Owner: the server's trio thread; everything runs in one event loop with the trio client.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import trio

from muxworker.client.checkpoint import CheckpointNotFound
from muxworker.client.client import MultiplexedWorkerClient, spawn_multiplexed_worker
from muxworker.client.errors import ClientClosedError, NotReady, SessionExists, Unsaveable, WorkerDiedError
from muxworker.client.params import GenerationParams
from muxworker.client.runtime import RuntimeStream, SessionRuntime
from muxworker.client.store import SessionInfo, StoreBinding

from .metrics import ServerMetrics

__all__ = ["SavePolicy", "ServiceConfig", "ModelService", "Tenant", "internal_id"]

log = logging.getLogger("muxworker.serve")


class SavePolicy(enum.Enum):
    TURN = "turn"  # save after every completed turn (and on eviction and shutdown)
    EVICT = "evict"  # save only on eviction and shutdown (fewer writes; a crash loses unsaved turns)


@dataclass(frozen=True)
class ServiceConfig:
    save_policy: SavePolicy = SavePolicy.TURN
    max_concurrent_requests: int | None = None  # below the worker's max_inflight_requests
    restart_backoff_s: float = 1.0  # first wait before restarting a dead worker; doubles to 30 s
    shutdown_timeout_s: float = 120.0  # bound on saving live sessions at shutdown
    startup_timeout_s: float = 600.0  # a first start may convert a GGUF


@dataclass(frozen=True)
class Tenant:
    """Whose request this is: a name derived from the API key, or ``local`` without keys."""

    name: str

    @classmethod
    def of_key(cls, key: str | None) -> Tenant:
        if key is None:
            return cls("local")
        return cls("k" + hashlib.sha256(key.encode()).hexdigest()[:16])

    @property
    def prefix(self) -> str:
        return self.name + "/"

    def cache_salt(self, salt: str | None) -> str:
        """The worker's prefix-cache namespace: the tenant, then the request's own salt."""
        return self.name if salt is None else f"{self.name}:{salt}"


def internal_id(tenant: Tenant, session_id: str) -> str:
    return tenant.prefix + session_id


_POLL_S = 0.25  # how often the supervisor checks the worker between requests


class ModelService:
    """One supervised worker with durable sessions (see the module docstring)."""

    def __init__(
        self,
        worker_command: Sequence[str],
        store: StoreBinding,
        metrics: ServerMetrics,
        config: ServiceConfig = ServiceConfig(),
    ) -> None:
        self.worker_command = list(worker_command)
        self.store = store
        self.metrics = metrics
        self.config = config
        self._client: MultiplexedWorkerClient | None = None
        self._runtime: SessionRuntime | None = None
        self._ready = trio.Event()  # set while a worker is up; replaced when it dies
        self._stopping = False
        self._nursery: trio.Nursery | None = None  # background saves and closes
        self._dirty: set[str] = set()  # internal ids with turns not yet in the store
        self._opening: dict[str, list] = {}  # sid -> [lock, users]: serializes a session's first use
        self._background = 0  # background tasks running (saves after turns, closes)
        self._idle = trio.Event()  # set while none runs
        self._idle.set()
        self._stopped = trio.Event()  # set when shutdown() is done
        self._restarting = trio.CancelScope()  # around the supervisor's restarts; shutdown() cancels it
        self.restarts = 0
        self.last_error: str | None = None
        metrics.bind_sessions(lambda: self._runtime.session_stats if self._runtime is not None else {})

    # -- lifecycle ----------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._client is not None and self._client.is_usable

    @property
    def info(self):
        return None if self._client is None else self._client.info

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the worker, report started, then restart it whenever it dies, until
        :meth:`shutdown`. A worker that fails to start the first time fails this call."""
        startup_error: WorkerDiedError | None = None
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                await self._start_worker(nursery)
            except WorkerDiedError as exc:
                # Raised below, outside the nursery, so the caller sees it as is.
                startup_error = exc
                nursery.cancel_scope.cancel()
            else:
                task_status.started()
                await self._supervise(nursery)
        if startup_error is not None:
            raise startup_error

    async def _supervise(self, nursery: trio.Nursery) -> None:
        """Restart the worker whenever it dies, until :meth:`shutdown`, which cancels a restart in
        progress (a start, or the wait before one)."""
        backoff = self.config.restart_backoff_s
        with self._restarting:
            while not self._stopping:
                while self.ready and not self._stopping:
                    await trio.sleep(_POLL_S)
                if self._stopping:
                    break
                self._ready = trio.Event()
                self.metrics.worker_up.set(0)
                client = self._client
                code = client.returncode if client is not None else None
                self.last_error = "the worker died" + (f" (exit status {code})" if code is not None else "")
                log.warning("%s; restarting it", self.last_error)
                await self._drop_worker()
                self.metrics.worker_restarts.inc()
                self.restarts += 1
                while not self._stopping:
                    try:
                        await self._start_worker(nursery)
                        backoff = self.config.restart_backoff_s
                        break
                    except Exception as exc:  # a start that fails in any way is tried again later
                        self.last_error = f"the worker did not restart: {type(exc).__name__}: {exc}"
                        log.error("%s; trying again in %.0f s", self.last_error, backoff)
                        await trio.sleep(backoff)
                        backoff = min(30.0, backoff * 2)
        await self._stopped.wait()  # shutdown() has saved what it could and closed the worker
        nursery.cancel_scope.cancel()

    def _spawn(self, fn, *args) -> None:
        """Run ``fn(*args)`` in the background (saves, closes); :meth:`shutdown` waits for them."""
        if self._nursery is None:
            return
        self._background += 1
        self._idle = trio.Event() if self._background == 1 else self._idle

        async def task() -> None:
            try:
                await fn(*args)
            finally:
                self._background -= 1
                if self._background == 0:
                    self._idle.set()

        self._nursery.start_soon(task)

    async def _start_worker(self, nursery: trio.Nursery) -> None:
        client = await spawn_multiplexed_worker(
            self.worker_command,
            session_store=self.store,
            nursery=nursery,
            startup_timeout=self.config.startup_timeout_s,
        )
        try:
            runtime = SessionRuntime(
                client, max_concurrent_requests=self.config.max_concurrent_requests, evict_idle_to_store=True
            )
        except BaseException:
            with trio.CancelScope(shield=True):
                await client.close()
            raise
        self._client, self._runtime = client, runtime
        self._dirty.clear()  # what the dead worker held unsaved is gone with it
        self._ready.set()
        self.metrics.worker_up.set(1)
        self.last_error = None

    async def _drop_worker(self) -> None:
        runtime, client = self._runtime, self._client
        self._runtime = None
        if runtime is not None:
            with trio.move_on_after(10):
                await runtime.aclose_worker()
        if client is not None:
            await client.close()

    async def shutdown(self) -> None:
        """Let background saves finish, save every live session with unsaved turns, then close the
        worker. Idempotent; bounded by ``shutdown_timeout_s``."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        self._restarting.cancel()
        try:
            with trio.move_on_after(self.config.shutdown_timeout_s) as scope:
                await self._idle.wait()
                runtime = self._runtime
                if runtime is not None and self._ready.is_set():
                    for sid in runtime.live_sessions():
                        if sid in self._dirty:
                            await self._save(runtime, sid)
            if scope.cancelled_caught:
                log.error(
                    "saving live sessions at shutdown took over %.0f s; the rest are lost",
                    self.config.shutdown_timeout_s,
                )
            self._ready = trio.Event()
            self.metrics.worker_up.set(0)
            await self._drop_worker()
        finally:
            self._stopped.set()

    def _live(self) -> tuple[MultiplexedWorkerClient, SessionRuntime]:
        if self._stopping:
            raise ClientClosedError("the server is shutting down")
        if not self.ready or self._runtime is None or self._client is None:
            raise NotReady(self.last_error or "the worker is starting")
        return self._client, self._runtime

    # -- sessions -----------------------------------------------------------------------------------

    def routing_stats(self) -> dict[str, Any]:
        """What a router placing sessions on many servers needs (muxworker.serve.ray): the ids of
        the named sessions live in the worker (without their tenant: the router sees only the
        X-Session-Id header), the worker's free session slots, evictions so far, the worker's pid."""
        runtime, client = self._runtime, self._client
        if runtime is None or client is None or client.info is None:
            return {"ready": False, "sessions": [], "free_slots": 0, "evictions": 0, "worker_pid": None}
        live = runtime.live_sessions()
        named = {sid.split("/", 1)[1] for sid in live if "/" in sid}
        max_sessions = client.info.limits.get("max_sessions")
        return {
            "ready": True,
            "sessions": sorted(s for s in named if not s.startswith("~")),
            "free_slots": max(0, max_sessions - len(live)) if isinstance(max_sessions, int) else None,
            "evictions": runtime.session_stats["evictions"],
            "worker_pid": client.pid,
        }

    async def ensure_session(self, sid: str) -> bool:
        """Make ``sid`` usable: live or evicted already, else resumed from the store when saved
        there, else opened empty. Returns whether it was resumed now. Concurrent first requests
        for one session wait for each other here, so it is resumed (or opened) once."""
        _, runtime = self._live()
        if runtime.session_state(sid) is not None:
            return False
        entry = self._opening.get(sid)
        if entry is None:
            entry = self._opening[sid] = [trio.Lock(), 0]
        entry[1] += 1  # tasks using this lock; the last one out removes it
        try:
            async with entry[0]:
                if runtime.session_state(sid) is not None:
                    return False
                try:
                    await runtime.resume_session(sid)
                except SessionExists:
                    return False  # another path made it usable meanwhile
                except CheckpointNotFound:
                    try:
                        await runtime.open_session(sid)
                    except SessionExists:
                        pass
                    return False
                self.metrics.resumes.inc()
                return True
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._opening[sid]

    async def open_ephemeral(self, tenant: Tenant) -> tuple[str, SessionRuntime]:
        """A session for one stateless request (never evicted, so it never leaves a file), and
        the runtime holding it (for :meth:`release_ephemeral`)."""
        _, runtime = self._live()
        sid = f"{tenant.prefix}~{uuid.uuid4().hex}"
        await runtime.open_session(sid, evictable=False)
        return sid, runtime

    def release_ephemeral(self, runtime: SessionRuntime, sid: str) -> None:
        """Close a stateless request's session once its generation has settled (in the background:
        the response does not wait). Its history becomes a prefix-cache entry of its namespace.
        Nothing to do if ``runtime`` (the one that served it) is gone with its worker."""
        if runtime is self._runtime:
            self._spawn(self._close_ephemeral, runtime, sid)

    async def _close_ephemeral(self, runtime: SessionRuntime, sid: str) -> None:
        try:
            await runtime.close_session(sid)  # never refused for capacity
        except Exception as exc:  # the worker died meanwhile: nothing is left to close
            log.info("closing %s: %s: %s", sid, type(exc).__name__, exc)

    def after_turn(self, runtime: SessionRuntime, sid: str) -> None:
        """A turn of ``sid`` settled on ``runtime``: save it now (in the background) or mark it
        for later. Nothing to do if that runtime is gone with its worker (the new one resumes the
        session from what the store holds)."""
        if runtime is not self._runtime:
            return
        self._dirty.add(sid)
        if self.config.save_policy is SavePolicy.TURN:
            self._spawn(self._save, runtime, sid)

    async def _save(self, runtime: SessionRuntime, sid: str) -> bool:
        try:
            # Outside the capacity: a save the server makes on its own never fails under load
            # and never takes capacity from clients.
            await runtime.save_session(sid, outside_capacity=True)
        except Unsaveable:
            self.metrics.saves.labels("nothing_to_save").inc()
            self._dirty.discard(sid)
            return False
        except Exception as exc:
            self.metrics.saves.labels("failed").inc()
            log.error("saving session %s failed: %s: %s", sid, type(exc).__name__, exc)
            return False
        self.metrics.saves.labels("ok").inc()
        self._dirty.discard(sid)
        return True

    async def save_now(self, sid: str) -> SessionInfo:
        """``POST /v1/sessions/{id}/save``: save it and return what the store holds."""
        _, runtime = self._live()
        if runtime.session_state(sid) is None:
            return await self.session_info(sid)  # not live: the store already has what there is
        await runtime.save_session(sid)  # Unsaveable (nothing committed) is the caller's 409
        self._dirty.discard(sid)
        self.metrics.saves.labels("ok").inc()
        return await self.session_info(sid)

    async def session_info(self, sid: str) -> SessionInfo:
        return await trio.to_thread.run_sync(self.store.info, sid)

    def session_state(self, sid: str) -> str | None:
        runtime = self._runtime
        return None if runtime is None else runtime.session_state(sid)

    async def list_sessions(self, tenant: Tenant) -> list[dict[str, Any]]:
        """The tenant's sessions: live or evicted ones, and those only in the store."""
        stored = await trio.to_thread.run_sync(self.store.list_info)
        out: dict[str, dict[str, Any]] = {}
        for info in stored:
            if info.session_id.startswith(tenant.prefix):
                out[info.session_id] = session_object(
                    tenant, info.session_id, self.session_state(info.session_id), info
                )
        runtime = self._runtime
        if runtime is not None:
            for sid in runtime.live_sessions():
                if sid.startswith(tenant.prefix) and sid not in out and not sid[len(tenant.prefix) :].startswith("~"):
                    out[sid] = session_object(tenant, sid, "live", None)
        return [out[k] for k in sorted(out)]

    async def delete_session(self, sid: str) -> bool:
        """Close it if live and delete its files; returns whether anything existed."""
        existed = False
        runtime = self._runtime
        if runtime is not None and runtime.session_state(sid) is not None:
            await runtime.close_session(sid)
            existed = True
        self._dirty.discard(sid)
        return await trio.to_thread.run_sync(self.store.delete, sid) or existed

    # -- generation ---------------------------------------------------------------------------------

    async def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        client, _ = self._live()
        prompt = await client.apply_chat_template(messages, add_generation_prompt=True)
        return prompt.token_ids

    def generate(
        self, sid: str, prompt: str | list[int], params: GenerationParams, cache_salt: str
    ) -> tuple[RuntimeStream, SessionRuntime]:
        """Admit the generation at once (CapacityExhausted beyond the capacity); returns its stream
        and the runtime that runs it (for :meth:`after_turn` and :meth:`release_ephemeral`)."""
        _, runtime = self._live()
        return runtime.generate(sid, prompt, replace(params, session_id=sid, cache_salt=cache_salt)), runtime


def session_object(tenant: Tenant, sid: str, state: str | None, info: SessionInfo | None) -> dict[str, Any]:
    """A session as ``/v1/sessions`` shows it."""
    obj: dict[str, Any] = {"id": sid[len(tenant.prefix) :], "object": "session", "state": state or "stored"}
    if info is not None:
        obj.update(saved_tokens=info.tokens, saved_bytes=info.nbytes, saved_at=math.floor(info.saved))
    return obj
