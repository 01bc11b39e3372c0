"""Llama-family decoder in torch (Llama, SmolLM2, Qwen2 with q/k/v bias, Mistral with sliding windows).

Parameter names follow Hugging Face so checkpoints load without renaming. The forward pass takes a
packed batch: the tokens of several sequences (decode tokens and prefill chunks) concatenated into
one flat [N] tensor, with a ``SeqSpan`` per sequence saying which cache slot and positions it covers.
Linear layers run once over all N rows; attention runs per sequence against that sequence's cache.

Dimension names: N packed tokens, H query heads, KV key/value heads, D head dim, C hidden size,
L keys attended, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from muxworker.worker.backends.interface import SeqSpan
from muxworker.worker.backends.torch.cache import KVCache
from muxworker.worker.models.args import ModelArgs, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 as the reference implementation does, then scale in the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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

    def forward(
        self,
        x: torch.Tensor,  # [N, C]
        cos: torch.Tensor,  # [N, D]
        sin: torch.Tensor,  # [N, D]
        spans: list[SeqSpan],
        cache: KVCache,
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(n, self.n_kv, self.head_dim)
        cos_, sin_ = cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, D]
        q = q * cos_ + rotate_half(q) * sin_
        k = k * cos_ + rotate_half(k) * sin_
        layer_cache = cache.layers[self.layer_idx]
        out = torch.empty_like(q)  # [N, H, D]
        gqa = self.n_kv != self.n_heads
        decode = [s for s in spans if s.length == 1]
        if len(decode) > 1:
            # All single-token decodes in one padded attention call: one kernel launch, not B.
            rows = torch.tensor([s.offset for s in decode], device=x.device)
            slots = torch.tensor([s.slot for s in decode], device=x.device)
            pos = torch.tensor([s.start for s in decode], device=x.device)
            kb, vb, valid = layer_cache.decode_kv(slots, pos, k[rows], v[rows])  # [B, KV, L, D]
            out[rows] = _decode_attention(q[rows], kb, vb, valid, self.scale)
            spans = [s for s in spans if s.length != 1]
        for s in spans:
            span = slice(s.offset, s.offset + s.length)
            kv = layer_cache.attention_kv(s.slot, s.start, k[span], v[span])
            qs = q[span].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
            ks = kv.k.unsqueeze(0)  # [1, KV, L, D]
            vs = kv.v.unsqueeze(0)
            mask: torch.Tensor | None = None
            causal = False
            if s.length > 1:
                if kv.lo == s.start == 0 and (self.window is None or s.length <= self.window):
                    causal = True
                else:
                    qpos = torch.arange(s.start, s.start + s.length, device=x.device).unsqueeze(1)
                    kpos = torch.arange(kv.lo, kv.lo + ks.shape[2], device=x.device).unsqueeze(0)
                    mask = kpos <= qpos
                    if self.window is not None:
                        mask &= kpos > qpos - self.window
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=gqa
            )
            out[span] = o[0].transpose(0, 1)  # [T, H, D]
        return self.o_proj(out.view(n, self.n_heads * self.head_dim))


def _decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k: torch.Tensor,  # [B, KV, L, D]
    v: torch.Tensor,  # [B, KV, L, D]
    mask: torch.Tensor,  # [B, 1, 1, L] bool, True = attend
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """One query per sequence. Two batched matmuls with the query heads grouped by KV head: for a
    single query row this is several times cheaper on CPU than the fused SDPA kernel with a mask."""
    b, h, d = q.shape
    kv = k.shape[1]
    qg = q.view(b, kv, h // kv, d)  # [B, KV, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, KV, G, L]
    scores = scores.masked_fill(~mask, float("-inf"))  # mask broadcasts over KV and G
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(b, h, d)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        c, f = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(c, f, bias=args.mlp_bias)
        self.up_proj = nn.Linear(c, f, bias=args.mlp_bias)
        self.down_proj = nn.Linear(f, c, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, spans, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, spans, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Transformer(nn.Module):
    """The decoder. ``forward`` runs one packed batch and returns logits for the selected rows."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope_max = 0
        self.register_buffer("_cos", torch.empty(0), persistent=False)
        self.register_buffer("_sin", torch.empty(0), persistent=False)

    def setup_rope(self, max_positions: int) -> None:
        """Precompute cos/sin for positions [0, max_positions) (idempotent)."""
        if max_positions <= self._rope_max:
            return
        device = self.lm_head.weight.device
        inv = torch.tensor(rope_inv_freq(self.args), dtype=torch.float32, device=device)
        t = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        dtype = self.lm_head.weight.dtype
        self._cos = emb.cos().to(dtype)
        self._sin = emb.sin().to(dtype)
        self._rope_max = max_positions

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [N] int64
        positions: torch.Tensor,  # [N] int64
        spans: list[SeqSpan],
        cache: KVCache,
        logits_rows: torch.Tensor,  # [B] int64: rows whose logits are returned
    ) -> torch.Tensor:  # [B, V] float32
        if tokens.ndim != 1 or tokens.shape != positions.shape:
            raise ValueError(f"tokens {tuple(tokens.shape)} and positions {tuple(positions.shape)} must be equal 1-D")
        cos, sin = self._cos[positions], self._sin[positions]
        x = self.model.embed_tokens(tokens)  # [N, C]
        for layer in self.model.layers:
            x = layer(x, cos, sin, spans, cache)
        h = self.model.norm(x[logits_rows])  # [B, C]
        return self.lm_head(h).float()


# Architecture string -> model class. Explicit, never globals().
ARCHITECTURES: dict[str, type[Transformer]] = {
    "LlamaForCausalLM": Transformer,
    "Qwen2ForCausalLM": Transformer,
    "MistralForCausalLM": Transformer,
}


def build_model(
    args: ModelArgs, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype, device: torch.device | str
) -> Transformer:
    """Instantiate the model for ``args.architecture`` and load ``state_dict`` strictly."""
    cls = ARCHITECTURES.get(args.architecture)
    if cls is None:
        raise ValueError(f"no model class for architecture {args.architecture!r}")
    with torch.device("meta"):
        model = cls(args)
    sd = dict(state_dict)
    if args.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict().keys() if not (args.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(expected - sd.keys())
    unexpected = sorted(k for k in sd.keys() - expected if not k.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise ValueError(
            f"weights do not match {args.architecture}: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    model = model.to_empty(device=device)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name in expected:
            params[name].copy_(sd[name].to(dtype))
    model.to(dtype)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    return model
