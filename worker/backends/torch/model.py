"""Llama-family decoder in torch: Llama (SmolLM2, Llama 3.x), Qwen2 (q/k/v bias), Mistral (sliding
windows), Qwen3 (q/k norms) and Gemma 3 (q/k norms, four norms a layer, GELU, scaled embeddings,
local and global layers with their own rope).

RMSNorm weights are held as the factors the norm multiplies by: Gemma's (1 + weight) is added
once at load (``build_model``), so the forward pass has one norm for every architecture.

Parameter names follow Hugging Face so checkpoints load without renaming. The forward pass takes a
packed batch: the tokens of several sequences (decode tokens and prefill chunks) concatenated into
one flat [N] tensor, with a ``SeqSpan`` per sequence saying which cache slot and positions it covers.
Linear layers run once over all N rows; attention runs per sequence against that sequence's cache.

The q/k/v projections run as one fused ``qkv_proj`` and gate/up as one ``gate_up_proj`` (one
matmul each per layer instead of three and two); ``build_model`` fuses the Hugging Face tensors at
load, so checkpoints and state dicts keep Hugging Face names. Every weight here is dense: a
quantized model's GGUF blocks are not the torch model's but the native step's (quant.py,
native_step.py), which runs its decode rows; this module then runs only its long prompt chunks.

Every single-token decode in a batch, one session or many, takes the same grouped-matmul attention
path (``_decode_attention``), so a session's tokens do not depend on whether it was batched; the
sessions' cache rows are read in place when their slots are consecutive (the usual case).

Dimension names: N packed tokens, H query heads, KV key/value heads, D head dim, C hidden size,
L keys attended, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from muxworker.worker.backends.interface import SeqSpan
from muxworker.worker.backends.torch.batch import DecodeBatch
from muxworker.worker.backends.torch.cache import KVCache
from muxworker.worker.backends.torch.quant import QuantBlocks
from muxworker.worker.models.args import ModelArgs, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel; it accumulates in float32 for bfloat16 input as the reference does (the
        # reference rounds to the model dtype before scaling by the weight, this rounds once after).
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in three ops: rotate_half(x) * sin is
    ``roll(x, D/2) * [-sin, sin]``, with the sign folded into the precomputed table."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


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
        # Rows: H query heads, then KV key heads, then KV value heads (q_proj, k_proj, v_proj stacked).
        self.qkv_proj: nn.Module = nn.Linear(
            c, (self.n_heads + 2 * self.n_kv) * self.head_dim, bias=args.attention_bias
        )
        self.o_proj: nn.Module = nn.Linear(self.n_heads * self.head_dim, c, bias=False)
        self.scale = args.attn_scale
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [N, C]
        cos: torch.Tensor,  # [N, D]
        sin: torch.Tensor,  # [N, D]
        spans: list[SeqSpan],
        decode: DecodeBatch | None,
        cache: KVCache,
    ) -> torch.Tensor:
        n, h, kvh = x.shape[0], self.n_heads, self.n_kv
        qkv = self.qkv_proj(x).view(n, h + 2 * kvh, self.head_dim)
        qk = qkv[:, : h + kvh]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        qk = _apply_rope(qk, cos.unsqueeze(1), sin.unsqueeze(1))  # q and k heads together
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kvh :]
        layer_cache = cache.layers[self.layer_idx]
        gqa = kvh != h
        out = torch.empty_like(q)  # [N, H, D]
        if decode is not None:
            kb, vb, valid = layer_cache.decode_kv(decode, decode.take(k), decode.take(v))
            o = _decode_attention(decode.take(q), kb, vb, valid, self.scale)
            if decode.size == n and isinstance(decode.rows, slice):  # decode only, in row order
                return self.o_proj(o.view(n, h * self.head_dim))
            out[decode.rows] = o
        for s in spans:
            if s.length == 1:
                continue  # in the decode batch
            span = slice(s.offset, s.offset + s.length)
            kv = layer_cache.attention_kv(s.slot, s.start, k[span], v[span])
            if s.length <= _SHORT_CHUNK and s.start > 0:
                # A short chunk after a long history (the first turn after a resume, a tool
                # result): grouped matmuls as for decode, not the fused kernel with a mask.
                out[span] = _chunk_attention(q[span], kv.k, kv.v, kv.lo, s.start, self.window, self.scale)
                continue
            qs = q[span].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
            ks = kv.k.unsqueeze(0)  # [1, KV, L, D]
            vs = kv.v.unsqueeze(0)
            mask: torch.Tensor | None = None
            causal = False
            if kv.lo == s.start == 0 and (self.window is None or s.length <= self.window):
                causal = True
            else:
                # A chunk after earlier positions, or within a window: an additive mask in the
                # activations' dtype (SDPA on CPU runs 15% faster than with a bool mask), built once
                # per forward and shared by the layers. (torch's causal_lower_right bias would
                # materialize the same mask with GQA on CPU, and importing it imports torch._dynamo:
                # 1.2 s of a start.)
                mask = _chunk_mask(s.start, s.length, kv.lo, ks.shape[2], self.window, q.dtype, x.device)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=gqa
            )
            out[span] = o[0].transpose(0, 1)  # [T, H, D]
        return self.o_proj(out.view(n, h * self.head_dim))


_MASKS: dict[tuple, torch.Tensor] = {}  # this forward's chunk masks (Transformer.forward clears it)


def _chunk_mask(
    start: int, length: int, lo: int, keys: int, window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[T, L] additive mask of a chunk at positions [start, start + T) over keys [lo, lo + L): 0 where
    visible (causal, within the window), -inf elsewhere."""
    key = (start, length, lo, keys, window, dtype, device)
    mask = _MASKS.get(key)
    if mask is None:
        qpos = torch.arange(start, start + length, device=device).unsqueeze(1)
        kpos = torch.arange(lo, lo + keys, device=device).unsqueeze(0)
        visible = kpos <= qpos
        if window is not None:
            visible &= kpos > qpos - window
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        _MASKS[key] = mask
    return mask


#: Prefill chunks of at most this many rows, after earlier positions, attend with _chunk_attention
#: (measured faster than SDPA at 2 rows; from 4 rows SDPA's kernel is as fast or faster).
_SHORT_CHUNK = 2


def _chunk_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [KV, L, D]: positions [lo, lo + L), the chunk's own rows last
    v: torch.Tensor,  # [KV, L, D]
    lo: int,
    start: int,
    window: int | None,
    scale: float,
) -> torch.Tensor:  # [T, H, D] in q's dtype
    """A few query rows against a long cache: :func:`_decode_attention`'s grouped matmuls with a
    causal (and sliding-window) mask over the chunk's T rows, applied to those columns only. For 2
    rows against 4,096 (bfloat16, 2 CPU threads) this takes 0.48 ms a layer, against 1.04 ms for
    SDPA with a bottom-right causal bias and about 1.07 ms with an additive mask."""
    t, h, d = q.shape
    kv, length = k.shape[0], k.shape[1]
    g = h // kv
    qg = q.permute(1, 0, 2).reshape(kv, g * t, d).float()  # [KV, G*T, D], query head h = kv*G + g
    scores = torch.matmul(qg, k.float().transpose(-1, -2)).view(kv, g, t, length)
    scores.mul_(scale)
    qpos = torch.arange(start, start + t, device=q.device).unsqueeze(1)
    if length >= 2 * t:
        # Only the last T keys (the chunk's own rows: causal) and, with a window, the first T
        # (older than some query's window) can be hidden: mask those columns, not all L.
        tail = torch.arange(lo + length - t, lo + length, device=q.device).unsqueeze(0)
        scores[..., length - t :].masked_fill_(tail > qpos, float("-inf"))
        if window is not None:
            head = torch.arange(lo, lo + t, device=q.device).unsqueeze(0)
            scores[..., :t].masked_fill_(head <= qpos - window, float("-inf"))
    else:
        kpos = torch.arange(lo, lo + length, device=q.device).unsqueeze(0)
        hidden = kpos > qpos
        if window is not None:
            hidden |= kpos <= qpos - window
        scores.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.view(kv, g * t, length), v.float())  # [KV, G*T, D]
    return out.view(h, t, d).permute(1, 0, 2).to(q.dtype)


def _decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k: torch.Tensor,  # [B, KV, L, D]
    v: torch.Tensor,  # [B, KV, L, D]
    mask: torch.Tensor | None,  # [B, 1, 1, L] bool, True = attend; None: every row
    scale: float,
) -> torch.Tensor:  # [B, H, D] in q's dtype
    """One query per sequence. Two batched matmuls with the query heads grouped by KV head: for a
    single query row this is several times cheaper on CPU than the fused SDPA kernel with a mask.
    In float32 whatever the cache dtype: on CPU a bfloat16 matmul this small costs more than
    casting the rows and multiplying in float32 (measured 2x at 40 and at 4,096 rows)."""
    b, h, d = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, kv, h // kv, d).float()  # [B, KV, G, D]
    scores = torch.matmul(qg, k.float().transpose(-1, -2)) * scale  # [B, KV, G, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # mask broadcasts over KV and G
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).view(b, h, d).to(q.dtype)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        c, f = args.hidden_size, args.intermediate_size
        self.intermediate = f
        self.gate_up_proj: nn.Module = nn.Linear(c, 2 * f, bias=args.mlp_bias)  # gate_proj rows, then up_proj
        self.down_proj: nn.Module = nn.Linear(f, c, bias=args.mlp_bias)
        self.gelu = args.activation == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


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

    def forward(self, x, rope, spans, decode, cache):
        cos, sin = rope[self.self_attn.rope_kind]
        a = self.self_attn(self.input_layernorm(x), cos, sin, spans, decode, cache)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(a)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        # An explicit (uninitialized) weight: Embedding's own init calls normal_, which on the meta
        # device imports torch._dynamo, 1.5 s of a 2 s start.
        self.embed_tokens = nn.Embedding(
            args.vocab_size, args.hidden_size, _weight=torch.empty(args.vocab_size, args.hidden_size)
        )
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
        self._rope_kinds = sorted(set(args.rope_kinds))
        # A quantized model's GGUF blocks by Hugging Face weight name, for the native decode step
        # (set by executor.load_model; None for a float model).
        self.quantized: dict[str, QuantBlocks] | None = None
        self.register_buffer("_cos", torch.empty(0), persistent=False)
        self.register_buffer("_sin", torch.empty(0), persistent=False)

    def setup_rope(self, max_positions: int) -> None:
        """Precompute cos/sin for positions [0, max_positions) (idempotent)."""
        if max_positions <= self._rope_max:
            return
        device = self.model.embed_tokens.weight.device
        dtype = self.model.embed_tokens.weight.dtype
        t = torch.arange(max_positions, dtype=torch.float32, device=device)
        cos, sin = [], []
        for kind in range(max(self._rope_kinds) + 1):  # [kinds, P, D]; a kind no layer uses stays unread
            inv = torch.tensor(rope_inv_freq(self.args, kind), dtype=torch.float32, device=device)
            freqs = torch.outer(t, inv)  # [P, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
            cos.append(emb.cos().to(dtype))
            sin.append(torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(dtype))  # signed for _apply_rope
        self._cos = torch.stack(cos)
        self._sin = torch.stack(sin)
        self._rope_max = max_positions

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N, C] input embeddings of ``tokens`` (Gemma's scaled by sqrt(C), rounded to the model
        dtype first as transformers does)."""
        x = self.model.embed_tokens(tokens)
        scale = self.args.embed_scale
        return x if scale is None else x * torch.tensor(scale, dtype=x.dtype)

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
        rope = [
            (self._cos[k, positions], self._sin[k, positions]) if k in self._rope_kinds else None
            for k in range(len(self._cos))
        ]
        _MASKS.clear()
        x = self.embed(tokens)  # [N, C]
        decode = DecodeBatch.of(spans, tokens.device)
        for layer in self.model.layers:
            x = layer(x, rope, spans, decode, cache)
        h = self.model.norm(x[logits_rows])  # [B, C]
        return self.lm_head(h).float()


# Architecture string -> model class. Explicit, never globals().
ARCHITECTURES: dict[str, type[Transformer]] = {
    "LlamaForCausalLM": Transformer,
    "Qwen2ForCausalLM": Transformer,
    "MistralForCausalLM": Transformer,
    "Qwen3ForCausalLM": Transformer,
    "Gemma3ForCausalLM": Transformer,
}


# Fused module -> the Hugging Face modules whose weights it stacks, in row order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def _hf_parameter_names(model: Transformer) -> set[str]:
    """The Hugging Face names of ``model``'s parameters (fused modules under their parts' names)."""
    names: set[str] = set()
    for name in model.state_dict().keys():
        for fused, parts in _FUSED.items():
            if f".{fused}." in name:
                names.update(name.replace(fused, part) for part in parts)
                break
        else:
            names.add(name)
    return names


def _fuse(sd: dict[str, torch.Tensor], n_layers: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = dict(sd)
    for i in range(n_layers):
        for fused, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{part}.{kind}" for part in parts]
                if all(n in out for n in names):
                    out[f"model.layers.{i}.{fused}.{kind}"] = torch.cat([out.pop(n).to(dtype) for n in names])
    return out


def build_model(
    args: ModelArgs, state_dict: dict[str, torch.Tensor], *, dtype: torch.dtype, device: torch.device | str
) -> Transformer:
    """Instantiate the model for ``args.architecture`` and load ``state_dict`` (Hugging Face names,
    dense tensors) strictly."""
    cls = ARCHITECTURES.get(args.architecture)
    if cls is None:
        raise ValueError(f"no model class for architecture {args.architecture!r}")
    device = torch.device(device)
    with torch.device("meta"):
        model = cls(args)
    sd = dict(state_dict)
    tied = args.tie_word_embeddings
    if tied:
        sd.pop("lm_head.weight", None)
    expected = {k for k in _hf_parameter_names(model) if not (tied and k == "lm_head.weight")}
    missing = sorted(expected - sd.keys())
    unexpected = sorted(k for k in sd.keys() - expected if not k.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise ValueError(
            f"weights do not match {args.architecture}: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    if args.norm_offset:
        # Gemma's norms scale by (1 + weight): held as that factor (in float32, then rounded).
        sd = {k: v.float() + args.norm_offset if k.endswith("norm.weight") else v for k, v in sd.items()}
    sd = _fuse(sd, args.num_hidden_layers, dtype)
    # The meta skeleton's tensors are replaced, never allocated: each weight becomes a Parameter of
    # the given tensor (no copy when it already has the dtype and device). (to_empty + copy_ +
    # .to(dtype) allocated every weight twice, in float32 first, and to_empty's meta path imports
    # sympy: ~1 s of a start.)
    for name, value in sd.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if value.shape != getattr(module, attr).shape:
            raise ValueError(
                f"weight {name} has shape {list(value.shape)}, the model expects {list(getattr(module, attr).shape)}"
            )
        setattr(module, attr, nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=False))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():  # buffers (rope tables) start empty, filled by setup_rope
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_meta:
                setattr(module, name, torch.empty(0, dtype=dtype, device=device))
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"weights left unset: {left[:5]}")
    model.eval()
    return model
