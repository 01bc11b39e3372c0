"""Load a model directory (or GGUF) into a ready Engine: config, weights, tokenizer, backend.

A backend (torch or MLX) is chosen through the explicit ``BACKENDS`` table. Each entry imports its
modules only when selected, so the torch path never imports mlx and a missing mlx package is a
clear :class:`BackendUnavailableError`, not an ImportError from deep inside.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from muxworker.transport.errors import InvalidArgument
from muxworker.worker.backends.interface import Executor, planned_nbytes
from muxworker.worker.engine import Engine, EngineConfig
from muxworker.worker.models.args import ModelArgs
from muxworker.worker.models.defaults import DTYPE_NAMES, resolve_weights
from muxworker.worker.models.loader import ModelFiles
from muxworker.worker.models.prefetch import ModelPrefetch, prefetch_model
from muxworker.worker.models.tokenizer import Tokenizer


class BackendUnavailableError(ValueError):
    """An unknown backend name, or a backend whose package is not installed."""


@dataclass
class LoadedModel:
    files: ModelFiles
    args: ModelArgs
    model: Any  # the backend's Transformer
    tokenizer: Tokenizer
    name: str
    backend: str = "torch"
    device: str = "cpu"
    weights: str = "float"  # resolve_weights: "quantized", "int4", "int8" or "float"


@dataclass(frozen=True)
class Backend:
    """What building an engine needs from one backend: the mirror functions of its executor.py."""

    name: str
    # (device, dtype name) -> raise ValueError when this backend cannot run them; before any loading.
    check: Callable[[str, str], None]
    # (files, args, *, device, dtype name) -> the backend's model with weights loaded.
    load: Callable[..., Any]
    # (model, slots, max_session_tokens, rollback_rows, device) -> the executor the engine schedules
    # against; rollback_rows is how far a slot must be able to roll back (speculative decoding).
    executor: Callable[[Any, int, int, int, str], Executor]


def dtype_name(dtype: str | torch.dtype) -> str:
    """The dtype's name as checkpoints and the wire spell it ("float32", "bfloat16", "float16")."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {', '.join(DTYPE_NAMES)}")
    return name


def _torch_backend() -> Backend:
    from muxworker.worker.backends.torch import executor as ex

    return Backend(
        "torch",
        ex.check_device,
        ex.load_model,
        lambda model, slots, tokens, rollback, device: ex.TorchExecutor(model, slots, tokens, rollback),
    )


def _mlx_backend() -> Backend:
    try:
        import mlx.core  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailableError(
            "--backend mlx needs the mlx package, which is not installed: "
            "pip install 'muxworker[mlx]' (on Linux, mlx[cpu] or mlx[cuda])"
        ) from exc
    from muxworker.worker.backends.mlx import executor as ex

    # The MLX ring has spare rows like the torch ring, so drafts work on MLX too.
    return Backend(
        "mlx",
        ex.check_device,
        ex.load_model,
        lambda model, slots, tokens, rollback, device: ex.MLXExecutor(model, slots, tokens, rollback, device=device),
    )


# Backend name -> a function that imports it and returns its entry. Explicit, never globals().
BACKENDS: dict[str, Callable[[], Backend]] = {"torch": _torch_backend, "mlx": _mlx_backend}


def get_backend(name: str) -> Backend:
    """The backend called ``name``, imported now; raise BackendUnavailableError when unknown or absent."""
    factory = BACKENDS.get(name)
    if factory is None:
        raise BackendUnavailableError(f"backend {name!r} is not supported; expected one of {', '.join(BACKENDS)}")
    return factory()


def load_model(
    path: str | os.PathLike[str] | None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    progress: TextIO | None = sys.stderr,
    backend: str = "torch",
    check: Callable[[ModelArgs, str, str], None] | None = None,
    weights: str | None = None,
    quantize: str | None = None,
    prefetched: ModelPrefetch | None = None,
) -> LoadedModel:
    """Resolve ``path`` (None: the bundled SmolLM2), convert a GGUF if needed, and load it on ``backend``.

    ``check(args, device, dtype)`` runs once the model's config is known, before any weight is
    loaded, so an impossible configuration fails before it allocates anything. ``weights`` and
    ``quantize`` are the --weights and --quantize flags (None: the model's default; see
    :func:`muxworker.worker.models.defaults.resolve_weights`)."""
    be = get_backend(backend)
    device_str = str(torch.device(device)) if backend == "torch" else str(device)
    dt = dtype_name(dtype)
    be.check(device_str, dt)
    pre = prefetched if prefetched is not None else prefetch_model(path, progress)
    model_dir, files = pre.model_dir, pre.files
    args = ModelArgs.from_dict(files.config)
    if check is not None:
        check(args, device_str, dt)
    resolved = resolve_weights(weights, model_dir, be.name, quantize)
    if be.name == "torch":
        kept = "quantized" if resolved == "quantized" else "float"  # int4/int8: float weights quantized at load
        model = be.load(files, args, device=device_str, dtype=dt, weights=kept, quantize=quantize)
    elif resolved != "float":
        raise BackendUnavailableError(f"the {be.name} backend loads float weights only, not --weights {resolved}")
    else:
        model = be.load(files, args, device=device_str, dtype=dt)
    name = files.config.get("_name_or_path") or Path(model_dir).name
    return LoadedModel(files, args, model, pre.tokenizer, str(name), be.name, device_str, resolved)


def load_engine(
    path: str | os.PathLike[str] | None,
    config: EngineConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    progress: TextIO | None = sys.stderr,
    backend: str = "torch",
    draft: str | os.PathLike[str] | None = None,
    weights: str | None = None,
    quantize: str | None = None,
    prefetched: ModelPrefetch | None = None,
) -> Engine:
    """Load the model at ``path`` and, with ``draft``, a draft model for speculative decoding that
    proposes ``config.n_draft`` tokens per step (same tokenizer, device and dtype)."""
    if draft is not None and config.n_draft < 1:
        raise InvalidArgument("a draft model needs n_draft >= 1 (tokens proposed per step)")
    if draft is None and config.n_draft and config.speculative != "ngram":
        raise InvalidArgument(f"n_draft is {config.n_draft} but no draft model was given (or --speculative ngram)")
    planned: list[int] = []  # bytes the models' weights and KV caches will take, as each is checked

    def check(args: ModelArgs, device: str, dtype: str, what: str) -> None:
        _check_fits(args, config, device, dtype, what, planned)

    loaded = load_model(
        path,
        device=device,
        dtype=dtype,
        progress=progress,
        backend=backend,
        check=lambda a, d, t: check(a, d, t, "model"),
        weights=weights,
        quantize=quantize,
        prefetched=prefetched,
    )
    be = get_backend(loaded.backend)
    slots = config.max_sessions + config.prefix_cache_entries
    executor = be.executor(loaded.model, slots, config.max_session_tokens, config.n_draft, loaded.device)
    draft_executor, draft_name = None, ""
    if draft is not None:
        drafted = load_model(
            draft,
            device=device,
            dtype=dtype,
            progress=progress,
            backend=backend,
            check=lambda a, d, t: check(a, d, t, "draft model"),
        )
        _check_same_tokenizer(loaded, drafted)
        draft_executor = be.executor(drafted.model, slots, config.max_session_tokens, config.n_draft, drafted.device)
        draft_name = drafted.name
    return Engine(
        executor,
        loaded.tokenizer,
        config,
        model_name=loaded.name,
        model_path=str(loaded.files.path),
        draft=draft_executor,
        draft_name=draft_name,
        weights=loaded.weights,
    )


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_MEMORY_HEADROOM = 0.9  # of what is available: the process and the allocator need some of it too


def weight_nbytes(args: ModelArgs, itemsize: int) -> int:
    """The weights of a Llama-family model of ``args`` at ``itemsize`` bytes per parameter."""
    h, d = args.hidden_size, args.head_size
    q, kv = args.num_attention_heads * d, args.num_kv_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * args.intermediate_size + 2 * h
    embed = args.vocab_size * h * (1 if args.tie_word_embeddings else 2)
    return (args.num_hidden_layers * per_layer + embed + h) * itemsize


def available_memory(device: str) -> int | None:
    """Bytes the device can still allocate (CUDA: free memory; CPU: MemAvailable), None if unknown."""
    if device.startswith("cuda"):
        try:
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            return int(free)
        except Exception:
            return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_fits(args: ModelArgs, config: EngineConfig, device: str, dtype: str, what: str, planned: list[int]) -> None:
    """Refuse, before anything is allocated, a configuration the model cannot run or the memory
    cannot hold, naming the flags that size it."""
    context = int(args.max_position_embeddings)
    if config.max_session_tokens > context:
        raise InvalidArgument(
            f"--max_session_tokens {config.max_session_tokens} exceeds the {what}'s context length ({context})"
        )
    itemsize = _ITEMSIZE[dtype]
    slots = config.max_sessions + config.prefix_cache_entries
    kv = planned_nbytes(
        args.windows,
        slots,
        config.max_session_tokens,
        args.num_kv_heads,
        args.head_size,
        itemsize,
        config.n_draft,
    )
    planned.append(kv + weight_nbytes(args, itemsize))
    available = available_memory(device)
    if available is not None and sum(planned) > available * _MEMORY_HEADROOM:
        gib = 2**30
        raise InvalidArgument(
            f"the {what}'s KV cache would take {kv / gib:.1f} GiB ({slots} slots = --max_sessions "
            f"{config.max_sessions} + --prefix_cache_entries {config.prefix_cache_entries}, x "
            f"--max_session_tokens {config.max_session_tokens} tokens, --dtype {dtype}) and the weights and "
            f"KV caches {sum(planned) / gib:.1f} GiB in all, but only {available / gib:.1f} GiB of {device} "
            "memory is available; lower --max_sessions or --max_session_tokens"
        )


def _check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft proposes token ids the target scores, so both must mean the same text by each id."""
    tv, dv = int(target.args.vocab_size), int(draft.args.vocab_size)
    if tv != dv:
        raise InvalidArgument(
            f"the draft model {draft.files.path} has a vocabulary of {dv} tokens but the target has {tv}; "
            "a draft must use the target's tokenizer"
        )
    if target.tokenizer.backend.get_vocab(with_added_tokens=True) != draft.tokenizer.backend.get_vocab(
        with_added_tokens=True
    ):
        raise InvalidArgument(
            f"the draft model {draft.files.path} has a different tokenizer from the target's "
            "(the same token id would mean different text); a draft must use the target's tokenizer"
        )
