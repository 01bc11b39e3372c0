"""Llama-family decoder in MLX: the mirror of model.py (same names, shapes and numerics).

Parameter names follow Hugging Face, as in the torch model, so the same safetensors load without
renaming. ``Transformer.__call__`` takes the same packed batch as the torch model: the tokens of
several sequences concatenated into one flat [N] array, with a ``SeqSpan`` per sequence. Linear
layers run once over all N rows; attention runs per sequence against that sequence's cache.

Numerics follow model.py step by step so float32 logits agree with torch to rounding: RoPE uses a
cos/sin table computed the same way (float32 ``t * inv_freq``, rounded to the model dtype) and HF's
rotate_half convention; RMSNorm is ``mx.fast.rms_norm`` (float32 inside); attention is
``mx.fast.scaled_dot_product_attention``, which handles grouped KV heads itself.

Dimension names: N packed tokens, H query heads, KV key/value heads, D head dim, C hidden size,
L keys attended, V vocabulary, P rope positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from muxworker.worker.backends.interface import SeqSpan
from muxworker.worker.backends.mlx.cache import KVCache
from muxworker.worker.models.args import ModelArgs, rope_inv_freq

__all__ = [
    "ARCHITECTURES",
    "Attention",
    "DecoderLayer",
    "MLP",
    "RMSNorm",
    "Transformer",
    "build_model",
]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dim,))

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


def rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = args.num_attention_heads
        self.n_kv = args.num_kv_heads
        self.head_dim = args.head_size
        self.window = args.windows[layer_idx]
        c = args.hidden_size
        self.q_proj = nn.Linear(c, self.n_heads * self.head_dim, bias=args.attention_bias)
        self.k_proj = nn.Linear(c, self.n_kv * self.head_dim, bias=args.attention_bias)
        self.v_proj = nn.Linear(c, self.n_kv * self.head_dim, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c, bias=False)
        self.scale = self.head_dim**-0.5

    def __call__(
        self,
        x: mx.array,  # [N, C]
        cos: mx.array,  # [N, D]
        sin: mx.array,  # [N, D]
        spans: Sequence[SeqSpan],
        cache: KVCache,
    ) -> mx.array:
        n = x.shape[0]
        q = self.q_proj(x).reshape(n, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(n, self.n_kv, self.head_dim)
        v = self.v_proj(x).reshape(n, self.n_kv, self.head_dim)
        cos_, sin_ = cos[:, None], sin[:, None]  # [N, 1, D]
        q = q * cos_ + rotate_half(q) * sin_
        k = k * cos_ + rotate_half(k) * sin_
        layer_cache = cache.layers[self.layer_idx]
        out = mx.zeros_like(q)  # [N, H, D]
        decode = [s for s in spans if s.length == 1]
        if len(decode) > 1:
            # All single-token decodes in one padded attention call, as the torch model does.
            idx = mx.array([s.offset for s in decode])
            kb, vb, mask = layer_cache.decode_kv(
                [s.slot for s in decode], [s.start for s in decode], k[idx], v[idx]
            )  # [B, KV, L, D], mask [B, 1, 1, L]
            o = mx.fast.scaled_dot_product_attention(q[idx][:, :, None], kb, vb, scale=self.scale, mask=mask)
            out[idx] = o[:, :, 0]  # [B, H, D]
            spans = [s for s in spans if s.length != 1]
        for s in spans:
            rows = slice(s.offset, s.offset + s.length)
            kv = layer_cache.attention_kv(s.slot, s.start, k[rows], v[rows])
            qs = q[rows].transpose(1, 0, 2)[None]  # [1, H, T, D]
            attn_mask: mx.array | str | None = None
            if s.length > 1:
                last = s.start + s.length - 1
                if self.window is None or last - self.window < kv.lo:
                    # Every query sees all keys up to its own position; MLX aligns "causal" to the
                    # bottom-right corner, so this also holds for a chunk after cached rows.
                    attn_mask = "causal"
                else:
                    qpos = mx.arange(s.start, last + 1)[:, None]
                    kpos = mx.arange(kv.lo, kv.lo + kv.k.shape[1])[None]
                    attn_mask = (kpos <= qpos) & (kpos > qpos - self.window)  # [T, L]
            o = mx.fast.scaled_dot_product_attention(qs, kv.k[None], kv.v[None], scale=self.scale, mask=attn_mask)
            out[rows] = o[0].transpose(1, 0, 2)  # [T, H, D]
        return self.o_proj(out.reshape(n, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        c, f = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(c, f, bias=args.mlp_bias)
        self.up_proj = nn.Linear(c, f, bias=args.mlp_bias)
        self.down_proj = nn.Linear(f, c, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x, cos, sin, spans, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, spans, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Transformer(nn.Module):
    """The decoder. Calling it runs one packed batch and returns logits for the selected rows."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        # Tied embeddings have no lm_head parameter: the head is embed_tokens.as_linear.
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # Underscored attributes are not parameters (mlx.nn skips them).
        self._rope_max = 0
        self._cos = mx.zeros((0,))
        self._sin = mx.zeros((0,))

    @property
    def dtype(self) -> mx.Dtype:
        return self.model.norm.weight.dtype

    @property
    def rope_positions(self) -> int:
        """Positions [0, rope_positions) have a precomputed rope table."""
        return self._rope_max

    def setup_rope(self, max_positions: int) -> None:
        """Precompute cos/sin for positions [0, max_positions) (idempotent)."""
        if max_positions <= self._rope_max:
            return
        inv = mx.array(rope_inv_freq(self.args), dtype=mx.float32)  # [D/2]
        t = mx.arange(max_positions, dtype=mx.float32)
        freqs = t[:, None] * inv[None]  # [P, D/2], the float32 products torch.outer forms
        emb = mx.concatenate([freqs, freqs], axis=-1)  # [P, D]
        self._cos = mx.cos(emb).astype(self.dtype)
        self._sin = mx.sin(emb).astype(self.dtype)
        mx.eval(self._cos, self._sin)
        self._rope_max = max_positions

    def __call__(
        self,
        tokens: mx.array,  # [N] int32
        positions: mx.array,  # [N] int32, each < rope_positions (the caller checks: take does not)
        spans: Sequence[SeqSpan],
        cache: KVCache,
        logits_rows: mx.array,  # [B] int32: rows whose logits are returned
    ) -> mx.array:  # [B, V] float32
        if tokens.ndim != 1 or tokens.shape != positions.shape:
            raise ValueError(f"tokens {tuple(tokens.shape)} and positions {tuple(positions.shape)} must be equal 1-D")
        _check_spans(spans, tokens.shape[0])
        cos, sin = self._cos[positions], self._sin[positions]  # [N, D]
        x = self.model.embed_tokens(tokens)  # [N, C]
        for layer in self.model.layers:
            x = layer(x, cos, sin, spans, cache)
        h = self.model.norm(x[logits_rows])  # [B, C]
        if self.args.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = self.lm_head(h)
        return logits.astype(mx.float32)


def _check_spans(spans: Sequence[SeqSpan], n: int) -> None:
    """Each packed row belongs to exactly one span (MLX slices clamp instead of raising)."""
    row = 0
    for s in sorted(spans, key=lambda s: s.offset):
        if s.offset != row or s.length < 1:
            raise ValueError(f"spans must tile the packed rows [0, {n}); got {list(spans)}")
        row += s.length
    if row != n:
        raise ValueError(f"spans cover {row} rows but the batch has {n}")


# Architecture string -> model class. Explicit, never globals(); the same keys as model.ARCHITECTURES.
ARCHITECTURES: dict[str, type[Transformer]] = {
    "LlamaForCausalLM": Transformer,
    "Qwen2ForCausalLM": Transformer,
    "MistralForCausalLM": Transformer,
}


def build_model(args: ModelArgs, state_dict: dict[str, mx.array], *, dtype: mx.Dtype) -> Transformer:
    """Instantiate the model for ``args.architecture`` and load ``state_dict`` strictly."""
    cls = ARCHITECTURES.get(args.architecture)
    if cls is None:
        raise ValueError(f"no model class for architecture {args.architecture!r}")
    model = cls(args)
    sd = dict(state_dict)
    if args.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    params = dict(tree_flatten(model.parameters()))
    expected = set(params)
    missing = sorted(expected - sd.keys())
    unexpected = sorted(k for k in sd.keys() - expected if not k.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise ValueError(
            f"weights do not match {args.architecture}: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name in sorted(expected):
        if tuple(sd[name].shape) != tuple(params[name].shape):
            raise ValueError(
                f"weight {name} has shape {tuple(sd[name].shape)}; {args.architecture} expects {tuple(params[name].shape)}"
            )
    model.update(tree_unflatten([(name, sd[name].astype(dtype)) for name in sorted(expected)]))
    mx.eval(model.parameters())
    model.eval()
    return model
