"""Admission of generations: at most ``capacity`` units run at once; the rest wait in a bounded
queue before a 429, shared fairly between the *parties* asking (a tenant; on a server without API
keys, a client address: :meth:`Tenant.admission_party`).

A request takes ``units`` (its choices: each runs on a session slot of its own) as a
:class:`Grant`, given back when its generation has settled. Two shares, both max-min fair and
work conserving (one party alone may use every slot and every place; nothing running is ever
preempted):

- Slots. A slot that comes free goes to the waiting party that holds the fewest running units
  (ties: parties in turn, each its own requests in arrival order), so another party's burst keeps
  a request waiting only until the first slot comes free, and while several parties wait each
  converges to an equal share of the slots: a party is granted only while it holds no more than
  any other waiting party.
- Queue places. While the queue has room anyone may wait. When it is full, a newcomer takes the
  place of the newest waiter of the party holding the most places, if that party keeps at least
  as many as the newcomer's would then be (longest queue drop); the one pushed out gets the 429
  it would have got had it come last. So one party's burst may fill an idle queue, but another
  party's first request still finds a place, and under contention each party holds an equal
  share (``max_queue`` / the parties waiting).

A request that cannot get a place, or waits ``max_wait_s``, is refused with
:class:`CapacityExhausted` (429 with Retry-After).

Owner: the server's trio thread.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import trio

from muxworker.transport.errors import CapacityExhausted

__all__ = ["Admission", "Grant"]


@dataclass(eq=False)
class Grant:
    """``units`` slots held by ``party`` (:meth:`Admission.acquire`); :meth:`release` gives them
    back (idempotent). ``waited``: the seconds it spent in the queue."""

    admission: Admission
    party: str
    units: int
    waited: float = 0.0
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission._give_back(self.party, self.units)


@dataclass(eq=False)
class _Waiter:
    units: int
    seq: int  # arrival order: the newest of a party is pushed out first
    event: trio.Event = field(default_factory=trio.Event)
    granted: bool = False
    refused: str | None = None  # pushed out of the queue: why


class Admission:
    """See the module docstring. ``capacity`` None: unbounded (every request runs at once)."""

    def __init__(self, capacity: int | None, max_queue: int = 128, max_wait_s: float = 60.0) -> None:
        self.capacity = capacity
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.running = 0  # units held, by everyone
        self._held: dict[str, int] = {}  # party -> units held (parties holding none are absent)
        self._queues: OrderedDict[str, deque[_Waiter]] = OrderedDict()  # party -> waiters; next in turn first
        self._waiting = 0
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return self._waiting

    def held(self, party: str) -> int:
        """The units ``party`` holds now."""
        return self._held.get(party, 0)

    def _fits(self, units: int) -> bool:
        return self.capacity is None or self.running + units <= max(self.capacity, units)

    async def acquire(self, party: str, units: int = 1) -> Grant:
        """Take ``units`` for ``party``, waiting in its queue while none are free. Raises
        CapacityExhausted when no place is left for it, it is pushed out, or it waits too long."""
        if not self._waiting and self._fits(units):
            self._hold(party, units)
            return Grant(self, party, units)
        waiter = _Waiter(units, next(self._seq))
        self._enqueue(party, waiter)
        t0 = trio.current_time()
        try:
            with trio.move_on_after(self.max_wait_s):
                await waiter.event.wait()
        except BaseException:  # cancelled (the client went away): give back what it holds or would
            if waiter.granted:
                self._give_back(party, waiter.units)
            else:
                self._remove(party, waiter)
            raise
        if waiter.refused is not None:
            raise CapacityExhausted(waiter.refused)
        if not waiter.granted:
            self._remove(party, waiter)
            raise CapacityExhausted(
                f"no generation slot came free within {self.max_wait_s:.0f} s ({self.running} running, "
                f"{self._waiting} waiting); retry later"
            )
        return Grant(self, party, units, trio.current_time() - t0)

    def _hold(self, party: str, units: int) -> None:
        self.running += units
        self._held[party] = self._held.get(party, 0) + units

    def _enqueue(self, party: str, waiter: _Waiter) -> None:
        if self._waiting >= self.max_queue:
            mine = len(self._queues.get(party, ()))
            # The party with the most places; of equals, the one whose newest waiter came last.
            longest = max(
                (p for p in self._queues if p != party),
                key=lambda p: (len(self._queues[p]), self._queues[p][-1].seq),
                default=None,
            )
            if longest is None or len(self._queues[longest]) - 1 < mine + 1:
                raise CapacityExhausted(
                    f"{self.running} generations are running and {self._waiting} waiting (the queue holds "
                    f"{self.max_queue}, {mine} of them yours); retry later"
                )
            queue = self._queues[longest]
            pushed = queue.pop()
            self._waiting -= 1
            if not queue:
                del self._queues[longest]
            pushed.refused = (
                f"the queue is full ({self.max_queue} waiting) and this client held more of its places than "
                "another that asked since; retry later"
            )
            pushed.event.set()
        self._queues.setdefault(party, deque()).append(waiter)
        self._waiting += 1

    def _remove(self, party: str, waiter: _Waiter) -> None:
        queue = self._queues.get(party)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self._waiting -= 1
            if not queue:
                del self._queues[party]
        self._grant()  # a large waiter leaving may let smaller ones in

    def _give_back(self, party: str, units: int) -> None:
        self.running -= units
        left = self._held.get(party, 0) - units
        if left > 0:
            self._held[party] = left
        else:
            self._held.pop(party, None)
        self._grant()

    def _grant(self) -> None:
        while self._queues:
            # The waiting party holding the fewest units; of equals, the first in turn.
            party = min(self._queues, key=self.held)
            queue = self._queues[party]
            waiter = queue[0]
            if not self._fits(waiter.units):
                return  # it waits for room rather than being passed by smaller requests forever
            queue.popleft()
            self._waiting -= 1
            del self._queues[party]
            if queue:
                self._queues[party] = queue  # to the back: the next party of equals goes first
            self._hold(party, waiter.units)
            waiter.granted = True
            waiter.event.set()
