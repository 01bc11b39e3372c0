"""The tensors of a GGUF file, read in place: numpy and gguf only, no torch.

A converted GGUF model directory does not copy the weights. Conversion (convert.py) records where
each tensor lies in the GGUF file in ``gguf_tensors.json`` (name, quantization type, shape, byte
offset) and links the file as ``model.gguf``; loading memory-maps that file and reads each tensor
from its bytes (parsing the GGUF header with ``gguf.GGUFReader`` takes seconds for a 49k-token
vocabulary, the index takes milliseconds). Each tensor can be read two ways:

- ``dequantize``: float32 values, exactly the gguf package's own dequantization (the oracle), with
  llama.cpp's rotary row permutation of attn_q/attn_k undone;
- ``raw``: its bytes in place (a read-only view of the map): a quantized tensor's blocks, which the
  native decode step multiplies as they are (muxworker.worker.backends.torch.quant).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "GGUF_ARCHITECTURES",
    "GGUF_LINK",
    "TENSOR_INDEX",
    "GGUFTensorError",
    "GGUFTensorIndex",
    "TensorEntry",
    "block_tensors",
    "dequantize_tensor",
    "hf_tensor_name",
    "unpermute_rotary_rows",
]

TENSOR_INDEX = "gguf_tensors.json"  # written by conversion, read at every load
GGUF_LINK = "model.gguf"  # the converted directory's link to the source GGUF
INDEX_VERSION = 2  # 2: entries carry "add" (Gemma's norms)


class GGUFTensorError(ValueError):
    """A tensor index or GGUF file that does not hold what it claims."""


_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
#: general.architecture -> the Hugging Face architecture it converts to.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
#: Architectures whose attn_q/attn_k rows llama.cpp's converter permutes (LlamaModel.permute); the
#: others keep Hugging Face's rotate-half order (llama.cpp runs them with NEOX rope).
ROTARY_PERMUTED = ("llama",)

_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_ARCH_BLOCK_TENSORS = {
    "llama": _BLOCK_TENSORS,
    "qwen2": _BLOCK_TENSORS,
    "qwen3": {**_BLOCK_TENSORS, **_QK_NORMS},
    # Gemma 3's MLP has its own input norm; its post_attention_layernorm normalizes the attention's output.
    "gemma3": {
        **_BLOCK_TENSORS,
        **_QK_NORMS,
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
#: What reading a norm weight adds to the file's values, by architecture: llama.cpp stores Gemma's
#: (1 + weight) factors, Hugging Face the weight (transformers subtracts 1 the same way).
NORM_ADD = {"gemma3": -1.0}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def block_tensors(arch: str) -> dict[str, str]:
    """llama.cpp's per-layer tensor names -> Hugging Face module names, for ``arch``."""
    if arch not in _ARCH_BLOCK_TENSORS:
        raise GGUFTensorError(f"no tensor names are known for general.architecture={arch!r}")
    return _ARCH_BLOCK_TENSORS[arch]


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face parameter name of a llama.cpp tensor name (GGUFTensorError if unknown)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    names = block_tensors(arch)
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m[2] not in names:
        raise GGUFTensorError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart we know of")
    return f"model.layers.{m[1]}.{names[m[2]]}.{m[3]}"


def unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation.

    convert_hf_to_gguf.py reorders each head's rows from Hugging Face's rotate-half layout
    (first half of the head, then second half) to GGML's interleaved pairs:
        w.reshape(n_head, 2, D // 2, *rest).swapaxes(1, 2)
    Viewing the GGUF rows as (n_head, D // 2, 2) and swapping back restores the original order.
    Works for any array whose first axis is the rows: weights [n_head * D, in], biases, and the
    per-row codes and group scales of a quantized weight.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFTensorError(f"cannot split {rows} rows into {n_head} heads of rotary pairs")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in the GGUF file, under its Hugging Face name."""

    name: str  # Hugging Face name
    gguf_name: str
    type: str  # GGML type name: "Q4_1", "F32", ...
    shape: tuple[int, ...]  # numpy/torch order (reversed GGML ne)
    offset: int  # absolute byte offset in the file
    nbytes: int
    rotary_heads: int | None  # attn_q/attn_k: heads whose rotary row order is undone on read
    add: float = 0.0  # added to every value on read (NORM_ADD)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "gguf_name": self.gguf_name,
            "type": self.type,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
            "rotary_heads": self.rotary_heads,
            "add": self.add,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorEntry:
        try:
            return cls(
                str(d["name"]),
                str(d["gguf_name"]),
                str(d["type"]),
                tuple(int(x) for x in d["shape"]),
                int(d["offset"]),
                int(d["nbytes"]),
                None if d["rotary_heads"] is None else int(d["rotary_heads"]),
                float(d["add"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise GGUFTensorError(f"malformed tensor entry {d!r}: {e}") from None


def _block_size(type_name: str) -> tuple[int, int]:
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]


class GGUFTensorIndex:
    """The tensor index of a converted directory over its memory-mapped GGUF file."""

    def __init__(
        self, gguf_path: str | os.PathLike[str], entries: list[TensorEntry], stamp: tuple[int, int] | None = None
    ) -> None:
        """``stamp``: the (size, mtime_ns) the file had when it was indexed; a file rewritten since
        (same name, other bytes) is refused rather than read at the old offsets."""
        self.path = Path(gguf_path)
        self.entries = {e.name: e for e in entries}
        if len(self.entries) != len(entries):
            raise GGUFTensorError("the tensor index names the same tensor twice")
        st = self.path.stat()
        size = st.st_size
        if stamp is not None and stamp != (st.st_size, st.st_mtime_ns):
            raise GGUFTensorError(
                f"{self.path} changed since conversion (size and mtime differ from the index); "
                "resolve the model again to convert the new file"
            )
        for e in entries:
            if e.offset < 0 or e.offset + e.nbytes > size:
                raise GGUFTensorError(
                    f"tensor {e.gguf_name} lies at bytes [{e.offset}, {e.offset + e.nbytes}) of {self.path}, "
                    f"which has {size}: the file changed since conversion"
                )
        # Read-only, shared: pages are read on first touch and shared with other processes.
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if entries else None

    # ---- persistence (written by conversion)

    @staticmethod
    def write(directory: Path, entries: list[TensorEntry], gguf_path: Path) -> None:
        st = gguf_path.stat()
        doc = {
            "version": INDEX_VERSION,
            "gguf_size": st.st_size,
            "gguf_mtime_ns": st.st_mtime_ns,
            "tensors": [e.to_json() for e in entries],
        }
        (directory / TENSOR_INDEX).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> GGUFTensorIndex:
        directory = Path(directory)
        try:
            doc = json.loads((directory / TENSOR_INDEX).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise GGUFTensorError(f"{directory / TENSOR_INDEX} cannot be read: {e}") from None
        if (
            not isinstance(doc, dict)
            or doc.get("version") != INDEX_VERSION
            or not isinstance(doc.get("tensors"), list)
            or not isinstance(doc.get("gguf_size"), int)
            or not isinstance(doc.get("gguf_mtime_ns"), int)
        ):
            raise GGUFTensorError(f"{directory / TENSOR_INDEX} is not a version {INDEX_VERSION} tensor index")
        link = directory / GGUF_LINK
        if not link.is_file():
            raise GGUFTensorError(f"{link} does not point at the GGUF file it was converted from")
        entries = [TensorEntry.from_json(t) for t in doc["tensors"]]
        return cls(link.resolve(), entries, (doc["gguf_size"], doc["gguf_mtime_ns"]))

    # ---- reading

    def names(self) -> list[str]:
        return list(self.entries)

    def type_of(self, name: str) -> str:
        return self.entries[name].type

    def _bytes(self, e: TensorEntry) -> np.ndarray:
        assert self._map is not None
        return self._map[e.offset : e.offset + e.nbytes]

    def _blocks(self, e: TensorEntry) -> np.ndarray:
        """[N * K / block_values, block_bytes] uint8 blocks of a quantized 2-D tensor."""
        values, nbytes = _block_size(e.type)
        rows, cols = e.shape if len(e.shape) == 2 else (1, e.shape[0])
        if cols % values or e.nbytes != rows * cols // values * nbytes:
            raise GGUFTensorError(
                f"tensor {e.gguf_name} of type {e.type} and shape {list(e.shape)} has {e.nbytes} bytes"
            )
        return self._bytes(e).reshape(-1, nbytes)

    def dequantize(self, name: str) -> np.ndarray:
        """float32 values of ``name`` (the gguf package's dequantization), rotary rows restored; a
        new writable array."""
        e = self.entries[name]
        values = dequantize_tensor(self._bytes(e), e.type, e.shape, e.rotary_heads)
        # A fresh, writable array: F32 tensors would otherwise be read-only views of the map.
        if not (values.dtype == np.float32 and values.flags.writeable):
            values = np.array(values, dtype=np.float32)
        if e.add:
            values += np.float32(e.add)
        return values

    def raw(self, name: str) -> np.ndarray:
        """The bytes of ``name`` in the file (uint8, a read-only view of the map): a quantized
        tensor's blocks, rows in the file's order (attn_q/attn_k rows still permuted)."""
        e = self.entries[name]
        if e.type not in ("F32", "F16", "BF16"):
            self._blocks(e)  # checks that the bytes are whole blocks
        return self._bytes(e)


def dequantize_tensor(raw: np.ndarray, type_name: str, shape: tuple[int, ...], rotary_heads: int | None) -> np.ndarray:
    """float32 values of one GGUF tensor's bytes: the gguf package's dequantization (F32 as a view),
    reshaped to ``shape``, with llama.cpp's rotary row order undone when ``rotary_heads`` is set."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if qtype == gguf.GGMLQuantizationType.F32:
        values = np.asarray(raw).view(np.float32).reshape(shape)
    else:
        values = gguf.quants.dequantize(raw, qtype).reshape(shape)
    if rotary_heads is not None:
        values = unpermute_rotary_rows(values, rotary_heads)
    return values
