"""A GGUF file's vocabulary as a Hugging Face fast tokenizer (tokenizer.json, tokenizer_config.json,
generation_config.json), the way llama.cpp reads it (llama-vocab.cpp).

Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3, Qwen) become a
``tokenizers`` BPE model with llama.cpp's pre-tokenizer for ``tokenizer.ggml.pre``. SentencePiece
vocabularies (``"llama"``: Llama 2, Mistral, Gemma) become a BPE model over the pieces with merges
derived from the scores and byte fallback, built exactly as transformers builds them from the same
file (its GGUF tokenizer mapping), so both tokenize alike. Anything else is refused with
`UnsupportedGGUFError` rather than tokenized approximately.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from muxworker.worker.models.base import InvalidModelError
from muxworker.worker.models.bounds import MAX_VOCAB

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
# Qwen2's tokenizer.json pattern, which llama.cpp keeps as the comment above its rewrite of it:
# Llama 3's with each digit alone.
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
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
    "qwen2": _QWEN2_REGEX,
    "deepseek-r1-qwen": _QWEN2_REGEX,
}

# Token texts llama.cpp treats as end of generation when present (llama-vocab.cpp, special_eog_ids),
# besides the eos/eot/eom ids. SmolLM2's <|im_end|> (eos) and <|endoftext|> come from here.
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<|end_of_text|>")

_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)

# SentencePiece's stand-in for a space inside pieces.
_SPACE = "\u2581"
# Architectures whose SentencePiece vocabulary transformers builds its Gemma way (GGUF_SENTENCEPIECE_BUILDERS).
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


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
    tokens: list[str] = list(require(metadata, "tokenizer.ggml.tokens"))
    if not 1 <= len(tokens) <= MAX_VOCAB:
        raise InvalidModelError(f"tokenizer.ggml.tokens has {len(tokens)} tokens; expected 1 to {MAX_VOCAB}")
    if not all(isinstance(t, str) for t in tokens):
        raise InvalidModelError("tokenizer.ggml.tokens holds a value that is not a string")
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise InvalidModelError(f"{len(tokens)} tokens but {len(types)} token types")
    if kind == "gpt2":
        backend, vocab = _byte_level_bpe(metadata, tokens, types)
        add_bos_default = False
    elif kind == "llama":
        backend, vocab = _sentencepiece_bpe(metadata, tokens, types)
        add_bos_default = True  # llama.cpp's default for SentencePiece files that do not say
    else:
        raise UnsupportedGGUFError(
            f"tokenizer.ggml.model={kind!r}; supported: byte-level BPE ('gpt2') and SentencePiece ('llama')"
        )
    _add_vocab_tokens(backend, tokens, types, vocab)
    return (backend, *_configs(backend, metadata, tokens, vocab, add_bos_default))


def _vocab(spelled: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(spelled):
        if vocab.setdefault(token, index) != index:
            raise InvalidModelError(f"token {token!r} appears twice in the vocabulary (ids {vocab[token]} and {index})")
    return vocab


def _byte_level_bpe(
    metadata: dict[str, Any], tokens: list[str], types: list[int]
) -> tuple[BackendTokenizer, dict[str, int]]:
    merges: list[str] = list(require(metadata, "tokenizer.ggml.merges"))
    # Byte-level vocabularies spell every byte with one printable character. A normal token that
    # uses any other character was written as raw text; respell it so BPE can reach it.
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spelling = dict(zip(range(256), _byte_spelling()))
    vocab = _vocab(
        [
            token
            if token_type in (_CONTROL, _USER_DEFINED) or set(token) <= alphabet
            else "".join(spelling[b] for b in token.encode("utf-8"))
            for token, token_type in zip(tokens, types)
        ]
    )
    pairs = []
    for index, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else []
        if len(parts) != 2:
            raise InvalidModelError(
                f"tokenizer.ggml.merges[{index}] = {merge!r} is malformed: expected two tokens separated by one space"
            )
        # The tokenizers library refuses (with a bare Exception) a merge of or into an unknown token.
        for token in (*parts, parts[0] + parts[1]):
            if token not in vocab:
                raise InvalidModelError(
                    f"tokenizer.ggml.merges[{index}] = {merge!r} names {token!r}, which is not in the vocabulary"
                )
        pairs.append((parts[0], parts[1]))

    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "gpt2")))
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _sentencepiece_bpe(
    metadata: dict[str, Any], tokens: list[str], types: list[int]
) -> tuple[BackendTokenizer, dict[str, int]]:
    """A SentencePiece vocabulary as transformers' GGUF loader makes it: BPE with byte fallback over
    the pieces, a merge for every way a piece splits into two others, the best-scored piece's
    merges first, and no splitting of text between added tokens. Spaces become U+2581, with one
    more in front of the text when tokenizer.ggml.add_space_prefix says so (transformers adds it
    outside Gemma even when the flag is false; llama.cpp and we do not)."""
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre != "default":
        raise UnsupportedGGUFError(f"tokenizer.ggml.pre={pre!r} with a SentencePiece vocabulary; expected 'default'")
    if metadata.get("general.architecture") in _GEMMA_ARCHITECTURES:
        # Gemma files store the pieces made of two or more spaces with real spaces, which text never
        # holds once its spaces are U+2581; and their scores do not follow the merge order, the
        # order of the pieces in the file does. transformers' Gemma tokenizer adds no leading space
        # (Gemma files say add_space_prefix = false).
        spelled = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores: Sequence[float] = range(0, -len(tokens), -1)
        prefix = False
    else:
        spelled = tokens
        scores = list(require(metadata, "tokenizer.ggml.scores"))
        if len(scores) != len(tokens):
            raise InvalidModelError(f"{len(tokens)} tokens but {len(scores)} scores")
        prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    vocab = _vocab(spelled)
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_by_score(spelled, vocab, scores),
            unk_token=_token_at(metadata, tokens, "unknown_token_id")[1],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="first", split=False)
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    else:
        backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.decoder = decoders.Sequence(steps)
    return backend, vocab


def _token_at(metadata: dict[str, Any], tokens: list[str], key: str) -> tuple[int | None, str | None]:
    """(id, text) of the token tokenizer.ggml.<key> names, or (None, None) if it names none."""
    index = metadata.get(f"tokenizer.ggml.{key}")
    if index is None or not 0 <= int(index) < len(tokens):
        return None, None
    return int(index), tokens[int(index)]


def _merges_by_score(spelled: Sequence[str], vocab: dict[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, ordered as transformers' generate_merges orders them:
    by the whole piece's score, best first, then by longer left part, then longer right part, then
    the piece's position."""
    found = []
    for index, token in enumerate(spelled):
        for cut in range(len(token) - 1, 0, -1):  # longer left part first
            left = token[:cut]
            if left in vocab and (right := token[cut:]) in vocab:
                found.append((-scores[index], -cut, cut - len(token), left, right))
    # Already in order when the scores fall with position (Gemma): then sorting is one pass.
    found.sort(key=lambda m: m[:3])
    return [(left, right) for *_, left, right in found]


def _add_vocab_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int], vocab: dict[str, int]) -> None:
    """Control tokens are matched whole in text and are special (skippable on decode); user-defined
    ones (like <think>) are matched whole but are ordinary text. A user-defined token the vocabulary
    respelled (Gemma's runs of spaces) is reached through the model instead, as transformers does."""
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for i, (t, k) in enumerate(zip(tokens, types))
            if k == _USER_DEFINED and vocab.get(t) == i
        ]
    )


def _configs(
    backend: BackendTokenizer, metadata: dict[str, Any], tokens: list[str], vocab: dict[str, int], add_bos_default: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sets the post-processor that adds BOS/EOS as the file says; returns (tokenizer_config,
    generation_config)."""
    bos_id, bos = _token_at(metadata, tokens, "bos_token_id")
    eos_id, eos = _token_at(metadata, tokens, "eos_token_id")
    _, unk = _token_at(metadata, tokens, "unknown_token_id")
    pad_id, pad = _token_at(metadata, tokens, "padding_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default))
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
        if (eog_id := _token_at(metadata, tokens, key)[0]) is not None:
            eog.append(eog_id)
    eog += [vocab[t] for t in _EOG_TEXTS if t in vocab]
    eog = list(dict.fromkeys(eog))
    generation_config: dict[str, Any] = {"bos_token_id": bos_id, "eos_token_id": eog[0] if len(eog) == 1 else eog}
    if pad_id is not None:
        generation_config["pad_token_id"] = pad_id
    return tokenizer_config, {k: v for k, v in generation_config.items() if v is not None and v != []}


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
