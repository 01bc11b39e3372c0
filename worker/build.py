"""Load a model directory (or GGUF) into a ready Engine: config, weights, tokenizer."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from .config import EngineConfig, ModelArgs
from .engine import Engine
from .executor import TorchExecutor
from .loader import ModelFiles, load_model_dir, load_state_dict, resolve_model
from .model import Transformer, build_model
from .tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    files: ModelFiles
    args: ModelArgs
    model: Transformer
    tokenizer: Tokenizer
    name: str


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; expected one of {', '.join(DTYPES)}") from None


def check_device_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """float32/bfloat16 on CPU; bfloat16/float16 (and float32) on CUDA."""
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError("float16 is not supported on CPU; use float32 or bfloat16")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")


def load_model(
    path: str | os.PathLike[str] | None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    progress: TextIO | None = sys.stderr,
) -> LoadedModel:
    """Resolve ``path`` (None: the bundled SmolLM2), convert a GGUF if needed, and load it."""
    device = torch.device(device)
    dt = parse_dtype(dtype)
    check_device_dtype(device, dt)
    model_dir = resolve_model(path, progress=progress)
    files = load_model_dir(model_dir)
    args = ModelArgs.from_dict(files.config)
    state = load_state_dict(model_dir, device="cpu")
    model = build_model(args, state, dtype=dt, device=device)
    del state
    tokenizer = Tokenizer.from_model_files(files)
    name = files.config.get("_name_or_path") or Path(model_dir).name
    return LoadedModel(files, args, model, tokenizer, str(name))


def load_engine(
    path: str | os.PathLike[str] | None,
    config: EngineConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    progress: TextIO | None = sys.stderr,
) -> Engine:
    loaded = load_model(path, device=device, dtype=dtype, progress=progress)
    executor = TorchExecutor(loaded.model, config.max_sessions + config.prefix_cache_entries, config.max_session_tokens)
    return Engine(executor, loaded.tokenizer, config, model_name=loaded.name, model_path=str(loaded.files.path))
