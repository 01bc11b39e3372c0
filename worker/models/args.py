"""A model's configuration (config.json) as a dataclass: unknown keys dropped, derived values in __post_init__."""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

from muxworker.worker.models.bounds import (
    MAX_CONTEXT_LENGTH,
    MAX_EMBEDDING_LENGTH,
    MAX_FEED_FORWARD_LENGTH,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_VOCAB,
    checked_float,
    checked_int,
)

# Architectures this worker runs, mapped to how their config differs. The loader picks the model
# class through ARCHITECTURES in model.py; this table only says what a config means.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

#: What transformers' Gemma3TextConfig assumes when a config (or a GGUF, which carries none of
#: these) leaves them out: every sixth layer global, the others sliding; the local layers' rope
#: base; the query scale 1/sqrt(query_pre_attn_scalar). The one place muxworker names them; the
#: converter writes them into config.json and tests check them against transformers.
GEMMA3_DEFAULTS = {"sliding_window_pattern": 6, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256}

#: Activations, by the names configs give them (hidden_act, Gemma's hidden_activation).
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class ConfigError(ValueError):
    """A model config that this worker cannot run, with the field that is wrong."""


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    hidden_activation: str | None = None  # Gemma's name for hidden_act
    sliding_window: int | None = None
    use_sliding_window: bool | None = None
    max_window_layers: int | None = None
    layer_types: list[str] | None = None
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Gemma 3 (None: GEMMA3_DEFAULTS for Gemma 3, unused otherwise).
    query_pre_attn_scalar: float | None = None
    rope_local_base_freq: float | None = None
    sliding_window_pattern: int | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # llama.cpp's per-frequency rope divisors (a Llama 3.x GGUF's rope_freqs tensor), written by
    # the converter; they replace rope_scaling.
    rope_freq_factors: list[float] | None = None
    # Derived: the attention window of each layer (None = full attention).
    windows: list[int | None] = field(default_factory=list)
    # Derived: which rope table each layer uses (0: the global one; 1: Gemma 3's local one).
    rope_kinds: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._check_bounds()
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        act = self.hidden_activation if self.hidden_activation is not None else self.hidden_act
        if act not in ACTIVATIONS:
            raise ConfigError(f"activation {act!r} is not supported (expected one of {', '.join(ACTIVATIONS)})")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            hint = " (Gemma 3's vision-language model: only its text model, Gemma3ForCausalLM, runs)"
            raise ConfigError(
                f"architecture {self.architecture!r} is not supported; "
                f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}"
                + (hint if self.architecture == "Gemma3ForConditionalGeneration" else "")
            )
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(self, name) is not None:
                raise ConfigError(f"{name}={getattr(self, name)} is not supported (Gemma 2's soft-capping)")
        if self.gemma3:
            for key, value in GEMMA3_DEFAULTS.items():
                if getattr(self, key) is None:
                    setattr(self, key, value)
            if self.layer_types is None and self.sliding_window:
                pattern = int(self.sliding_window_pattern or 0)
                self.layer_types = [
                    "full_attention" if pattern and (i + 1) % pattern == 0 else "sliding_attention"
                    for i in range(self.num_hidden_layers)
                ]
        if not self.windows:
            self.windows = self._derive_windows()
        if len(self.windows) != self.num_hidden_layers:
            raise ConfigError(f"windows has {len(self.windows)} entries for {self.num_hidden_layers} layers")
        if not self.rope_kinds:
            local = self.gemma3
            self.rope_kinds = [1 if local and w is not None else 0 for w in self.windows]
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_size // 2:
            raise ConfigError(
                f"rope_freq_factors has {len(self.rope_freq_factors)} entries for head_dim {self.head_size}"
            )

    def _check_bounds(self) -> None:
        """Counts and sizes within bounds.py, before anything is sized by them (a config is untrusted)."""

        def integer(name: str, low: int, high: int) -> None:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, checked_int(value, name, low, high, error=ConfigError))

        integer("num_hidden_layers", 1, MAX_LAYERS)
        integer("vocab_size", 1, MAX_VOCAB)
        integer("hidden_size", 1, MAX_EMBEDDING_LENGTH)
        integer("intermediate_size", 1, MAX_FEED_FORWARD_LENGTH)
        integer("num_attention_heads", 1, MAX_HEADS)
        integer("num_key_value_heads", 1, MAX_HEADS)
        integer("head_dim", 2, MAX_HEAD_DIM)
        integer("max_position_embeddings", 1, MAX_CONTEXT_LENGTH)
        integer("sliding_window", 1, MAX_CONTEXT_LENGTH)
        integer("sliding_window_pattern", 0, MAX_LAYERS)
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                f"({self.num_attention_heads}) and head_dim is not given"
            )
        self.rms_norm_eps = checked_float(self.rms_norm_eps, "rms_norm_eps", high=1.0, error=ConfigError)
        self.rope_theta = checked_float(self.rope_theta, "rope_theta", error=ConfigError)
        for name in ("rope_local_base_freq", "query_pre_attn_scalar"):
            if getattr(self, name) is not None:
                setattr(self, name, checked_float(getattr(self, name), name, error=ConfigError))
        if self.rope_freq_factors is not None:
            for factor in self.rope_freq_factors:
                checked_float(factor, "rope_freq_factors", error=ConfigError)
        if self.rope_scaling is not None and "factor" in self.rope_scaling:
            checked_float(self.rope_scaling["factor"], "rope_scaling.factor", error=ConfigError)
        if self.layer_types is not None and len(self.layer_types) > MAX_LAYERS:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries; at most {MAX_LAYERS}")

    @property
    def gemma3(self) -> bool:
        return self.architecture == "Gemma3ForCausalLM"

    @property
    def activation(self) -> str:
        """ "silu" or "gelu_tanh": the gated MLP's activation."""
        return ACTIVATIONS[self.hidden_activation if self.hidden_activation is not None else self.hidden_act]

    @property
    def qk_norm(self) -> bool:
        """Whether each query and key head is RMS-normalized before rope (Qwen3, Gemma 3)."""
        return self.architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM")

    @property
    def sandwich_norms(self) -> bool:
        """Gemma 3's four norms a layer: the attention's and the MLP's outputs are normalized too
        (post_attention_layernorm, post_feedforward_layernorm), and the MLP's input by
        pre_feedforward_layernorm; in the others, post_attention_layernorm is the MLP's input norm."""
        return self.gemma3

    @property
    def norm_offset(self) -> float:
        """What every RMSNorm adds to its weight: Gemma's norms scale by (1 + weight)."""
        return 1.0 if self.gemma3 else 0.0

    @property
    def embed_scale(self) -> float | None:
        """The factor embeddings are scaled by (Gemma: sqrt(hidden_size), in the model dtype)."""
        return self.hidden_size**0.5 if self.gemma3 else None

    @property
    def attn_scale(self) -> float:
        """The attention scores' scale: 1/sqrt(query_pre_attn_scalar) for Gemma 3, 1/sqrt(head_dim)."""
        if self.gemma3:
            assert self.query_pre_attn_scalar is not None
            return float(self.query_pre_attn_scalar) ** -0.5
        return float(self.head_size) ** -0.5

    def _derive_windows(self) -> list[int | None]:
        n = self.num_hidden_layers
        w = self.sliding_window
        if self.layer_types is not None:
            if len(self.layer_types) != n:
                raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {n} layers")
            if any(t == "sliding_attention" for t in self.layer_types) and not w:
                raise ConfigError("layer_types names sliding_attention but sliding_window is unset")
            return [w if t == "sliding_attention" else None for t in self.layer_types]
        if not w:
            return [None] * n
        if self.architecture == "MistralForCausalLM":
            return [w] * n
        if self.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            # Qwen2: windows only when use_sliding_window, on layers >= max_window_layers.
            if not self.use_sliding_window:
                return [None] * n
            first = self.max_window_layers if self.max_window_layers is not None else n
            return [w if i >= first else None for i in range(n)]
        return [None] * n

    @property
    def num_kv_heads(self) -> int:
        """``num_key_value_heads`` once derived (``__post_init__`` fills it in)."""
        assert self.num_key_value_heads is not None
        return self.num_key_value_heads

    @property
    def head_size(self) -> int:
        """``head_dim`` once derived (``__post_init__`` fills it in)."""
        assert self.head_dim is not None
        return self.head_dim

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        """Build from a Hugging Face config.json dict; unknown keys are dropped."""
        d = dict(config)
        archs = d.get("architectures") or []
        if archs:
            d["architecture"] = archs[0]
        elif d.get("model_type"):
            d["architecture"] = _MODEL_TYPES.get(d["model_type"], d["model_type"])
        # transformers >= 5 keeps rope settings under rope_parameters; Gemma 3 one per layer type.
        rp = d.get("rope_parameters")
        if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):
            local = rp.get("sliding_attention")
            if isinstance(local, dict) and "rope_theta" in local:
                if local.get("rope_type", "default") != "default":
                    raise ConfigError(f"scaled rope on sliding layers ({local}) is not supported")
                d["rope_local_base_freq"] = local["rope_theta"]
            rp = rp["full_attention"]
        if isinstance(rp, dict):
            if "rope_theta" in rp:
                d["rope_theta"] = rp["rope_theta"]
            if rp.get("rope_type", "default") != "default":
                d["rope_scaling"] = rp
        if d.get("architecture") == "Qwen2ForCausalLM":
            d.setdefault("attention_bias", True)
        names = {f.name for f in dataclasses.fields(cls)} - {"windows"}
        params = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in d.items() if k in names and k in params})


def rope_inv_freq(args: ModelArgs, kind: int = 0) -> list[float]:
    """Inverse frequencies for RoPE, with linear and llama3 scaling (as transformers computes them)
    or llama.cpp's frequency factors. ``kind`` 1: Gemma 3's local layers (their own base, never
    scaled)."""
    dim = args.head_dim
    assert dim is not None
    if kind == 1:
        assert args.rope_local_base_freq is not None
        return [1.0 / (args.rope_local_base_freq ** (i / dim)) for i in range(0, dim, 2)]
    inv = [1.0 / (args.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
    if args.rope_freq_factors is not None:
        return [f / factor for f, factor in zip(inv, args.rope_freq_factors)]
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        factor = float(scaling["factor"])
        return [f / factor for f in inv]
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / factor)
            else:
                smooth = (old_ctx / wavelen - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        return out
    raise ConfigError(f"rope scaling type {kind!r} is not supported (expected default, linear or llama3)")
