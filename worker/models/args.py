"""A model's configuration (config.json) as a dataclass: unknown keys dropped, derived values in __post_init__."""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

# Architectures this worker runs, mapped to how their config differs. The loader picks the model
# class through ARCHITECTURES in model.py; this table only says what a config means.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


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
    sliding_window: int | None = None
    use_sliding_window: bool | None = None
    max_window_layers: int | None = None
    layer_types: list[str] | None = None
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Derived: the attention window of each layer (None = full attention).
    windows: list[int | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (expected 'silu')")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architecture {self.architecture!r} is not supported; "
                f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if not self.windows:
            self.windows = self._derive_windows()
        if len(self.windows) != self.num_hidden_layers:
            raise ConfigError(f"windows has {len(self.windows)} entries for {self.num_hidden_layers} layers")

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
        if self.architecture == "Qwen2ForCausalLM":
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
            d["architecture"] = {
                "llama": "LlamaForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
                "mistral": "MistralForCausalLM",
            }.get(d["model_type"], d["model_type"])
        # transformers >= 5 keeps rope settings under rope_parameters.
        rp = d.get("rope_parameters")
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


def rope_inv_freq(args: ModelArgs) -> list[float]:
    """Inverse frequencies for RoPE, with linear and llama3 scaling (as transformers computes them)."""
    dim = args.head_dim
    assert dim is not None
    inv = [1.0 / (args.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
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
