"""What a session checkpoint is bound to: the model's files and the activation-affecting settings.

Applications pass these to ``SessionStore.create(path, model_files=..., configuration=...)`` so a
checkpoint saved with one model or configuration is refused by a worker running another.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from muxworker.worker.models.defaults import resolve_dtype, resolve_weights
from muxworker.worker.models.gguf_tensors import GGUF_LINK, TENSOR_INDEX

_MODEL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
)


def model_identity_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """Every file of an HF model directory that changes what the model computes or tokenizes."""
    d = Path(model_dir)
    files = [d / name for name in _MODEL_FILES if (d / name).is_file()]
    files += sorted(d.glob("*.safetensors"))
    if (d / TENSOR_INDEX).is_file():  # a converted GGUF: the GGUF's own bytes and the tensor index
        files += [d / TENSOR_INDEX, (d / GGUF_LINK).resolve()]
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files.append(index)
    if not files:
        raise FileNotFoundError(f"{d} holds no model files")
    return files


def worker_configuration(
    *,
    backend: str | None = "torch",
    dtype: str = "auto",
    device: str = "cpu",
    model_dir: str | os.PathLike[str] | None = None,
    weights: str | None = None,
    quantize: str | None = None,
    draft: str | os.PathLike[str] | None = None,
    n_draft: int = 0,
    **extra: Any,
) -> dict[str, Any]:
    """The settings that change activations (and so a checkpoint's KV), as a canonical dict.

    Pass what the worker is started with: ``dtype`` and ``weights`` resolve as the worker's
    --dtype and --weights do (``dtype="auto"`` on ``device``; ``weights=None``: the default for
    ``model_dir``, so give one of them), so the store matches a worker started with the defaults.
    Checkpoints are logical, so torch and MLX workers can read each other's; ``backend=None``
    leaves the backend out of the identity for applications that want to move sessions between
    backends (the worker still checks dtype and geometry on restore).
    """
    if weights is None and quantize is None and model_dir is None:
        raise ValueError("worker_configuration needs model_dir= (for the default --weights) or weights=")
    be = backend or "torch"
    config: dict[str, Any] = {
        "dtype": resolve_dtype(dtype, device, be),
        "weights": resolve_weights(weights, model_dir or ".", be, quantize),
        "draft": None,
        "n_draft": 0,
    }
    if backend is not None:
        config["backend"] = backend
    if draft is not None:
        # The draft's bytes are bound by passing model_identity_files(draft) in model_files too.
        config["draft"] = Path(draft).name
        config["n_draft"] = int(n_draft)
    config.update(extra)
    return config
