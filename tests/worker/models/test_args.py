"""What a config means (ModelArgs): Gemma 3's defaults and layer pattern, and the variants refused."""

from __future__ import annotations

import pytest

from muxworker.worker.models.args import GEMMA3_DEFAULTS, ConfigError, ModelArgs, rope_inv_freq

GEMMA = {
    "architectures": ["Gemma3ForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "sliding_window": 16,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_theta": 1_000_000.0,
}


def test_gemma3_defaults_match_transformers() -> None:
    """What a GGUF leaves out is what transformers' Gemma3TextConfig assumes."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.Gemma3TextConfig()
    assert GEMMA3_DEFAULTS["query_pre_attn_scalar"] == ref.query_pre_attn_scalar
    assert GEMMA3_DEFAULTS["sliding_window_pattern"] == ref._sliding_window_pattern
    assert GEMMA3_DEFAULTS["rope_local_base_freq"] == ref.rope_parameters["sliding_attention"]["rope_theta"]
    args = ModelArgs.from_dict(GEMMA)
    layer_types = transformers.Gemma3TextConfig(num_hidden_layers=12, sliding_window=16).layer_types
    assert args.windows == [16 if t == "sliding_attention" else None for t in layer_types]
    assert args.rope_kinds == [1 if t == "sliding_attention" else 0 for t in layer_types]
    assert args.attn_scale == GEMMA3_DEFAULTS["query_pre_attn_scalar"] ** -0.5
    assert (args.activation, args.norm_offset, args.embed_scale) == ("gelu_tanh", 1.0, 8.0)
    assert rope_inv_freq(args, 1)[1] == pytest.approx(10_000 ** (-2 / 32))
    assert rope_inv_freq(args, 0)[1] == pytest.approx(1_000_000 ** (-2 / 32))


@pytest.mark.parametrize(
    "change,message",
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, "only its text model"),
        ({"architectures": ["Gemma2ForCausalLM"]}, "'Gemma2ForCausalLM' is not supported"),
        ({"hidden_activation": "relu"}, "activation 'relu' is not supported"),
    ],
)
def test_variants_we_do_not_implement_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelArgs.from_dict({**GEMMA, **change})
