"""Test helpers shared by test_convert, test_tokenizer and test_loader: a tiny llama GGUF written
with gguf.GGUFWriter from known Hugging Face tensors, and the converted bundled SmolLM2.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from muxworker.worker.models.gguf_tensors import unpermute_rotary_rows
from muxworker.worker.models.loader import resolve_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>"]
# Merges chosen so that pre-tokenizers disagree visibly: "Ġ1" joins a space to a digit (GPT-2
# splitting allows it, Llama 3's and SmolLM's do not) and "12" joins two digits (SmolLM's does not).
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "in g", "Ġ 1", "1 2", "Ġ Ġ"]
TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of bytes 0..255, written out independently of the converter."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int]]:
    merged = [a + b for a, b in (m.split(" ") for m in MERGES)]
    tokens = SPECIALS + byte_alphabet() + merged + USER_DEFINED
    types = [3] * len(SPECIALS) + [1] * (256 + len(merged)) + [4] * len(USER_DEFINED)
    return tokens, types


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The q/k row permutation llama.cpp's convert_hf_to_gguf.py applies (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    pre: str = "gpt2",
    n_layer: int = 2,
    hidden: int = 64,
    n_head: int = 4,
    n_kv_head: int = 2,
    ffn: int = 96,
    vocab_rows: int = 288,
    tied: bool = False,
    quantize_down: bool = True,
    extra_tensor: str | None = None,
    claimed_ffn: int | None = None,
    add_bos: bool = False,
    seed: int = 0,
    linear_type: str | None = None,
) -> dict[str, torch.Tensor]:
    """Write a random llama GGUF the way llama.cpp would; return the Hugging Face tensors it encodes.

    `claimed_ffn` writes a feed_forward_length that disagrees with the tensors. Most tensors are F32; attn_norm is F16 and (with quantize_down) ffn_down is Q8_0, so the
    returned tensors hold exactly the values the file can represent.

    `linear_type` (a GGML type name: "Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", ...) writes all seven
    linear weights of every block in that type (quantized by the gguf package; Q4_K, which it cannot
    quantize, and Q5_K and Q6_K, as random valid blocks; K-quants need input sizes that are multiples of 256), and
    returns their dequantized values: the gguf package's dequantizer is the oracle.
    """
    rng = np.random.default_rng(seed)
    head_dim = hidden // n_head
    tokens, types = tiny_vocab()
    assert vocab_rows >= len(tokens)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * 0.05

    hf: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rand(vocab_rows, hidden),
        "model.norm.weight": 1 + rand(hidden),
    }
    if not tied:
        hf["lm_head.weight"] = rand(vocab_rows, hidden)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(claimed_ffn if claimed_ffn is not None else ffn)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(50000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab_rows)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(TINY_TEMPLATE)

    w.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    if not tied:
        w.add_tensor("output.weight", hf["lm_head.weight"])
    for i in range(n_layer):
        p = f"model.layers.{i}."
        q, k = rand(n_head * head_dim, hidden), rand(n_kv_head * head_dim, hidden)
        v, o = rand(n_kv_head * head_dim, hidden), rand(hidden, n_head * head_dim)
        gate, up, down = rand(ffn, hidden), rand(ffn, hidden), rand(hidden, ffn)
        attn_norm = (1 + rand(hidden)).astype(np.float16)
        ffn_norm = 1 + rand(hidden)
        if linear_type is not None:
            qq = _add_quantized(w, f"blk.{i}.attn_q.weight", llama_cpp_permute(q, n_head), linear_type, rng)
            kk = _add_quantized(w, f"blk.{i}.attn_k.weight", llama_cpp_permute(k, n_kv_head), linear_type, rng)
            q, k = unpermute_rotary_rows(qq, n_head), unpermute_rotary_rows(kk, n_kv_head)
            v = _add_quantized(w, f"blk.{i}.attn_v.weight", v, linear_type, rng)
            o = _add_quantized(w, f"blk.{i}.attn_output.weight", o, linear_type, rng)
            gate = _add_quantized(w, f"blk.{i}.ffn_gate.weight", gate, linear_type, rng)
            up = _add_quantized(w, f"blk.{i}.ffn_up.weight", up, linear_type, rng)
            down = _add_quantized(w, f"blk.{i}.ffn_down.weight", down, linear_type, rng)
        else:
            w.add_tensor(f"blk.{i}.attn_q.weight", llama_cpp_permute(q, n_head))
            w.add_tensor(f"blk.{i}.attn_k.weight", llama_cpp_permute(k, n_kv_head))
            w.add_tensor(f"blk.{i}.attn_v.weight", v)
            w.add_tensor(f"blk.{i}.attn_output.weight", o)
            w.add_tensor(f"blk.{i}.ffn_gate.weight", gate)
            w.add_tensor(f"blk.{i}.ffn_up.weight", up)
        if linear_type is not None:
            pass
        elif quantize_down:
            packed = gguf.quants.quantize(down, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(f"blk.{i}.ffn_down.weight", packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            # What the file holds: the oracle is the gguf package's own dequantizer.
            down = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(f"blk.{i}.ffn_down.weight", down)
        w.add_tensor(f"blk.{i}.attn_norm.weight", attn_norm)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ffn_norm)
        hf |= {
            p + "self_attn.q_proj.weight": q,
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": o,
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": down,
            p + "input_layernorm.weight": attn_norm.astype(np.float32),
            p + "post_attention_layernorm.weight": ffn_norm,
        }
    if extra_tensor is not None:
        w.add_tensor(extra_tensor, rand(head_dim // 2))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {name: torch.from_numpy(np.array(value)) for name, value in hf.items()}


# K-quant type -> (block bytes, [(byte offset of an f16 scale, its magnitude)]).
K_BLOCKS = {
    "Q4_K": (144, [(0, 0.01), (2, 0.01)]),  # d, dmin, 12 bytes of 6-bit scales/mins, 128 of codes
    "Q5_K": (176, [(0, 0.005), (2, 0.005)]),  # d, dmin, scales, 32 bytes of high bits, 128 of codes
    "Q6_K": (210, [(208, 2e-5)]),  # 128 + 64 bytes of codes, 16 int8 scales, d
}


def _add_quantized(w: gguf.GGUFWriter, name: str, values: np.ndarray, type_name: str, rng) -> np.ndarray:
    """Write ``values`` [rows, cols] as ``type_name``; return what the file holds, dequantized."""
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in K_BLOCKS:
        # The gguf package cannot quantize K-quants: random valid blocks of 256 values, their f16
        # scales set so that the weights stay about as small as the float ones.
        size, fields = K_BLOCKS[type_name]
        rows, cols = values.shape
        n = rows * cols // 256
        blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
        for offset, scale in fields:
            blocks[:, offset : offset + 2] = (
                (rng.random(n) * scale + scale / 100).astype(np.float16).view(np.uint8).reshape(n, 2)
            )
        packed = blocks.reshape(rows, cols // 256 * size)
    else:
        packed = gguf.quants.quantize(values, qtype)
    w.add_tensor(name, packed, raw_dtype=qtype)
    return gguf.quants.dequantize(packed, qtype).reshape(values.shape)


def converted_smollm(base: Path) -> Path:
    """The bundled SmolLM2 converted into a cache under `base`. Every test module passes the
    session's base temp dir, so the conversion runs once per session and later calls hit the cache."""
    return resolve_model(None, progress=None, cache_dir=base / "muxworker-cache")


def exported_smollm(base: Path) -> Path:
    """The bundled SmolLM2 exported as a full float32 Hugging Face directory (model.safetensors),
    which transformers can load: the oracle's view of our conversion. Once per session."""
    from muxworker.worker.models.convert import convert_gguf
    from muxworker.worker.models.loader import bundled_gguf_path

    out = base / "smollm-export"
    if not (out / "config.json").is_file():
        convert_gguf(bundled_gguf_path(), out, progress=None, weights="copy")
    return out


# Hugging Face module -> llama.cpp tensor name, as convert_hf_to_gguf.py writes them.
_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_GEMMA_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_from_hf(model_dir: Path, path: Path, arch: str, *, linear_type: str | None = None) -> Path:
    """Write a tiny Hugging Face model directory as a GGUF the way llama.cpp's convert_hf_to_gguf.py
    would for ``arch`` ("llama", "qwen3", "gemma3"): its tensor names, the q/k row permutation of
    llama, Gemma's norms stored as (1 + weight), a Llama 3 rope_scaling as a rope_freqs tensor.
    ``linear_type`` quantizes the 2-D layer weights (the model directory is left as it is)."""
    import json
    import math

    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    sd = load_file(model_dir / "model.safetensors")
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    base = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    w.add_rope_freq_base(base)
    if arch == "gemma3":
        w.add_sliding_window(config["sliding_window"])
    tokens, types = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TINY_TEMPLATE)
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else None)
    if scaling is not None and scaling.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        factors = []
        for i in range(0, head_dim, 2):
            wavelen = 2 * math.pi * base ** (i / head_dim)
            if wavelen < old / high:
                factors.append(1.0)
            elif wavelen > old / low:
                factors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    names = {**_GGUF_NAMES, **(_GEMMA_NAMES if arch == "gemma3" else {})}
    for name, value in sd.items():
        value = value.astype(np.float32)
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", value)
            continue
        if name == "model.norm.weight":
            w.add_tensor("output_norm.weight", value + 1 if arch == "gemma3" else value)
            continue
        if name == "lm_head.weight":
            w.add_tensor("output.weight", value)
            continue
        _, _, layer, rest = name.split(".", 3)
        module, _, kind = rest.rpartition(".")
        if arch == "gemma3" and module.endswith("norm"):
            value = value + 1
        if arch == "llama" and module == "self_attn.q_proj":
            value = llama_cpp_permute(value, n_head)
        elif arch == "llama" and module == "self_attn.k_proj":
            value = llama_cpp_permute(value, n_kv)
        gguf_name = f"blk.{layer}.{names[module]}.{kind}"
        if linear_type is not None and value.ndim == 2:
            packed = gguf.quants.quantize(value, gguf.GGMLQuantizationType[linear_type])
            w.add_tensor(gguf_name, packed, raw_dtype=gguf.GGMLQuantizationType[linear_type])
        else:
            w.add_tensor(gguf_name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_VOCAB_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def without_vocabulary(src: Path, dst: Path) -> Path:
    """A copy of the GGUF ``src`` with the same tensors (byte for byte) and metadata, less its
    vocabulary arrays (the vocabulary's size written as ``{arch}.vocab_size`` instead): what a
    reference needs to load the model. transformers spends 30 of its 40 s loading Gemma 3 270M
    parsing the 262k-entry vocabulary arrays, twice, with gguf.GGUFReader."""
    from muxworker.worker.models.gguf_file import GGUFFile

    if dst.is_file():
        return dst
    source = GGUFFile(src)
    arch = source.metadata["general.architecture"]
    w = gguf.GGUFWriter(str(dst), arch)
    vocab = f"{arch}.vocab_size"
    for key, value in source.metadata.items():
        if key in _VOCAB_ARRAYS or key in ("general.architecture", vocab):
            continue
        w.add_key_value(key, value, *_gguf_type(value))
    w.add_key_value(vocab, len(source.metadata["tokenizer.ggml.tokens"]), gguf.GGUFValueType.UINT32)
    for t in source.tensors:
        data = source.data(t)
        if t.type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(t.name, data.view(np.float32 if t.type == gguf.GGMLQuantizationType.F32 else np.float16))
        else:
            w.add_tensor(t.name, data.reshape(t.shape[0] if len(t.shape) > 1 else 1, -1), raw_dtype=t.type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _gguf_type(value) -> tuple:
    """(GGUF value type, array item type) of a metadata value as GGUFFile reads it."""
    kinds = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32}
    if isinstance(value, str):
        return (gguf.GGUFValueType.STRING,)
    if isinstance(value, list):
        item = value[0] if value else ""
        return gguf.GGUFValueType.ARRAY, (gguf.GGUFValueType.STRING if isinstance(item, str) else kinds[type(item)])
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        return (gguf.GGUFValueType.INT32,)
    return (kinds[type(value)],)
