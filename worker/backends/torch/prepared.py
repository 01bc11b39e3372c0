"""The prepared-weights cache: a GGUF model's dense tensors, dequantized once.

Building a model from a GGUF dequantizes every tensor into the model dtype (with --weights
quantized the dense copies a prefill multiplies, quant.py; with --weights float the whole model):
0.6 s of a start for SmolLM2, 5 s for Gemma 3 270M, every start. The first load writes the
result beside the converted model as one ``torch.save`` file; later loads memory-map it
(``torch.load(mmap=True, weights_only=True)``), so a start reads only what it touches, and the
pages are the page cache's, shared between workers of the same model. (The GGUF blocks the native
decode step multiplies are read in place from the GGUF itself, never from here.)

The file is derived data, never part of a checkpoint's identity. It is keyed by everything that
shapes its bytes: its name carries the torch version (its serialization), the device type and dtype; its manifest repeats them with ``PREPARED_VERSION`` (bumped when the
mapping changes) and the GGUF's size and mtime. Anything that does not match, or a file that does
not load, is ignored and rebuilt; a cache that cannot be written (read-only model directory) is
skipped.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from muxworker.worker.backends.torch.model import ARCHITECTURES, Transformer
from muxworker.worker.models.args import ModelArgs

PREPARED_VERSION = 4  # 2: Int4Linear holds a dense copy; 3: kernel scales bfloat16; 4: dense tensors only
_MANIFEST = "__muxworker_prepared__"


def prepared_path(model_dir: Path, dtype: torch.dtype, device: torch.device) -> Path:
    dt = str(dtype).removeprefix("torch.")
    return model_dir / f"prepared-torch{torch.__version__}-{device.type}-{dt}.pt"


def _stamp(gguf: Path) -> list[int]:
    st = gguf.stat()
    return [st.st_size, st.st_mtime_ns]


def _manifest(dtype: torch.dtype, gguf: Path) -> dict[str, Any]:
    return {"version": PREPARED_VERSION, "torch": str(torch.__version__), "dtype": str(dtype), "gguf": _stamp(gguf)}


def save_prepared(model: Transformer, path: Path, dtype: torch.dtype, gguf: Path) -> bool:
    """Write ``model``'s tensors to ``path`` atomically; False when the directory is not writable."""
    state: dict[str, Any] = dict(model.state_dict())
    state[_MANIFEST] = _manifest(dtype, gguf)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_prepared(args: ModelArgs, path: Path, dtype: torch.dtype, gguf: Path) -> Transformer | None:
    """The model from a prepared file that matches, memory-mapped; None when there is none or it
    does not match (the caller builds the model and saves a new file)."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception:  # a damaged or foreign file: rebuild it
        return None
    manifest = state.pop(_MANIFEST, None) if isinstance(state, dict) else None
    if not (
        isinstance(manifest, dict)
        and manifest.get("version") == PREPARED_VERSION
        and manifest.get("torch") == str(torch.__version__)
        and manifest.get("dtype") == str(dtype)
        and manifest.get("gguf") == _stamp(gguf)
    ):
        return None
    with torch.device("meta"):
        model = ARCHITECTURES[args.architecture](args)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except (KeyError, ValueError, RuntimeError, TypeError, AttributeError):
        return None
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for p in model.parameters():
        p.requires_grad_(False)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers()) if t.numel()):
        return None
    for module in model.modules():  # the rope tables start empty, filled by setup_rope
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_meta:
                setattr(module, name, torch.empty(0, dtype=dtype))
    return model.eval()
