"""Prompts too long for the context are refused before the expensive part (client/serve/prompt_bound.py):
the byte bound from the tokenizer's longest token, the chunked count, and what the tokenizer's
``max_token_bytes`` is for tokenizers that keep every byte of their input and those that may not."""

from __future__ import annotations

import random

import pytest
from helpers.gguf_files import converted_smollm
from helpers.tiny_models import tiny_tokenizer
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from muxworker.serve.prompt_bound import (
    CUT_SLACK_TOKENS,
    WHOLE_BYTES_PER_TOKEN,
    check_bytes,
    chunk_cuts,
    encode_within,
    string_bytes,
    utf8_len,
)
from muxworker.transport.errors import ContextOverflow
from muxworker.worker.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smollm(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(converted_smollm(tmp_path_factory.getbasetemp()))


def _texts(seed: int) -> list[str]:
    """Text of every kind the tokenizers split differently: words, code, runs of spaces and
    newlines, digits, punctuation, CJK, emoji, special-token markers."""
    rng = random.Random(seed)
    pieces = [
        "word", " word", "  two spaces", "\n", "\n\n", "    indented", "\t", "x" * 50, " " * 40, "12345678",
        "3.14", "naïve", "日本語", "😀👍🏽", "<|im_start|>", "<|im_end|>\n", "def f(a, b):\n    return a + b\n",
        "\u2581", "'s", "?!", "\r\n",
    ]  # fmt: skip
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 3000))) for _ in range(40)]


def test_longest_token_bounds_every_texts_token_count(smollm: Tokenizer) -> None:
    # SmolLM2's longest token is a newline and 80 spaces; no text has fewer tokens than its bytes
    # over that, special tokens parsed or not.
    assert smollm.max_token_bytes == 81
    tiny = Tokenizer(tiny_tokenizer())
    assert tiny.max_token_bytes is not None
    for tok in (smollm, tiny):
        limit = tok.max_token_bytes
        assert limit is not None
        for text in [*_texts(0), "\n" + " " * 80, ("\n" + " " * 80) * 100]:
            for special in (False, True):
                assert len(tok.encode(text, parse_special=special)) * limit >= utf8_len(text)


def test_no_byte_bound_for_tokenizers_that_may_drop_input() -> None:
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "ab": 3}

    def tokenizer(model=None, normalizer=None, pre=None) -> Tokenizer:
        backend = BackendTokenizer(model or models.BPE(vocab, [("a", "b")], unk_token="[UNK]"))
        if normalizer is not None:
            backend.normalizer = normalizer
        if pre is not None:
            backend.pre_tokenizer = pre
        return Tokenizer(backend)

    assert tokenizer().max_token_bytes == 5  # the unknown token's own text; "ab" is 2 bytes
    assert tokenizer(normalizer=normalizers.NFKC()).max_token_bytes == 20  # U+1D400 (4 bytes) -> "A"
    assert tokenizer(normalizer=normalizers.Replace(" ", "\u2581")).max_token_bytes == 5
    assert tokenizer(pre=pre_tokenizers.Metaspace()).max_token_bytes == 5
    dropping = [
        tokenizer(normalizer=normalizers.Strip()),
        tokenizer(normalizer=normalizers.BertNormalizer()),
        tokenizer(normalizer=normalizers.Sequence([normalizers.NFC(), normalizers.StripAccents()])),
        tokenizer(normalizer=normalizers.Replace("ab", "")),
        tokenizer(pre=pre_tokenizers.Whitespace()),
        tokenizer(pre=pre_tokenizers.Split(" ", behavior="removed")),
        tokenizer(model=models.WordPiece(vocab, unk_token="[UNK]")),
        tokenizer(model=models.BPE(vocab, [("a", "b")], unk_token="[UNK]", fuse_unk=True)),
        tokenizer(model=models.BPE(vocab, [("a", "b")])),  # unknown characters vanish
    ]
    assert [t.max_token_bytes for t in dropping] == [None] * len(dropping)
    # A whole run of unknown characters is one token: no bound from the vocabulary.
    assert len(dropping[-2].encode("xyz" * 1000)) == 1


def test_check_bytes_refuses_what_cannot_fit() -> None:
    check_bytes(81 * 8191, 8192, 81)  # at least 8191 tokens: may fit
    with pytest.raises(ContextOverflow, match="at least 8192 tokens; a session holds at most 8192"):
        check_bytes(81 * 8191 + 1, 8192, 81)
    check_bytes(10**9, 8192, None)  # no bound known
    check_bytes(10**9, None, 81)  # no context known (no worker yet)
    assert string_bytes({"messages": [{"role": "user", "content": "ü"}], "n": 3}) == len("user") + 2


def test_chunks_are_cut_between_words() -> None:
    text = " ".join(["word"] * 5000) + "\n" + "x" * 20000 + "  y"
    cuts = list(chunk_cuts(text, 4096))
    assert cuts[-1] == len(text) and cuts == sorted(set(cuts))
    for cut in cuts[:-1]:
        if text[cut - 1] == "x" and text[cut] == "x":
            continue  # a word longer than the window: cut inside it
        assert text[cut] in " \n" and not text[cut - 1].isspace() and not text[cut + 1].isspace(), cut
    assert all(b - a >= 4096 for a, b in zip([0, *cuts], cuts[:-1]))


def test_chunked_count_is_the_whole_texts_count(smollm: Tokenizer) -> None:
    # For byte-level BPE a cut before a lone space between words changes no token: the chunks
    # count what the whole text has, and the slack per cut is never needed there.
    for text in _texts(1):
        for special in (False, True):
            whole = len(smollm.encode(text, parse_special=special))
            cuts = list(chunk_cuts(text, 4096))
            counted = sum(len(smollm.encode(text[a:b], parse_special=special)) for a, b in zip([0, *cuts], cuts))
            assert counted == whole


def test_encode_within_returns_the_whole_texts_tokens_when_they_fit(smollm: Tokenizer) -> None:
    def encode(text: str) -> list[int]:
        return smollm.encode(text, parse_special=False)

    text = " ".join(["lighthouse"] * 30000)  # 330 KB, about 30,000 tokens: counted in chunks, then whole
    tokens = encode(text)
    assert len(text) > WHOLE_BYTES_PER_TOKEN * len(tokens)
    for bound in (smollm.max_token_bytes, None):
        assert encode_within(encode, text, len(tokens) + 1, bound) == tokens  # one token left for the reply
        with pytest.raises(ContextOverflow, match=f"at least {len(tokens)} tokens"):
            encode_within(encode, text, len(tokens), bound)  # none left
    short = "a short prompt"
    assert encode_within(encode, short, 8192, smollm.max_token_bytes) == encode(short)
    assert encode_within(encode, text, None, None) == tokens  # no context known: no bound


def test_encode_within_costs_the_room_not_the_body(smollm: Tokenizer) -> None:
    seen: list[int] = []

    def encode(text: str) -> list[int]:
        seen.append(len(text))
        return smollm.encode(text, parse_special=False)

    body = " ".join(random.Random(2).choice(["lighthouse", "keeper", "a", "storm"]) for _ in range(700_000))
    assert len(body) > 3_500_000
    # With the byte bound nothing is tokenized at all.
    with pytest.raises(ContextOverflow, match="a session holds at most 8192"):
        encode_within(encode, body, 8192, smollm.max_token_bytes)
    assert seen == []
    # Without it (a tokenizer that may drop input), the count stops at the first chunk past the
    # room: about the room's worth of text (8,192 tokens of ~5 bytes each here) plus one chunk.
    for room in (8192, 131072):
        seen.clear()
        with pytest.raises(ContextOverflow) as info:
            encode_within(encode, body, room, None)
        tokens = len(smollm.encode(body[: sum(seen)], parse_special=False))
        assert room <= tokens < room + 65536
        assert sum(seen) < len(body) // 4
        given = int(str(info.value).split("at least ")[1].split()[0])
        assert room <= given <= tokens and given >= tokens - CUT_SLACK_TOKENS * len(seen)
