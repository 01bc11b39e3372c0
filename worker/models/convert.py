"""GGUF -> Hugging Face directory conversion.

    python -m muxworker.worker.models.convert MODEL.gguf OUT_DIR [--dtype float32|bfloat16|float16]

Reads the file with the gguf package (memory-mapped), undoes llama.cpp's rotary row permutation of
attn_q/attn_k, and writes config.json, tokenizer.json, tokenizer_config.json and
generation_config.json, plus the weights in one of two ways:

- ``weights="copy"`` (the command line): model.safetensors with every tensor dequantized by
  `gguf.quants.dequantize` (Q4_1, Q8_0, K-quants, F16, BF16, ...), a directory transformers can
  load. float32 by default: dequantized values are exact in float32, so a float32 model reproduces
  the GGUF exactly. `--dtype bfloat16` halves it at the cost of rounding.
- ``weights="link"`` (what `resolve_model` caches): no copy at all. The directory links the GGUF
  as model.gguf and records where each tensor lies in it (gguf_tensors.json, see gguf_tensors.py);
  the worker reads quantized tensors straight from the memory-mapped file, keeping their blocks
  for the native decode step or dequantizing them at load (--weights quantized|float).

Supported: general.architecture "llama" with a byte-level BPE vocabulary (tokenizer.ggml.model
"gpt2"). Anything else is refused with `UnsupportedGGUFError` rather than converted approximately.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal, TextIO

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from muxworker.worker.models.base import CONVERTER_VERSION, InvalidModelError, ModelNotFoundError, progress_stream
from muxworker.worker.models.gguf_tensors import (
    BLOCK_TENSORS,
    GGUF_LINK,
    GGUFTensorError,
    GGUFTensorIndex,
    TensorEntry,
    dequantize_tensor,
    hf_tensor_name,
)

__all__ = ["CONVERTER_VERSION", "UnsupportedGGUFError", "convert_gguf", "main", "read_gguf_metadata"]


class UnsupportedGGUFError(InvalidModelError):
    """The GGUF file uses an architecture, tensor or tokenizer the converter does not handle."""


# --------------------------------------------------------------------------------------------
# Metadata


def read_gguf_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every key-value field as plain Python values (str, int, float, bool, list)."""
    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):  # version, tensor_count, kv_count: file structure, not metadata
            continue
        try:
            metadata[name] = field.contents()
        except UnicodeDecodeError as e:
            raise InvalidModelError(f"GGUF metadata field {name!r} holds invalid UTF-8: {e}") from e
    return metadata


def _require(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise UnsupportedGGUFError(f"GGUF metadata lacks {key!r}")
    return metadata[key]


# --------------------------------------------------------------------------------------------
# Tensors


@dataclass(frozen=True)
class _TensorPlan:
    hf_name: str
    source: Any  # gguf.ReaderTensor
    shape: tuple[int, ...]  # numpy/torch order (reversed GGML ne)
    rotary_heads: int | None  # set for attn_q/attn_k: heads to unpermute over

    def entry(self) -> TensorEntry:
        """Where this tensor lies in the GGUF file, for the tensor index of a linked directory."""
        t = self.source
        return TensorEntry(
            self.hf_name, t.name, t.tensor_type.name, self.shape, int(t.data_offset), int(t.n_bytes), self.rotary_heads
        )


def _plan_tensors(reader: gguf.GGUFReader, n_head: int, n_kv_head: int, n_layer: int) -> list[_TensorPlan]:
    plans: list[_TensorPlan] = []
    for t in reader.tensors:
        heads = None
        if ".attn_q." in t.name:
            heads = n_head
        elif ".attn_k." in t.name:
            heads = n_kv_head
        # GGML lists ne0 (the contiguous dimension) first; numpy and torch list it last.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            name = hf_tensor_name(t.name)
        except GGUFTensorError as e:
            raise UnsupportedGGUFError(str(e)) from None
        plans.append(_TensorPlan(name, t, shape, heads))
    names = {p.hf_name for p in plans}
    if len(names) != len(plans):
        raise InvalidModelError("GGUF file holds the same tensor twice")
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{hf}.weight" for i in range(n_layer) for hf in BLOCK_TENSORS.values()
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
        return dequantize_tensor(t.data, t.tensor_type.name, plan.shape, plan.rotary_heads)
    except GGUFTensorError as e:
        raise UnsupportedGGUFError(str(e)) from None


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


def _model_config(metadata: dict[str, Any], plans: list[_TensorPlan], dtype: torch.dtype | None) -> dict[str, Any]:
    def key(name: str) -> str:
        return f"llama.{name}"

    n_head = int(_require(metadata, key("attention.head_count")))
    hidden = int(_require(metadata, key("embedding_length")))
    head_dim = int(metadata.get(key("attention.key_length"), hidden // n_head))
    rope_dim = metadata.get(key("rope.dimension_count"))
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise UnsupportedGGUFError(f"partial rotary embeddings (rope.dimension_count={rope_dim}, head_dim={head_dim})")
    shapes = {p.hf_name: p.shape for p in plans}
    vocab_size = shapes["model.embed_tokens.weight"][0]
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(_require(metadata, key("feed_forward_length"))),
        "num_hidden_layers": int(_require(metadata, key("block_count"))),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(metadata.get(key("attention.head_count_kv"), n_head)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(_require(metadata, key("attention.layer_norm_rms_epsilon"))),
        "rope_theta": float(metadata.get(key("rope.freq_base"), 10000.0)),
        "max_position_embeddings": int(_require(metadata, key("context_length"))),
        "tie_word_embeddings": "lm_head.weight" not in shapes,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in shapes,
        "mlp_bias": False,
    }
    if dtype is not None:  # a linked directory's weights keep the GGUF's types
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    scaling = metadata.get(key("rope.scaling.type"), "none")
    if scaling == "linear":
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(_require(metadata, key("rope.scaling.factor"))),
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
# Tokenizer


_GPT2_SPLIT = "gpt2"
_DIGITS_THEN_GPT2 = "digits"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> how llama.cpp splits text before BPE (llama-vocab.cpp). "digits" is the
# starcoder family (SmolLM included): each digit alone, then the GPT-2 pattern -- what the
# original SmolLM2 tokenizer.json does with Digits(individual_digits=True) + ByteLevel.
_PRE_TOKENIZERS = {
    "gpt2": _GPT2_SPLIT,
    "mpt": _GPT2_SPLIT,
    "olmo": _GPT2_SPLIT,
    "jais": _GPT2_SPLIT,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2,
    "exaone": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3_REGEX,
    "llama3": _LLAMA3_REGEX,
    "llama-v3": _LLAMA3_REGEX,
    "smaug-bpe": _LLAMA3_REGEX,
    "dbrx": _LLAMA3_REGEX,
}

# Token texts llama.cpp treats as end of generation when present (llama-vocab.cpp, special_eog_ids),
# besides the eos/eot/eom ids. SmolLM2's <|im_end|> (eos) and <|endoftext|> come from here.
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<|end_of_text|>")

_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    split = _PRE_TOKENIZERS.get(pre)
    if split is None:
        raise UnsupportedGGUFError(
            f"tokenizer.ggml.pre={pre!r} is not supported; supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split in (_GPT2_SPLIT, _DIGITS_THEN_GPT2))
    if split == _GPT2_SPLIT:
        return byte_level
    if split == _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])


def _build_tokenizer(metadata: dict[str, Any]) -> tuple[BackendTokenizer, dict[str, Any], dict[str, Any]]:
    """(tokenizer.json, tokenizer_config.json, generation_config.json) from the GGUF vocabulary."""
    kind = _require(metadata, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedGGUFError(f"tokenizer.ggml.model={kind!r}; only byte-level BPE ('gpt2') is supported")
    tokens: list[str] = list(_require(metadata, "tokenizer.ggml.tokens"))
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges: list[str] = list(_require(metadata, "tokenizer.ggml.merges"))
    if len(types) != len(tokens):
        raise InvalidModelError(f"{len(tokens)} tokens but {len(types)} token types")

    # Byte-level vocabularies spell every byte with one printable character. A normal token that
    # uses any other character was written as raw text; respell it so BPE can reach it.
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spelling = dict(zip(range(256), _byte_spelling()))
    vocab: dict[str, int] = {}
    for index, (token, token_type) in enumerate(zip(tokens, types)):
        if token_type not in (_CONTROL, _USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        if vocab.setdefault(token, index) != index:
            raise InvalidModelError(f"token {token!r} appears twice in the vocabulary (ids {vocab[token]} and {index})")
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise InvalidModelError(f"malformed merge {merge!r}: expected two tokens separated by one space")
        pairs.append((parts[0], parts[1]))

    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "gpt2")))
    backend.decoder = decoders.ByteLevel()
    # Control tokens are matched whole in text and are special (skippable on decode); user-defined
    # ones (like <think>) are matched whole but are ordinary text.
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    )

    def token_text(key: str) -> tuple[int | None, str | None]:
        index = metadata.get(f"tokenizer.ggml.{key}")
        if index is None or not 0 <= int(index) < len(tokens):
            return None, None
        return int(index), tokens[int(index)]

    bos_id, bos = token_text("bos_token_id")
    eos_id, eos = token_text("eos_token_id")
    _, unk = token_text("unknown_token_id")
    pad_id, pad = token_text("padding_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    specials = []
    if add_bos and bos_id is not None:
        specials.append((bos, bos_id))
    if add_eos and eos_id is not None and (eos, eos_id) not in specials:
        specials.append((eos, eos_id))

    def sequence(name: str, type_id: int) -> str:
        parts = [f"${name}:{type_id}"]
        if add_bos and bos_id is not None:
            parts.insert(0, f"{bos}:{type_id}")
        if add_eos and eos_id is not None:
            parts.append(f"{eos}:{type_id}")
        return " ".join(parts)

    backend.post_processor = processors.TemplateProcessing(
        single=sequence("A", 0), pair=f"{sequence('A', 0)} {sequence('B', 1)}", special_tokens=specials
    )

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "clean_up_tokenization_spaces": False,
    }
    if (context := metadata.get("llama.context_length")) is not None:
        tokenizer_config["model_max_length"] = int(context)
    if (chat_template := metadata.get("tokenizer.chat_template")) is not None:
        tokenizer_config["chat_template"] = chat_template

    eog: list[int] = [eos_id] if eos_id is not None else []
    for key in ("eot_token_id", "eom_token_id"):
        if (eog_id := token_text(key)[0]) is not None:
            eog.append(eog_id)
    eog += [vocab[t] for t in _EOG_TEXTS if t in vocab]
    eog = list(dict.fromkeys(eog))
    generation_config: dict[str, Any] = {"bos_token_id": bos_id, "eos_token_id": eog[0] if len(eog) == 1 else eog}
    if pad_id is not None:
        generation_config["pad_token_id"] = pad_id
    return backend, tokenizer_config, {k: v for k, v in generation_config.items() if v is not None and v != []}


def _byte_spelling() -> list[str]:
    """GPT-2's printable spelling of bytes 0..255, in byte order (what ByteLevel.alphabet() holds,
    unordered)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


# --------------------------------------------------------------------------------------------
# Driver


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
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (ValueError, OSError) as e:
        raise InvalidModelError(f"{gguf_path} is not a readable GGUF file: {e}") from e
    if reader.byte_order != "I":
        raise UnsupportedGGUFError(f"{gguf_path} is a byte-swapped (big-endian) GGUF")
    metadata = read_gguf_metadata(reader)
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise UnsupportedGGUFError(f"general.architecture={arch!r}; only 'llama' is supported")

    n_head = int(_require(metadata, "llama.attention.head_count"))
    n_kv_head = int(metadata.get("llama.attention.head_count_kv", n_head))
    n_layer = int(_require(metadata, "llama.block_count"))
    plans = _plan_tensors(reader, n_head, n_kv_head, n_layer)
    config = _model_config(metadata, plans, dtype if weights == "copy" else None)
    tokenizer, tokenizer_config, generation_config = _build_tokenizer(metadata)
    if (n_tokens := tokenizer.get_vocab_size(with_added_tokens=True)) > config["vocab_size"]:
        raise InvalidModelError(f"{n_tokens} tokens but the embedding has only {config['vocab_size']} rows")
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
