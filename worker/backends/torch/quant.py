"""Quantized weights: GGUF blocks for the native decode step, dense copies for prefill.

A quantized linear weight is kept twice, each copy where it is fastest:

- its **GGUF blocks** (``QuantBlocks``), which the native decode step (native_step.py, over
  native/quant.c) multiplies in place with int8-quantized activations. For a GGUF model these are
  the file's own bytes, memory-mapped, never copied; ``--quantize int4|int8`` of a float model
  makes Q4_1 or Q8_0 blocks at load with the gguf package's quantizer;
- a **dense copy** in the model dtype (the model's ``nn.Linear`` weights): the dequantized blocks,
  which a prefill multiplies with torch's dense kernels (7-8x llama.cpp's prompt speed here,
  where a quantized kernel does no better than llama.cpp). For a GGUF model the copy lives in the
  prepared-weights file (prepared.py), memory-mapped: its pages are read on the first prefill, are
  the page cache's to reclaim, and are shared by workers of one model.

The q and k projections of a llama.cpp GGUF hold their rows in GGML's rotary order; their blocks
keep it and carry a ``row_map`` that sends each row's output to its Hugging Face row, so the dense
copy and the native step produce the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from muxworker.native import QUANT_TYPES, quant_row_bytes

#: --quantize mode -> the GGUF type a float model's linear weights are quantized to at load.
QUANTIZE_TYPES = {"int4": "Q4_1", "int8": "Q8_0"}


@dataclass(frozen=True)
class QuantBlocks:
    """One weight [rows, cols] as GGUF blocks: ``blocks`` uint8 [rows, row_bytes], rows in the
    file's order; ``row_map`` int32 [rows] gives each row's Hugging Face row (None: the same)."""

    blocks: np.ndarray
    type: str
    shape: tuple[int, int]
    row_map: np.ndarray | None = None

    def __post_init__(self) -> None:
        rows, cols = self.shape
        if self.type not in QUANT_TYPES:
            raise ValueError(f"no native product for GGUF type {self.type}")
        if self.blocks.dtype != np.uint8 or self.blocks.shape != (rows, quant_row_bytes(self.type, cols)):
            raise ValueError(f"{self.type} blocks of a [{rows}, {cols}] weight, got {self.blocks.shape}")

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols] in Hugging Face row order (the gguf package's dequantization)."""
        import gguf

        values = gguf.quants.dequantize(self.blocks, gguf.GGMLQuantizationType[self.type]).reshape(self.shape)
        if self.row_map is None:
            return values
        out = np.empty_like(values)
        out[self.row_map] = values
        return out


def rotary_row_map(rows: int, n_head: int) -> np.ndarray:
    """row_map of a llama.cpp attn_q/attn_k tensor: GGUF row g holds Hugging Face row map[g]."""
    from muxworker.worker.models.gguf_tensors import unpermute_rotary_rows

    hf_to_gguf = unpermute_rotary_rows(np.arange(rows, dtype=np.int32), n_head)  # HF row i = GGUF row [i]
    row_map = np.empty(rows, dtype=np.int32)
    row_map[hf_to_gguf] = np.arange(rows, dtype=np.int32)
    return row_map


def quantize_blocks(w: torch.Tensor, type_name: str) -> QuantBlocks:
    """A float weight [N, K] quantized to ``type_name`` blocks (Q4_0, Q4_1, Q5_0 or Q8_0: the types
    the gguf package quantizes) by the gguf package."""
    import gguf

    n, k = w.shape
    if k % 32:
        raise ValueError(f"quantizing needs the input size to be a multiple of 32, got {k}")
    blocks = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType[type_name])
    return QuantBlocks(np.ascontiguousarray(blocks), type_name, (int(n), int(k)))
