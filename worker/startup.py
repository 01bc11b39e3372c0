"""Start-up of the worker process: parse the flags, load the model (its files prefetched while torch
imports), report a load failure as an error frame, then hand the pipes to :class:`WorkerServer`.

``python -m muxworker.worker`` runs :func:`main`. Exit statuses are server.py's ``EXIT_*``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from muxworker.transport.errors import ContextOverflow, InternalError, InvalidArgument, MuxError
from muxworker.transport.fdio import FdFrameReader, FdFrameWriter, worker_fds
from muxworker.transport.fdpass import FileReceiver
from muxworker.transport.framing import Frame
from muxworker.transport.schema import error_control, hello_control, validate
from muxworker.worker.models.args import ConfigError
from muxworker.worker.options import UsageError, build_parser, parse_args
from muxworker.worker.server import EXIT_STARTUP, EXIT_USAGE, WorkerServer, _log

if TYPE_CHECKING:
    from muxworker.worker.engine import Engine

__all__ = ["main"]


def _hello(engine: Engine, *, protocol_1_1: bool = True, files: bool = False) -> dict[str, Any]:
    """The hello; ``readiness`` only for a client that announced protocol 1.1 (``--heartbeat_ms``),
    ``files`` when the client passed a file channel."""
    return hello_control(
        files=files,
        model=engine.model_info(),
        backend=engine.backend,
        device=engine.device_name,
        dtype=engine.dtype_name,
        limits=dataclasses.asdict(engine.config),
        readiness=engine.readiness.value if protocol_1_1 else None,
        weights=engine.weights,
    )


def _prompt_screen(max_session_tokens: int) -> Callable[[dict[str, Any], tuple[int, ...]], MuxError | None]:
    """A frame screen (transport FrameDecoder) that refuses, from its control map, a generate whose
    token payloads alone cannot fit in a session. Its body is then skipped unread: a 64 MiB prompt
    costs neither 64 MiB of memory nor seconds of the engine thread (converting and checking 16M
    token ids), during which every other stream would stall."""

    def screen(control: dict[str, Any], lengths: tuple[int, ...]) -> MuxError | None:
        if control.get("kind") != "generate":
            return None
        try:
            validate(control, sender="client")  # the payload sizes are checked with the body
        except MuxError:
            return None  # the complete frame gets its own answer
        n = sum(math.prod(seg["tokens"]["shape"]) for seg in control["prompt"] if "tokens" in seg)
        if n < max_session_tokens:
            return None
        return ContextOverflow(
            f"the prompt has at least {n} tokens; a session holds at most {max_session_tokens} "
            "(max_session_tokens), prompt plus generated tokens"
        )

    return screen


def _load_error(exc: BaseException) -> MuxError:
    """The error frame a load failure is reported as: the worker's own message, classified."""
    from muxworker.worker.models.loader import ModelLoadError

    if isinstance(exc, MuxError):
        return exc
    if isinstance(exc, (ModelLoadError, ConfigError, ValueError, OSError)):
        return InvalidArgument(f"cannot load the model: {exc}")
    return InternalError(f"cannot load the model: {type(exc).__name__}: {exc}")


def _load_exit_status(exc: BaseException) -> int:
    """A malformed model file (or its config or chat template) is a bad argument: EXIT_USAGE, as
    ``python -m muxworker.serve`` exits for it; a model that does not exist or cannot run here is
    EXIT_STARTUP."""
    from muxworker.worker.models.loader import InvalidModelError
    from muxworker.worker.models.tokenizer import ChatTemplateError

    return EXIT_USAGE if isinstance(exc, (InvalidModelError, ConfigError, ChatTemplateError)) else EXIT_STARTUP


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
    writer = FdFrameWriter(reply_fd)
    # The model directory and tokenizer (torch-free) load on a thread while torch imports.
    from concurrent.futures import ThreadPoolExecutor

    from muxworker.worker.models.prefetch import prefetch_model

    pool = ThreadPoolExecutor(1, thread_name_prefix="muxworker-prefetch")
    prefetch = pool.submit(prefetch_model, options.model, sys.stderr)
    pool.shutdown(wait=False)  # the thread ends with its one task; result() below waits for it
    try:
        from muxworker.worker.build import load_engine

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
            weights=options.weights,
            quantize=options.quantize,
            prefetched=prefetch.result(),
        )
    except Exception as exc:
        if isinstance(exc, ConfigError):  # config.json's field is named; name the model too
            exc = ConfigError(f"{options.model or 'the bundled model'}: {exc}")
        error = _load_error(exc)
        _log(error.message)
        if not isinstance(exc, (MuxError, ValueError, OSError)):
            _log(traceback.format_exc())
        try:
            writer.write(Frame(error_control(0, error)))
        except OSError:
            pass
        writer.close()
        return _load_exit_status(exc)
    _release_freed_memory()
    _log(_startup_summary(engine))
    reader = FdFrameReader(control_fd, screen=_prompt_screen(engine.config.max_session_tokens))
    files = _file_channel(options.files_fd)
    hello = _hello(engine, protocol_1_1=options.heartbeat_ms is not None, files=files is not None)
    return WorkerServer(
        engine, reader, writer, hello, heartbeat_s=(options.heartbeat_ms or 0) / 1000, files=files
    ).serve()


def _file_channel(fd: int | None) -> FileReceiver | None:
    """The file channel the client passed, if it is one (without it the worker refuses checkpoint requests)."""
    if fd is None:
        return None
    try:
        return FileReceiver(fd)
    except OSError as exc:
        _log(f"--files-fd {fd} is not a usable socket ({exc}); the worker refuses checkpoint requests")
        return None


def _release_freed_memory() -> None:
    """Hand what loading freed back to the system (glibc keeps freed heap pages resident): parsing
    a large tokenizer.json leaves its JSON tree behind, 195 MB of Gemma 3's 290 MB."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass


def _startup_summary(engine: Engine) -> str:
    """One stderr line: what is served and how much KV memory was preallocated for it."""
    cfg = engine.config
    mib = engine.cache.nbytes / 2**20
    draft = getattr(engine, "draft", None)
    draft_mib = draft.cache.nbytes / 2**20 if draft is not None else 0.0
    groups = engine.executor.weight_groups
    weights = sum(g.nbytes for g in groups)
    return (
        f"serving {engine.model_name} on {engine.backend}/{engine.device_name} ({engine.dtype_name}, "
        f"{engine.weights} weights); weights {weights / 2**20:.0f} MiB: {', '.join(g.describe() for g in groups)}; "
        f"KV cache {mib:.1f} MiB preallocated: {cfg.max_sessions} sessions + {cfg.prefix_cache_entries} "
        f"prefix-cache entries x {cfg.max_session_tokens} tokens"
        + (f"; draft KV cache {draft_mib:.1f} MiB" if draft is not None else "")
        + f"; total {(weights + engine.cache.nbytes + (draft.cache.nbytes if draft is not None else 0)) / 2**20:.0f} MiB"
    )
