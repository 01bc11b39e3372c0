"""Tiny random Hugging Face model directories for tests (written with transformers, the oracle).

Each directory is a complete HF model: config.json, model.safetensors, tokenizer.json (a byte-level
BPE trained here on a small corpus), tokenizer_config.json with a ChatML chat template, and
generation_config.json. A worker starts on one in about a second.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def hello(name):\n    return f'Hello, {name}!'\n" * 3,
    "Sessions are saved to disk and resumed later without recomputing the prefix. " * 3,
    "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001f600 \U0001f680 emoji and unicode text. " * 3,
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" \n\t" * 3,
]

ARCH_CONFIGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "llama3": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=True,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        use_sliding_window=False,
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        sliding_window=16,
        tie_word_embeddings=False,
    ),
    # q/k norms; head_dim apart from hidden / heads.
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    # Local and global layers with their own rope bases, a query scale apart from head_dim, GELU,
    # (1 + weight) norms, scaled embeddings.
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=24,
        rms_norm_eps=1e-6,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
}
_CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok


def tiny_tokenizer(added_tokens: tuple[str, ...] = ()):
    """The tiny models' tokenizer (a ``tokenizers.Tokenizer``), with ``added_tokens`` as
    :func:`write_tiny_model` adds them."""
    tok = _train_tokenizer(384)
    if added_tokens:
        from tokenizers import AddedToken

        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    return tok


def write_tiny_model(
    path: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    max_position_embeddings: int = 4096,
    chat_template: str = CHAT_TEMPLATE,
    added_tokens: tuple[str, ...] = (),
    **overrides,
) -> Path:
    """Write a tiny random model of ``arch`` to ``path`` and return it (``chat_template``: its
    tokenizer_config.json's; ChatML by default; ``added_tokens``: more single tokens of the
    vocabulary, added as Qwen3 adds ``<think>`` and ``</think>``: not special, so they decode as text)."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer(added_tokens)
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|im_end|>")
    bos = tok.token_to_id("<|endoftext|>")
    cfg = dict(ARCH_CONFIGS[arch])
    cfg.update(overrides)
    cls_name = cfg["architectures"][0]
    config_cls = getattr(transformers, _CONFIG_CLASSES.get(cls_name, cls_name.replace("ForCausalLM", "Config")))
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config = config_cls(
        vocab_size=vocab,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
        **kwargs,
    )
    config.architectures = [cls_name]
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config)
    # Larger than the default init so that logits are far from uniform and greedy choices are stable.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.15 if "embed" in name else 0.08)
            elif "norm" in name and cls_name in _CONFIG_CLASSES | {"Qwen3ForCausalLM": ""}:
                p.add_(torch.randn_like(p) * 0.1)  # norms that start at 0 or 1 would hide an offset
    model.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": chat_template,
                "bos_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": max_position_embeddings,
            },
            indent=2,
        )
    )
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    return path
