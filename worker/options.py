"""The worker's command line: every flag, its check, and the parsed :class:`WorkerOptions`.

``python -m muxworker.worker --help`` prints them; the client's ``default_worker_command`` builds
the command. Parsing imports no torch, so a usage error is reported at once.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from muxworker.transport.fdio import FDS_ENV
from muxworker.transport.fdpass import FILES_FLAG
from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.models.args import ConfigError
from muxworker.worker.models.defaults import (
    DTYPE_CHOICES,
    DTYPE_NAMES,
    QUANTIZE_CHOICES,
    WEIGHTS_CHOICES,
    default_threads,
    resolve_dtype,
)

__all__ = ["BACKENDS", "DTYPE_NAMES", "UsageError", "WorkerOptions", "build_parser", "parse_args"]

BACKENDS = ("torch", "mlx")
LATER_BACKENDS: tuple[str, ...] = ()


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


# Engine limits and knobs: one flag per EngineConfig field, with EngineConfig's own default.
_ENGINE_FLAGS: dict[str, tuple[Callable[[str], int], str]] = {
    "max_sessions": (_positive_int, "open sessions at once; each owns one KV cache slot"),
    "max_session_tokens": (
        _positive_int,
        "tokens one session holds, prompt plus generated; at most the model's context length",
    ),
    "max_decode_sequences": (_positive_int, "sequences decoded together in one forward pass"),
    "max_inflight_requests": (_positive_int, "generations accepted at once; more are refused with capacity_exhausted"),
    "prefill_chunk_tokens": (
        _positive_int,
        "prompt tokens prefilled per forward pass, so long prompts do not stall decoding",
    ),
    "prefix_cache_entries": (
        _nonnegative_int,
        "LRU entries of shared prompt prefixes, each a preallocated KV slot; new sessions whose "
        "prompt starts with a cached prefix prefill only the rest",
    ),
    "n_draft": (_nonnegative_int, "tokens the draft proposes per session per step with --draft (0: no draft)"),
    "seed": (_nonnegative_int, "seed for requests that sample without their own seed (none: a fixed internal seed)"),
}

# Everything else, as (flags, argparse keywords): what to serve, then how the process runs.
_Flags = list[tuple[tuple[str, ...], dict[str, Any]]]
_MODEL_FLAGS: _Flags = [
    (
        ("--model",),
        dict(
            metavar="PATH",
            help="Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or a .gguf file, "
            "converted once into the cache (default: the bundled SmolLM2-135M-Instruct GGUF)",
        ),
    ),
    (("--backend",), dict(default="torch", help="inference backend: torch or mlx (default: %(default)s)")),
    (("--device",), dict(default="cpu", help="torch: cpu, cuda or cuda:N; mlx: cpu or gpu (default: %(default)s)")),
    (
        ("--dtype",),
        dict(
            choices=DTYPE_CHOICES,
            default="auto",
            help="activations, KV cache and float weights (default: auto = bfloat16 on cuda and on CPUs with "
            "native bfloat16 (AVX512-BF16 or AMX), float32 elsewhere; float16 needs cuda)",
        ),
    ),
    (
        ("--weights",),
        dict(
            choices=WEIGHTS_CHOICES,
            help="quantized: a quantized GGUF's blocks stay as they are and decode in the native step (CPU); "
            "float: every tensor dequantized to --dtype (exactly the GGUF's values with --dtype float32) "
            "(default: quantized for a GGUF on torch, float otherwise)",
        ),
    ),
    (
        ("--quantize",),
        dict(
            choices=QUANTIZE_CHOICES,
            help="quantize a float (Hugging Face) model's linear layers and output layer at load: int4 (Q4_1 "
            "blocks) or int8 (Q8_0), decoded in the native step; torch on cpu (default: none)",
        ),
    ),
]
_PROCESS_FLAGS: _Flags = [
    (
        ("--threads",),
        dict(
            type=_positive_int,
            metavar="N",
            help="CPU threads for torch (default: one per physical core this process may use, here "
            f"{default_threads()}); on a shared machine fewer threads than cores avoid oversubscription",
        ),
    ),
    (
        ("--draft",),
        dict(metavar="PATH", help="draft model for speculative decoding (same tokenizer as --model); needs --n_draft"),
    ),
    (
        ("--speculative",),
        dict(
            choices=["ngram"],
            default=None,
            help="ngram: speculative decoding without a draft model, proposing --n_draft tokens per step "
            "from the session's own history (prompt lookup; pays off when outputs copy their input)",
        ),
    ),
    (
        ("--own-process-group",),
        dict(
            action="store_true",
            help="leave the parent's process group at start (an application that handles a terminal's "
            "Ctrl-C itself keeps its worker out of the terminal's SIGINT); the worker still exits when "
            "its control pipe closes",
        ),
    ),
    (
        ("--heartbeat_ms", "--heartbeat-ms"),
        dict(
            type=_nonnegative_int,
            metavar="N",
            help="protocol 1.1 liveness, passed by the client: write a heartbeat frame when nothing else "
            "was written for N ms while busy (0: none); also adds readiness to the hello",
        ),
    ),
    (
        ("--control-fd",),
        dict(type=int, metavar="N", help=f"inherited fd the worker reads requests from (or {FDS_ENV}=N,M)"),
    ),
    (
        ("--reply-fd",),
        dict(type=int, metavar="M", help=f"inherited fd the worker writes replies to (or {FDS_ENV}=N,M)"),
    ),
    (
        (FILES_FLAG,),
        dict(
            type=int,
            metavar="F",
            dest="files_fd",
            help="inherited socket the client passes checkpoint files on (SCM_RIGHTS); without it "
            "the worker refuses checkpoint requests",
        ),
    ),
]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m muxworker.worker",
        description=(
            "Serve one model over two inherited pipes: continuous batching over named sessions. "
            "Started by muxworker.client.spawn_multiplexed_worker, which creates the pipes."
        ),
        allow_abbrev=False,
    )
    for flags, kwargs in _MODEL_FLAGS:
        p.add_argument(*flags, **kwargs)
    defaults = EngineConfig()
    for name, (kind, help_text) in _ENGINE_FLAGS.items():
        dashed = name.replace("_", "-")
        aliases = (f"--{name}", f"--{dashed}") if dashed != name else (f"--{name}",)
        p.add_argument(
            *aliases,
            type=kind,
            metavar="N",
            default=getattr(defaults, name),
            help=help_text + " (default: %(default)s)",
        )
    for flags, kwargs in _PROCESS_FLAGS:
        p.add_argument(*flags, **kwargs)
    return p


@dataclass(frozen=True)
class WorkerOptions:
    """The parsed and checked command line."""

    model: str | None
    backend: str
    device: str
    dtype: str  # resolved: never "auto"
    config: EngineConfig
    draft: str | None = None
    threads: int | None = None
    weights: str | None = None  # None: the model's default (muxworker.worker.models.defaults.resolve_weights)
    quantize: str | None = None
    heartbeat_ms: int | None = None  # None: a protocol 1.0 client (no heartbeats, no hello readiness)
    files_fd: int | None = None  # the client's file channel (transport/fdpass.py), if it passed one


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
    if ns.speculative == "ngram" and ns.draft is not None:
        raise UsageError("--speculative ngram takes no --draft (it drafts from the session's own history)")
    if ns.speculative == "ngram" and ns.n_draft == 0:
        raise UsageError("--speculative ngram needs --n_draft N >= 1 (tokens proposed per step)")
    if ns.draft is None and ns.speculative is None and ns.n_draft != 0:
        raise UsageError("--n_draft needs --draft PATH (a draft model) or --speculative ngram")
    dtype = resolve_dtype(ns.dtype, ns.device, ns.backend)
    if ns.backend == "torch" and ns.device == "cpu" and dtype == "float16":
        raise UsageError("--dtype float16 is not supported on --device cpu; use float32 or bfloat16")
    if ns.quantize is not None and ns.weights is not None:
        raise UsageError("--quantize quantizes a float model at load; it does not combine with --weights")
    if ns.quantize is not None and (ns.backend != "torch" or ns.device != "cpu"):
        raise UsageError("--quantize feeds the native CPU decode step: it needs --backend torch --device cpu")
    if ns.weights == "quantized" and ns.backend != "torch":
        raise UsageError("--weights quantized needs --backend torch (the mlx backend loads float weights)")
    try:
        config = EngineConfig(**{name: getattr(ns, name) for name in _ENGINE_FLAGS}, speculative=ns.speculative)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    return WorkerOptions(
        ns.model,
        ns.backend,
        ns.device,
        dtype,
        config,
        draft=ns.draft,
        threads=ns.threads if ns.threads is not None else default_threads(),
        weights=ns.weights,
        quantize=ns.quantize,
        heartbeat_ms=ns.heartbeat_ms,
        files_fd=ns.files_fd,
    )
