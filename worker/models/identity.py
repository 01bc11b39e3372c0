"""What a session checkpoint is bound to: the model's files and the activation-affecting settings.

Applications pass these to ``SessionStore.create(path, model_files=..., configuration=...)`` so a
checkpoint saved with one model or configuration is refused by a worker running another.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files.append(index)
    if not files:
        raise FileNotFoundError(f"{d} holds no model files")
    return files


def worker_configuration(
    *,
    backend: str | None = "torch",
    dtype: str = "float32",
    draft: str | os.PathLike[str] | None = None,
    n_draft: int = 0,
    **extra: Any,
) -> dict[str, Any]:
    """The settings that change activations (and so a checkpoint's KV), as a canonical dict.

    Checkpoints are logical, so torch and MLX workers can read each other's; ``backend=None``
    leaves the backend out of the identity for applications that want to move sessions between
    backends (the worker still checks dtype and geometry on restore).
    """
    config: dict[str, Any] = {"dtype": dtype, "draft": None, "n_draft": 0}
    if backend is not None:
        config["backend"] = backend
    if draft is not None:
        # The draft's bytes are bound by passing model_identity_files(draft) in model_files too.
        config["draft"] = Path(draft).name
        config["n_draft"] = int(n_draft)
    config.update(extra)
    return config
