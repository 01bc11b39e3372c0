"""The worker process: one :class:`Engine` served over the two protocol pipes.

Threads, and who owns what:

- The **main thread** runs the engine loop. It is the only thread that calls the engine, and it
  writes every reply.
- The **reader thread** reads frames from the control pipe, checks each against the schema and puts
  it on the inbox. It never touches the engine. The inbox is bounded (:class:`Inbox`): when the
  engine falls behind, the reader stops reading, the control pipe fills and the client's writes
  wait, so a client that sends without reading replies cannot grow the worker's memory.
- The **heartbeat thread** (only with ``--heartbeat_ms N``, which protocol 1.1 clients pass) writes a
  ``heartbeat`` frame when nothing else was written for N ms while the worker is busy (the engine
  thread is handling messages or stepping, a checkpoint file is being written or read, or a frame is
  half read). It writes from its own thread so that a long forward pass cannot starve it. Writes of
  the two threads are serialized by ``_write_lock``; a heartbeat is skipped while the engine thread
  holds it (bytes are moving then).
- The **I/O thread** writes and fsyncs checkpoint files (``save_file``) and reads them
  (``restore_file``), so no other session's tokens wait for a disk. The engine thread plans each job
  (engine/checkpoint_files.py: the session is busy, or a slot reserved, meanwhile), the I/O thread
  runs it and puts an :class:`IoDone` on the inbox, and the engine thread finishes it and replies.

The engine loop drains the inbox between steps, so a cancel or an open that arrives during a step is
handled right after that step; it steps while there is work and blocks on the inbox when idle.
Token deltas go out as ``token`` frames in the order the engine produced them, so each request's
output stays in order; its ``done`` (or ``error``) frame comes last.

Exit: EOF on the control pipe, SIGTERM or SIGINT settle every request (checkpoint files in flight
are finished first, then ``engine.shutdown()``; their results are sent) and exit 0. A broken frame
stream exits :data:`EXIT_PROTOCOL` and a failed engine loop :data:`EXIT_INTERNAL` (readiness
``failed``); then nothing in flight is settled on the wire, so the client fails every pending
stream with ``WorkerDiedError`` and never mistakes the death for a normal finish: only requests
still queued, never seen by the engine, are answered (``not_ready``; ``info`` is answered), then an
``error`` frame (id 0) gives the reason. A model that fails to load sends an ``error`` frame (id 0)
and exits :data:`EXIT_STARTUP`. Checkpoint files in flight are completed before any exit; a worker
killed meanwhile leaves a segment no manifest names, which the store collects.
"""

from __future__ import annotations

import functools
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from muxworker.transport.errors import (
    InternalError,
    InvalidArgument,
    MuxError,
    NotReady,
    ProtocolError,
)
from muxworker.transport.fdio import FdFrameReader, FdFrameWriter
from muxworker.transport.fdpass import FileReceiver
from muxworker.transport.framing import Frame, attach_payload, payload_array
from muxworker.transport.messages import (
    REQUESTS,
    CancelRequest,
    ChatTemplateRequest,
    CloseSession,
    DetokenizeRequest,
    ForkSession,
    InfoRequest,
    OpenSession,
    ResetSession,
    RestoreFileRequest,
    SaveFileRequest,
    TokenizeRequest,
    TokenLogprob,
)
from muxworker.transport.prompt import SpecialText
from muxworker.transport.sampling import SamplingFields
from muxworker.transport.schema import error_control, validate
from muxworker.worker.inbox import Guided, Inbox, IoDone, Item, Rejected, Stop

if TYPE_CHECKING:
    from muxworker.worker.engine import Engine, EngineOutput

__all__ = [
    "EXIT_OK",
    "EXIT_STARTUP",
    "EXIT_USAGE",
    "EXIT_PROTOCOL",
    "EXIT_INTERNAL",
    "WorkerServer",
]

EXIT_OK = 0
EXIT_STARTUP = 1  # the model could not be loaded or the engine could not be built
EXIT_USAGE = 2  # bad command line (argparse's own code)
EXIT_PROTOCOL = 3  # the control stream broke: bad framing, or a message that cannot be answered
EXIT_INTERNAL = 4  # a bug: the engine loop raised

_STEP_WINDOW = 1024  # recent step durations kept for ``info``'s percentiles
# While the engine steps, the I/O thread works on a checkpoint file in bursts of about
# _IO_BURST_S and pauses _IO_PAUSE_S after each (see _pace).
_IO_BURST_S = 0.0002
_IO_PAUSE_S = 0.0015


_EOF = Stop(EXIT_OK)


def _log(message: str) -> None:
    print(f"muxworker.worker: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# The server


class WorkerServer:
    """Runs the engine loop over a frame reader and writer (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        reader: FdFrameReader,
        writer: FdFrameWriter,
        hello: dict[str, Any],
        *,
        heartbeat_s: float = 0.0,
        files: FileReceiver | None = None,
    ):
        """``heartbeat_s`` > 0 starts the heartbeat thread (see the module docstring). ``files``:
        the file channel checkpoint files arrive on (transport/fdpass.py), read by the engine thread."""
        self._engine = engine  # owned by the thread that calls serve()
        self._files = files
        self._reader = reader  # owned by the reader thread once serve() starts it
        self._writer = writer  # written under _write_lock only (engine and heartbeat threads)
        self._hello = hello
        self._write_lock = threading.Lock()
        self._last_write = time.monotonic()  # when a frame was last written; under _write_lock
        self._heartbeat_s = heartbeat_s
        self._stopping = threading.Event()  # ends the heartbeat thread
        # Set by the engine thread: False only while it waits on an empty inbox with nothing to do.
        # Read by the heartbeat thread (a plain bool: a stale read delays one heartbeat at most).
        self._busy = True
        self._inbox = Inbox()
        # Replies that must follow the outputs of the next step: a close or reset settles the
        # session's request, and its done should reach the client before the ok.
        self._deferred: list[Frame] = []
        self._reply_broken: BaseException | None = None
        # Checkpoint file jobs run here (see the module docstring). One thread: a client sends one
        # checkpoint operation at a time (its CheckpointQueue), so a second would only sit idle.
        self._io = ThreadPoolExecutor(1, thread_name_prefix="muxworker-io")
        self._io_pending = 0  # jobs submitted whose IoDone the engine thread has not handled yet
        # Set by the engine thread around each step, read by the I/O thread (_pace); a stale read
        # costs one pause, or one slice written during a step.
        self._stepping = False
        self._io_burst = 0.0  # when the I/O thread's current burst began; I/O thread only
        self._steps = 0
        self._step_time_s = 0.0
        self._recent_steps: deque[float] = deque(maxlen=_STEP_WINDOW)
        # Every request kind but generate, by kind; each takes its typed message (REQUESTS).
        self._handlers: dict[str, Callable[[int, Any, Frame], None]] = {
            OpenSession.KIND: self._open,
            CloseSession.KIND: self._close,
            ResetSession.KIND: self._reset,
            ForkSession.KIND: self._fork,
            CancelRequest.KIND: self._cancel,
            TokenizeRequest.KIND: self._tokenize,
            DetokenizeRequest.KIND: self._detokenize,
            ChatTemplateRequest.KIND: self._chat_template,
            SaveFileRequest.KIND: self._save_file,
            RestoreFileRequest.KIND: self._restore_file,
            InfoRequest.KIND: self._info,
        }
        assert self._handlers.keys() == REQUESTS.keys()

    # -- the loop -------------------------------------------------------------------------

    def serve(self) -> int:
        """Send the hello, then serve until EOF, a signal or a broken stream; return the exit status.

        Main thread only (signal handlers)."""
        # Handlers first: a SIGTERM that follows the hello must find them in place.
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        thread = threading.Thread(target=self._read_frames, name="muxworker-reader", daemon=True)
        thread.start()
        self._write(Frame(self._hello))
        if self._heartbeat_s > 0:
            threading.Thread(target=self._beat, name="muxworker-heartbeat", daemon=True).start()
        try:
            stop = self._run()
        except Exception:
            from muxworker.worker.engine import Readiness

            _log("the engine loop failed:\n" + traceback.format_exc())
            self._engine.readiness = Readiness.FAILED
            stop = Stop(EXIT_INTERNAL, "the engine loop failed (traceback above)")
        try:
            self._settle(stop)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return stop.code

    def _run(self) -> Stop:
        engine = self._engine
        while True:
            # Block only when idle; otherwise take what has arrived and step again.
            item: Item | None = None
            if not engine.has_work():
                self._busy = self._io_pending > 0  # the client waits for those replies meanwhile
                item = self._inbox.get()
                self._busy = True
            while True:
                if item is not None:
                    stop = self._handle(item)
                    if stop is not None:
                        return stop
                try:
                    item = self._inbox.get(block=False)
                except queue.Empty:
                    break
            self._send_outputs(self._step() if engine.has_work() else [])
            if self._reply_broken is not None:
                return Stop(EXIT_OK, f"the client closed the reply pipe ({self._reply_broken})")

    def _step(self) -> list[EngineOutput]:
        t0 = time.perf_counter()
        self._stepping = True
        try:
            outputs = self._engine.step()
        finally:
            self._stepping = False
        dt = time.perf_counter() - t0
        self._steps += 1
        self._step_time_s += dt
        self._recent_steps.append(dt)
        return outputs

    def _settle(self, stop: Stop) -> None:
        """Settle what can be settled and send it (best effort: the client may be gone).

        A clean stop settles every accepted request (their results are sent). After a failure the
        connection dies with the worker: requests in flight get no reply, so the client reports
        each as WorkerDiedError, never as an ordinary finish; queued ones get not_ready."""
        if stop.reason:
            _log(stop.reason)
        if stop.code == EXIT_OK:
            self._finish_io()
            try:
                outputs = self._engine.shutdown()
            except Exception:
                _log("engine shutdown failed:\n" + traceback.format_exc())
                outputs = []
            self._send_outputs(outputs)
        else:
            self._io.shutdown(wait=True)  # writes in flight complete, unanswered like every call in flight
            self._deferred = []  # replies to calls whose effect the client can no longer rely on
            self._refuse_queued(stop)
            exc = ProtocolError(stop.reason or "") if stop.code == EXIT_PROTOCOL else InternalError(stop.reason or "")
            self._write(Frame(error_control(0, exc)))
        self._stopping.set()
        with self._write_lock:
            self._writer.close()

    def _finish_io(self) -> None:
        """After a clean stop: wait for the checkpoint file jobs in flight and finish and answer
        each. Frames that arrive meanwhile are dropped, as every frame after a stop is."""
        while self._io_pending:
            item = self._inbox.get()
            if isinstance(item, IoDone):
                self._handle(item)
        self._io.shutdown()

    def _refuse_queued(self, stop: Stop) -> None:
        """After a failure: answer what is still queued (the engine never saw it) with not_ready,
        except generations, which fail with the worker like every other stream, and info, which
        reports the readiness."""
        why = NotReady(f"the worker is {self._engine.readiness.value} and exiting: {stop.reason}")
        while True:
            try:
                item = self._inbox.get(block=False)
            except queue.Empty:
                return
            if isinstance(item, Rejected):
                self._write(Frame(error_control(item.request_id, item.error)))
            elif isinstance(item, Frame) and item.control["kind"] not in ("generate", "cancel"):
                if item.control["kind"] == "info":
                    self._handle(item)
                else:
                    self._write(Frame(error_control(item.control["id"], why)))

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._inbox.put_event(Stop(EXIT_OK, f"received {signal.Signals(signum).name}; shutting down"))

    # -- heartbeat thread -----------------------------------------------------------------

    def _beat(self) -> None:
        """Heartbeat thread: a ``heartbeat`` frame whenever the worker is busy and silent."""
        interval = self._heartbeat_s
        beat = Frame({"kind": "heartbeat"})
        while not self._stopping.wait(interval / 2):
            if not (self._busy or self._reader.in_frame):
                continue
            # Never wait for the lock: its holder is writing, which shows liveness by itself.
            if not self._write_lock.acquire(blocking=False):
                continue
            try:
                if self._stopping.is_set() or self._reply_broken is not None:
                    return
                if time.monotonic() - self._last_write >= interval:
                    self._writer.write(beat)
                    self._last_write = time.monotonic()
            except OSError:
                return  # the client is gone; the engine thread finds out on its next write
            finally:
                self._write_lock.release()

    # -- reader thread --------------------------------------------------------------------

    def _read_frames(self) -> None:
        """Reader thread: frames (checked against the schema) onto the inbox, then a Stop."""
        inbox = self._inbox
        try:
            while True:
                inbox.wait_for_room()  # backpressure: a full inbox leaves the rest in the pipe
                frame = self._reader.read()
                if frame is None:
                    break
                if frame.refused is not None:  # screened from its header (see _prompt_screen)
                    inbox.put_frame(Rejected(frame.control["id"], frame.refused))  # type: ignore[arg-type]
                    continue
                try:
                    validate(frame.control, sender="client", payloads=frame.payloads)
                    item = self._compiled(frame)
                except InvalidArgument as exc:
                    inbox.put_frame(Rejected(frame.control["id"], exc))
                    continue
                inbox.put_frame(item)
        except ProtocolError as exc:
            inbox.put_event(Stop(EXIT_PROTOCOL, f"the control stream is broken: {exc}"))
        except Exception as exc:
            inbox.put_event(Stop(EXIT_PROTOCOL, f"reading the control pipe failed: {type(exc).__name__}: {exc}"))
        else:
            inbox.put_event(_EOF)

    def _compiled(self, frame: Frame) -> Frame | Guided:
        """Reader thread: a generate frame with a constraint, compiled here, off the engine thread
        (bounded in size and work, constraints.py), so a large schema never delays a step; the
        engine's grammar compiler is the one engine attribute this thread uses (it is thread-safe)."""
        if frame.control["kind"] != "generate" or frame.control.get("constraint") is None:
            return frame
        params = SamplingFields.from_wire(frame.control)  # every field checked, the constraint's size too
        assert params.constraint is not None
        return Guided(frame, params, self._engine.grammars.compile(params.constraint))

    # -- messages -------------------------------------------------------------------------

    def _handle(self, item: Item) -> Stop | None:
        if isinstance(item, Stop):
            return item
        if isinstance(item, Rejected):
            self._write(Frame(error_control(item.request_id, item.error)))
            return None
        if isinstance(item, IoDone):
            self._io_pending -= 1
            rid, kind = item.request_id, item.kind
            call = functools.partial(self._io_done, item)
        elif isinstance(item, Guided):
            rid, kind = item.frame.control["id"], "generate"
            call = functools.partial(self._generate, rid, item.frame.control, item.frame, item)
        else:
            rid, kind = item.control["id"], item.control["kind"]
            call = functools.partial(self._request, rid, kind, item)
        try:
            call()
        except MuxError as exc:
            self._write(Frame(error_control(rid, exc)))
        except Exception as exc:
            # A bug in a handler ends that request only; the traceback goes to stderr.
            _log(f"request {rid} ({kind}) failed:\n" + traceback.format_exc())
            self._write(Frame(error_control(rid, InternalError(f"{type(exc).__name__}: {exc}"))))
        return None

    def _request(self, rid: int, kind: str, frame: Frame) -> None:
        """Run the handler of a schema-checked request, with its typed message (transport/messages.py)."""
        if kind == "generate":
            self._generate(rid, frame.control, frame)
        else:
            self._handlers[kind](rid, REQUESTS[kind].from_control(frame.control), frame)

    def _start_io(
        self,
        rid: int,
        kind: str,
        fds: list[int],
        work: Callable[[], Any],
        finish: Callable[[Future[Any]], dict[str, Any]],
    ) -> None:
        """Run ``work`` on the I/O thread; once it has ended, the engine thread closes ``fds`` and
        replies with what ``finish(future)`` returns (:meth:`_io_done`)."""
        future = self._io.submit(work)
        self._io_pending += 1
        future.add_done_callback(lambda f: self._inbox.put_event(IoDone(rid, kind, fds, f, finish)))

    def _pace(self) -> None:
        """I/O thread, after each slice of a checkpoint file it checksums, writes or reads: while the
        engine steps, work in short bursts with pauses between them (about an eighth of one core).

        A forward pass runs as many torch threads as there are cores, and each of its parallel
        regions waits for its slowest thread, so a thread that holds a core meanwhile (copying rows
        into the page cache, checksumming them) stalls every region it overlaps: on 2 cores one
        88 MB write in one go stretched a 20 ms decode step to 300 ms (scripts/bench_save_stall.py).
        With no step running the job goes at full speed."""
        if self._stepping and time.perf_counter() - self._io_burst >= _IO_BURST_S:
            time.sleep(_IO_PAUSE_S)
            self._io_burst = time.perf_counter()

    def _io_done(self, item: IoDone) -> None:
        for fd in item.fds:
            os.close(fd)
        self._write(self._ok(item.request_id, item.finish(item.future)))

    def _ok(self, rid: int, value: dict[str, Any] | None = None) -> Frame:
        control: dict[str, Any] = {"kind": "ok", "id": rid}
        if value is not None:
            control["value"] = value
        return Frame(control)

    def _open(self, rid: int, msg: OpenSession, frame: Frame) -> None:
        self._engine.open_session(msg.session_id)
        self._write(self._ok(rid))

    def _close(self, rid: int, msg: CloseSession, frame: Frame) -> None:
        self._engine.close_session(msg.session_id)
        self._deferred.append(self._ok(rid))

    def _reset(self, rid: int, msg: ResetSession, frame: Frame) -> None:
        self._engine.reset_session(msg.session_id)
        self._deferred.append(self._ok(rid))

    def _fork(self, rid: int, msg: ForkSession, frame: Frame) -> None:
        self._engine.fork_session(msg.session_id, msg.target_id, msg.rows)
        self._write(self._ok(rid))

    def _generate(self, rid: int, control: dict[str, Any], frame: Frame, guided: Guided | None = None) -> None:
        prompt: list[str | list[int]] = []
        for segment in control["prompt"]:
            if "text" in segment:
                text = segment["text"]
                prompt.append(SpecialText(text) if segment.get("special") else text)
            else:
                prompt.append(payload_array(frame, segment["tokens"]).tolist())
        params = guided.params if guided is not None else SamplingFields.from_wire(control)
        guide = guided.guide if guided is not None else None
        self._engine.submit(
            rid, control["session_id"], prompt, params, cache_salt=control.get("cache_salt"), guide=guide
        )

    def _cancel(self, rid: int, msg: CancelRequest, frame: Frame) -> None:
        # The target ends with its own done (finish_reason "cancelled"); an unknown id is a no-op
        # because the request may have finished while the cancel was on its way.
        self._engine.cancel(rid)

    def _tokenize(self, rid: int, msg: TokenizeRequest, frame: Frame) -> None:
        ids = self._engine.tokenizer.encode(
            msg.text, add_special_tokens=msg.add_special_tokens, parse_special=msg.parse_special
        )
        self._write(_tokens_frame(rid, ids))

    def _detokenize(self, rid: int, msg: DetokenizeRequest, frame: Frame) -> None:
        ids = payload_array(frame, msg.tokens)
        vocab = self._engine.vocab_size
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise InvalidArgument(
                f"token ids must lie in [0, {vocab}); got values in [{int(ids.min())}, {int(ids.max())}]"
            )
        self._write(Frame({"kind": "text", "id": rid, "text": self._engine.tokenizer.decode(ids.tolist())}))

    def _chat_template(self, rid: int, msg: ChatTemplateRequest, frame: Frame) -> None:
        from muxworker.worker.models.tokenizer import ChatTemplateError

        tokenizer = self._engine.tokenizer
        try:
            text = tokenizer.apply_chat_template(msg.messages, add_generation_prompt=msg.add_generation_prompt)
        except ChatTemplateError as exc:
            raise InvalidArgument(str(exc)) from None
        self._write(_tokens_frame(rid, tokenizer.encode(text, parse_special=True), text=text))

    def _passed_files(self, rid: int, count: int) -> list[int]:
        if self._files is None:
            raise InvalidArgument("this worker has no file channel (--files-fd): checkpoints travel only as files")
        return self._files.receive(rid, count)

    def _save_file(self, rid: int, msg: SaveFileRequest, frame: Frame) -> None:
        engine = self._engine
        (fd,) = self._passed_files(rid, 1)
        try:
            job = engine.begin_save(
                msg.session_id,
                fd,
                tag=msg.tag,
                base=msg.base,
                identity=msg.identity,
                max_bytes=msg.max_bytes,
                position=msg.position,
            )
        except BaseException:
            os.close(fd)
            raise
        write = functools.partial(job.write, self._pace)
        self._start_io(rid, "save_file", [fd], write, lambda f: engine.finish_save(job, f.exception()).to_wire())

    def _restore_file(self, rid: int, msg: RestoreFileRequest, frame: Frame) -> None:
        engine = self._engine
        fds = self._passed_files(rid, len(msg.segments))
        try:
            job = engine.begin_restore(
                msg.session_id,
                fds,
                msg.segments,
                tag=msg.tag,
                identity=msg.identity,
                max_bytes=msg.max_bytes,
                saved_id=msg.saved_id,
            )
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        read = functools.partial(job.read, self._pace)
        self._start_io(
            rid, "restore_file", fds, read, lambda f: {"position": engine.finish_restore(job, f.exception())}
        )

    def _info(self, rid: int, msg: InfoRequest, frame: Frame) -> None:
        value = {k: v for k, v in self._hello.items() if k != "kind"}
        value["readiness"] = self._engine.readiness.value
        recent = sorted(self._recent_steps)
        value["sessions"] = len(self._engine.session_ids())
        value["inflight_requests"] = self._engine.inflight
        value["stats"] = {
            "steps": self._steps,
            "step_time_s": self._step_time_s,
            "recent_steps": len(recent),
            "recent_step_p50_s": recent[len(recent) // 2] if recent else 0.0,
            "recent_step_p90_s": recent[(len(recent) * 9) // 10] if recent else 0.0,
        }
        self._write(self._ok(rid, value))

    # -- output ---------------------------------------------------------------------------

    def _send_outputs(self, outputs: list[EngineOutput]) -> None:
        """Send one step's outputs, then the replies deferred behind them, in one gather write."""
        frames: list[Frame] = []
        for out in outputs:
            rid = out.request_id
            if out.text or out.token_ids:
                control = {"kind": "token", "id": rid, "text": out.text, "token_ids": out.token_ids}
                if out.logprobs is not None:
                    control.update(TokenLogprob.to_wire(out.logprobs))
                frames.append(Frame(control))
            if out.result is None:
                continue
            if out.error is not None:
                frames.append(Frame(error_control(rid, out.error)))
                continue
            result = dict(out.result)
            payloads: list[Any] = []
            ids = np.asarray(result.pop("generated_token_ids"), dtype=np.int32)
            result["generated_token_ids"] = attach_payload(payloads, ids)
            frames.append(Frame({"kind": "done", "id": rid, "result": result}, payloads))
        frames += self._deferred
        self._deferred = []
        if frames:
            # One syscall and one client wake-up per step rather than one per stream.
            self._write_frames(frames)

    def _write(self, frame: Frame) -> None:
        """Write one frame; once the client has gone, drop the rest (the loop then stops)."""
        self._write_frames([frame])

    def _write_frames(self, frames: list[Frame]) -> None:
        if self._reply_broken is not None:
            return
        with self._write_lock:
            try:
                self._writer.write_many(frames)
            except OSError as exc:
                self._reply_broken = exc
            self._last_write = time.monotonic()


def _tokens_frame(rid: int, ids: Sequence[int], *, text: str | None = None) -> Frame:
    payloads: list[Any] = []
    control: dict[str, Any] = {
        "kind": "tokens",
        "id": rid,
        "tokens": attach_payload(payloads, np.asarray(ids, dtype=np.int32)),
    }
    if text is not None:
        control["text"] = text
    return Frame(control, payloads)
