"""Weight-only quantized linear layers on torch's CPU kernels.

``Int4Linear`` keeps a weight as 4-bit codes with a scale and a zero per group of 32 input values,

    W[n, k] = (codes[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32],

packed for ``torch.ops.aten._weight_int4pack_mm_for_cpu``. The kernel always runs in bfloat16
(``KERNEL_DTYPE``): its float32 variant is a scalar path, measured 27x slower (1.55 ms against
56 us on a 3072x576 layer, casts included). Scales and zeros are rounded to bfloat16 once at load,
and with ``--dtype float32`` a quantized layer's input is rounded to bfloat16 and its output cast
back; everything else stays float32. ``--weights float`` is the exact path. GGUF Q4_0, Q4_1
and Q4_K map onto this form exactly (muxworker.worker.models.gguf_tensors); a float weight is
quantized to it with per-group min/max (``quantize_int4``, for --quantize int4).

``Int8Linear`` keeps int8 codes with one scale per output row (``_weight_int8pack_mm``'s form),
``W[n, k] = codes[n, k] * scale[n]``, for --quantize int8 and a quantized GGUF's output layer; it
also runs in bfloat16 (its float32 variant measured 4.4x slower on the 49,152-row head).

Both are CPU kernels; on another device the weight is dequantized to a dense ``nn.Linear`` at load
(``dequantize``), so a quantized model still runs there, at float speed and size.

The int4 kernel reads 4-bit weights, which makes a decode step fast, but it does no work sharing
across rows: measured on SmolLM2's shapes it is 2x faster than a dense bfloat16 matmul at 1-2
rows, even at 8, and 2.3-2.5x slower at 64-512. So an ``Int4Linear`` also holds the dequantized
weight (``dense``), and a forward pass that prefills at least ``DENSE_ROWS`` prompt rows runs
every layer dense (``dense_route``). Decode-only steps, whatever their batch size, always take the
int4 kernel, so a session's decode tokens do not depend on how many others decoded with it. The
dense copy lives in the prepared-weights file (prepared.py), memory-mapped: its pages are read
on the first prefill, are the page cache's to reclaim, and are shared by workers of one model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP = 32  # the GGUF block size; also the kernel's group size here
KERNEL_DTYPE = torch.bfloat16  # the int4 kernel's activations, scales and zeros (see above)
DENSE_ROWS = 8  # prompt rows in a forward from which Int4Linear runs its dense copy (measured crossover)


class _Route:
    dense = False


_ROUTE = _Route()  # the engine thread's current forward pass


@contextmanager
def dense_route(dense: bool) -> Iterator[None]:
    """Within the block, ``Int4Linear`` layers multiply by their dense copy (a prefill pass)."""
    before = _ROUTE.dense
    _ROUTE.dense = dense
    try:
        yield
    finally:
        _ROUTE.dense = before


@dataclass(frozen=True)
class Int4Weight:
    """A weight in the int4 form above, as CPU tensors: codes uint8 [N, K] (0..15), scales and
    zeros float32 [N, K // 32]."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    @classmethod
    def from_numpy(cls, codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> Int4Weight:
        return cls(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(scales), torch.from_numpy(zeros))

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.codes.shape
        return int(n), int(k)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        s = self.scales.repeat_interleave(INT4_GROUP, dim=1)
        z = self.zeros.repeat_interleave(INT4_GROUP, dim=1)
        return (self.codes.float() - 8) * s + z

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Stack weights along the output rows (fused projections)."""
        return Int4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "zeros")))


@dataclass(frozen=True)
class Int8Weight:
    """codes int8 [N, K], scales float32 [N]: ``W[n, k] = codes[n, k] * scales[n]``."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.codes.shape
        return int(n), int(k)

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales[:, None]

    @staticmethod
    def cat(parts: list[Int8Weight]) -> Int8Weight:
        return Int8Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))


QuantWeight = Int4Weight | Int8Weight
_L = TypeVar("_L", bound=nn.Module)
Weight = torch.Tensor | QuantWeight  # what build_model takes per Hugging Face name


def quantize_int4(w: torch.Tensor) -> Int4Weight:
    """Asymmetric 4-bit per group of 32 (min/max): what Q4_1 does, from a float weight [N, K]."""
    n, k = w.shape
    if k % INT4_GROUP:
        raise ValueError(f"int4 needs the input size to be a multiple of {INT4_GROUP}, got {k}")
    g = w.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return Int4Weight(codes, scale, lo + 8 * scale)


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric 8-bit per output row (absmax)."""
    wf = w.float()
    scale = wf.abs().amax(1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(codes, scale)


class Int4Linear(nn.Module):
    """``y = x W^T + b`` through the int4 CPU kernel (x of any leading shape, in ``dtype``)."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if self.in_features % INT4_GROUP:
            raise ValueError(f"int4 weight of shape {weight.shape}: input size must be a multiple of {INT4_GROUP}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
        # [K // 32, N, 2]: per group, per output row, (scale, zero).
        sz = torch.stack([weight.scales.t(), weight.zeros.t()], dim=-1).to(KERNEL_DTYPE).contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", sz)
        self.register_buffer("dense", weight.dequantize().to(dtype))  # for prefill (see the module docstring)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    @classmethod
    def shell(cls, out_features: int, in_features: int, has_bias: bool, dtype: torch.dtype) -> Int4Linear:
        """An Int4Linear with meta tensors of the right shapes, for ``load_state_dict(assign=True)``
        of already packed tensors (the prepared-weights cache)."""
        self = _shell(cls, out_features, in_features, has_bias, dtype)
        meta = torch.device("meta")
        self.register_buffer("packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=meta))
        self.register_buffer(
            "scales_zeros", torch.empty(in_features // INT4_GROUP, out_features, 2, dtype=KERNEL_DTYPE, device=meta)
        )
        self.register_buffer("dense", torch.empty(out_features, in_features, dtype=dtype, device=meta))
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _ROUTE.dense:
            return F.linear(x, self.get_buffer("dense"), self.bias)
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, self.in_features).to(KERNEL_DTYPE), self.packed, INT4_GROUP, self.scales_zeros
        ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {INT4_GROUP}"


class Int8Linear(nn.Module):
    """``y = x W^T + b`` through the int8 weight-only CPU kernel (one scale per output row)."""

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("codes", weight.codes.contiguous())
        self.register_buffer("scales", weight.scales.to(KERNEL_DTYPE))  # bfloat16, as for int4 (4x faster)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    @classmethod
    def shell(cls, out_features: int, in_features: int, has_bias: bool, dtype: torch.dtype) -> Int8Linear:
        """An Int8Linear with meta tensors of the right shapes (see ``Int4Linear.shell``)."""
        self = _shell(cls, out_features, in_features, has_bias, dtype)
        meta = torch.device("meta")
        self.register_buffer("codes", torch.empty(out_features, in_features, dtype=torch.int8, device=meta))
        self.register_buffer("scales", torch.empty(out_features, dtype=KERNEL_DTYPE, device=meta))
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, self.in_features).to(KERNEL_DTYPE), self.codes, self.scales
        ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row"


def _shell(cls: type[_L], out_features: int, in_features: int, has_bias: bool, dtype: torch.dtype) -> _L:
    """An instance of ``cls`` without running its __init__: sizes and a meta bias; the caller adds
    its meta buffers."""
    self: Any = cls.__new__(cls)
    nn.Module.__init__(self)
    self.out_features, self.in_features = out_features, in_features
    meta = torch.device("meta")
    self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=meta), False) if has_bias else None
    return self


def quantized_linear(
    weight: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """The module for a quantized weight on ``device``: the kernel on CPU, else a dense Linear."""
    if device.type != "cpu":
        dense = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=device, dtype=dtype)
        with torch.no_grad():
            dense.weight.copy_(weight.dequantize().to(dtype))
            if bias is not None:
                dense.bias.copy_(bias.to(dtype))
        return dense.requires_grad_(False)
    if isinstance(weight, Int4Weight):
        return Int4Linear(weight, bias, dtype)
    return Int8Linear(weight, bias, dtype)
