"""The worker's command line: every flag, its check, and the parsed :class:`WorkerOptions`.

``python -m muxworker.worker --help`` prints them; the client's ``default_worker_command`` builds
the command. Parsing imports no torch, so a usage error is reported at once.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from muxworker.transport.fdio import FDS_ENV
from muxworker.worker.engine.config import EngineConfig
from muxworker.worker.models.args import ConfigError

__all__ = ["BACKENDS", "DTYPE_NAMES", "UsageError", "WorkerOptions", "build_parser", "parse_args"]

BACKENDS = ("torch", "mlx")
LATER_BACKENDS: tuple[str, ...] = ()
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # weights, activations and KV; checkpoints use the same names


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
    p.add_argument("--device", default="cpu", help="torch: cpu, cuda or cuda:N; mlx: cpu or gpu (default: %(default)s)")
    p.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=None,
        help="weights, activations and KV cache dtype (default: float32 on cpu, bfloat16 on cuda; float16 needs cuda)",
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
        help="prompt tokens prefilled per forward pass, so long prompts do not stall decoding (default: %(default)s)",
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
        "--heartbeat_ms",
        "--heartbeat-ms",
        type=_nonnegative_int,
        metavar="N",
        default=None,
        help="protocol 1.1 liveness, passed by the client: write a heartbeat frame when nothing else "
        "was written for N ms while busy (0: none); also adds readiness to the hello",
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
    heartbeat_ms: int | None = None  # None: a protocol 1.0 client (no heartbeats, no hello readiness)


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
    return WorkerOptions(ns.model, ns.backend, ns.device, dtype, config, ns.draft, ns.threads, ns.heartbeat_ms)
