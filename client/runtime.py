"""SessionRuntime: per-session leases and bounded admission over a MultiplexedWorkerClient.

Servers (an HTTP front, an agent host) get per-session ordering and bounded admission without
writing their own locks:

- **Admission.** At most ``capacity`` operations (generations, lifecycle and checkpoint calls) are
  admitted at once: ``min(worker's max_inflight_requests, max_concurrent_requests)``. One more fails
  at once with :class:`CapacityExhausted`; nothing waits in a hidden queue. An operation waiting for
  its session's lease counts as admitted. Two operations wait for their lease but are never
  refused or counted: ``close_session`` (it frees what the capacity protects) and
  ``save_session(..., outside_capacity=True)`` (a server's own saves after each turn).
- **Leases.** Each session has a lane: its admitted operations run one at a time, first come first
  served, in the order of the calls (``generate`` admits when called, the async calls when awaited).
  The operation at the head of a lane holds the lease until it settles; different sessions run
  concurrently. So a save waits for the generation before it, and a generation never meets
  ``session_busy``.
- **Cancellation.** An operation still waiting in its lane when its caller is cancelled (or its
  stream's :meth:`RuntimeStream.cancel` is called) leaves the lane and never runs; its capacity is
  free at once. A checkpoint call (save, resume, export, restore) that holds its lease but has not
  started its transfer (it waits in the client's checkpoint queue behind another session's, or its
  request is not written yet) is cancelled with its caller and never starts. Once it holds the
  lease, a cancelled lifecycle call, or a checkpoint call whose transfer has started, returns to its
  caller at once while the operation settles under the lease, so later operations on that session
  wait behind it; a cancelled generation is cancelled in the worker and holds the lease until the
  worker has ended it. Nothing undoes a completed save or restore. A worker that stops answering
  ends every stuck operation with WorkerDiedError (the client's liveness rule), which frees them.

- **Eviction** (opt-in, ``evict_idle_to_store=True``, needs the client's session store). The runtime
  tracks the sessions it opened, resumed or restored, in order of last use. When one of those needs
  a worker slot and none is free (the worker's ``max_sessions`` are all tracked as live, or the worker
  answers CapacityExhausted), the least recently used *idle* session (no operation in its lane) is
  saved to the store and closed, under its own lease, and marked evicted; then the open is tried
  again. With no idle session the call fails with CapacityExhausted at once. A failed save leaves the
  session live and fails the call with :class:`EvictionFailed`; a save refused as a conflict (another
  writer saved the session since, SaveConflict) closes the stale copy, which is then not tracked, and
  the slot is free. Any later operation on an evicted
  session first resumes it from the store, under its lease; its generation's result then says
  ``resumed_from_store=True``. Evicted sessions are open as far as callers can tell (open and resume
  raise SessionExists); close forgets one (its file stays), reset empties one without loading it,
  save is a no-op (its file already holds its committed state).

Each operation holding a lease runs in a trio *system* task, so it outlives a cancelled caller (and
the caller's nursery); :meth:`SessionRuntime.aclose_worker` waits for all of them before it closes
the worker.

Ownership: everything here runs in the trio thread; lanes and counters are touched only between
checkpoints, so they need no locks.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from muxworker.transport.checkpoint import CPUCheckpoint
from muxworker.transport.errors import (
    CapacityExhausted,
    ClientClosedError,
    InvalidArgument,
    OperationCancelled,
    SaveConflict,
    SessionExists,
    SessionNotFound,
    Unsaveable,
    WorkerDiedError,
)

from .client import DEFAULT_STREAM_BUFFER, MultiplexedWorkerClient
from .params import CheckedParams, RuntimeGenerationResult, check_params
from .runtime_ops import RuntimeStream, _fresh, _Op, _State
from .sessions import SaveResult

__all__ = ["SessionRuntime", "RuntimeStream", "RuntimeGenerationResult", "EvictionFailed"]


class EvictionFailed(CapacityExhausted):
    """No worker slot was free, and saving the least recently used idle session to the store (so as
    to evict it) failed. That session stays live, nothing of it is lost, and the operation that
    needed its slot fails with this error. ``session_id`` names it and ``cause`` is the save's error
    (also the ``__cause__``). A :class:`CapacityExhausted`, so a server that sheds load on that keeps
    working; the cause (a full disk, a store refusing the worker) usually needs an operator."""

    def __init__(self, message: str, session_id: str | None = None, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.session_id = session_id
        self.cause = cause
        self.__cause__ = cause


class _Tracked:
    """A session this runtime opened, resumed or restored (for the eviction policy and the counts)."""

    __slots__ = ("evicted", "has_file", "evictable")

    def __init__(self) -> None:
        self.evicted = False  # its state is in the store, not in a worker slot
        self.has_file = False  # evicted with state to resume (else it had none: it reopens empty)
        self.evictable = True  # False: never chosen for eviction (a short-lived session)


class SessionRuntime:
    """Per-session FIFO leases and bounded admission over ``client`` (see the module docstring).

    ``max_concurrent_requests`` lowers the capacity below the worker's ``max_inflight_requests``.
    ``evict_idle_to_store=True`` lets more sessions be open than the worker has slots: the least
    recently used idle session is saved to the client's session store and closed when a slot is
    needed, and resumed from it on its next use (docs/RUNTIME.md, "Eviction"). It needs the client's
    ``session_store`` (else InvalidArgument), and every session must then be used through this
    runtime only: one opened or closed with the client directly is not tracked.
    """

    def __init__(
        self,
        client: MultiplexedWorkerClient,
        *,
        max_concurrent_requests: int | None = None,
        evict_idle_to_store: bool = False,
    ) -> None:
        if max_concurrent_requests is not None and (
            isinstance(max_concurrent_requests, bool)
            or not isinstance(max_concurrent_requests, int)
            or max_concurrent_requests < 1
        ):
            raise InvalidArgument(
                f"max_concurrent_requests must be a positive integer or None, got {max_concurrent_requests!r}"
            )
        if not isinstance(evict_idle_to_store, bool):
            raise InvalidArgument(f"evict_idle_to_store must be a bool, got {evict_idle_to_store!r}")
        if not isinstance(client, MultiplexedWorkerClient):
            raise InvalidArgument(f"client must be a MultiplexedWorkerClient, got {type(client).__name__}")
        if client.info is None:
            raise InvalidArgument("the client has not connected to its worker yet (use spawn_multiplexed_worker)")
        if evict_idle_to_store:
            if client.session_store is None:
                raise InvalidArgument(
                    "evict_idle_to_store needs the client's session_store (pass session_store= to "
                    "spawn_multiplexed_worker): evicted sessions are saved there"
                )
            client.session_store.check_worker(client.info)  # a mismatch fails here, not at the first eviction
        self.client = client
        limits = [client.info.limits["max_inflight_requests"], max_concurrent_requests]
        self.capacity: int = min(n for n in limits if n is not None)
        self.evict_idle_to_store = evict_idle_to_store
        max_sessions = client.info.limits.get("max_sessions")
        self._max_sessions: int | None = max_sessions if isinstance(max_sessions, int) and max_sessions > 0 else None
        # Session id -> its admitted, unsettled operations: the head holds the lease (RUNNING),
        # the rest are QUEUED in arrival order. A lane is removed when it empties.
        self._lanes: dict[str, deque[_Op]] = {}
        self._admitted = 0
        # Internal operations running: evictions, closes and saves outside the capacity (not admitted).
        self._evicting = 0
        self._all_settled = trio.Event()  # set while nothing is admitted or evicting
        self._all_settled.set()
        self._closing = False
        # The sessions opened, resumed or restored here, least recently used first.
        self._sessions: OrderedDict[str, _Tracked] = OrderedDict()
        self._live = 0  # of those, the ones holding a worker slot
        self._freeing = 0  # evicted or closed here, their slot not yet freed by the worker
        self._evictions = 0
        self._resumes = 0
        self._eviction_failures = 0

    # -- introspection (tests and metrics) --------------------------------------------------------

    @property
    def admitted(self) -> int:
        """Operations admitted and not yet settled (running or waiting for their lease)."""
        return self._admitted

    @property
    def leased_sessions(self) -> int:
        """Sessions with an operation admitted and not yet settled (or being evicted)."""
        return len(self._lanes)

    @property
    def session_stats(self) -> dict[str, int]:
        """Counts for metrics: ``live`` (tracked sessions in a worker slot), ``evicted`` (tracked
        sessions whose state waits in the store), and since the start ``evictions``,
        ``resumes_from_store`` and ``eviction_failures`` (saves that failed, leaving their session
        live). Only sessions opened, resumed or restored through this runtime are tracked."""
        return {
            "live": self._live,
            "evicted": len(self._sessions) - self._live,
            "evictions": self._evictions,
            "resumes_from_store": self._resumes,
            "eviction_failures": self._eviction_failures,
        }

    def live_sessions(self) -> list[str]:
        """Ids of the tracked sessions holding a worker slot, least recently used first."""
        return [sid for sid, tracked in self._sessions.items() if not tracked.evicted]

    def session_state(self, session_id: str) -> str | None:
        """``"live"``, ``"evicted"``, or None for a session this runtime does not track (never
        opened here, or closed)."""
        tracked = self._sessions.get(session_id)
        if tracked is None:
            return None
        return "evicted" if tracked.evicted else "live"

    # -- admission and leases ---------------------------------------------------------------------

    def _admit(
        self,
        session_id: str,
        body: Callable[[], Awaitable[Any]],
        *,
        follows_caller: bool = False,
        outside_capacity: bool = False,
    ) -> _Op:
        """Queue ``body`` in its session's lane, or raise at once. Does not block.
        ``outside_capacity``: not admitted against the capacity (nor counted in ``admitted``); it
        still waits for its session's lease like any operation."""
        if self._closing:
            raise ClientClosedError("the session runtime is closing")
        if not isinstance(session_id, str) or not session_id:
            raise InvalidArgument(f"session id must be a non-empty string, got {session_id!r}")
        if not outside_capacity and self._admitted >= self.capacity:
            raise CapacityExhausted(f"{self._admitted} operations are admitted (capacity {self.capacity})")
        op = _Op(session_id, body, follows_caller=follows_caller, internal=outside_capacity)
        if outside_capacity:
            self._evicting += 1  # counted with the evictions: settled before the worker closes
        self._enqueue(op)
        if not outside_capacity:
            self._admitted += 1
        self._touch(session_id)
        return op

    def _enqueue(self, op: _Op) -> None:
        lane = self._lanes.setdefault(op.session_id, deque())
        lane.append(op)
        if self._all_settled.is_set():
            self._all_settled = trio.Event()
        if len(lane) == 1:
            self._start(op)

    def _start(self, op: _Op) -> None:
        """Give ``op`` its session's lease and run it in a system task, so it outlives its caller."""
        op.state = _State.RUNNING
        trio.lowlevel.spawn_system_task(self._run, op, name=f"muxworker-session-op:{op.session_id}")

    async def _run(self, op: _Op) -> None:
        try:
            with op.scope:
                op.value = await op.body()
            if op.scope.cancelled_caught:
                op.error = OperationCancelled(f"cancelled before its transfer started on session {op.session_id!r}")
        except trio.Cancelled:
            # Only when the trio run itself ends (the system nursery is cancelled): no caller is left.
            op.error = OperationCancelled("the trio run ended while the operation was running")
            raise
        except BaseException as exc:  # handed to the caller; it must never escape a system task
            op.error = exc
        finally:
            self._settle(op)

    def _abandon(self, op: _Op, *, value: Any = None) -> None:
        """Drop an operation still waiting for its lease: it never runs and frees its capacity."""
        if op.state is _State.QUEUED:
            op.value = value
            if value is None:
                op.error = OperationCancelled(f"cancelled while waiting for session {op.session_id!r}")
            self._settle(op)

    def _settle(self, op: _Op) -> None:
        """Record that ``op`` ended; if it held the lease, pass the lease to the next in its lane."""
        if op.state is _State.DONE:
            return
        held_lease = op.state is _State.RUNNING
        op.state = _State.DONE
        lane = self._lanes[op.session_id]
        if held_lease:
            lane.popleft()  # the lease holder is always the head
        else:
            lane.remove(op)
        if op.on_settle is not None:
            op.on_settle()
        op.done.set()
        if op.internal:
            self._evicting -= 1
        else:
            self._admitted -= 1
            self._touch(op.session_id)
        if not lane:
            del self._lanes[op.session_id]
        elif held_lease:
            self._start(lane[0])
        if self._admitted == 0 and self._evicting == 0:
            self._all_settled.set()

    async def _call(
        self,
        session_id: str,
        body: Callable[[], Awaitable[Any]],
        *,
        follows_caller: bool = False,
        outside_capacity: bool = False,
    ) -> Any:
        op = self._admit(session_id, body, follows_caller=follows_caller, outside_capacity=outside_capacity)
        try:
            await op.done.wait()
        except trio.Cancelled:
            self._abandon(op)  # no-op once it holds the lease: then it settles under the lease
            if op.follows_caller:
                op.scope.cancel()  # a checkpoint call not yet transferring never starts
            raise
        if op.error is not None:
            raise _fresh(op.error)
        return op.value

    # -- tracking and eviction --------------------------------------------------------------------
    #
    # A tracked session's record changes only in an operation holding its lease (or synchronously
    # as an eviction takes that lease), so an operation sees its own session's state stay put.

    def _touch(self, session_id: str) -> None:
        if session_id in self._sessions:
            self._sessions.move_to_end(session_id)

    def _track_live(self, session_id: str) -> None:
        """``session_id`` now holds a worker slot (opened, resumed or restored here)."""
        tracked = self._sessions.get(session_id)
        if tracked is None:
            self._sessions[session_id] = _Tracked()
            self._live += 1
        elif tracked.evicted:
            tracked.evicted = False
            self._live += 1
        self._sessions.move_to_end(session_id)

    def _forget(self, session_id: str) -> None:
        tracked = self._sessions.pop(session_id, None)
        if tracked is not None and not tracked.evicted:
            self._live -= 1

    def _refuse_if_tracked(self, session_id: str) -> None:
        """SessionExists for a session that is open as far as callers can tell: evicted, or (with
        eviction on) live. Raised before a slot is made for it; the worker would say the same."""
        tracked = self._sessions.get(session_id)
        if tracked is not None and (tracked.evicted or self.evict_idle_to_store):
            where = "evicted to the store" if tracked.evicted else "live"
            raise SessionExists(f"session {session_id!r} is already open ({where})")

    async def _with_slot(self, session_id: str, attempt: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``attempt`` (an open, resume or restore of ``session_id``), evicting idle sessions
        first while no slot is free. Raises CapacityExhausted when none is idle."""
        if not self.evict_idle_to_store:
            return await attempt()
        # Each round evicts one session or raises; the bound only stops a pathological ping-pong
        # with other operations taking every freed slot.
        for _ in range(max(8, 2 * (self._max_sessions or 0) + 2)):
            if self._max_sessions is not None and self._live + self._freeing >= self._max_sessions:
                await self._evict_one(session_id)
                continue
            try:
                return await attempt()
            except CapacityExhausted:
                await self._evict_one(session_id)
        raise CapacityExhausted(f"no session slot stayed free for {session_id!r}: other operations took each one")

    async def _evict_one(self, for_session: str) -> None:
        """Evict the least recently used idle tracked session, under its lease; raise
        CapacityExhausted when there is none, EvictionFailed when its save failed."""
        victim = next(
            (
                sid
                for sid, tracked in self._sessions.items()
                if not tracked.evicted and tracked.evictable and sid not in self._lanes and sid != for_session
            ),
            None,
        )
        if victim is None:
            raise CapacityExhausted(
                f"all session slots are in use and no idle session can be evicted to make room for "
                f"{for_session!r} (every live session has an operation admitted)"
            )
        op = _Op(victim, lambda: self._evict(victim), internal=True)
        self._evicting += 1
        self._enqueue(op)  # its lane was empty: it holds the lease at once
        # A cancelled caller leaves it running: the eviction completes (or fails) under its lease.
        await op.done.wait()
        if op.error is not None:
            raise _fresh(op.error)

    async def _evict(self, session_id: str) -> None:
        """Body of an eviction: save, close, mark evicted. A failed save keeps the session live."""
        has_file = True
        try:
            await self.client.save_session(session_id)
        except Unsaveable:
            # No committed state to keep (opened or reset and not generated since, or its last
            # generation failed, which empties it): it will be reopened empty.
            has_file = False
        except SessionNotFound:
            self._forget(session_id)  # no longer in the worker (closed behind the runtime's back)
            return
        except (WorkerDiedError, ClientClosedError):
            raise
        except SaveConflict:
            # Another writer saved the session since this worker's copy was saved or resumed: the
            # copy is stale, so it is dropped (the store keeps the other writer's save, which the
            # session's next use resumes; the store remembers the conflict for whoever reports it).
            self._forget(session_id)
            self._evictions += 1
            await self._free_slot(session_id)
            return
        except Exception as exc:
            self._eviction_failures += 1
            raise EvictionFailed(
                f"no session slot is free, and evicting the least recently used idle session {session_id!r} failed: "
                f"saving it to the store raised {type(exc).__name__}: {exc}. It stays live; nothing was lost",
                session_id,
                exc,
            ) from exc
        # Counted as evicted before its slot is freed, so the live count never exceeds the slots the
        # worker has (another operation may fill this slot before this task runs again); the
        # slots check counts it as closing until the worker has freed the slot.
        tracked = self._sessions[session_id]
        tracked.evicted = True
        tracked.has_file = has_file
        self._live -= 1
        self._evictions += 1
        await self._free_slot(session_id)

    async def _free_slot(self, session_id: str) -> None:
        """Close ``session_id``'s worker copy, counted as closing until the worker has freed its slot."""
        self._freeing += 1
        try:
            await self.client.close_session(session_id)
        except SessionNotFound:
            pass
        finally:
            self._freeing -= 1

    async def _bring_back(self, session_id: str) -> bool:
        """Under ``session_id``'s lease: if it is evicted, resume it from the store (or reopen it
        empty when it had nothing to save), making room first. Returns whether it was resumed."""
        tracked = self._sessions.get(session_id)
        if tracked is None or not tracked.evicted:
            return False
        if tracked.has_file:
            await self._with_slot(session_id, lambda: self.client.resume_session(session_id))
            self._resumes += 1
        else:
            await self._with_slot(session_id, lambda: self.client.open_session(session_id))
        self._track_live(session_id)
        return tracked.has_file

    # -- operations -------------------------------------------------------------------------------

    def generate(self, session_id: str, prompt: str | Sequence[int] | Sequence[Any], params: Any) -> RuntimeStream:
        """Admit a generation on ``session_id`` and return its stream (raises CapacityExhausted at once).

        ``params`` is a :class:`GenerationParams` or any object with its attributes; its
        ``session_id`` may be left out (or None), and must otherwise equal ``session_id``. An
        evicted session is resumed from the store first (its result says ``resumed_from_store``).
        """
        given = getattr(params, "session_id", None)
        if given is not None and not (isinstance(given, str) and given == session_id):
            raise InvalidArgument(f"params.session_id is {given!r} but the generation is for session {session_id!r}")
        if isinstance(params, CheckedParams):
            checked = params.for_session(session_id)
        else:
            checked = check_params(_SessionParams(params, session_id))  # bad params fail here, once
        stream = RuntimeStream(self, session_id, prompt, checked, DEFAULT_STREAM_BUFFER)
        op = self._admit(session_id, stream._pump)
        op.on_settle = stream._send.close  # ends iteration, whether or not the generation ran
        op.cancel = stream.cancel
        stream._op = op
        return stream

    async def open_session(self, session_id: str, *, evictable: bool = True) -> None:
        """Open an empty session, evicting an idle one first if that is on and no slot is free.
        ``evictable=False``: this session is never evicted to make room (a one-request session a
        server closes at once, which must leave no file behind)."""

        async def body() -> None:
            self._refuse_if_tracked(session_id)
            await self._with_slot(session_id, lambda: self.client.open_session(session_id))
            self._track_live(session_id)
            self._sessions[session_id].evictable = evictable

        return await self._call(session_id, body)

    async def close_session(self, session_id: str) -> None:
        """Close a session. An evicted one is only forgotten: its file stays in the store, as after a save.
        Never refused for capacity: a close frees what the capacity protects."""

        async def body() -> None:
            tracked = self._sessions.get(session_id)
            if tracked is not None and tracked.evicted:
                self._forget(session_id)
                return
            live = tracked is not None
            # Forgotten before the worker frees the slot, so the live count never exceeds the slots.
            self._forget(session_id)
            self._freeing += live
            try:
                await self.client.close_session(session_id)
            finally:
                self._freeing -= live

        return await self._call(session_id, body, outside_capacity=True)

    async def fork_session(self, session_id: str, target_id: str, rows: int) -> None:
        """Make live session ``target_id``'s history the first ``rows`` tokens of live session
        ``session_id``'s (the client's :meth:`~.MultiplexedWorkerClient.fork_session`), in
        ``target_id``'s turn; ``session_id`` may be generating meanwhile."""

        async def body() -> None:
            for sid in (session_id, target_id):
                tracked = self._sessions.get(sid)
                if tracked is None or tracked.evicted:
                    raise SessionNotFound(f"session {sid!r} is not live in this runtime")
            await self.client.fork_session(session_id, target_id, rows)

        return await self._call(target_id, body)

    async def bring_back(self, session_id: str) -> bool:
        """Make an evicted session live again (resumed from the store, in its turn); returns
        whether it was resumed. A live one is left as it is."""
        return await self._call(session_id, lambda: self._bring_back(session_id))

    async def reset_session(self, session_id: str) -> None:
        """Forget a session's history and keep it open. An evicted one is not loaded: it stays
        evicted with nothing to resume, and its next use reopens it empty (its file stays)."""

        async def body() -> None:
            tracked = self._sessions.get(session_id)
            if tracked is not None and tracked.evicted:
                tracked.has_file = False
                return
            await self.client.reset_session(session_id)

        return await self._call(session_id, body)

    async def save_session(self, session_id: str, *, outside_capacity: bool = False) -> SaveResult | None:
        """Save the session to the client's store after every earlier operation on it (a running
        generation included); returns what was written. For an evicted session there is nothing to
        do (None): its file already holds its committed state (Unsaveable if it had none).
        ``outside_capacity=True``: not admitted against the capacity, for saves a server makes on
        its own (after each turn), which must neither fail for capacity nor take it from clients."""

        async def body() -> SaveResult | None:
            tracked = self._sessions.get(session_id)
            if tracked is not None and tracked.evicted:
                if not tracked.has_file:
                    raise Unsaveable(f"session {session_id!r} cannot be saved: empty")
                return None
            return await self.client.save_session(session_id)

        return await self._call(session_id, body, follows_caller=True, outside_capacity=outside_capacity)

    async def resume_session(self, session_id: str) -> str:
        """Restore the session's saved file into a new live session of that id; returns the id.
        An evicted session counts as open (SessionExists): its next use resumes it anyway."""

        async def body() -> str:
            self._refuse_if_tracked(session_id)
            await self._with_slot(session_id, lambda: self.client.resume_session(session_id))
            self._track_live(session_id)
            return session_id

        return await self._call(session_id, body, follows_caller=True)

    async def export_checkpoint_to_cpu(
        self, session_id: str, position: int | None = None, identity: str | None = None
    ) -> CPUCheckpoint:
        """A host copy of the session's committed state; an evicted session is resumed first."""

        async def body() -> CPUCheckpoint:
            tracked = self._sessions.get(session_id)
            if tracked is not None and tracked.evicted and not tracked.has_file:
                raise Unsaveable(f"session {session_id!r} cannot be saved: empty")
            await self._bring_back(session_id)
            return await self.client.export_checkpoint_to_cpu(session_id, position, identity)

        return await self._call(session_id, body, follows_caller=True)

    async def restore_checkpoint_from_cpu(
        self,
        checkpoint: CPUCheckpoint,
        session_id: str,
        position: int | None = None,
        expected_identity: str | None = None,
    ) -> None:
        """Restore ``checkpoint`` into the unused session id (an evicted one counts as used)."""

        async def body() -> None:
            self._refuse_if_tracked(session_id)
            await self._with_slot(
                session_id,
                lambda: self.client.restore_checkpoint_from_cpu(checkpoint, session_id, position, expected_identity),
            )
            self._track_live(session_id)

        return await self._call(session_id, body, follows_caller=True)

    async def aclose_worker(self) -> None:
        """Refuse new operations, let every admitted one settle, then close the worker.

        Idempotent. If the caller is cancelled while waiting, generations are cancelled (waiting
        ones never run), the worker is closed at once, and the remaining operations settle (those
        still waiting for a lease fail with ClientClosedError) before the Cancelled propagates.
        Evicted sessions stay in the store (closing never saves a live one).
        """
        self._closing = True
        try:
            await self._all_settled.wait()
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                for lane in list(self._lanes.values()):
                    for op in list(lane):
                        if op.cancel is not None:
                            op.cancel()
                await self.client.close()
                # Quick now: the client fails every call; a save already writing its file finishes.
                await self._all_settled.wait()
            raise
        with trio.CancelScope(shield=True):
            await self.client.close()


class _SessionParams:
    """``params`` as the client reads them, with ``session_id`` set to the runtime's argument."""

    __slots__ = ("session_id", "_params")

    def __init__(self, params: Any, session_id: str) -> None:
        self.session_id = session_id
        self._params = params

    def __getattr__(self, name: str) -> Any:
        return getattr(self._params, name)
