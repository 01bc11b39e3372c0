"""Admission of generations: at most ``capacity`` run at once; the rest wait in a bounded queue,
fair between tenants, before a 429.

A request takes ``units`` (its choices: each runs on a session slot of its own) and gives them
back when its generation has settled. Waiters are served tenant by tenant in turn (round robin
over the tenants with waiters, each tenant's own in arrival order), so one tenant's burst cannot
hold another's single request behind it. A request that finds ``max_queue`` waiting, or waits
``max_wait_s``, is refused with :class:`CapacityExhausted` (429 with Retry-After), as it was at
once before the queue existed.

Owner: the server's trio thread.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import trio

from muxworker.transport.errors import CapacityExhausted

__all__ = ["Admission"]


@dataclass(eq=False)
class _Waiter:
    units: int
    event: trio.Event = field(default_factory=trio.Event)
    granted: bool = False


class Admission:
    """See the module docstring. ``capacity`` None: unbounded (every request runs at once)."""

    def __init__(self, capacity: int | None, max_queue: int = 128, max_wait_s: float = 60.0) -> None:
        self.capacity = capacity
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.running = 0  # units held
        self._queues: OrderedDict[str, deque[_Waiter]] = OrderedDict()  # tenant -> waiters, next tenant first
        self._waiting = 0

    @property
    def waiting(self) -> int:
        return self._waiting

    def _fits(self, units: int) -> bool:
        return self.capacity is None or self.running + units <= max(self.capacity, units)

    async def acquire(self, tenant: str, units: int = 1) -> float:
        """Take ``units``, waiting in the tenant's queue while none are free; returns the seconds
        waited. Raises CapacityExhausted when the queue is full or the wait too long."""
        if not self._waiting and self._fits(units):
            self.running += units
            return 0.0
        if self._waiting >= self.max_queue:
            raise CapacityExhausted(
                f"{self.running} generations are running and {self._waiting} waiting (the queue holds "
                f"{self.max_queue}); retry later"
            )
        waiter = _Waiter(units)
        self._queues.setdefault(tenant, deque()).append(waiter)
        self._waiting += 1
        t0 = trio.current_time()
        try:
            with trio.move_on_after(self.max_wait_s):
                await waiter.event.wait()
        except BaseException:  # cancelled (the client went away): give back what it holds or would
            if waiter.granted:
                self.release(waiter.units)
            else:
                self._remove(tenant, waiter)
            raise
        if not waiter.granted:
            self._remove(tenant, waiter)
            raise CapacityExhausted(
                f"no generation slot came free within {self.max_wait_s:.0f} s ({self.running} running, "
                f"{self._waiting} waiting); retry later"
            )
        return trio.current_time() - t0

    def _remove(self, tenant: str, waiter: _Waiter) -> None:
        queue = self._queues.get(tenant)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self._waiting -= 1
            if not queue:
                del self._queues[tenant]
        self._grant()  # a large waiter leaving may let smaller ones in

    def release(self, units: int = 1) -> None:
        """Give ``units`` back and let waiters in, tenants in turn."""
        self.running -= units
        self._grant()

    def _grant(self) -> None:
        while self._queues:
            tenant, queue = next(iter(self._queues.items()))
            waiter = queue[0]
            if not self._fits(waiter.units):
                return
            queue.popleft()
            self._waiting -= 1
            del self._queues[tenant]
            if queue:
                self._queues[tenant] = queue  # to the back: the next tenant goes first
            self.running += waiter.units
            waiter.granted = True
            waiter.event.set()
