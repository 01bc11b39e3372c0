"""The client's connection driven over in-memory streams by a fake worker: routing, cancellation
races, slow consumers and connection loss, without spawning a worker process."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from muxworker.client.connection import Connection
from muxworker.transport.errors import ClientClosedError, SessionBusy, SlowConsumer, WorkerDiedError
from muxworker.transport.framing import Frame, attach_payload
from muxworker.transport.messages import RESULT_FIELDS, GenerationResult
from muxworker.transport.trio_stream import TrioFrameReader, TrioFrameWriter

pytestmark = pytest.mark.trio


class FakeWorker:
    """The worker's end of the streams: reads the client's frames, sends what a test tells it."""

    def __init__(self, receive: trio.abc.ReceiveStream, send: trio.abc.SendStream) -> None:
        self.reader = TrioFrameReader(receive)
        self.writer = TrioFrameWriter(send)

    async def receive(self) -> dict:
        frame = await self.reader.receive()
        assert frame is not None, "the client closed its end"
        return frame.control

    async def token(self, rid: int, text: str, ids: list[int]) -> None:
        await self.writer.send(Frame({"kind": "token", "id": rid, "text": text, "token_ids": ids}))

    async def done(self, rid: int, finish_reason: str = "stop", ids: list[int] = ()) -> None:
        payloads: list = []
        result = {name: 0 for name in RESULT_FIELDS} | {
            "finish_reason": finish_reason,
            "prefill_time_s": 0.0,
            "decode_time_s": 0.0,
            "generated_token_ids": attach_payload(payloads, np.asarray(ids, dtype=np.int32)),
        }
        await self.writer.send(Frame({"kind": "done", "id": rid, "result": result}, payloads))

    async def send(self, control: dict) -> None:
        await self.writer.send(Frame(control))


def _pair(**kw) -> tuple[Connection, FakeWorker]:
    to_worker_send, to_worker_recv = trio.testing.memory_stream_one_way_pair()
    to_client_send, to_client_recv = trio.testing.memory_stream_one_way_pair()
    options = {"stream_buffer": 8, "close_timeout": 1.0, "liveness_timeout": None} | kw
    connection = Connection(to_client_recv, to_worker_send, **options)
    return connection, FakeWorker(to_worker_recv, to_client_send)


def _generate(connection: Connection, session_id: str = "s"):
    fields = {"session_id": session_id, "prompt": [{"text": "hi"}]}
    return connection.submit("generate", fields, expect="done", buffer=connection.stream_buffer)


async def _drain(connection: Connection, request) -> list[str]:
    texts = []
    while (frame := await connection.next_token_frame(request)) is not None:
        texts.append(frame.control["text"])
    return texts


async def test_interleaved_streams_are_routed_to_their_own_requests():
    connection, worker = _pair()
    async with trio.open_nursery() as nursery:
        await nursery.start(connection.run)
        a, b = _generate(connection, "a"), _generate(connection, "b")
        assert [(await worker.receive())["session_id"] for _ in range(2)] == ["a", "b"]
        await worker.token(b.rid, "B1", [7])
        await worker.token(a.rid, "A1", [5])
        await worker.token(b.rid, "B2", [8])
        await worker.done(b.rid, ids=[7, 8])
        await worker.done(a.rid, ids=[5])
        assert await _drain(connection, a) == ["A1"] and await _drain(connection, b) == ["B1", "B2"]
        result = connection.outcome(b)
        assert isinstance(result, GenerationResult) and result.generated_token_ids == [7, 8]
        nursery.cancel_scope.cancel()


async def test_a_request_error_ends_that_request_only():
    connection, worker = _pair()
    async with trio.open_nursery() as nursery:
        await nursery.start(connection.run)

        async def open_session():
            with pytest.raises(SessionBusy, match="busy"):
                await connection.call("open", {"session_id": "s"}, expect="ok")

        nursery.start_soon(open_session)
        gen = _generate(connection, "t")
        sent = {c["kind"]: c for c in [await worker.receive(), await worker.receive()]}
        await worker.send({"kind": "error", "id": sent["open"]["id"], "code": "session_busy", "message": "busy"})
        await worker.done(sent["generate"]["id"])
        assert await _drain(connection, gen) == [] and connection.outcome(gen).finish_reason == "stop"
        assert connection.is_usable
        nursery.cancel_scope.cancel()


async def test_cancel_before_send_never_reaches_the_worker():
    connection, worker = _pair()
    request = _generate(connection)  # queued: the writer has not run yet
    connection.cancel_request(request)
    assert request.settled and connection.outcome(request).finish_reason == "cancelled"
    async with trio.open_nursery() as nursery:
        await nursery.start(connection.run)
        later = _generate(connection, "later")
        assert (await worker.receive())["id"] == later.rid  # the cancelled one was skipped
        nursery.cancel_scope.cancel()


async def test_cancel_after_send_asks_the_worker_and_waits_for_its_done():
    connection, worker = _pair()
    async with trio.open_nursery() as nursery:
        await nursery.start(connection.run)
        request = _generate(connection)
        assert (await worker.receive())["kind"] == "generate"
        await worker.token(request.rid, "x", [1])
        connection.cancel_request(request)
        connection.cancel_request(request)  # idempotent: one cancel frame
        assert await worker.receive() == {"kind": "cancel", "id": request.rid}
        assert not request.settled
        await worker.done(request.rid, "cancelled", [1])
        assert await _drain(connection, request) == ["x"]
        assert connection.outcome(request).finish_reason == "cancelled"
        nursery.cancel_scope.cancel()


async def test_done_racing_a_cancel_settles_once_and_drops_the_late_frames():
    connection, worker = _pair()
    async with trio.open_nursery() as nursery:
        await nursery.start(connection.run)
        request = _generate(connection)
        await worker.receive()
        await worker.done(request.rid, "length", [3])
        await trio.testing.wait_all_tasks_blocked()  # the done is routed first
        connection.cancel_request(request)  # too late: a no-op
        assert connection.outcome(request).finish_reason == "length"
        # A worker that crossed a cancel may still send for the finished id: dropped, not an error.
        await worker.token(request.rid, "late", [4])
        probe = _generate(connection, "next")
        assert (await worker.receive())["id"] == probe.rid  # no cancel frame was sent
        await worker.done(probe.rid)
        await _drain(connection, probe)
        assert connection.is_usable
        nursery.cancel_scope.cancel()


async def test_a_cancelled_caller_abandons_its_call_and_the_reply_is_dropped():
    connection, worker = _pair()
    async with trio.open_nursery() as nursery:
        await nursery.start(connection.run)
        with trio.move_on_after(0.05):
            await connection.call("info", {}, expect="ok")
        sent = await worker.receive()
        await worker.send({"kind": "ok", "id": sent["id"], "value": {}})
        await trio.testing.wait_all_tasks_blocked()
        assert connection.is_usable
        nursery.cancel_scope.cancel()


async def test_a_slow_consumer_is_cancelled_without_stalling_the_others():
    connection, worker = _pair(stream_buffer=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(connection.run)
        slow, fast = _generate(connection, "slow"), _generate(connection, "fast")
        await worker.receive(), await worker.receive()
        for i in range(3):  # one more than the slow stream's buffer
            await worker.token(slow.rid, f"s{i}", [i])
        await worker.token(fast.rid, "f", [9])
        await worker.done(fast.rid)
        assert await _drain(connection, fast) == ["f"]
        assert await worker.receive() == {"kind": "cancel", "id": slow.rid}
        assert await _drain(connection, slow) == []
        with pytest.raises(SlowConsumer, match="2 token frames behind"):
            connection.outcome(slow)
        nursery.cancel_scope.cancel()


async def test_connection_loss_settles_every_pending_request_with_one_worker_died():
    connection, worker = _pair()
    async with trio.open_nursery() as nursery:
        await nursery.start(connection.run)
        a, b = _generate(connection, "a"), _generate(connection, "b")
        await worker.receive(), await worker.receive()
        await worker.token(a.rid, "partial", [1])
        await worker.writer.aclose()  # the worker's reply stream ends
        assert await _drain(connection, a) == ["partial"]  # what arrived before the loss is kept
        await _drain(connection, b)
        for request in (a, b):
            with pytest.raises(WorkerDiedError, match="closed its reply pipe"):
                connection.outcome(request)
        with pytest.raises(WorkerDiedError):
            _generate(connection, "later")
        assert not connection.is_usable
        nursery.cancel_scope.cancel()


async def test_a_malformed_frame_is_a_protocol_error_that_ends_the_connection():
    connection, worker = _pair()
    async with trio.open_nursery() as nursery:
        await nursery.start(connection.run)
        request = _generate(connection)
        await worker.receive()
        await worker.send({"kind": "token", "id": request.rid})  # no text, no token_ids
        await _drain(connection, request)
        with pytest.raises(WorkerDiedError, match="protocol error"):
            connection.outcome(request)
        nursery.cancel_scope.cancel()


async def test_a_silent_worker_is_declared_dead_by_the_watchdog():
    connection, worker = _pair(liveness_timeout=0.2)
    async with trio.open_nursery() as nursery:
        await nursery.start(connection.run)
        request = _generate(connection)
        await worker.receive()
        await _drain(connection, request)  # the worker never answers
        assert connection.peer.hung
        with pytest.raises(WorkerDiedError, match="no heartbeat for 0.2 s"):
            connection.outcome(request)
        nursery.cancel_scope.cancel()


async def test_close_sends_what_was_queued_then_closes_the_stream():
    connection, worker = _pair()
    async with trio.open_nursery() as nursery:
        await nursery.start(connection.run)
        request = _generate(connection)

        async def worker_side():
            assert (await worker.receive())["id"] == request.rid
            await worker.done(request.rid)
            assert await worker.reader.receive() is None  # the client closed its end
            await worker.writer.aclose()  # and the worker goes, as a real one does

        nursery.start_soon(worker_side)
        await connection.close()
        assert connection.outcome(request).finish_reason == "stop"
        with pytest.raises(ClientClosedError):
            _generate(connection)
        nursery.cancel_scope.cancel()


async def test_cancelling_the_connection_settles_what_is_pending_as_closed():
    connection, worker = _pair()
    async with trio.open_nursery() as nursery:
        await nursery.start(connection.run)
        request = _generate(connection)
        await worker.receive()
        nursery.cancel_scope.cancel()
    await _drain(connection, request)
    with pytest.raises(ClientClosedError, match="cancelled"):
        connection.outcome(request)
