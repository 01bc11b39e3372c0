"""GGUF -> Hugging Face directory conversion.

    python -m muxworker.worker.models.convert MODEL.gguf OUT_DIR [--dtype float32|bfloat16|float16]

Reads the file's header with gguf_file.GGUFFile (the tensors stay memory-mapped), undoes llama.cpp's
rotary row permutation of a llama's attn_q/attn_k and its (1 + weight) Gemma norms, and writes config.json, tokenizer.json, tokenizer_config.json and
generation_config.json, plus the weights in one of two ways:

- ``weights="copy"`` (the command line): model.safetensors with every tensor dequantized by
  `gguf.quants.dequantize` (Q4_1, Q8_0, K-quants, F16, BF16, ...), a directory transformers can
  load. float32 by default: dequantized values are exact in float32, so a float32 model reproduces
  the GGUF exactly. `--dtype bfloat16` halves it at the cost of rounding.
- ``weights="link"`` (what `resolve_model` caches): no copy at all. The directory links the GGUF
  as model.gguf and records where each tensor lies in it (gguf_tensors.json, see gguf_tensors.py);
  the worker reads quantized tensors straight from the memory-mapped file, keeping their blocks
  for the native decode step or dequantizing them at load (--weights quantized|float).

Supported: general.architecture llama (Llama 2/3.x, SmolLM2), qwen2, qwen3 and gemma3, with the
vocabularies gguf_vocab.py reads. Anything else is refused with `UnsupportedGGUFError` rather than
converted approximately.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal, TextIO

import numpy as np
import torch
from tokenizers import Tokenizer as BackendTokenizer

from muxworker.worker.models.args import GEMMA3_DEFAULTS, ConfigError, ModelArgs
from muxworker.worker.models.base import CONVERTER_VERSION, InvalidModelError, ModelNotFoundError, progress_stream
from muxworker.worker.models.bounds import (
    MAX_CONTEXT_LENGTH,
    MAX_EMBEDDING_LENGTH,
    MAX_FEED_FORWARD_LENGTH,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_VOCAB,
    checked_float,
    checked_int,
)
from muxworker.worker.models.gguf_file import GGUFFile, GGUFTensorInfo
from muxworker.worker.models.gguf_tensors import (
    GGUF_ARCHITECTURES,
    GGUF_LINK,
    NORM_ADD,
    ROTARY_PERMUTED,
    GGUFTensorError,
    GGUFTensorIndex,
    TensorEntry,
    block_tensors,
    dequantize_tensor,
    hf_tensor_name,
)
from muxworker.worker.models.gguf_vocab import UnsupportedGGUFError, build_tokenizer, require
from muxworker.worker.models.template_sandbox import ChatTemplateError, check_chat_template

__all__ = ["CONVERTER_VERSION", "UnsupportedGGUFError", "convert_gguf", "main"]


# --------------------------------------------------------------------------------------------
# Metadata


# --------------------------------------------------------------------------------------------
# Tensors


@dataclass(frozen=True)
class _TensorPlan:
    hf_name: str
    file: GGUFFile
    source: GGUFTensorInfo
    shape: tuple[int, ...]  # numpy/torch order (reversed GGML ne)
    rotary_heads: int | None  # set for attn_q/attn_k: heads to unpermute over
    add: float  # added on read (NORM_ADD)

    def entry(self) -> TensorEntry:
        """Where this tensor lies in the GGUF file, for the tensor index of a linked directory."""
        t = self.source
        return TensorEntry(
            self.hf_name, t.name, t.type.name, self.shape, t.offset, t.nbytes, self.rotary_heads, self.add
        )


#: A Llama 3.x GGUF's rope scaling: llama.cpp's per-frequency divisors, not a model weight.
_ROPE_FREQS = "rope_freqs.weight"


def _plan_tensors(file: GGUFFile, arch: str, n_head: int, n_kv_head: int, n_layer: int) -> list[_TensorPlan]:
    plans: list[_TensorPlan] = []
    permuted = arch in ROTARY_PERMUTED
    for t in file.tensors:
        if t.name == _ROPE_FREQS:
            continue
        heads = None
        if permuted and ".attn_q." in t.name:
            heads = n_head
        elif permuted and ".attn_k." in t.name:
            heads = n_kv_head
        shape = t.shape
        try:
            name = hf_tensor_name(t.name, arch)
        except GGUFTensorError as e:
            raise UnsupportedGGUFError(str(e)) from None
        add = NORM_ADD.get(arch, 0.0) if name.endswith("norm.weight") else 0.0
        plans.append(_TensorPlan(name, file, t, shape, heads, add))
    names = {p.hf_name for p in plans}
    if len(names) != len(plans):
        raise InvalidModelError("GGUF file holds the same tensor twice")
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{hf}.weight" for i in range(n_layer) for hf in block_tensors(arch).values()
    }
    if missing := sorted(expected - names):
        raise InvalidModelError(
            f"GGUF file lacks tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
        )
    if extra := sorted(n for n in names if n.startswith("model.layers.") and int(n.split(".")[2]) >= n_layer):
        raise InvalidModelError(f"GGUF file has tensors beyond block_count={n_layer}: {', '.join(extra[:4])}")
    return plans


def _dequantize(plan: _TensorPlan) -> np.ndarray:
    t = plan.source
    try:  # float32 for every type; F32 tensors come back as a view of the memory map
        values = dequantize_tensor(plan.file.data(t), t.type.name, plan.shape, plan.rotary_heads)
    except GGUFTensorError as e:
        raise UnsupportedGGUFError(str(e)) from None
    return values + np.float32(plan.add) if plan.add else values


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _write_safetensors(
    path: Path,
    plans: list[_TensorPlan],
    dtype: torch.dtype,
    progress: TextIO | None,
) -> None:
    """Stream one tensor at a time into a safetensors file, so memory stays at one tensor
    whatever the model size. The header is known up front: every shape comes from the GGUF."""
    code = _SAFETENSORS_DTYPES[dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in plans:
        nbytes = int(np.prod(p.shape, dtype=np.int64)) * itemsize
        header[p.hf_name] = {"dtype": code, "shape": list(p.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8 bytes with spaces
    step = max(1, len(plans) // 10)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for i, p in enumerate(plans, 1):
            _write_tensor(f, _dequantize(p), dtype)
            if progress is not None and (i % step == 0 or i == len(plans)):
                print(f"muxworker: converted {i}/{len(plans)} tensors", file=progress, flush=True)
        if f.tell() != 8 + len(blob) + offset:
            raise RuntimeError(f"wrote {f.tell()} bytes to {path}, its header promises {8 + len(blob) + offset}")


def _write_tensor(f: BinaryIO, values: np.ndarray, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        f.write(np.ascontiguousarray(values, dtype="<f4").data)
        return
    # np.array copies: torch warns on read-only (memory-mapped) arrays.
    tensor = torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype)
    f.write(tensor.view(torch.uint8).numpy().data)


# --------------------------------------------------------------------------------------------
# Config


def _model_config(
    metadata: dict[str, Any],
    arch: str,
    hp: dict[str, Any],
    plans: list[_TensorPlan],
    rope_freqs: _TensorPlan | None,
    dtype: torch.dtype | None,
) -> dict[str, Any]:
    def key(name: str) -> str:
        return f"{arch}.{name}"

    n_head, hidden, head_dim = hp["n_head"], hp["hidden"], hp["head_dim"]
    rope_dim = hp.get("rope_dim")
    if rope_dim is not None and rope_dim != head_dim:
        raise UnsupportedGGUFError(f"partial rotary embeddings (rope.dimension_count={rope_dim}, head_dim={head_dim})")
    shapes = {p.hf_name: p.shape for p in plans}
    vocab_size = checked_int(
        shapes["model.embed_tokens.weight"][0], "token_embd.weight's rows", 1, MAX_VOCAB, error=InvalidModelError
    )
    hf_arch = GGUF_ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": "gemma3_text" if arch == "gemma3" else arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": hp["ffn"],
        "num_hidden_layers": hp["n_layer"],
        "num_attention_heads": n_head,
        "num_key_value_heads": hp["n_kv_head"],
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": hp["eps"],
        "rope_theta": hp["rope_theta"],
        "max_position_embeddings": hp["context"],
        "tie_word_embeddings": "lm_head.weight" not in shapes,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in shapes,
        "mlp_bias": False,
    }
    if arch == "gemma3":
        # The GGUF carries the window but not the layer pattern, the local rope base or the query
        # scale: transformers' defaults (GEMMA3_DEFAULTS), written out so config.json is complete.
        n_layer, pattern = config["num_hidden_layers"], GEMMA3_DEFAULTS["sliding_window_pattern"]
        config |= {
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": hp["sliding_window"],
            "layer_types": [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layer)
            ],
            "rope_local_base_freq": GEMMA3_DEFAULTS["rope_local_base_freq"],
            "query_pre_attn_scalar": GEMMA3_DEFAULTS["query_pre_attn_scalar"],
        }
        del config["hidden_act"]
    if rope_freqs is not None:
        if rope_freqs.source.n_elements != head_dim // 2:
            raise InvalidModelError(f"{_ROPE_FREQS} has {rope_freqs.source.n_elements} entries for head_dim {head_dim}")
        factors = np.asarray(_dequantize(rope_freqs), dtype=np.float64).reshape(-1)
        if not (np.isfinite(factors).all() and (factors > 0).all()):
            raise InvalidModelError(f"{_ROPE_FREQS} holds a factor that is not a finite positive number")
        config["rope_freq_factors"] = factors.tolist()
    if dtype is not None:  # a linked directory's weights keep the GGUF's types
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    scaling = metadata.get(key("rope.scaling.type"), "none")
    if scaling == "linear":
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": hp["rope_factor"],
        }
    elif scaling != "none":
        raise UnsupportedGGUFError(f"rope scaling type {scaling!r}")
    for name in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if (value := metadata.get(f"tokenizer.ggml.{name}")) is not None:
            config[name.replace("padding", "pad")] = int(value)
    _check_shapes(config, shapes)
    return config


def _check_shapes(config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """Every tensor must have the shape the metadata implies; a mismatch means a damaged or
    misdescribed file, which would otherwise surface as a confusing error at load time."""
    hidden, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    per_layer = {
        "self_attn.q_proj": (q_rows, hidden),
        "self_attn.k_proj": (kv_rows, hidden),
        "self_attn.v_proj": (kv_rows, hidden),
        "self_attn.o_proj": (hidden, q_rows),
        "mlp.gate_proj": (ffn, hidden),
        "mlp.up_proj": (ffn, hidden),
        "mlp.down_proj": (hidden, ffn),
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
        "pre_feedforward_layernorm": (hidden,),
        "post_feedforward_layernorm": (hidden,),
        "self_attn.q_norm": (config["head_dim"],),
        "self_attn.k_norm": (config["head_dim"],),
    }
    expected = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(config["num_hidden_layers"]):
        for module, shape in per_layer.items():
            expected[f"model.layers.{i}.{module}.weight"] = shape
            expected[f"model.layers.{i}.{module}.bias"] = shape[:1]
    for name, shape in shapes.items():
        if shape != expected[name]:
            raise InvalidModelError(
                f"GGUF tensor for {name} has shape {list(shape)}, the metadata implies {list(expected[name])}"
            )


# --------------------------------------------------------------------------------------------
# Driver


def _read_checked(
    gguf_path: Path, dtype: torch.dtype | None
) -> tuple[list[_TensorPlan], dict[str, Any], tuple[BackendTokenizer, dict[str, Any], dict[str, Any]]]:
    """Read and check everything the conversion writes, before anything is written. A malformed or
    crafted file gets one InvalidModelError naming the file and the field, never a traceback: the
    file is untrusted input (bounds.py)."""
    where = str(gguf_path)
    try:
        file = GGUFFile(gguf_path)
        metadata = file.metadata
        arch = metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedGGUFError(
                f"general.architecture={arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        hp = _hyperparameters(metadata, arch)  # bounded before anything is sized by them
        plans = _plan_tensors(file, arch, hp["n_head"], hp["n_kv_head"], hp["n_layer"])
        freqs = next((t for t in file.tensors if t.name == _ROPE_FREQS), None)
        rope_freqs = None if freqs is None else _TensorPlan(_ROPE_FREQS, file, freqs, (freqs.n_elements,), None, 0.0)
        config = _model_config(metadata, arch, hp, plans, rope_freqs, dtype)
        try:
            ModelArgs.from_dict(config)  # the same checks a config.json gets at load
        except ConfigError as e:
            raise InvalidModelError(f"the model it describes cannot run: {e}") from None
        tokenizer, tokenizer_config, generation_config = build_tokenizer(metadata)
        if (n_tokens := tokenizer.get_vocab_size(with_added_tokens=True)) > config["vocab_size"]:
            raise InvalidModelError(f"{n_tokens} tokens but the embedding has only {config['vocab_size']} rows")
        if isinstance(template := tokenizer_config.get("chat_template"), str):
            try:
                check_chat_template(template)
            except ChatTemplateError as e:
                raise InvalidModelError(f"tokenizer.chat_template: {e}") from None
    except InvalidModelError as e:
        if str(e).startswith(where):
            raise
        raise type(e)(f"{where}: {e}") from None
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, MemoryError) as e:
        # A combination of fields no check above foresaw: still the file's fault, still one line.
        raise InvalidModelError(f"{where}: malformed GGUF ({type(e).__name__}: {e})") from None
    return plans, config, (tokenizer, tokenizer_config, generation_config)


def _hyperparameters(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    """The counts and sizes the conversion is sized by, each checked against bounds.py."""

    def integer(name: str, low: int, high: int, default: int | None = None) -> int:
        key = f"{arch}.{name}"
        value = require(metadata, key) if default is None else metadata.get(key, default)
        return checked_int(value, key, low, high, error=InvalidModelError)

    def number(name: str, default: float | None = None, high: float = math.inf) -> float:
        key = f"{arch}.{name}"
        value = require(metadata, key) if default is None else metadata.get(key, default)
        return checked_float(value, key, high=high, error=InvalidModelError)

    n_layer = integer("block_count", 1, MAX_LAYERS)
    n_head = integer("attention.head_count", 1, MAX_HEADS)
    n_kv_head = integer("attention.head_count_kv", 1, n_head, default=n_head)
    if n_head % n_kv_head:
        raise InvalidModelError(
            f"{arch}.attention.head_count ({n_head}) is not a multiple of {arch}.attention.head_count_kv ({n_kv_head})"
        )
    hidden = integer("embedding_length", 1, MAX_EMBEDDING_LENGTH)
    if f"{arch}.attention.key_length" in metadata:
        head_dim = integer("attention.key_length", 1, MAX_HEAD_DIM)
    elif hidden % n_head:
        raise InvalidModelError(
            f"{arch}.embedding_length ({hidden}) is not a multiple of {arch}.attention.head_count ({n_head}) "
            f"and {arch}.attention.key_length is not given"
        )
    else:
        head_dim = hidden // n_head
    if head_dim % 2:
        raise InvalidModelError(f"the head width {head_dim} is odd: rotary embeddings rotate pairs")
    hp: dict[str, Any] = {
        "n_layer": n_layer,
        "n_head": n_head,
        "n_kv_head": n_kv_head,
        "hidden": hidden,
        "head_dim": head_dim,
        "ffn": integer("feed_forward_length", 1, MAX_FEED_FORWARD_LENGTH),
        "context": integer("context_length", 1, MAX_CONTEXT_LENGTH),
        "eps": number("attention.layer_norm_rms_epsilon", high=1.0),
        "rope_theta": number("rope.freq_base", 10000.0),
    }
    if f"{arch}.rope.dimension_count" in metadata:
        hp["rope_dim"] = integer("rope.dimension_count", 1, MAX_HEAD_DIM)
    if arch == "gemma3":
        hp["sliding_window"] = integer("attention.sliding_window", 1, MAX_CONTEXT_LENGTH)
    if metadata.get(f"{arch}.rope.scaling.type", "none") == "linear":
        hp["rope_factor"] = number("rope.scaling.factor")
    return hp


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    progress: TextIO | Literal["stderr"] | None = "stderr",
    weights: Literal["copy", "link"] = "copy",
) -> Path:
    """Convert `gguf_path` into a new Hugging Face directory `out_dir`.

    ``weights``: "copy" writes model.safetensors in ``dtype``; "link" writes no weights, only the
    tensor index and a model.gguf symlink to the (absolute) `gguf_path` (see the module docstring).

    Everything is validated before anything is written; the files are written into a temporary
    directory beside `out_dir` and renamed into place, so `out_dir` either does not exist or is
    complete. Progress goes to `progress` ("stderr": sys.stderr at call time; None: silent).
    `out_dir` must not exist or be an empty directory; if it is created meanwhile
    (a concurrent conversion), the rename raises OSError and nothing of ours is left behind.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    progress = progress_stream(progress)
    if weights not in ("copy", "link"):
        raise ValueError(f'weights must be "copy" or "link", got {weights!r}')
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype must be one of {list(_SAFETENSORS_DTYPES)}, got {dtype}")
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf_path} does not exist")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"output directory {out_dir} already exists and is not empty")
    start = time.monotonic()
    plans, config, (tokenizer, tokenizer_config, generation_config) = _read_checked(
        gguf_path, dtype if weights == "copy" else None
    )
    if progress is not None:
        print(f"muxworker: converting {len(plans)} tensors of {gguf_path.name}", file=progress, flush=True)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the model directory is an ordinary one
        if weights == "copy":
            _write_safetensors(tmp / "model.safetensors", plans, dtype, progress)
        else:
            GGUFTensorIndex.write(tmp, [p.entry() for p in plans], gguf_path)
            os.symlink(gguf_path.resolve(), tmp / GGUF_LINK)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        _write_json(tmp / "generation_config.json", generation_config)
        # config.json last: its presence marks a complete directory.
        _write_json(tmp / "config.json", config)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if progress is not None:
        print(f"muxworker: wrote {out_dir} in {time.monotonic() - start:.1f} s", file=progress, flush=True)
    return out_dir


_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m muxworker.worker.models.convert",
        description="Convert a llama GGUF file into a Hugging Face model directory.",
    )
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    parser.add_argument("out_dir", type=Path, help="the directory to create (must not exist or be empty)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="weight dtype (default float32)")
    args = parser.parse_args(argv)
    try:
        convert_gguf(args.gguf, args.out_dir, dtype=_DTYPES[args.dtype])
    except (InvalidModelError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
