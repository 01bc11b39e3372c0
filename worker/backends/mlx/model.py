"""Llama-family decoder in MLX: the mirror of model.py (same names, shapes and numerics), for the
same architectures: Llama, Qwen2, Mistral, Qwen3 (q/k norms) and Gemma 3 (q/k norms, four norms a
layer, GELU, scaled embeddings, local and global layers with their own rope).

Parameter names follow Hugging Face, as in the torch model, so the same safetensors load without
renaming. ``Transformer.__call__`` takes the same packed batch as the torch model: the tokens of
several sequences concatenated into one flat [N] array, with a ``SeqSpan`` per sequence. Linear
layers run once over all N rows; attention runs per sequence against that sequence's cache.

Numerics follow model.py step by step so float32 logits agree with torch to rounding: RoPE uses a
cos/sin table computed the same way (float32 ``t * inv_freq``, rounded to the model dtype) and HF's
rotate_half convention, one table per rope kind (``args.rope_kinds``); RMSNorm is
``mx.fast.rms_norm`` (float32 inside), its weight the factor it multiplies by (Gemma's (1 + weight)
added once at load, in ``build_model``); attention is ``mx.fast.scaled_dot_product_attention``,
which handles grouped KV heads itself.

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
        self.rope_kind = args.rope_kinds[layer_idx]
        c = args.hidden_size
        self.q_proj = nn.Linear(c, self.n_heads * self.head_dim, bias=args.attention_bias)
        self.k_proj = nn.Linear(c, self.n_kv * self.head_dim, bias=args.attention_bias)
        self.v_proj = nn.Linear(c, self.n_kv * self.head_dim, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c, bias=False)
        self.scale = args.attn_scale
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

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
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, before rope
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
        self.gelu = args.activation == "gelu_tanh"

    def __call__(self, x: mx.array) -> mx.array:
        gate = self.gate_proj(x)
        act = nn.gelu_approx(gate) if self.gelu else nn.silu(gate)  # gelu_approx: the tanh form
        return self.down_proj(act * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # Gemma 3: post_attention_layernorm normalizes the attention's output, these the MLP's
        # input and output (elsewhere post_attention_layernorm is the MLP's input norm).
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if args.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x, rope, spans, cache):
        cos, sin = rope[self.self_attn.rope_kind]
        a = self.self_attn(self.input_layernorm(x), cos, sin, spans, cache)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(a)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


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
        self._rope_kinds = sorted(set(args.rope_kinds))
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
        t = mx.arange(max_positions, dtype=mx.float32)
        cos, sin = [], []
        for kind in range(max(self._rope_kinds) + 1):  # [kinds, P, D]; a kind no layer uses stays unread
            inv = mx.array(rope_inv_freq(self.args, kind), dtype=mx.float32)  # [D/2]
            freqs = t[:, None] * inv[None]  # [P, D/2], the float32 products torch.outer forms
            emb = mx.concatenate([freqs, freqs], axis=-1)  # [P, D]
            cos.append(mx.cos(emb).astype(self.dtype))
            sin.append(mx.sin(emb).astype(self.dtype))
        self._cos = mx.stack(cos)
        self._sin = mx.stack(sin)
        mx.eval(self._cos, self._sin)
        self._rope_max = max_positions

    def embed(self, tokens: mx.array) -> mx.array:
        """[N, C] input embeddings of ``tokens`` (Gemma's scaled by sqrt(C), rounded to the model
        dtype first as transformers does)."""
        x = self.model.embed_tokens(tokens)
        scale = self.args.embed_scale
        return x if scale is None else x * mx.array(scale, dtype=x.dtype)

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
        rope = [
            (self._cos[k][positions], self._sin[k][positions]) if k in self._rope_kinds else None  # [N, D]
            for k in range(self._cos.shape[0])
        ]
        x = self.embed(tokens)  # [N, C]
        for layer in self.model.layers:
            x = layer(x, rope, spans, cache)
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
    "Qwen3ForCausalLM": Transformer,
    "Gemma3ForCausalLM": Transformer,
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
    if args.norm_offset:
        # Gemma's norms scale by (1 + weight): held as that factor (in float32, then rounded).
        sd = {k: v.astype(mx.float32) + args.norm_offset if k.endswith("norm.weight") else v for k, v in sd.items()}
    for name in sorted(expected):
        if tuple(sd[name].shape) != tuple(params[name].shape):
            raise ValueError(
                f"weight {name} has shape {tuple(sd[name].shape)}; {args.architecture} expects {tuple(params[name].shape)}"
            )
    model.update(tree_unflatten([(name, sd[name].astype(dtype)) for name in sorted(expected)]))
    mx.eval(model.parameters())
    model.eval()
    return model
