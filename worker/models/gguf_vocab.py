"""A GGUF file's vocabulary as a Hugging Face fast tokenizer (tokenizer.json, tokenizer_config.json,
generation_config.json), the way llama.cpp reads it (llama-vocab.cpp).

Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3, Qwen) become a
``tokenizers`` BPE model with llama.cpp's pre-tokenizer for ``tokenizer.ggml.pre``. Anything else
is refused with `UnsupportedGGUFError` rather than tokenized approximately.
"""

from __future__ import annotations

from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from muxworker.worker.models.base import InvalidModelError

__all__ = ["UnsupportedGGUFError", "build_tokenizer", "require"]


class UnsupportedGGUFError(InvalidModelError):
    """The GGUF file uses an architecture, tensor or tokenizer the converter does not handle."""


def require(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise UnsupportedGGUFError(f"GGUF metadata lacks {key!r}")
    return metadata[key]


_GPT2_SPLIT = "gpt2"
_DIGITS_THEN_GPT2 = "digits"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> how llama.cpp splits text before BPE (llama-vocab.cpp). "digits" is the
# starcoder family (SmolLM included): each digit alone, then the GPT-2 pattern -- what the
# original SmolLM2 tokenizer.json does with Digits(individual_digits=True) + ByteLevel.
_PRE_TOKENIZERS = {
    "gpt2": _GPT2_SPLIT,
    "mpt": _GPT2_SPLIT,
    "olmo": _GPT2_SPLIT,
    "jais": _GPT2_SPLIT,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2,
    "exaone": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3_REGEX,
    "llama3": _LLAMA3_REGEX,
    "llama-v3": _LLAMA3_REGEX,
    "smaug-bpe": _LLAMA3_REGEX,
    "dbrx": _LLAMA3_REGEX,
}

# Token texts llama.cpp treats as end of generation when present (llama-vocab.cpp, special_eog_ids),
# besides the eos/eot/eom ids. SmolLM2's <|im_end|> (eos) and <|endoftext|> come from here.
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<|end_of_text|>")

_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    split = _PRE_TOKENIZERS.get(pre)
    if split is None:
        raise UnsupportedGGUFError(
            f"tokenizer.ggml.pre={pre!r} is not supported; supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split in (_GPT2_SPLIT, _DIGITS_THEN_GPT2))
    if split == _GPT2_SPLIT:
        return byte_level
    if split == _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])


def build_tokenizer(metadata: dict[str, Any]) -> tuple[BackendTokenizer, dict[str, Any], dict[str, Any]]:
    """(tokenizer.json, tokenizer_config.json, generation_config.json) from the GGUF vocabulary."""
    kind = require(metadata, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedGGUFError(f"tokenizer.ggml.model={kind!r}; only byte-level BPE ('gpt2') is supported")
    tokens: list[str] = list(require(metadata, "tokenizer.ggml.tokens"))
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges: list[str] = list(require(metadata, "tokenizer.ggml.merges"))
    if len(types) != len(tokens):
        raise InvalidModelError(f"{len(tokens)} tokens but {len(types)} token types")

    # Byte-level vocabularies spell every byte with one printable character. A normal token that
    # uses any other character was written as raw text; respell it so BPE can reach it.
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spelling = dict(zip(range(256), _byte_spelling()))
    vocab: dict[str, int] = {}
    for index, (token, token_type) in enumerate(zip(tokens, types)):
        if token_type not in (_CONTROL, _USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        if vocab.setdefault(token, index) != index:
            raise InvalidModelError(f"token {token!r} appears twice in the vocabulary (ids {vocab[token]} and {index})")
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise InvalidModelError(f"malformed merge {merge!r}: expected two tokens separated by one space")
        pairs.append((parts[0], parts[1]))

    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "gpt2")))
    backend.decoder = decoders.ByteLevel()
    # Control tokens are matched whole in text and are special (skippable on decode); user-defined
    # ones (like <think>) are matched whole but are ordinary text.
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    )

    def token_text(key: str) -> tuple[int | None, str | None]:
        index = metadata.get(f"tokenizer.ggml.{key}")
        if index is None or not 0 <= int(index) < len(tokens):
            return None, None
        return int(index), tokens[int(index)]

    bos_id, bos = token_text("bos_token_id")
    eos_id, eos = token_text("eos_token_id")
    _, unk = token_text("unknown_token_id")
    pad_id, pad = token_text("padding_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    specials = []
    if add_bos and bos_id is not None:
        specials.append((bos, bos_id))
    if add_eos and eos_id is not None and (eos, eos_id) not in specials:
        specials.append((eos, eos_id))

    def sequence(name: str, type_id: int) -> str:
        parts = [f"${name}:{type_id}"]
        if add_bos and bos_id is not None:
            parts.insert(0, f"{bos}:{type_id}")
        if add_eos and eos_id is not None:
            parts.append(f"{eos}:{type_id}")
        return " ".join(parts)

    backend.post_processor = processors.TemplateProcessing(
        single=sequence("A", 0), pair=f"{sequence('A', 0)} {sequence('B', 1)}", special_tokens=specials
    )

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "clean_up_tokenization_spaces": False,
    }
    arch = metadata.get("general.architecture")
    if (context := metadata.get(f"{arch}.context_length")) is not None:
        tokenizer_config["model_max_length"] = int(context)
    if (chat_template := metadata.get("tokenizer.chat_template")) is not None:
        tokenizer_config["chat_template"] = chat_template

    eog: list[int] = [eos_id] if eos_id is not None else []
    for key in ("eot_token_id", "eom_token_id"):
        if (eog_id := token_text(key)[0]) is not None:
            eog.append(eog_id)
    eog += [vocab[t] for t in _EOG_TEXTS if t in vocab]
    eog = list(dict.fromkeys(eog))
    generation_config: dict[str, Any] = {"bos_token_id": bos_id, "eos_token_id": eog[0] if len(eog) == 1 else eog}
    if pad_id is not None:
        generation_config["pad_token_id"] = pad_id
    return backend, tokenizer_config, {k: v for k, v in generation_config.items() if v is not None and v != []}


def _byte_spelling() -> list[str]:
    """GPT-2's printable spelling of bytes 0..255, in byte order (what ByteLevel.alphabet() holds,
    unordered)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]
