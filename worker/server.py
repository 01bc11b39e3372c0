"""The worker process: one :class:`Engine` served over the two protocol pipes.

Threads, and who owns what:

- The **main thread** runs the engine loop. It is the only thread that touches the engine and the
  only one that writes frames (to the reply pipe).
- The **reader thread** reads frames from the control pipe, checks each against the schema and puts
  it on the inbox. It never touches the engine.

The engine loop drains the inbox between steps, so a cancel or an open that arrives during a step is
handled right after that step; it steps while there is work and blocks on the inbox when idle.
Token deltas go out as ``token`` frames in the order the engine produced them, so each request's
output stays in order; its ``done`` (or ``error``) frame comes last.

Exit: EOF on the control pipe, SIGTERM or SIGINT settle every request (``engine.shutdown()``, their
results are sent) and exit 0. A broken frame stream exits :data:`EXIT_PROTOCOL` with the reason on
stderr; a model that fails to load sends an ``error`` frame (id 0) and exits :data:`EXIT_STARTUP`.
"""
from __future__ import annotations

import argparse
import dataclasses
import queue
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from muxworker.transport.checkpoint import checkpoint_from_wire, checkpoint_to_wire
from muxworker.transport.errors import InternalError, InvalidArgument, MuxError, ProtocolError
from muxworker.transport.fdio import FDS_ENV, FdFrameReader, FdFrameWriter, worker_fds
from muxworker.transport.framing import Frame, attach_payload, payload_array
from muxworker.transport.prompt import SpecialText
from muxworker.transport.schema import error_control, hello_control, validate

from .config import ConfigError, EngineConfig

if TYPE_CHECKING:
    from .engine import Engine, EngineOutput

__all__ = [
    "EXIT_OK",
    "EXIT_STARTUP",
    "EXIT_USAGE",
    "EXIT_PROTOCOL",
    "EXIT_INTERNAL",
    "WorkerServer",
    "build_parser",
    "parse_args",
    "main",
]

EXIT_OK = 0
EXIT_STARTUP = 1  # the model could not be loaded or the engine could not be built
EXIT_USAGE = 2  # bad command line (argparse's own code)
EXIT_PROTOCOL = 3  # the control stream broke: bad framing, or a message that cannot be answered
EXIT_INTERNAL = 4  # a bug: the engine loop raised

BACKENDS = ("torch", "mlx")
LATER_BACKENDS: tuple[str, ...] = ()
DTYPE_NAMES = ("float32", "bfloat16", "float16")
_STEP_WINDOW = 1024  # recent step durations kept for ``info``'s percentiles


def _log(message: str) -> None:
    print(f"muxworker.worker: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Command line


class UsageError(Exception):
    """A command-line flag or combination of flags is invalid."""


class _Parser(argparse.ArgumentParser):
    # Raise instead of exiting, so main() can also report the error on the reply pipe.
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _int_at_least(lo: int, what: str):
    """An argparse type: an integer >= ``lo``, described as ``what`` in its error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonnegative_int = _int_at_least(0, "an integer >= 0")


def _check_torch_device(text: str) -> None:
    head, _, index = text.partition(":")
    if head not in ("cpu", "cuda") or (index and (head == "cpu" or not index.isdigit())):
        raise UsageError(f"--device for --backend torch must be cpu, cuda or cuda:N, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    defaults = EngineConfig()
    p = _Parser(
        prog="python -m muxworker.worker",
        description=(
            "Serve one model over two inherited pipes: continuous batching over named sessions. "
            "Started by muxworker.client.spawn_multiplexed_worker, which creates the pipes."
        ),
        allow_abbrev=False,
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or a .gguf file, "
        "converted once into the cache (default: the bundled SmolLM2-135M-Instruct GGUF)",
    )
    p.add_argument(
        "--backend",
        default="torch",
        help="inference backend: torch or mlx (default: %(default)s)",
    )
    p.add_argument(
        "--device", default="cpu", help="torch: cpu, cuda or cuda:N; mlx: cpu or gpu (default: %(default)s)"
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=None,
        help="weights, activations and KV cache dtype (default: float32 on cpu, bfloat16 on cuda; "
        "float16 needs cuda)",
    )
    p.add_argument(
        "--max_sessions",
        "--max-sessions",
        type=_positive_int,
        metavar="N",
        default=defaults.max_sessions,
        help="open sessions at once; each owns one KV cache slot (default: %(default)s)",
    )
    p.add_argument(
        "--max_session_tokens",
        "--max-session-tokens",
        type=_positive_int,
        metavar="N",
        default=defaults.max_session_tokens,
        help="tokens one session holds, prompt plus generated; at most the model's context length "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--max_decode_sequences",
        "--max-decode-sequences",
        type=_positive_int,
        metavar="N",
        default=defaults.max_decode_sequences,
        help="sequences decoded together in one forward pass (default: %(default)s)",
    )
    p.add_argument(
        "--max_inflight_requests",
        "--max-inflight-requests",
        type=_positive_int,
        metavar="N",
        default=defaults.max_inflight_requests,
        help="generations accepted at once; more are refused with capacity_exhausted (default: %(default)s)",
    )
    p.add_argument(
        "--prefill_chunk_tokens",
        "--prefill-chunk-tokens",
        type=_positive_int,
        metavar="N",
        default=defaults.prefill_chunk_tokens,
        help="prompt tokens prefilled per forward pass, so long prompts do not stall decoding "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--prefix_cache_entries",
        "--prefix-cache-entries",
        type=_nonnegative_int,
        metavar="N",
        default=0,
        help="LRU entries of shared prompt prefixes, each a preallocated KV slot; new sessions whose "
        "prompt starts with a cached prefix prefill only the rest (default: %(default)s)",
    )
    p.add_argument(
        "--threads",
        type=_positive_int,
        metavar="N",
        default=None,
        help="CPU threads for torch (default: torch's own choice, one per core); on a shared machine "
        "fewer threads than cores avoid oversubscription",
    )
    p.add_argument(
        "--draft",
        metavar="PATH",
        default=None,
        help="draft model for speculative decoding (same tokenizer as --model); needs --n_draft",
    )
    p.add_argument(
        "--n_draft",
        "--n-draft",
        type=_nonnegative_int,
        metavar="N",
        default=0,
        help="tokens the draft proposes per session per step with --draft (default: %(default)s, no draft)",
    )
    p.add_argument(
        "--seed",
        type=_nonnegative_int,
        metavar="N",
        default=None,
        help="seed for requests that sample without their own seed (default: a fixed internal seed)",
    )
    p.add_argument(
        "--control-fd",
        type=int,
        metavar="N",
        help=f"inherited fd the worker reads requests from (or {FDS_ENV}=N,M)",
    )
    p.add_argument(
        "--reply-fd",
        type=int,
        metavar="M",
        help=f"inherited fd the worker writes replies to (or {FDS_ENV}=N,M)",
    )
    return p


@dataclass(frozen=True)
class WorkerOptions:
    """The parsed and checked command line."""

    model: str | None
    backend: str
    device: str
    dtype: str
    config: EngineConfig
    draft: str | None = None
    threads: int | None = None


def parse_args(argv: Sequence[str]) -> WorkerOptions:
    """Parse and check the command line; raise :class:`UsageError` naming the bad flag."""
    ns = build_parser().parse_args(list(argv))
    if ns.backend in LATER_BACKENDS:
        raise UsageError(f"--backend {ns.backend} is not supported yet; use --backend torch")
    if ns.backend not in BACKENDS:
        raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {ns.backend!r}")
    if ns.backend == "torch":
        _check_torch_device(ns.device)  # mlx checks its own device names when it loads
    if ns.draft is not None and ns.n_draft == 0:
        raise UsageError("--draft needs --n_draft N >= 1 (tokens drafted per step)")
    if ns.draft is None and ns.n_draft != 0:
        raise UsageError("--n_draft needs --draft PATH (a draft model)")
    dtype = ns.dtype or ("float32" if ns.device == "cpu" else "bfloat16")
    if ns.backend == "torch" and ns.device == "cpu" and dtype == "float16":
        raise UsageError("--dtype float16 is not supported on --device cpu; use float32 or bfloat16")
    try:
        config = EngineConfig(
            max_sessions=ns.max_sessions,
            max_session_tokens=ns.max_session_tokens,
            max_decode_sequences=ns.max_decode_sequences,
            max_inflight_requests=ns.max_inflight_requests,
            prefill_chunk_tokens=ns.prefill_chunk_tokens,
            prefix_cache_entries=ns.prefix_cache_entries,
            seed=ns.seed,
            n_draft=ns.n_draft,
        )
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    return WorkerOptions(ns.model, ns.backend, ns.device, dtype, config, ns.draft, ns.threads)


# ----------------------------------------------------------------------------------------------
# Inbox items other than frames


@dataclass(frozen=True)
class _Rejected:
    """A message that failed the schema but names a request id we can answer."""

    request_id: int
    error: MuxError


@dataclass(frozen=True)
class _Stop:
    """Leave the engine loop: settle everything, then exit with ``code``."""

    code: int
    reason: str | None = None  # logged to stderr (and sent as an error frame when code != 0)


_EOF = _Stop(EXIT_OK)
_Item = Frame | _Rejected | _Stop


# ----------------------------------------------------------------------------------------------
# The server


class WorkerServer:
    """Runs the engine loop over a frame reader and writer (see the module docstring)."""

    def __init__(self, engine: Engine, reader: FdFrameReader, writer: FdFrameWriter, hello: dict[str, Any]):
        self._engine = engine  # owned by the thread that calls serve()
        self._reader = reader  # owned by the reader thread once serve() starts it
        self._writer = writer  # engine thread only
        self._hello = hello
        self._inbox: queue.SimpleQueue[_Item] = queue.SimpleQueue()  # put() is safe in signal handlers
        # Replies that must follow the outputs of the next step: a close or reset settles the
        # session's request, and its done should reach the client before the ok.
        self._deferred: list[Frame] = []
        self._reply_broken: BaseException | None = None
        self._steps = 0
        self._step_time_s = 0.0
        self._recent_steps: deque[float] = deque(maxlen=_STEP_WINDOW)
        self._handlers: dict[str, Callable[[int, dict[str, Any], Frame], None]] = {
            "open": self._open,
            "close": self._close,
            "reset": self._reset,
            "generate": self._generate,
            "cancel": self._cancel,
            "tokenize": self._tokenize,
            "detokenize": self._detokenize,
            "chat_template": self._chat_template,
            "export": self._export,
            "restore": self._restore,
            "info": self._info,
        }

    # -- the loop -------------------------------------------------------------------------

    def serve(self) -> int:
        """Send the hello, then serve until EOF, a signal or a broken stream; return the exit status.

        Main thread only (signal handlers)."""
        # Handlers first: a SIGTERM that follows the hello must find them in place.
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        thread = threading.Thread(target=self._read_frames, name="muxworker-reader", daemon=True)
        thread.start()
        self._write(Frame(self._hello))
        try:
            stop = self._run()
        except Exception:
            _log("the engine loop failed:\n" + traceback.format_exc())
            stop = _Stop(EXIT_INTERNAL, "the engine loop failed (traceback above)")
        try:
            self._settle(stop)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return stop.code

    def _run(self) -> _Stop:
        engine = self._engine
        while True:
            # Block only when idle; otherwise take what has arrived and step again.
            item: _Item | None = None if engine.has_work() else self._inbox.get()
            while True:
                if item is not None:
                    stop = self._handle(item)
                    if stop is not None:
                        return stop
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
            self._send_outputs(self._step() if engine.has_work() else [])
            if self._reply_broken is not None:
                return _Stop(EXIT_OK, f"the client closed the reply pipe ({self._reply_broken})")

    def _step(self) -> list[EngineOutput]:
        t0 = time.perf_counter()
        outputs = self._engine.step()
        dt = time.perf_counter() - t0
        self._steps += 1
        self._step_time_s += dt
        self._recent_steps.append(dt)
        return outputs

    def _settle(self, stop: _Stop) -> None:
        """Settle every accepted request and send the results (best effort: the client may be gone)."""
        if stop.reason:
            _log(stop.reason)
        try:
            outputs = self._engine.shutdown()
        except Exception:
            _log("engine shutdown failed:\n" + traceback.format_exc())
            outputs = []
        self._send_outputs(outputs)
        if stop.code != EXIT_OK and stop.reason:
            exc = ProtocolError(stop.reason) if stop.code == EXIT_PROTOCOL else InternalError(stop.reason)
            self._write(Frame(error_control(0, exc)))
        self._writer.close()

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._inbox.put(_Stop(EXIT_OK, f"received {signal.Signals(signum).name}; shutting down"))

    # -- reader thread --------------------------------------------------------------------

    def _read_frames(self) -> None:
        """Reader thread: frames (checked against the schema) onto the inbox, then a _Stop."""
        try:
            while (frame := self._reader.read()) is not None:
                try:
                    validate(frame.control, sender="client", payloads=frame.payloads)
                except InvalidArgument as exc:
                    self._inbox.put(_Rejected(frame.control["id"], exc))
                    continue
                self._inbox.put(frame)
        except ProtocolError as exc:
            self._inbox.put(_Stop(EXIT_PROTOCOL, f"the control stream is broken: {exc}"))
        except Exception as exc:
            self._inbox.put(_Stop(EXIT_PROTOCOL, f"reading the control pipe failed: {type(exc).__name__}: {exc}"))
        else:
            self._inbox.put(_EOF)

    # -- messages -------------------------------------------------------------------------

    def _handle(self, item: _Item) -> _Stop | None:
        if isinstance(item, _Stop):
            return item
        if isinstance(item, _Rejected):
            self._write(Frame(error_control(item.request_id, item.error)))
            return None
        control = item.control
        rid = control["id"]
        try:
            self._handlers[control["kind"]](rid, control, item)
        except MuxError as exc:
            self._write(Frame(error_control(rid, exc)))
        except Exception as exc:
            # A bug in a handler ends that request only; the traceback goes to stderr.
            _log(f"request {rid} ({control['kind']}) failed:\n" + traceback.format_exc())
            self._write(Frame(error_control(rid, InternalError(f"{type(exc).__name__}: {exc}"))))
        return None

    def _ok(self, rid: int, value: dict[str, Any] | None = None) -> Frame:
        control: dict[str, Any] = {"kind": "ok", "id": rid}
        if value is not None:
            control["value"] = value
        return Frame(control)

    def _open(self, rid: int, control: dict[str, Any], frame: Frame) -> None:
        self._engine.open_session(control["session_id"])
        self._write(self._ok(rid))

    def _close(self, rid: int, control: dict[str, Any], frame: Frame) -> None:
        self._engine.close_session(control["session_id"])
        self._deferred.append(self._ok(rid))

    def _reset(self, rid: int, control: dict[str, Any], frame: Frame) -> None:
        self._engine.reset_session(control["session_id"])
        self._deferred.append(self._ok(rid))

    def _generate(self, rid: int, control: dict[str, Any], frame: Frame) -> None:
        from .sampling import SamplingParams

        prompt: list[str | list[int]] = []
        for segment in control["prompt"]:
            if "text" in segment:
                text = segment["text"]
                prompt.append(SpecialText(text) if segment.get("special") else text)
            else:
                prompt.append(payload_array(frame, segment["tokens"]).tolist())
        params = SamplingParams.from_wire(control)
        self._engine.submit(rid, control["session_id"], prompt, params)

    def _cancel(self, rid: int, control: dict[str, Any], frame: Frame) -> None:
        # The target ends with its own done (finish_reason "cancelled"); an unknown id is a no-op
        # because the request may have finished while the cancel was on its way.
        self._engine.cancel(rid)

    def _tokenize(self, rid: int, control: dict[str, Any], frame: Frame) -> None:
        ids = self._engine.tokenizer.encode(
            control["text"],
            add_special_tokens=control.get("add_special_tokens", False),
            parse_special=control.get("parse_special", False),
        )
        self._write(_tokens_frame(rid, ids))

    def _detokenize(self, rid: int, control: dict[str, Any], frame: Frame) -> None:
        ids = payload_array(frame, control["tokens"])
        vocab = self._engine.vocab_size
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise InvalidArgument(f"token ids must lie in [0, {vocab}); got values in [{int(ids.min())}, {int(ids.max())}]")
        self._write(Frame({"kind": "text", "id": rid, "text": self._engine.tokenizer.decode(ids.tolist())}))

    def _chat_template(self, rid: int, control: dict[str, Any], frame: Frame) -> None:
        from .tokenizer import ChatTemplateError

        tokenizer = self._engine.tokenizer
        try:
            text = tokenizer.apply_chat_template(
                control["messages"], add_generation_prompt=control.get("add_generation_prompt", True)
            )
        except ChatTemplateError as exc:
            raise InvalidArgument(str(exc)) from None
        self._write(_tokens_frame(rid, tokenizer.encode(text, parse_special=True), text=text))

    def _export(self, rid: int, control: dict[str, Any], frame: Frame) -> None:
        checkpoint = self._engine.export_checkpoint(control["session_id"], control.get("position"))
        manifest, payloads = checkpoint_to_wire(checkpoint)
        self._write(Frame({"kind": "checkpoint", "id": rid, "checkpoint": manifest}, list(payloads)))

    def _restore(self, rid: int, control: dict[str, Any], frame: Frame) -> None:
        checkpoint = checkpoint_from_wire(control["checkpoint"], frame.payloads)
        self._engine.restore_checkpoint(control["session_id"], checkpoint, control["position"])
        self._write(self._ok(rid))

    def _info(self, rid: int, control: dict[str, Any], frame: Frame) -> None:
        value = {k: v for k, v in self._hello.items() if k != "kind"}
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
                frames.append(Frame({"kind": "token", "id": rid, "text": out.text, "token_ids": out.token_ids}))
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
        if frames and self._reply_broken is None:
            try:
                # One syscall and one client wake-up per step rather than one per stream.
                self._writer.write_many(frames)
            except OSError as exc:
                self._reply_broken = exc

    def _write(self, frame: Frame) -> None:
        """Write one frame; once the client has gone, drop the rest (the loop then stops)."""
        if self._reply_broken is not None:
            return
        try:
            self._writer.write(frame)
        except OSError as exc:
            self._reply_broken = exc


def _tokens_frame(rid: int, ids: Sequence[int], *, text: str | None = None) -> Frame:
    payloads: list[Any] = []
    control: dict[str, Any] = {"kind": "tokens", "id": rid, "tokens": attach_payload(payloads, np.asarray(ids, dtype=np.int32))}
    if text is not None:
        control["text"] = text
    return Frame(control, payloads)


# ----------------------------------------------------------------------------------------------
# Start-up


def _hello(engine: Engine) -> dict[str, Any]:
    return hello_control(
        model=engine.model_info(),
        backend=engine.backend,
        device=engine.device_name,
        dtype=engine.dtype_name,
        limits=dataclasses.asdict(engine.config),
    )


def _load_error(exc: BaseException) -> MuxError:
    """The error frame a load failure is reported as: the worker's own message, classified."""
    from .loader import ModelLoadError

    if isinstance(exc, MuxError):
        return exc
    if isinstance(exc, (ModelLoadError, ConfigError, ValueError, OSError)):
        return InvalidArgument(f"cannot load the model: {exc}")
    return InternalError(f"cannot load the model: {type(exc).__name__}: {exc}")


def _report_usage_error(message: str, argv: Sequence[str]) -> None:
    """Usage errors go to stderr, and to the reply pipe too when its fd was given correctly."""
    build_parser().print_usage(sys.stderr)
    _log(f"error: {message}")
    try:
        _, reply_fd = worker_fds(argv)
    except ValueError:
        return
    with FdFrameWriter(reply_fd) as writer:
        try:
            writer.write(Frame(error_control(0, InvalidArgument(message))))
        except OSError:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        options = parse_args(argv)
        control_fd, reply_fd = worker_fds(argv)
    except (UsageError, ValueError) as exc:
        _report_usage_error(str(exc), argv)
        return EXIT_USAGE
    reader = FdFrameReader(control_fd)
    writer = FdFrameWriter(reply_fd)
    try:
        from .build import load_engine

        if options.threads is not None:
            import torch

            torch.set_num_threads(options.threads)
        engine = load_engine(
            options.model,
            options.config,
            device=options.device,
            dtype=options.dtype,
            backend=options.backend,
            draft=options.draft,
        )
    except Exception as exc:
        error = _load_error(exc)
        _log(error.message)
        if not isinstance(exc, (MuxError, ValueError, OSError)):
            _log(traceback.format_exc())
        try:
            writer.write(Frame(error_control(0, error)))
        except OSError:
            pass
        writer.close()
        return EXIT_STARTUP
    _log(_startup_summary(engine))
    return WorkerServer(engine, reader, writer, _hello(engine)).serve()


def _startup_summary(engine: Engine) -> str:
    """One stderr line: what is served and how much KV memory was preallocated for it."""
    cfg = engine.config
    mib = engine.cache.nbytes / 2**20
    draft = getattr(engine, "draft", None)
    draft_mib = draft.cache.nbytes / 2**20 if draft is not None else 0.0
    return (
        f"serving {engine.model_name} on {engine.backend}/{engine.device_name} ({engine.dtype_name}); "
        f"KV cache {mib:.1f} MiB preallocated: {cfg.max_sessions} sessions + {cfg.prefix_cache_entries} "
        f"prefix-cache entries x {cfg.max_session_tokens} tokens"
        + (f"; draft KV cache {draft_mib:.1f} MiB" if draft is not None else "")
    )
