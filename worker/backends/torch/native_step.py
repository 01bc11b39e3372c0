"""The native decode step: short rows of a quantized model in one C call per pass (native/quant.c).

A forward pass's **short spans** (at most ``max_rows`` rows: every decode token, every speculative
verify chunk, a short prompt chunk such as the first suffix after a resume) run here; longer
prompt chunks run the torch model's dense path (executor.py splits the pass). For each row and
each layer, ``mux_forward`` computes RMSNorm, the q/k/v, output and gate/up/down products over the
GGUF blocks (int8-quantized activations, integer dot products), rotary embedding, the cache write
(bfloat16 or float32 rows in the executor's own KV tensors) and attention over the row's visible
cache rows, in float32, with no per-operation dispatch.

Row independence: every row is computed by the same code in the same order whatever else the
pass holds (products per row, attention per row and key/value head), so a session's greedy tokens
are the same decoded alone, batched with others, or verified as a speculative draft.

Owner: the engine thread (through the executor). The step reads the cache tensors through raw
pointers taken here once; the cache is allocated once and never reallocated.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from muxworker import native
from muxworker.native import _ffi, _lib
from muxworker.worker.backends.interface import SeqSpan
from muxworker.worker.backends.torch.cache import KVCache, RingLayerCache
from muxworker.worker.backends.torch.model import DecoderLayer, Transformer
from muxworker.worker.backends.torch.quant import QuantBlocks
from muxworker.worker.models.args import rope_inv_freq

#: Spans of at most this many rows take the native step (the C side's per-call row limit).
MAX_ROWS = native.MAX_ROWS

_LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
_HF = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def unsupported(model: Transformer, quantized: dict[str, QuantBlocks] | None, device: torch.device) -> str | None:
    """Why this model cannot take the native step, or None when it can."""
    args = model.args
    if quantized is None:
        return "its weights are not quantized, or not all in a type the native step multiplies"
    if device.type != "cpu":
        return f"it runs on {device.type}"
    if args.mlp_bias:
        return "its MLP has biases"
    if model.model.embed_tokens.weight.dtype not in (torch.float32, torch.bfloat16):
        return f"its dtype is {model.model.embed_tokens.weight.dtype}"
    names = [f"model.layers.{i}.{_HF[p]}.weight" for i in range(args.num_hidden_layers) for p in _LINEARS]
    missing = [n for n in (*names, "lm_head.weight") if n not in quantized]
    if missing:
        return f"{missing[0]} is not in a GGUF type the native step multiplies ({', '.join(native.QUANT_TYPES)})"
    return None


class NativeStep:
    """The short rows of a pass, over a model's GGUF blocks and the executor's KV cache."""

    def __init__(self, model: Transformer, quantized: dict[str, QuantBlocks], cache: KVCache, threads: int) -> None:
        args = model.args
        self.args = args
        self.vocab = int(args.vocab_size)
        self._embed = model.embed
        native.set_threads(threads)
        keep: list[object] = []  # everything the C structs point into

        def ptr(ctype: str, a: np.ndarray):
            keep.append(a)
            return _ffi.cast(ctype, a.__array_interface__["data"][0])

        def f32(t: torch.Tensor | None):
            if t is None:
                return _ffi.NULL
            return ptr("const float *", np.ascontiguousarray(t.detach().float().numpy(), dtype=np.float32))

        def weight(dst, q: QuantBlocks) -> None:
            keep.extend((q.blocks, q.row_map))
            native.fill_qweight(dst, q.blocks, q.type, q.row_map)

        h, kv, d = args.num_attention_heads, args.num_kv_heads, args.head_size
        # float32 rotary tables [positions, D/2] per rope kind (the torch path keeps them in the
        # model dtype).
        rope = {}
        for kind in set(args.rope_kinds):
            inv = np.asarray(rope_inv_freq(args, kind), dtype=np.float32)
            angles = np.outer(np.arange(cache.max_tokens, dtype=np.float32), inv)
            rope[kind] = (
                ptr("const float *", np.ascontiguousarray(np.cos(angles), dtype=np.float32)),
                ptr("const float *", np.ascontiguousarray(np.sin(angles), dtype=np.float32)),
            )
        layers = _ffi.new("mux_layer[]", args.num_hidden_layers)
        keep.append(layers)
        # Ring layers (sliding windows) hold capacity - window spare rows: a chunk of T rows may
        # overwrite the oldest rows its first row still needs unless T - 1 <= spare.
        max_rows = MAX_ROWS
        for i, layer in enumerate(model.model.layers):
            assert isinstance(layer, DecoderLayer)
            dst = layers[i]
            for p in _LINEARS:
                weight(getattr(dst, p), quantized[f"model.layers.{i}.{_HF[p]}.weight"])
            bias = layer.self_attn.qkv_proj.bias
            if isinstance(bias, torch.Tensor):
                bq, bk, bv = bias.split([h * d, kv * d, kv * d])
                dst.bias_q, dst.bias_k, dst.bias_v = f32(bq), f32(bk), f32(bv)
            else:
                dst.bias_q = dst.bias_k = dst.bias_v = _ffi.NULL
            dst.attn_norm = f32(layer.input_layernorm.weight)
            attn = layer.self_attn
            dst.q_norm = f32(attn.q_norm.weight if attn.q_norm is not None else None)
            dst.k_norm = f32(attn.k_norm.weight if attn.k_norm is not None else None)
            if layer.pre_feedforward_layernorm is not None and layer.post_feedforward_layernorm is not None:
                dst.post_attn_norm = f32(layer.post_attention_layernorm.weight)
                dst.ffn_norm = f32(layer.pre_feedforward_layernorm.weight)
                dst.post_ffn_norm = f32(layer.post_feedforward_layernorm.weight)
            else:
                dst.post_attn_norm = dst.post_ffn_norm = _ffi.NULL
                dst.ffn_norm = f32(layer.post_attention_layernorm.weight)
            dst.rope_cos, dst.rope_sin = rope[attn.rope_kind]
            lc = cache.layers[i]
            if lc.k.dtype not in (torch.float32, torch.bfloat16) or not lc.k.is_contiguous():
                raise ValueError(f"the native step needs a contiguous float32 or bfloat16 cache, got {lc.k.dtype}")
            keep.extend((lc.k, lc.v))
            dst.k_cache = _ffi.cast("void *", lc.k.data_ptr())
            dst.v_cache = _ffi.cast("void *", lc.v.data_ptr())
            dst.slot_stride, dst.head_stride = lc.k.stride(0), lc.k.stride(1)
            dst.capacity = lc.k.shape[2]
            if isinstance(lc, RingLayerCache):
                dst.window = lc.window
                max_rows = min(max_rows, lc.capacity - lc.window + 1)
            else:
                dst.window = 0
        self.max_rows = max_rows

        m = _ffi.new("mux_model *")
        keep.append(m)
        m.n_layers, m.hidden, m.n_heads, m.n_kv, m.head_dim = args.num_hidden_layers, args.hidden_size, h, kv, d
        m.inter, m.vocab, m.max_pos = args.intermediate_size, self.vocab, cache.max_tokens
        m.cache_bf16 = int(cache.layers[0].k.dtype == torch.bfloat16)
        m.eps = float(args.rms_norm_eps)
        m.attn_scale = float(args.attn_scale)
        m.gelu = int(args.activation == "gelu_tanh")
        m.final_norm = f32(model.model.norm.weight)
        weight(m.head, quantized["lm_head.weight"])
        m.layers = layers
        self._model = m
        self._keep = keep

    def forward(
        self, tokens: Sequence[int], positions: Sequence[int], spans: Sequence[SeqSpan], logits_rows: Sequence[int]
    ) -> np.ndarray:
        """Run ``spans`` (each at most ``max_rows`` rows) of a packed batch; float32 logits
        [len(logits_rows), V] for ``logits_rows`` (packed rows inside those spans)."""
        want = {r: i for i, r in enumerate(logits_rows)}
        out = np.empty((len(logits_rows), self.vocab), dtype=np.float32)
        group: list[SeqSpan] = []
        size = 0
        for s in sorted(spans, key=lambda s: s.offset):
            if s.length > self.max_rows:
                raise ValueError(f"a span of {s.length} rows is longer than the native step's {self.max_rows}")
            if size + s.length > MAX_ROWS:
                self._run(tokens, positions, group, want, out)
                group, size = [], 0
            group.append(s)
            size += s.length
        if group:
            self._run(tokens, positions, group, want, out)
        return out

    def _run(self, tokens, positions, group: list[SeqSpan], want: dict[int, int], out: np.ndarray) -> None:
        rows = [r for s in group for r in range(s.offset, s.offset + s.length)]
        n = len(rows)
        x = np.ascontiguousarray(self._embed(torch.tensor([tokens[r] for r in rows])).float().numpy())
        pos = np.array([positions[r] for r in rows], dtype=np.int32)
        slot = np.array([s.slot for s in group for _ in range(s.length)], dtype=np.int32)
        local = [i for i, r in enumerate(rows) if r in want]
        lrows = np.array(local, dtype=np.int32)
        logits = np.empty((max(len(local), 1), self.vocab), dtype=np.float32)
        rc = _lib.mux_forward(
            self._model,
            n,
            _ffi.cast("float *", x.ctypes.data),
            _ffi.cast("const int32_t *", pos.ctypes.data),
            _ffi.cast("const int32_t *", slot.ctypes.data),
            len(local),
            _ffi.cast("const int32_t *", lrows.ctypes.data),
            _ffi.cast("float *", logits.ctypes.data),
        )
        if rc != 0:
            raise RuntimeError(f"the native decode step failed ({rc}) on {n} rows at positions {pos.tolist()}")
        for i, r in enumerate(local):
            out[want[rows[r]]] = logits[i]
