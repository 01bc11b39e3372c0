"""What loading a model needs before torch, read on a thread while torch imports.

``import torch`` takes about 1.1 s of a worker's start and holds one core; resolving the model
directory and loading its tokenizer (0.1 s, most of it in the tokenizers library, which runs in
parallel) need no torch. The worker starts ``prefetch_model`` on a thread first, then imports
torch and the backend, then hands the result to ``load_engine``. Torch-free by design.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from muxworker.worker.models.loader import ModelFiles, load_model_dir, resolve_model
from muxworker.worker.models.tokenizer import Tokenizer

__all__ = ["ModelPrefetch", "prefetch_model"]


@dataclass(frozen=True)
class ModelPrefetch:
    """What a load needs before torch: the resolved directory, its files and its tokenizer.
    Torch-free, so the worker reads it on a thread while torch imports (``prefetch_model``)."""

    model_dir: Path
    files: ModelFiles
    tokenizer: Tokenizer


def prefetch_model(path: str | os.PathLike[str] | None, progress: TextIO | None = sys.stderr) -> ModelPrefetch:
    """Resolve ``path`` (converting a GGUF on first use), parse its directory, load its tokenizer."""
    model_dir = resolve_model(path, progress=progress)
    files = load_model_dir(model_dir)
    tokenizer = Tokenizer.from_model_files(files)
    tokenizer.check_chat_template()  # a template that cannot render one message fails the start
    return ModelPrefetch(model_dir, files, tokenizer)
