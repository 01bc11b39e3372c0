"""Model files: HF directories and GGUF import, the tokenizer, the model's configuration, and what a
checkpoint is bound to. Applications may use this layer directly to resolve a model path and bind a
SessionStore to it; importing it does not import torch (only loading weights or converting a GGUF
does).
"""

from __future__ import annotations

from .args import ConfigError, ModelArgs
from .identity import model_identity_files, worker_configuration
from .loader import (
    BundledModelMissingError,
    InvalidModelError,
    ModelFiles,
    ModelLoadError,
    ModelNotFoundError,
    bundled_gguf_path,
    load_model_dir,
    resolve_model,
)

__all__ = [
    "ConfigError",
    "ModelArgs",
    "model_identity_files",
    "worker_configuration",
    "BundledModelMissingError",
    "InvalidModelError",
    "ModelFiles",
    "ModelLoadError",
    "ModelNotFoundError",
    "bundled_gguf_path",
    "load_model_dir",
    "resolve_model",
]
