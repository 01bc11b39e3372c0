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

import contextlib
import enum
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from muxworker.client.client import MultiplexedWorkerClient, spawn_multiplexed_worker
from muxworker.client.params import CheckedParams, GenerationResult
from muxworker.client.runtime import EvictionFailed, RuntimeStream, SessionRuntime
from muxworker.client.stores import SaveConflict, SessionInfo, StoreBinding, StoreBusy, StoreUnavailable
from muxworker.transport.checkpoint import CheckpointError, CheckpointNotFound
from muxworker.transport.errors import (
    CapacityExhausted,
    ClientClosedError,
    ConfigurationMismatch,
    ContextOverflow,
    InvalidArgument,
    NotReady,
    SessionBusy,
    SessionExists,
    SessionNotFound,
    Unsaveable,
    WorkerDiedError,
)
from muxworker.worker.engine.constraints import GrammarCompiler
from muxworker.worker.models.tokenizer import ChatTemplateError, Tokenizer
from muxworker.worker.spec import WorkerSpec

from .admission import Admission, Grant
from .metrics import ServerMetrics
from .prompt_bound import TRIM_AFTER_BYTES, check_bytes, encode_within, string_bytes, trim_heap
from .reasoning import Thinking
from .reuse import Plan, ReuseIndex
from .tenants import EPHEMERAL, IMPLICIT, NAMED, RESPONSE, Tenant, TenantQuotaExceeded, _Usage, session_kind
from .tools import ToolFormat, ToolRequest, tool_format

__all__ = [
    "ModelService",
    "SaveOutcome",
    "SavePolicy",
    "ServiceConfig",
    "SessionRecord",
]


log = logging.getLogger("muxworker.serve")


class SavePolicy(enum.Enum):
    TURN = "turn"  # save in the background after every completed turn (and on eviction and shutdown)
    SYNC = "sync"  # save after every turn before answering it: a reply means its state is durable
    EVICT = "evict"  # save only on eviction and shutdown (fewer writes; a crash loses unsaved turns)


@dataclass(frozen=True)
class ServiceConfig:
    save_policy: SavePolicy = SavePolicy.TURN
    max_concurrent_requests: int | None = None  # below the worker's max_inflight_requests
    restart_backoff_s: float = 1.0  # first wait before restarting a dead worker; doubles to 30 s
    shutdown_timeout_s: float = 120.0  # bound on saving live sessions at shutdown
    startup_timeout_s: float = 600.0  # a first start may convert a GGUF
    max_sessions_per_tenant: int | None = None  # named sessions (live or stored) a tenant may have
    max_store_bytes_per_tenant: int | None = None  # store bytes a tenant's sessions may take
    #: How often the server collects what no saved session names (segments of killed saves), and
    #: the age below which nothing is collected (a save in progress is younger). 0: never.
    collect_interval_s: float = 3600.0
    collect_older_than_s: float = 3600.0
    #: Store bytes a tenant's implicit sessions (reuse for requests naming none) may take; the
    #: least recently used go first beyond it, and before the tenant's store quota is reached.
    implicit_store_bytes: int = 2 << 30
    #: How long a stored response (/v1/responses) and its session are kept after its last use.
    response_ttl_s: float = 30 * 86400.0
    #: Generations beyond the free slots wait, fair between tenants, in a queue this long, at
    #: most this many seconds, before a 429 (admission.py).
    max_queued_requests: int = 128
    queue_timeout_s: float = 60.0
    #: Seconds a request waits on the store (a resume, an eviction save making room) before a 503
    #: store_unavailable, and past which a store call still running makes /health "degraded"
    #: (--store-timeout). None: no bound (a directory store, unless the flag is given).
    store_timeout_s: float | None = None


@dataclass
class SessionRecord:
    """What the server knows of one named session beyond the runtime: its length after its last
    turn, what the store held after the last save, and the last save's failure (until a save
    succeeds). Owner: the server's trio thread."""

    live_tokens: int = 0
    saved_tokens: int | None = None
    save_error: str | None = None
    save_failed_at: float | None = None
    store_failed: bool = False  # the last save failed in the store (not with a dying worker)
    created: bool = False  # opened empty by this server and no turn has committed yet

    def as_dict(self) -> dict[str, Any]:
        return {
            "live_tokens": self.live_tokens,
            "durable_tokens": self.saved_tokens,
            "last_save_error": self.save_error,
            "last_save_failed_at": None if self.save_failed_at is None else math.floor(self.save_failed_at),
        }


@dataclass(frozen=True)
class SaveOutcome:
    """How a save the server made for a turn ended: ``saved`` and the tokens the store now holds,
    or the error."""

    saved: bool
    tokens: int | None = None
    error: str | None = None


_POLL_S = 0.25  # how often the supervisor checks the worker between requests


class ModelService:
    """One supervised worker with durable sessions (see the module docstring)."""

    def __init__(
        self,
        spec: WorkerSpec,
        store: StoreBinding,
        metrics: ServerMetrics,
        config: ServiceConfig = ServiceConfig(),
    ) -> None:
        self.spec = spec
        self.worker_command = spec.command()
        self._tokenizer: Tokenizer | None = None  # the worker's own, loaded here: chat turns render here
        self._thinking: Thinking | None = None  # the model's reasoning tags, when it thinks (reasoning.py)
        self._grammars: GrammarCompiler | None = None  # constraints checked before admission (check_constraint)
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
        self._holder_locks: dict[str, list] = {}  # response session -> [lock, users] (_holders_lock)
        self._background = 0  # background tasks running (saves after turns, closes)
        self._idle = trio.Event()  # set while none runs
        self._idle.set()
        self._stopped = trio.Event()  # set when shutdown() is done
        self._restarting = trio.CancelScope()  # around the supervisor's restarts; shutdown() cancels it
        self.restarts = 0
        self.last_error: str | None = None
        self._records: dict[str, SessionRecord] = {}  # named sessions this server has served
        self.store_error: str | None = None  # the store's last failure, until an operation succeeds
        self._store_calls: dict[object, float] = {}  # store calls running -> when each began (store_health)
        self.store_error_since: float | None = None
        self._usage: dict[str, _Usage] | None = None  # per tenant, from a store listing (quotas only)
        self._usage_at = -math.inf
        self._message_tokens = 1  # the fewest tokens one chat message renders to (measured at start)
        self._trim_pending = False  # a heap trim after a refused big prompt is scheduled
        self.reuse = ReuseIndex()  # what a prompt naming no session may continue (reuse.py)
        self.admission = Admission(None, config.max_queued_requests, config.queue_timeout_s)
        self._indexed: set[str] = set()  # tenants whose stored sessions the index has listed since the start
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
                if self.config.collect_interval_s > 0:
                    nursery.start_soon(self._collect_loop)
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
            # No capacity of its own: the admission queue bounds generations (admission.py).
            runtime = SessionRuntime(client, evict_idle_to_store=True)
        except BaseException:
            with trio.CancelScope(shield=True):
                await client.close()
            raise
        if self._tokenizer is None:
            self._tokenizer = await trio.to_thread.run_sync(_load_tokenizer, self.spec)
            self._thinking = Thinking.of(self._tokenizer)
            try:
                self._message_tokens = _tokens_per_message(self._tokenizer)
            except Exception as exc:  # a template that cannot render empty messages: bound by count only
                log.info("measuring a chat message's tokens: %s: %s", type(exc).__name__, exc)
        if self._client is not None:  # a restart: what the dead worker held unsaved is gone with it
            self.reuse, self._indexed = ReuseIndex(), set()
        limits = client.info.limits if client.info is not None else {}
        bounds = [self.config.max_concurrent_requests, limits.get("max_inflight_requests"), limits.get("max_sessions")]
        self.admission.capacity = min((b for b in bounds if isinstance(b, int)), default=None)
        self._client, self._runtime = client, runtime
        self._dirty.clear()
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

    async def ensure_session(self, sid: str, tenant: Tenant | None = None) -> bool:
        """Make ``sid`` usable: live or evicted already, else resumed from the store when saved
        there, else opened empty (within ``tenant``'s session quota). Returns whether it was
        resumed now. Concurrent first requests for one session wait for each other here, so it is
        resumed (or opened) once."""
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
                    await self._store_call(runtime.resume_session(sid))
                except SessionExists:
                    return False  # another path made it usable meanwhile
                except CheckpointNotFound:
                    if tenant is not None:
                        await self._check_session_quota(tenant, sid)
                    try:
                        await runtime.open_session(sid)
                    except SessionExists:
                        return False
                    self._records[sid] = SessionRecord(created=True)
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
            self._spawn(self._close_quietly, runtime, sid)

    async def _close_quietly(self, runtime: SessionRuntime, sid: str) -> None:
        try:
            await runtime.close_session(sid)  # never refused for capacity
        except Exception as exc:  # the worker died meanwhile: nothing is left to close
            log.info("closing %s: %s: %s", sid, type(exc).__name__, exc)

    def record(self, sid: str) -> SessionRecord | None:
        return self._records.get(sid)

    def after_turn(
        self,
        runtime: SessionRuntime,
        sid: str,
        result: GenerationResult | None,
        *,
        saved: bool,
        prompt: list[int] | None = None,
        ran: bool = True,
    ) -> None:
        """A turn of ``sid`` settled on ``runtime`` (``result`` None: it failed; ``prompt``: its
        token ids, for reuse): save it now (in the background) or mark it for later; ``saved``:
        the turn's own synchronous save already made it durable. A session this server opened
        whose first turn committed nothing is closed, so a failed first request leaves nothing
        tracked. Nothing to do if that runtime is gone with its worker (the new one resumes the
        session from what the store holds). Implicit sessions are a cache: saved when evicted
        and at shutdown, not after every turn. ``ran`` False: the turn never reached the engine
        (refused at submit, cancelled while queued): the session is as it was."""
        if runtime is not self._runtime:
            return
        # A block of reasoning the template opened at the prompt's end is dropped when the next
        # turn renders this one (Qwen3's templates): that turn continues the session from there.
        rerendered = self._thinking.rerendered(prompt) if self._thinking is not None and prompt else 0
        self.reuse.note_turn(sid, prompt, result, ran=ran, rerendered=rerendered)
        kind = session_kind(sid)
        if kind != NAMED:
            entry = self.reuse.get(sid)
            if entry is None or entry.rows == 0:  # nothing to continue: it holds no slot for nothing
                self.reuse.forget(sid)
                self._spawn(self._close_quietly, runtime, sid)
                return
            self._dirty.add(sid)
            if kind == RESPONSE and not saved and self.config.save_policy is not SavePolicy.EVICT:
                self._spawn(self._save, runtime, sid)
            self._spawn(self._bound_implicit, Tenant(sid.split("/", 1)[0]))
            return
        record = self._note_turn(sid, result)
        if record.created:
            if result is None or not result.committed_tokens:
                self._records.pop(sid, None)
                if self._usage is not None:
                    self._usage.get(sid.split("/", 1)[0], _Usage()).sessions.pop(sid, None)
                self._spawn(self._close_quietly, runtime, sid)
                return
            record.created = False
        if saved:
            return
        self._dirty.add(sid)
        # Under --save sync a turn gets here unsaved only when it was cut short (a disconnect):
        # it is saved in the background, as with --save turn.
        if self.config.save_policy is not SavePolicy.EVICT:
            self._spawn(self._save, runtime, sid)

    async def admit(self, party: str, units: int) -> Grant:
        """Wait for ``units`` generation slots for ``party`` (``Tenant.admission_party``;
        admission.py); :meth:`after_stream` gives them back, or the caller with ``Grant.release``
        when no generation started."""
        grant = await self.admission.acquire(party, units)
        self.metrics.queued.observe(grant.waited)
        return grant

    def after_stream(
        self, runtime: SessionRuntime, sid: str, stream: RuntimeStream, *, saved: bool, prompt: list[int], grant: Grant
    ) -> None:
        """:meth:`after_turn` once ``stream``'s generation has settled (in the background: a
        cancelled one settles after its response is gone), then give its ``grant`` back."""

        async def settle() -> None:
            try:
                result, error = await stream.settled()
            finally:
                grant.release()
            ran = not isinstance(error, _REFUSED_AT_SUBMIT) and not (result is not None and _never_sent(result))
            self.after_turn(runtime, sid, result, saved=saved, prompt=prompt, ran=ran)

        if self._nursery is None:  # not running (an in-process test): nothing settles later
            grant.release()
            return
        self._spawn(settle)

    # -- stored responses (/v1/responses; responses_api.py) ------------------------------------------

    @staticmethod
    def _response_key(tenant: Tenant, rid: str) -> str:
        return f"{tenant.prefix}response/{rid}"

    async def load_response(self, tenant: Tenant, rid: Any) -> dict[str, Any] | None:
        """The tenant's stored response ``rid`` (its record), or None: never stored, deleted,
        expired (``response_ttl_s`` after it was created; then it is deleted now) or another
        tenant's."""
        if not isinstance(rid, str) or not _RESPONSE_ID.fullmatch(rid):
            return None
        try:
            raw = await self._store_call(
                trio.to_thread.run_sync(self.store.get_record, self._response_key(tenant, rid))
            )
        except CheckpointNotFound:
            return None
        doc = json.loads(raw)
        if doc["created"] + self.config.response_ttl_s < time.time():
            await self.delete_response(tenant, rid)
            return None
        return doc

    async def store_response(self, tenant: Tenant, rid: str, data: bytes, session: str) -> None:
        """Keep response ``rid`` (its record ``data``) with the session holding it. The session's
        list of the responses it holds (a record of its own, so a server started later knows it)
        names ``rid`` first: a crash between the two writes leaves the session kept until
        ``response_ttl_s``, never deleted while a stored response needs it."""
        held = session_kind(session) == RESPONSE and session.startswith(tenant.prefix)
        if held:
            async with self._holders_lock(session):
                rids = await self._holders(session) or set()
                await self._put_holders(session, rids | {rid})
        try:
            await self._store_call(
                trio.to_thread.run_sync(self.store.put_record, self._response_key(tenant, rid), data)
            )
        except Exception:
            if held:  # not stored: it holds nothing (the session stays, as any other with no response yet)
                try:
                    async with self._holders_lock(session):
                        listed = await self._holders(session)
                        if listed is not None and rid in listed:
                            await self._put_holders(session, listed - {rid})
                except Exception as exc:  # the store fails: the session then stays until response_ttl_s
                    log.info("unlisting response %s of %s: %s: %s", rid, session, type(exc).__name__, exc)
            raise

    async def delete_response(self, tenant: Tenant, rid: Any) -> bool:
        """Delete response ``rid``, and its session (live and in the store) when no other stored
        response needs it, by the session's list of the responses it holds (also after a restart).
        A session saved before servers kept that list stays until ``response_ttl_s`` after its
        last use."""
        if not isinstance(rid, str) or not _RESPONSE_ID.fullmatch(rid):
            return False
        key = self._response_key(tenant, rid)
        try:
            doc = json.loads(await self._store_call(trio.to_thread.run_sync(self.store.get_record, key)))
        except CheckpointNotFound:
            return False
        await self._store_call(trio.to_thread.run_sync(self.store.delete_record, key))
        session = doc.get("session")
        if isinstance(session, str) and session.startswith(tenant.prefix) and session_kind(session) == RESPONSE:
            await self._drop_holder(session, rid)
        return True

    @staticmethod
    def _holders_key(session: str) -> str:
        """The record listing the stored responses whose KV response session ``session`` holds."""
        return f"{session}/responses"

    async def _holders(self, session: str) -> set[str] | None:
        """The responses ``session`` holds, as its record lists them; None: no record."""
        try:
            raw = await self._store_call(trio.to_thread.run_sync(self.store.get_record, self._holders_key(session)))
        except CheckpointNotFound:
            return None
        return set(json.loads(raw))

    async def _put_holders(self, session: str, rids: set[str]) -> None:
        data = json.dumps(sorted(rids)).encode()
        await self._store_call(trio.to_thread.run_sync(self.store.put_record, self._holders_key(session), data))

    @contextlib.asynccontextmanager
    async def _holders_lock(self, session: str) -> AsyncIterator[None]:
        """Serializes the read-modify-write of one session's list of responses."""
        entry = self._holder_locks.get(session)
        if entry is None:
            entry = self._holder_locks[session] = [trio.Lock(), 0]
        entry[1] += 1  # tasks using this lock; the last one out removes it
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._holder_locks[session]

    async def _drop_holder(self, session: str, rid: str) -> None:
        """``rid`` no longer needs ``session``: delete the session once none does (unless a turn
        runs on it now, whose response will name it)."""
        async with self._holders_lock(session):
            rids = await self._holders(session)
            if rids is None:  # listed by no record (saved by an older server): kept until its TTL
                return
            rids.discard(rid)
            entry = self.reuse.get(session)
            if rids or (entry is not None and entry.busy):
                await self._put_holders(session, rids)
                return
            await self.delete_session(session)  # its list of responses too

    # -- reuse without a session id (reuse.py) ---------------------------------------------------------

    async def place(
        self,
        tenant: Tenant,
        prompt: list[int],
        named: str | None = None,
        kind: str = IMPLICIT,
        salt: str | None = None,
        hint: str | None = None,
    ) -> Plan:
        """Where a turn with ``prompt`` runs, its reuse set up: on the named session ``named``
        (internal id), or for a request naming none, on the tenant's session of ``kind`` that it
        continues, or a new one with the shared rows copied in (reuse.py). The target is claimed
        until :meth:`after_turn` (or :meth:`unplace`, when the turn never runs). Copying rows is
        best effort: where it fails (the source's save is gone or damaged), the turn prefills.
        ``salt``: the request's cache_salt; only histories of that salt are reused. ``hint``: a
        session the prompt likely continues (a previous response's), read from the store now if
        the index has not read it yet."""
        _, runtime = self._live()
        if hint is not None and hint.startswith(tenant.prefix):
            await self._index_stored(tenant)
            entry = self.reuse.get(hint)
            if entry is None or entry.tokens is None:
                try:
                    tokens = await self._store_call(trio.to_thread.run_sync(self.store.saved_tokens, hint))
                    self.reuse.add(hint)
                    self.reuse.loaded(hint, tokens)
                except Exception as exc:  # gone or unreadable: the prompt is matched against the rest
                    log.info("reading %s for reuse: %s: %s", hint, type(exc).__name__, exc)
        if named is not None:
            await self.ensure_owned(runtime, named)
            await self._room(lambda: self.ensure_session(named, tenant))
            await self._know_history(named)
            plan = self.reuse.plan_named(tenant, named, prompt, salt)
        else:
            await self._index_stored(tenant)
            plan = self.reuse.plan(tenant, prompt, kind, salt)
        try:
            if plan.branch is not None and named is not None:
                branch = self.reuse.get(plan.branch)
                if branch is not None and not await self._copy(runtime, named, plan.branch, branch.rows, fresh=True):
                    self.reuse.forget(plan.branch)
                else:
                    self.reuse.release(plan.branch)
            if plan.fresh_target:
                await self._room(lambda: runtime.open_session(plan.target))
            elif runtime.session_state(plan.target) is None:  # saved before a restart: resume it
                plan = await self._resume_target(runtime, tenant, plan, kind, salt)
            if plan.source is not None:
                await self._copy(runtime, plan.source, plan.target, plan.rows)
        except BaseException:
            self.unplace(plan)
            raise
        return plan

    async def ensure_owned(self, runtime: SessionRuntime, sid: str) -> None:
        """SaveConflict (a 409) when a save of ``sid`` was refused because another writer (a
        second server on the store) saved it since this server last saved or resumed it: the
        turns since this server's last save are gone, and the client must know before it builds
        on them. Said once; the live copy is dropped (with its history in the reuse index), so
        the next request resumes what the store holds. Under ``--save sync`` the store is asked before every turn of a live
        session, so that the turn itself is refused rather than answered and then not saved."""
        message = self.store.take_conflict(sid)
        if message is None and self.config.save_policy is SavePolicy.SYNC and runtime.session_state(sid) == "live":
            try:
                await self._store_call(trio.to_thread.run_sync(self.store.check_owned, sid))
            except SaveConflict as exc:
                message = self.store.take_conflict(sid) or str(exc)
        if message is not None:
            # Also where an eviction's save met the conflict (the runtime dropped the copy, but
            # the index still holds its history).
            await self._drop_stale(runtime, sid)
            raise SaveConflict(message)

    async def _drop_stale(self, runtime: SessionRuntime, sid: str) -> None:
        """Close ``sid``'s live copy, which another writer's save superseded (not saved: the
        store keeps the other's), and forget its history here; its next use resumes the store's."""
        self._dirty.discard(sid)
        self.reuse.forget(sid)
        if runtime.session_state(sid) is not None:
            await self._close_quietly(runtime, sid)

    async def _resume_target(
        self, runtime: SessionRuntime, tenant: Tenant, plan: Plan, kind: str, salt: str | None
    ) -> Plan:
        """Resume a plan's target saved before a restart; one that cannot be resumed (damaged, of
        another model) is forgotten, and the turn runs on a fresh session instead: a request that
        names no session must not fail for a cache entry it cannot delete."""
        try:
            await self._room(lambda: self.ensure_session(plan.target))
            return plan
        except (WorkerDiedError, ClientClosedError, NotReady, CapacityExhausted, StoreUnavailable):
            raise
        except Exception as exc:
            log.warning(
                "implicit session %s cannot be resumed (%s: %s); not reused", plan.target, type(exc).__name__, exc
            )
            self.reuse.forget(plan.target)
            fresh = Plan(self.reuse.new_sid(tenant, kind, salt), fresh_target=True)
            self.reuse.add(fresh.target).busy = True
            await self._room(lambda: runtime.open_session(fresh.target))
            return fresh

    async def _know_history(self, named: str) -> None:
        """Read a named session's saved history into the index when it has none (its turns ran
        before a restart): so its first divergent turn here keeps what it would overwrite too."""
        entry = self.reuse.get(named)
        if entry is not None and entry.tokens is not None:
            return
        try:
            tokens = await self._store_call(trio.to_thread.run_sync(self.store.saved_tokens, named))
        except Exception as exc:  # never saved (a new session), or unreadable: nothing to protect
            if not isinstance(exc, CheckpointNotFound):
                log.info("reading %s's history for reuse: %s: %s", named, type(exc).__name__, exc)
            return
        self.reuse.add(named)
        self.reuse.loaded(named, tokens)

    async def _room(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """``call()`` (an open or resume), tried again while no slot can be freed for it: the
        admission queue bounds generations to the slots, so a slot is short only while the
        sessions holding them have a save or close in flight, which ends soon; given up after
        ``queue_timeout_s`` (CapacityExhausted, a 429)."""
        deadline = trio.current_time() + self.config.queue_timeout_s
        delay = 0.005

        async def attempt() -> Any:
            try:
                return await call()
            except EvictionFailed as exc:
                # The slot's holder could not be saved (the store is down, the disk full): that
                # is the answer now, not a 429 after the queue's wait for a slot that stays taken.
                if isinstance(exc.cause, CheckpointError):
                    raise exc.cause from None
                raise

        while True:
            try:
                # Bounded by --store-timeout: an eviction save or a resume stuck in the store is
                # a 503 then (it goes on under its session's lease, and the next try finds it done).
                return await self._store_call(attempt(), bounded=True, clears=False)
            except CapacityExhausted:
                if trio.current_time() + delay > deadline:
                    raise
                await trio.sleep(delay)
                delay = min(0.25, delay * 2)

    def unplace(self, plan: Plan) -> None:
        """A placed turn did not run: release its target (a new one is closed)."""
        self.reuse.release(plan.target)
        runtime = self._runtime
        if plan.fresh_target:
            self.reuse.forget(plan.target)
            if runtime is not None and runtime.session_state(plan.target) is not None:
                self._spawn(self._close_quietly, runtime, plan.target)

    async def fork(self, runtime: SessionRuntime, source: str, target: str, rows: int) -> None:
        """Make live session ``target``'s history the first ``rows`` tokens of ``source``'s,
        bringing ``source`` back from the store first (it may have been evicted to make room for
        ``target``, or saved before a restart)."""
        for attempt in range(2):
            state = runtime.session_state(source)
            if state is None:
                await self._store_call(runtime.resume_session(source), bounded=True)
            elif state == "evicted":
                await self._store_call(runtime.bring_back(source), bounded=True)
            try:
                await runtime.fork_session(source, target, rows)
                return
            except SessionNotFound:
                if attempt or runtime.session_state(source) is None:
                    raise  # evicted again meanwhile, once more: the slots are that contended

    async def _copy(self, runtime: SessionRuntime, source: str, target: str, rows: int, *, fresh: bool = False) -> bool:
        """Copy ``source``'s first ``rows`` rows into ``target`` (opened first when ``fresh``),
        bringing ``source`` back from the store first. Returns whether it did."""
        try:
            if fresh:
                await runtime.open_session(target)
            await self.fork(runtime, source, target, rows)
        except (WorkerDiedError, ClientClosedError, NotReady):
            raise
        except Exception as exc:  # the source's save is gone, damaged or of another model: no reuse from it
            log.info("reusing %d rows of %s for %s: %s: %s", rows, source, target, type(exc).__name__, exc)
            if isinstance(exc, (CheckpointError, ConfigurationMismatch, SessionNotFound)):
                self.reuse.forget(source)  # gone, damaged or of another model: never a source again
            if fresh and runtime.session_state(target) is not None:
                self._spawn(self._close_quietly, runtime, target)
            return False
        self.metrics.reuse_copies.inc()
        return True

    async def _index_stored(self, tenant: Tenant) -> None:
        """Once per worker start, per tenant: enter its implicit and response sessions that the
        store holds (saved before a restart) into the reuse index, with the token histories of
        the most recently used ones."""
        if tenant.name in self._indexed:
            return
        self._indexed.add(tenant.name)
        try:
            await self._tenant_usage(tenant, fresh=True)
            for entry in self.reuse.unloaded(tenant)[:_LOAD_AT_START]:
                tokens = await self._store_call(trio.to_thread.run_sync(self.store.saved_tokens, entry.sid))
                self.reuse.loaded(entry.sid, tokens)
        except Exception as exc:  # reuse from the store is lost for now, nothing else
            log.warning("listing the store for reuse: %s: %s", type(exc).__name__, exc)

    async def _bound_implicit(self, tenant: Tenant) -> None:
        """Delete the tenant's least recently used implicit sessions beyond their store bound,
        and beyond what its store quota leaves after its named and response sessions."""
        limit = self.config.implicit_store_bytes
        quota = self.config.max_store_bytes_per_tenant
        try:
            await self._tenant_usage(tenant)
            if quota is not None and self._usage is not None:
                usage = self._usage.get(tenant.name, _Usage())
                kept = usage.nbytes - self.reuse.implicit_bytes(tenant)
                limit = min(limit, max(0, quota - kept))
            for entry in self.reuse.over_bound(tenant, limit):
                if entry.busy:
                    continue
                self.reuse.forget(entry.sid)  # before any await: no plan picks it meanwhile
                await self.delete_session(entry.sid)
                self.metrics.implicit_deletes.inc()
        except Exception as exc:
            log.warning("bounding implicit sessions of %s: %s: %s", tenant.name, type(exc).__name__, exc)

    def _note_turn(self, sid: str, result: GenerationResult | None) -> SessionRecord:
        record = self._records.setdefault(sid, SessionRecord())
        if result is not None and (result.committed_tokens or result.prompt_tokens):
            # Positions with KV rows, as a save counts them: the last generated token's row is
            # computed by the next turn, which resends it.
            record.live_tokens = result.prompt_tokens + max(0, result.committed_tokens - 1)
        return record

    async def save_turn(self, runtime: SessionRuntime, sid: str, result: GenerationResult) -> SaveOutcome:
        """``--save sync``: save the turn that just settled (``result``) before it is answered."""
        if runtime is not self._runtime:
            return SaveOutcome(False, error="the worker died before the turn was saved")
        self._note_turn(sid, result)
        await self._save(runtime, sid)
        self.store.take_conflict(sid)  # a conflict is this turn's save_error: told here, not again
        record = self._records.get(sid)
        if record is None or record.save_error is not None or sid in self._dirty:
            return SaveOutcome(False, error=record.save_error if record is not None else None)
        return SaveOutcome(True, tokens=record.saved_tokens)

    async def _save(self, runtime: SessionRuntime, sid: str) -> bool:
        record = self._records.setdefault(sid, SessionRecord())
        try:
            # Outside the capacity: a save the server makes on its own never fails under load
            # and never takes capacity from clients.
            written = await self._store_call(runtime.save_session(sid, outside_capacity=True))
        except Unsaveable:
            self.metrics.saves.labels("nothing_to_save").inc()
            self._dirty.discard(sid)
            return False
        except SaveConflict as exc:
            # Another writer saved the session since this server last saved or resumed it: this
            # copy is stale. Dropped, so the next turn resumes the store's; the session's next
            # request is answered 409 (ensure_owned), so the turns the other save replaced are
            # not lost silently.
            self.metrics.saves.labels("failed").inc()
            record.save_error = f"{type(exc).__name__}: {exc}"[:500]
            record.save_failed_at = time.time()
            record.store_failed = False  # the store works; the session has another owner
            log.warning("saving session %s: %s", sid, exc)
            await self._drop_stale(runtime, sid)
            return False
        except Exception as exc:
            if isinstance(exc, SessionNotFound) and runtime.session_state(sid) is None:
                # Deleted (or closed) before this background save reached it: nothing is left to save.
                self._records.pop(sid, None)
                self._dirty.discard(sid)
                return False
            self.metrics.saves.labels("failed").inc()
            record.save_error = f"{type(exc).__name__}: {exc}"[:500]
            record.save_failed_at = time.time()
            record.store_failed = not isinstance(exc, (WorkerDiedError, ClientClosedError))
            log.error("saving session %s failed: %s", sid, record.save_error)
            return False
        self.metrics.saves.labels("ok").inc()
        self._dirty.discard(sid)
        record.save_error = record.save_failed_at = None
        record.store_failed = False
        if written is not None:
            record.saved_tokens = written.position
        if self._quotas:
            try:
                await self._note_saved(sid)
            except Exception as exc:  # the quota's figure stays as listed; the save itself is done
                log.info("reading %s after its save: %s: %s", sid, type(exc).__name__, exc)
        return True

    async def save_now(self, sid: str) -> SessionInfo:
        """``POST /v1/sessions/{id}/save``: save it and return what the store holds."""
        _, runtime = self._live()
        if runtime.session_state(sid) is None:
            return await self.session_info(sid)  # not live: the store already has what there is
        try:
            await self._store_call(runtime.save_session(sid))  # Unsaveable (nothing committed) is the caller's 409
        except SaveConflict:
            self.store.take_conflict(sid)  # this request is told
            await self._drop_stale(runtime, sid)
            raise
        self._dirty.discard(sid)
        record = self._records.setdefault(sid, SessionRecord())
        record.save_error = record.save_failed_at = None
        record.store_failed = False
        self.metrics.saves.labels("ok").inc()
        info = await self.session_info(sid)
        record.saved_tokens = info.tokens
        return info

    async def session_info(self, sid: str) -> SessionInfo:
        return await self._store_call(trio.to_thread.run_sync(self.store.info, sid))

    def session_state(self, sid: str) -> str | None:
        runtime = self._runtime
        return None if runtime is None else runtime.session_state(sid)

    async def list_sessions(self, tenant: Tenant) -> list[dict[str, Any]]:
        """The tenant's sessions: live or evicted ones, and those only in the store."""
        stored = await self._store_call(trio.to_thread.run_sync(self.store.list_info))
        out: dict[str, dict[str, Any]] = {}
        for info in stored:
            if info.session_id.startswith(tenant.prefix):
                sid = info.session_id
                out[sid] = session_object(tenant, sid, self.session_state(sid), info, self._records.get(sid))
        runtime = self._runtime
        if runtime is not None:
            for sid in runtime.live_sessions():
                if sid.startswith(tenant.prefix) and sid not in out and session_kind(sid) != EPHEMERAL:
                    out[sid] = session_object(tenant, sid, "live", None, self._records.get(sid))
        return [out[k] for k in sorted(out)]

    async def delete_session(self, sid: str) -> bool:
        """Close it if live, its history forgotten first (so its KV does not stay behind as a
        prefix-cache entry), and delete its files (for a response session, also its list of the
        responses it holds); returns whether anything existed."""
        existed = False
        self.reuse.forget(sid)  # before any await: no plan picks it meanwhile
        runtime = self._runtime
        state = runtime.session_state(sid) if runtime is not None else None
        if runtime is not None and state is not None:
            if state == "live":
                try:
                    await runtime.reset_session(sid)
                except CapacityExhausted:  # all capacity admitted: closed as it is (a close never waits for it)
                    pass
            await runtime.close_session(sid)
            existed = True
        self._dirty.discard(sid)
        self._records.pop(sid, None)
        if self._usage is not None:
            usage = self._usage.get(sid.split("/", 1)[0], _Usage())
            usage.sessions.pop(sid, None)
            usage.cached.pop(sid, None)
        deleted = await self._store_call(trio.to_thread.run_sync(self.store.delete, sid))
        if session_kind(sid) == RESPONSE:
            await self._store_call(trio.to_thread.run_sync(self.store.delete_record, self._holders_key(sid)))
        return deleted or existed

    # -- the store: failures, quotas, collection ---------------------------------------------------

    async def _store_call(self, call: Any, *, bounded: bool = False, clears: bool = True) -> Any:
        """Await ``call`` (a store operation, or a runtime call that reaches the store) and keep
        :attr:`store_error` true: set by StoreUnavailable (which propagates), cleared by success
        (unless not ``clears``: a call that may not have reached the store). ``bounded`` (a
        runtime call, which goes on under its session's lease when its caller stops waiting):
        StoreUnavailable once it has run ``store_timeout_s``. While a call runs longer than
        that, :meth:`store_health` says the store is failing."""
        token = object()
        self._store_calls[token] = time.time()
        limit = self.config.store_timeout_s
        try:
            with trio.move_on_after(limit if bounded and limit is not None else math.inf) as scope:
                result = await call
            if scope.cancelled_caught:
                raise StoreUnavailable(
                    f"the session store did not answer within {limit:g} s (--store-timeout); the saved "
                    "sessions are not known to be damaged"
                )
        except StoreUnavailable as exc:
            if self.store_error is None:
                self.store_error_since = time.time()
            self.store_error = f"{type(exc).__name__}: {exc}"[:500]
            raise
        finally:
            del self._store_calls[token]
        if not clears:
            return result
        if self.store_error is not None:
            log.info("the session store answers again")
        self.store_error = self.store_error_since = None
        return result

    def store_health(self) -> dict[str, Any]:
        """The store's state for ``/health``: ok, or its last failure and since when."""
        failing = [r for r in self._records.values() if r.save_error is not None and r.store_failed]
        limit, now = self.config.store_timeout_s, time.time()
        stuck = min(self._store_calls.values(), default=now) if limit is not None else now
        if self.store_error is None and not failing and now - stuck <= (limit or 0):
            return {"status": "ok"}
        out: dict[str, Any] = {"status": "failing"}
        if self.store_error is not None:
            out.update(error=self.store_error, since=math.floor(self.store_error_since or 0))
        elif limit is not None and now - stuck > limit:  # a call stuck past the timeout, not failed yet
            out.update(error=f"a store operation has not returned for {now - stuck:.0f} s", since=math.floor(stuck))
        if failing:
            out["sessions_with_failed_saves"] = len(failing)
            out["last_save_error"] = max(failing, key=lambda r: r.save_failed_at or 0).save_error
        return out

    async def _tenant_usage(self, tenant: Tenant, *, fresh: bool = False) -> _Usage:
        """The tenant's sessions and store bytes, from a store listing at most 30 s old (listing
        reads every manifest, so quotas and the implicit bound are checked against a recent one,
        not a live one; ``fresh``: list now). A listing also tells the reuse index what the store
        holds of each implicit and response session."""
        if fresh or self._usage is None or trio.current_time() - self._usage_at > _USAGE_TTL_S:
            listing = await self._store_call(trio.to_thread.run_sync(self.store.list_info))
            usage: dict[str, _Usage] = {}
            tokens = nbytes = 0
            for info in listing:
                name, _, rest = info.session_id.partition("/")
                kind = session_kind(info.session_id)
                tokens, nbytes = tokens + info.tokens, nbytes + info.nbytes
                if rest and kind == NAMED:
                    usage.setdefault(name, _Usage()).sessions[info.session_id] = info.nbytes
                elif rest and kind in (IMPLICIT, RESPONSE):
                    usage.setdefault(name, _Usage()).cached[info.session_id] = info.nbytes
                    entry = self.reuse.get(info.session_id)
                    if entry is None and name in self._indexed:
                        entry = self.reuse.add(info.session_id, used=info.saved)
                        entry.rows = info.tokens
                    if entry is not None:
                        entry.nbytes = info.nbytes
            if tokens:
                self.reuse.bytes_per_token = nbytes / tokens
            self._usage, self._usage_at = usage, trio.current_time()
        return self._usage.setdefault(tenant.name, _Usage())

    @property
    def _quotas(self) -> bool:
        return self.config.max_sessions_per_tenant is not None or self.config.max_store_bytes_per_tenant is not None

    async def _note_saved(self, sid: str) -> None:
        """Keep the quota's figures current after a save of ``sid`` (one manifest read)."""
        if self._usage is None or "/" not in sid:
            return
        info = await trio.to_thread.run_sync(self.store.info, sid)
        usage = self._usage.setdefault(sid.split("/", 1)[0], _Usage())
        (usage.sessions if session_kind(sid) == NAMED else usage.cached)[sid] = info.nbytes

    async def _check_session_quota(self, tenant: Tenant, sid: str) -> None:
        limit = self.config.max_sessions_per_tenant
        if limit is None:
            return
        usage = await self._tenant_usage(tenant)
        runtime = self._runtime
        live = set(runtime.live_sessions()) if runtime is not None else set()
        named = {s for s in live if s.startswith(tenant.prefix) and not s[len(tenant.prefix) :].startswith("~")}
        count = len((usage.sessions.keys() | named) - {sid})
        if count >= limit:
            raise TenantQuotaExceeded(
                f"this key already has {count} sessions, its limit is {limit}; DELETE /v1/sessions/{{id}} "
                "the ones it no longer needs",
                "sessions",
            )
        usage.sessions.setdefault(sid, 0)

    async def check_constraint(self, constraint: dict[str, Any] | None) -> None:
        """InvalidArgument unless ``constraint`` compiles and can start, as the worker's engine will
        compile it (worker/engine/constraints.py), on a thread: a schema the engine cannot follow is
        refused before the request is admitted, never mid-stream."""
        if constraint is None:
            return
        tokenizer = self._tokenizer
        assert tokenizer is not None  # loaded before the first worker is ready
        if self._grammars is None:
            self._grammars = GrammarCompiler(tokenizer, tokenizer.vocab_size, sorted(tokenizer.eos_token_ids))
        await trio.to_thread.run_sync(self._grammars.check, constraint)

    async def check_store_quota(self, tenant: Tenant) -> None:
        """Before a turn: TenantQuotaExceeded when the tenant's sessions already fill its store quota."""
        limit = self.config.max_store_bytes_per_tenant
        if limit is None:
            return
        usage = await self._tenant_usage(tenant)
        # Implicit sessions are a cache the bound trims (_bound_implicit), never a refusal.
        implicit = sum(n for sid, n in usage.cached.items() if session_kind(sid) == IMPLICIT)
        if usage.nbytes - implicit >= limit:
            raise TenantQuotaExceeded(
                f"this key's sessions take {usage.nbytes} bytes of the store, its limit is {limit}; "
                "DELETE /v1/sessions/{id} the ones it no longer needs",
                "bytes",
            )

    async def _expire_responses(self) -> None:
        """Delete the response sessions unused for ``response_ttl_s`` (their records expire as
        they are read: client/serve/responses_api.py)."""
        cutoff = time.time() - self.config.response_ttl_s
        for info in await self._store_call(trio.to_thread.run_sync(self.store.list_info)):
            entry = self.reuse.get(info.session_id)
            recent = entry is not None and (entry.busy or entry.used >= cutoff)
            if (
                session_kind(info.session_id) == RESPONSE
                and info.saved < cutoff
                and not recent
                and info.session_id not in self._dirty
            ):
                await self.delete_session(info.session_id)

    async def _collect_loop(self) -> None:
        """Collect, now and then every ``collect_interval_s``, what no saved session names: the
        segments of saves a kill -9 cut short, blocks no session names any more. Only files older
        than ``collect_older_than_s`` go, and the store's collector keeps anything a manifest it
        cannot read might name."""
        while not self._stopping:
            try:
                await self._expire_responses()
            except Exception as exc:
                log.warning("expiring stored responses: %s: %s", type(exc).__name__, exc)
            try:
                names, nbytes = await trio.to_thread.run_sync(
                    lambda: self.store.clean(older_than=self.config.collect_older_than_s)
                )
                if names:
                    log.info("collected %d unreferenced store files (%d bytes)", len(names), nbytes)
            except StoreBusy:
                pass  # a writer holds the store: the next round collects
            except Exception as exc:
                log.warning("collecting the store: %s: %s", type(exc).__name__, exc)
            await trio.sleep(self.config.collect_interval_s)

    # -- generation ---------------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of token ``token_id`` (for logprobs), from the worker's own tokenizer."""
        assert self._tokenizer is not None  # loaded before the first worker is ready
        return self._tokenizer.token_bytes(token_id)

    async def encode(self, text: str) -> list[int]:
        """``text`` as the worker encodes a text prompt (no special tokens parsed), on a thread;
        ContextOverflow for a text that cannot fit a session, at a cost bounded by the context
        (prompt_bound.py). The tokenizer releases the GIL: other sessions stream meanwhile."""
        tokenizer = self._tokenizer
        assert tokenizer is not None  # loaded before the first worker is ready
        room = self.max_model_len()

        def encode() -> list[int]:
            return encode_within(
                lambda part: tokenizer.encode(part, parse_special=False), text, room, tokenizer.max_token_bytes
            )

        return await self._bounded(encode, lambda: len(text))

    async def _bounded(self, work: Callable[[], list[int]], size: Callable[[], int]) -> list[int]:
        """``work()`` on a thread; where it refuses an input of more than TRIM_AFTER_BYTES
        (``size()``), the memory it took goes back to the system once its request is done."""
        try:
            return await trio.to_thread.run_sync(work)
        except ContextOverflow:
            if not self._trim_pending and size() > TRIM_AFTER_BYTES:
                self._trim_pending = True
                self._spawn(self._trim_heap)
            raise

    async def _trim_heap(self) -> None:
        await trio.sleep(_TRIM_DELAY_S)  # the refused request has answered and dropped its body by then
        self._trim_pending = False
        await trio.to_thread.run_sync(trim_heap)

    def max_messages(self) -> int | None:
        """The most chat messages a request may carry: more cannot fit the worker's context, as
        each renders to at least ``_message_tokens`` tokens. Checked before the body's messages
        are even parsed: rendering runs in the worker, and a body of thousands of messages would
        hold every session up for its time."""
        client = self._client
        limit = client.info.limits.get("max_session_tokens") if client is not None and client.info else None
        return limit // self._message_tokens if isinstance(limit, int) else None

    def thinking(self) -> Thinking | None:
        """The model's reasoning tags when it thinks (client/serve/reasoning.py), else None."""
        return self._thinking

    def tool_format(self) -> ToolFormat:
        """How this model writes tool calls (client/serve/tools.py), from its chat template."""
        assert self._tokenizer is not None  # loaded before the first worker is ready
        return tool_format(self._tokenizer.chat_template)

    async def render_chat(self, messages: list[dict[str, Any]], tools: ToolRequest | None = None) -> list[int]:
        """The prompt of ``messages`` (and ``tools``, in the model's tool format), rendered here
        with the worker's own tokenizer and template (the same files, the same code), on a
        thread: a turn makes one worker round trip, and a long message list never holds the
        engine up."""
        self._live()
        tokenizer = self._tokenizer
        assert tokenizer is not None  # loaded before the first worker is ready
        fmt = self.tool_format()

        room, max_token_bytes = self.max_model_len(), tokenizer.max_token_bytes

        def size() -> int:
            """The bytes of the strings the template is handed (messages, tools' names, descriptions, schemas)."""
            return string_bytes(messages) + (string_bytes([t.openai() for t in tools.tools]) if tools else 0)

        def render() -> list[int]:
            # Text that cannot fit is refused before it is formatted (json.dumps holds the GIL) or
            # rendered (prompt_bound.py).
            check_bytes(size(), room, max_token_bytes)
            try:
                text = tokenizer.apply_chat_template(
                    fmt.messages(messages, tools), add_generation_prompt=True, tools=fmt.template_tools(tools)
                )
            except ChatTemplateError as exc:
                raise InvalidArgument(str(exc)) from None
            return encode_within(lambda part: tokenizer.encode(part, parse_special=True), text, room, max_token_bytes)

        return await self._bounded(render, size)

    def generate(
        self, sid: str, prompt: str | list[int], params: CheckedParams, cache_salt: str
    ) -> tuple[RuntimeStream, SessionRuntime]:
        """Admit the generation at once (CapacityExhausted beyond the capacity); returns its stream
        and the runtime that runs it (for :meth:`after_turn` and :meth:`release_ephemeral`)."""
        _, runtime = self._live()
        return runtime.generate(sid, prompt, params.for_session(sid, cache_salt)), runtime

    def weight_groups(self) -> list[dict[str, Any]]:
        """How the worker holds its weights, by tensor type (``/v1/models``' ``weights``); empty
        while no worker is up."""
        client = self._client
        return [dict(g) for g in client.info.model.weight_groups] if client is not None and client.info else []

    def max_model_len(self) -> int | None:
        """The most tokens a session holds, prompt plus reply (the worker's ``max_session_tokens``,
        reported as ``/v1/models``' ``max_model_len``); None while no worker is up."""
        client = self._client
        limit = client.info.limits.get("max_session_tokens") if client is not None and client.info else None
        return limit if isinstance(limit, int) else None


_USAGE_TTL_S = 30.0
#: Errors a generation meets before the engine runs it: its session is untouched.
_REFUSED_AT_SUBMIT = (ContextOverflow, CapacityExhausted, InvalidArgument, SessionBusy)


def _never_sent(result: GenerationResult) -> bool:
    """A generation cancelled before it reached the worker (while queued behind its session)."""
    return result.finish_reason == "cancelled" and not (result.prompt_tokens or result.committed_tokens)


_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
_LOAD_AT_START = 32  # stored sessions per tenant whose histories the reuse index reads after a start


_TRIM_DELAY_S = 0.5  # after a refused big prompt, the heap is trimmed this much later


def _load_tokenizer(spec: WorkerSpec) -> Tokenizer:
    """The worker's tokenizer, with its longest token measured (a pass over the vocabulary) here,
    on the loading thread."""
    tokenizer = Tokenizer.from_dir(spec.model_dir)
    tokenizer.max_token_bytes  # noqa: B018 - computed once and cached
    return tokenizer


def _tokens_per_message(tokenizer: Tokenizer) -> int:
    """The fewest tokens one more (empty) message adds to a rendered chat: a lower bound on a
    body's prompt from its message count alone."""

    def tokens(messages: list[dict[str, str]]) -> int:
        return len(
            tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False), parse_special=True)
        )

    one = tokens([{"role": "user", "content": ""}])
    two = tokens([{"role": "user", "content": ""}, {"role": "assistant", "content": ""}])
    return max(1, two - one)


def session_object(
    tenant: Tenant, sid: str, state: str | None, info: SessionInfo | None, record: SessionRecord | None = None
) -> dict[str, Any]:
    """A session as ``/v1/sessions`` shows it: its state, what the store holds, and (for sessions
    this server has served) its live length and the last save's failure."""
    kind = {NAMED: "named", IMPLICIT: "implicit", RESPONSE: "response"}.get(session_kind(sid), "ephemeral")
    obj: dict[str, Any] = {
        "id": sid[len(tenant.prefix) :],
        "object": "session",
        "kind": kind,  # named: the client's; implicit: reuse for requests naming none; response: stored responses
        "state": state or "stored",
    }
    if info is not None:
        obj.update(saved_tokens=info.tokens, saved_bytes=info.nbytes, saved_at=math.floor(info.saved))
    if record is not None:
        obj.update(record.as_dict())
    return obj
