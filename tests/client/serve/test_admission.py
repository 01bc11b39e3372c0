"""The admission queue (client/serve/admission.py), in-process: fair shares of the slots and of the
queue places between parties, and the bounds that refuse."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from muxworker.client.serve.admission import Admission
from muxworker.client.serve.options import check_flags, parser
from muxworker.client.serve.tenants import Tenant
from muxworker.transport.errors import CapacityExhausted


class _Requests:
    """Requests started one at a time, each holding its grant until told to finish."""

    def __init__(self, adm: Admission, nursery: trio.Nursery) -> None:
        self.adm, self.nursery = adm, nursery
        self.granted: list[str] = []  # tags, in the order they got their slots
        self.refused: list[str] = []
        self._done: dict[str, trio.Event] = {}

    async def start(self, party: str, tag: str, units: int = 1) -> None:
        self._done[tag] = trio.Event()
        self.nursery.start_soon(self._one, party, tag, units)
        await trio.testing.wait_all_tasks_blocked()

    async def finish(self, tag: str) -> None:
        self._done[tag].set()
        await trio.testing.wait_all_tasks_blocked()

    async def _one(self, party: str, tag: str, units: int) -> None:
        try:
            grant = await self.adm.acquire(party, units)
        except CapacityExhausted:
            self.refused.append(tag)
            return
        self.granted.append(tag)
        await self._done[tag].wait()
        grant.release()


async def test_one_partys_burst_leaves_another_a_place_and_the_next_slot():
    # The red-team case: 2 slots, 8 places, tenant A sends 60 at once, then tenant B one.
    adm = Admission(2, max_queue=8, max_wait_s=60)
    async with trio.open_nursery() as nursery:
        reqs = _Requests(adm, nursery)
        for i in range(60):
            await reqs.start("A", f"a{i}")
        assert reqs.granted == ["a0", "a1"] and len(reqs.refused) == 50 and adm.waiting == 8
        await reqs.start("B", "b0")
        assert reqs.refused[-1] == "a9"  # A's newest waiter gave its place up to B's first
        assert adm.waiting == 8 and "b0" not in reqs.refused
        await reqs.finish("a0")
        assert reqs.granted[-1] == "b0"  # the first slot free goes to B, ahead of A's 7 waiting
        assert adm.held("A") == 1 and adm.held("B") == 1
        for tag in ["a1", "b0", *(f"a{i}" for i in range(2, 9))]:
            await reqs.finish(tag)
    assert reqs.granted == ["a0", "a1", "b0", *(f"a{i}" for i in range(2, 9))]
    assert adm.running == 0 and adm.waiting == 0 and adm.held("A") == 0


async def test_free_slots_go_to_the_party_running_fewest():
    adm = Admission(4, max_queue=16, max_wait_s=60)
    async with trio.open_nursery() as nursery:
        reqs = _Requests(adm, nursery)
        for i in range(8):
            await reqs.start("A", f"a{i}")  # A alone: it may take every slot (nothing is kept idle)
        for i in range(3):
            await reqs.start("B", f"b{i}")
        assert reqs.granted == ["a0", "a1", "a2", "a3"]
        for i in range(4):
            await reqs.finish(f"a{i}")
        # B while it runs fewer, then in turn: equal shares while both wait, none preempted.
        assert reqs.granted[4:] == ["b0", "b1", "a4", "a5"]
        assert adm.held("A") == 2 and adm.held("B") == 2
        for tag in ["a4", "a5", "b0", "b1", "a6", "a7", "b2"]:
            await reqs.finish(tag)
    assert adm.running == 0 and adm.waiting == 0


async def test_parties_of_equal_holdings_take_turns():
    adm = Admission(1, max_queue=3, max_wait_s=5)
    async with trio.open_nursery() as nursery:
        reqs = _Requests(adm, nursery)
        for tag in ("a0", "a1", "a2"):
            await reqs.start("a", tag)
        await reqs.start("b", "b1")  # the queue has room: no one is pushed out
        assert reqs.refused == []
        await reqs.start("c", "c1")  # full: a, with two places, gives its newest up
        assert reqs.refused == ["a2"]
        with pytest.raises(CapacityExhausted, match="queue holds 3, 0 of them yours"):
            await adm.acquire("d")  # full, and every party holds one place: none gives it up
        for tag in ("a0", "a1", "b1", "c1"):
            await reqs.finish(tag)
    assert reqs.granted == ["a0", "a1", "b1", "c1"]  # tenants in turn, not arrival order
    assert adm.running == 0 and adm.waiting == 0


async def test_a_full_queue_converges_to_equal_shares():
    adm = Admission(1, max_queue=6, max_wait_s=60)
    async with trio.open_nursery() as nursery:
        reqs = _Requests(adm, nursery)
        await reqs.start("X", "x")  # holds the slot
        for i in range(6):
            await reqs.start("A", f"a{i}")
        for party in ("B", "C"):
            for i in range(3):
                await reqs.start(party, f"{party.lower()}{i}")
        # A gave up its newest four places, B its newest one; C's third found no one to take from.
        assert reqs.refused == ["a5", "a4", "a3", "b2", "a2", "c2"]
        assert [len(adm._queues[p]) for p in ("A", "B", "C")] == [2, 2, 2]
        nursery.cancel_scope.cancel()


async def test_units_wait_for_room_rather_than_being_passed():
    adm = Admission(3, max_queue=8, max_wait_s=60)
    async with trio.open_nursery() as nursery:
        reqs = _Requests(adm, nursery)
        await reqs.start("A", "a0", units=2)
        await reqs.start("B", "b0", units=2)  # n=2: needs two free slots
        await reqs.start("C", "c0")
        assert reqs.granted == ["a0"]  # c0 would fit the free slot, but no one passes the queue
        await reqs.finish("a0")
        assert sorted(reqs.granted) == ["a0", "b0", "c0"]  # both at once (their tasks wake in any order)
        nursery.cancel_scope.cancel()


async def test_wait_bound_cancel_and_double_release_give_back():
    adm = Admission(1, max_queue=8, max_wait_s=0.05)
    grant = await adm.acquire("a")
    with pytest.raises(CapacityExhausted, match="within"):
        await adm.acquire("b")
    assert adm.waiting == 0
    with trio.move_on_after(0.01):
        await adm.acquire("b")
    assert adm.waiting == 0 and adm.running == 1
    grant.release()
    grant.release()  # idempotent: the second gives back nothing
    assert adm.running == 0 and adm.held("a") == 0
    again = await adm.acquire("b")
    assert again.waited == 0.0 and adm.running == 1


def test_a_keyless_server_shares_admission_by_client_address():
    local = Tenant.of_key(None)
    assert local.admission_party(("10.0.0.1", 5000)) != local.admission_party(("10.0.0.2", 5000))
    assert local.admission_party(("10.0.0.1", 5000)) == local.admission_party(("10.0.0.1", 6000))
    assert local.admission_party(None) == local.name  # a unix socket: no address
    keyed = Tenant.of_key("sk-1")
    assert keyed.admission_party(("10.0.0.1", 5000)) == keyed.admission_party(("10.0.0.2", 1)) == keyed.name


def test_the_send_timeout_flag():
    p = parser()
    assert p.parse_known_args([])[0].send_timeout == 30.0
    for bad in ("0", "0.5", "nan", "4000"):
        problem = check_flags(p.parse_known_args(["--port", "0", "--send-timeout", bad])[0])
        assert problem is not None and problem.startswith("--send-timeout must be in [1, 3600]"), problem
    assert check_flags(p.parse_known_args(["--port", "0", "--send-timeout", "2"])[0]) is None
