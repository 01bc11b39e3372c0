"""The tokenizer built from a GGUF vocabulary, checked against transformers' tokenizer loaded from the
same file: the real Gemma 3 270M SentencePiece vocabulary (262,144 pieces), tiny SentencePiece files
written here, and the Qwen2 pre-tokenizer of byte-level files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import pytest
import regex
from helpers.gguf_files import byte_alphabet, write_tiny_gguf
from tokenizers import Tokenizer as BackendTokenizer

from muxworker.worker.models.gguf_file import GGUFFile
from muxworker.worker.models.gguf_vocab import UnsupportedGGUFError, build_tokenizer
from muxworker.worker.models.loader import GEMMA_PACKAGE, named_model_path
from muxworker.worker.models.tokenizer import Tokenizer

CORPUS = [
    "",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog. It's, they're, we'll, I'd've.",
    "naïve café, Ünïcödé façade — “quotes” and ‘apostrophes’ … ellipsis",
    "日本語のテキストです。中文文本也在这里。한국어 텍스트.",
    "עברית מימין לשמאל, والعربية أيضاً: مرحبا بالعالم",
    "emoji 😀👍🏽 flags 🇫🇷🇯🇵 family 👨‍👩‍👧‍👦 and ❤️ and a rare one 🫠",
    "tabs\tand\t\ttabs, spaces    inside   and trailing   ",
    "   leading spaces\n\n\nblank lines\r\nwindows\r\n",
    " ",
    "  ",
    "\n",
    "\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t indented deep",
    " " * 40 + "x" + " " * 33,
    "numbers 0 12 345 6789 3.14159 1e-9 2,000,000 and  42 with two spaces",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "text with <eos> inside and <pad><unk><mask> and <start_of_turn without its end",
    "an image <start_of_image> here <end_of_image> and [multimodal]",
    "<unused0><unused6241> and <0x41> written out",
    "control bytes \x00\x01\x7f, ÿ, and characters only byte fallback spells: 𠀀𓀀",
    "Ĝ weird letters ŉ ǅ ﬁ ℌ ⅷ ① ²",
]


# ------------------------------------------------------------------------------------------
# The real Gemma 3 270M vocabulary


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    pytest.importorskip(GEMMA_PACKAGE)
    return named_model_path("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_built(gemma_gguf: Path) -> tuple[BackendTokenizer, dict[str, Any], dict[str, Any]]:
    """Our tokenizer files from the real file's metadata."""
    return build_tokenizer(GGUFFile(gemma_gguf).metadata)


@pytest.fixture(scope="module")
def gemma(gemma_built, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """Our tokenizer as the runtime loads it: through the tokenizer.json conversion writes."""
    backend, tokenizer_config, generation_config = gemma_built
    path = tmp_path_factory.mktemp("gemma") / "tokenizer.json"
    backend.save(str(path))
    return Tokenizer(
        BackendTokenizer.from_file(str(path)),
        tokenizer_config=tokenizer_config,
        generation_config=generation_config,
    )


@pytest.fixture(scope="module")
def gemma_reference(gemma_gguf: Path):
    """transformers' tokenizer from the same GGUF (about 15-25 s to build, so once per module)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)


def test_gemma_model_equals_transformers(gemma_built, gemma_reference) -> None:
    """Same tokenizer.json: pieces, merges in the same order, added tokens, normalizer,
    post-processor and decoder. transformers also sets a pre-tokenizer that splits on " ", which
    never occurs once the normalizer has made every space U+2581; ours has none."""
    split = '"pre_tokenizer":{"type":"Split","pattern":{"String":" "},"behavior":"MergedWithPrevious","invert":false}'
    theirs = gemma_reference.backend_tokenizer.to_str()
    assert split in theirs
    theirs = theirs.replace(split, '"pre_tokenizer":null')
    ours = gemma_built[0].to_str()
    # Compared as text (12 MB): pytest would take minutes to diff the parsed JSON.
    same = ours == theirs
    assert same, f"tokenizer.json differs from character {len(os.path.commonprefix([ours, theirs]))}"


@pytest.mark.parametrize("text", CORPUS)
def test_gemma_encode_equals_transformers(gemma: Tokenizer, gemma_reference, text: str) -> None:
    # A rendered chat template: special-token markers become their ids.
    assert gemma.encode(text, add_special_tokens=True, parse_special=True) == gemma_reference.encode(text)
    assert gemma.encode(text, parse_special=True) == gemma_reference.encode(text, add_special_tokens=False)
    # Plain text: markers are characters; the oracle is transformers with split_special_tokens.
    gemma_reference.split_special_tokens = True
    try:
        assert gemma.encode(text, add_special_tokens=True) == gemma_reference.encode(text)
    finally:
        gemma_reference.split_special_tokens = False


@pytest.mark.parametrize("text", CORPUS)
def test_gemma_decode_equals_transformers(gemma: Tokenizer, gemma_reference, text: str) -> None:
    for ids in (gemma.encode(text, add_special_tokens=True, parse_special=True), gemma.encode(text)):
        for skip in (False, True):
            assert gemma.decode(ids, skip_special_tokens=skip) == gemma_reference.decode(ids, skip_special_tokens=skip)
    assert gemma.decode(gemma.encode(text)) == text
    assert gemma.decode(gemma.encode(text, parse_special=True)) == text


def test_gemma_special_tokens(gemma: Tokenizer, gemma_built) -> None:
    _, tokenizer_config, generation_config = gemma_built
    assert gemma.bos_token_id == 2
    assert gemma.eos_token_ids == [1, 106]  # <eos>, <end_of_turn>
    assert generation_config == {"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0}
    assert tokenizer_config["add_bos_token"] is True
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<bos>", "<eos>")
    assert (tokenizer_config["unk_token"], tokenizer_config["pad_token"]) == ("<unk>", "<pad>")
    assert gemma.vocab_size == 262144
    # Control tokens are special: parsed only when asked, skipped on decode.
    assert gemma.encode("<start_of_turn>", parse_special=True) == [105]
    assert 105 not in gemma.encode("<start_of_turn>")
    assert gemma.decode([2, 105, 106], skip_special_tokens=True) == ""
    # User-defined tokens are text: always whole, never skipped.
    assert gemma.encode("<start_of_image>") == [255999]
    assert gemma.decode([255999], skip_special_tokens=True) == "<start_of_image>"
    # BOS once, from the post-processor.
    assert gemma.encode("", add_special_tokens=True) == [2]


def test_gemma_token_bytes(gemma: Tokenizer) -> None:
    assert [gemma.token_bytes(i) for i in (238, 238 + 0x41, 238 + 0xE2, 493)] == [b"\x00", b"A", b"\xe2", b"\xff"]
    assert gemma.id_to_token(238 + 0xE2) == "<0xE2>"
    # Pieces: U+2581 is a space, and the runs of spaces the file spells with real ones are pieces too.
    assert gemma.token_bytes(gemma.token_to_id("\u2581the")) == b" the"
    assert gemma.id_to_token(138) == "\u2581\u2581"
    assert gemma.token_bytes(138) == b"  "
    # A character with no piece of its own: four byte tokens.
    assert gemma.encode("\U00020000") == [238 + 0xF0, 238 + 0xA0, 238 + 0x80, 238 + 0x80]
    assert b"".join(gemma.token_bytes(i) for i in gemma.encode("\U00020000")) == "\U00020000".encode()


# ------------------------------------------------------------------------------------------
# Tiny SentencePiece files

BYTES = [f"<0x{b:02X}>" for b in range(256)]


def write_spm_gguf(path: Path, arch: str, pieces: list[tuple[str, float]], *, add_space_prefix: bool) -> None:
    """A GGUF holding only a SentencePiece vocabulary: special tokens named as the architecture's
    transformers tokenizer expects them, user-defined tokens (runs of spaces among them), the 256
    byte tokens, then `pieces` with their scores."""
    bos, eos = ("<bos>", "<eos>") if arch == "gemma3" else ("<s>", "</s>")
    specials = ["<pad>", eos, bos, "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    user_defined = ["\n", "  ", "   ", "<tool>"]
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(128)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([*specials, *user_defined, *BYTES, *(p for p, _ in pieces)])
    w.add_token_types([3] * len(specials) + [4] * len(user_defined) + [6] * 256 + [1] * len(pieces))
    w.add_token_scores([-1000.0] * (len(specials) + len(user_defined)) + [0.0] * 256 + [s for _, s in pieces])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Scores out of file order, and tied, so that merge order by score, by file order and by the
# tie-breaks all differ.
PIECES = [
    ("\u2581", -1.0),
    ("h", -2.0),
    ("e", -2.0),
    ("l", -2.0),
    ("o", -2.0),
    ("w", -2.0),
    ("r", -2.0),
    ("d", -2.0),
    ("he", -5.0),
    ("ll", -3.0),
    ("\u2581h", -4.0),
    ("llo", -6.0),
    ("hello", -9.0),
    ("\u2581hello", -7.0),
    ("or", -3.0),
    ("\u2581w", -4.0),
    ("\u2581wor", -8.0),
    ("ld", -8.0),
    ("\u2581world", -8.0),
    ("lo", -1.5),
    ("hel", -9.0),
]
TINY_CORPUS = [
    "",
    "hello world",
    " hello  world ",
    "helloworld hello   world",
    "<start_of_turn>hello\n<tool>world<end_of_turn>\n",
    "<bos>hello<eos><s>hello</s>",
    "héllo wörld 日本 🫠",
    "\n\n  \t",
]


def tiny_tokenizer(path: Path) -> Tokenizer:
    backend, tokenizer_config, generation_config = build_tokenizer(GGUFFile(path).metadata)
    return Tokenizer(backend, tokenizer_config=tokenizer_config, generation_config=generation_config)


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_tiny_sentencepiece_equals_transformers(tmp_path: Path, arch: str) -> None:
    """Gemma files are built transformers' Gemma way (runs of spaces respelled, merges in file
    order, no leading space); other architectures its Llama way (merges by score, a leading
    U+2581 that decoding strips)."""
    transformers = pytest.importorskip("transformers")
    write_spm_gguf(tmp_path / "tiny.gguf", arch, PIECES, add_space_prefix=arch != "gemma3")
    ours = tiny_tokenizer(tmp_path / "tiny.gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")

    ours_json, theirs_json = json.loads(ours.backend.to_str()), json.loads(theirs.backend_tokenizer.to_str())
    # transformers' Llama way names no unk token: with all 256 byte tokens there it is never used.
    theirs_json["model"]["unk_token"] = "<unk>"
    assert ours_json["model"] == theirs_json["model"]
    assert ours_json["added_tokens"] == theirs_json["added_tokens"]
    for text in TINY_CORPUS:
        ids = ours.encode(text, add_special_tokens=True, parse_special=True)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text
        theirs.split_special_tokens = True
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
        theirs.split_special_tokens = False


def test_tiny_sentencepiece_pieces(tmp_path: Path) -> None:
    """Hand-checked pieces: the leading U+2581, merges by score, byte fallback, whole added tokens."""
    write_spm_gguf(tmp_path / "tiny.gguf", "llama", PIECES, add_space_prefix=True)
    tok = tiny_tokenizer(tmp_path / "tiny.gguf")

    def pieces(text: str, **kwargs: Any) -> list[str | None]:
        return [tok.id_to_token(i) for i in tok.encode(text, **kwargs)]

    # "lo" (-1.5) merges before "ll" (-3) and takes the second "l"; "\u2581h" (-4) before "he" (-5).
    assert pieces("hello world", add_special_tokens=True) == ["<s>", "\u2581h", "e", "llo", "\u2581world"]
    assert pieces("h\u00e9") == ["\u2581h", "<0xC3>", "<0xA9>"]
    # The leading U+2581 only at the start of the text; user-defined "  " whole, even in plain text.
    assert pieces("x<tool>  x", parse_special=True) == ["\u2581", "<0x78>", "<tool>", "  ", "<0x78>"]
    assert pieces("<tool>  x") == ["<tool>", "  ", "<0x78>"]
    assert tok.decode(tok.encode("hello world", add_special_tokens=True), skip_special_tokens=True) == "hello world"


def test_tiny_sentencepiece_without_space_prefix(tmp_path: Path) -> None:
    """tokenizer.ggml.add_space_prefix = false (llama.cpp honours it): no leading U+2581, and decoding
    strips nothing. transformers ignores the flag outside Gemma and always adds one."""
    write_spm_gguf(tmp_path / "tiny.gguf", "llama", PIECES, add_space_prefix=False)
    tok = tiny_tokenizer(tmp_path / "tiny.gguf")
    assert [tok.id_to_token(i) for i in tok.encode("hello world")] == ["hello", "\u2581world"]
    assert tok.decode(tok.encode(" hello")) == " hello"


def test_sentencepiece_refuses_a_pre_tokenizer(tmp_path: Path) -> None:
    write_spm_gguf(tmp_path / "tiny.gguf", "llama", PIECES, add_space_prefix=True)
    metadata = GGUFFile(tmp_path / "tiny.gguf").metadata
    with pytest.raises(UnsupportedGGUFError, match="tokenizer.ggml.pre='llama-bpe' with a SentencePiece"):
        build_tokenizer({**metadata, "tokenizer.ggml.pre": "llama-bpe"})
    with pytest.raises(UnsupportedGGUFError, match="tokenizer.ggml.model='bert'"):
        build_tokenizer({**metadata, "tokenizer.ggml.model": "bert"})


# ------------------------------------------------------------------------------------------
# Qwen2's pre-tokenizer

# llama.cpp's spelling of Qwen2's pattern (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_QWEN2), which
# writes the case-insensitive contractions out instead of using (?i:...).
LLAMA_CPP_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def test_qwen2_pre_tokenizer(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", pre="qwen2")
    tok = tiny_tokenizer(tmp_path / "tiny.gguf")
    # Each digit alone, and the space before a number is its own piece: the merges "Ġ1" and
    # "12" never apply.
    assert [tok.id_to_token(i) for i in tok.encode("a 12 the")] == ["a", "Ġ", "1", "2", "Ġthe"]
    spelling = byte_alphabet()
    for text in [*CORPUS, "It'S 2024's THE'LL 100,000.5\n\n\r\n  x  \n"]:
        expected = ["".join(spelling[b] for b in piece.encode()) for piece in regex.findall(LLAMA_CPP_QWEN2, text)]
        assert [piece for piece, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)] == expected, text


def test_qwen2_tiny_gguf_equals_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    write_tiny_gguf(tmp_path / "tiny.gguf", pre="qwen2")
    ours = tiny_tokenizer(tmp_path / "tiny.gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    for text in [*CORPUS, "the thing 12 1 121  1", "<think>inside</think> the"]:
        assert ours.encode(text, parse_special=True) == theirs.encode(text, add_special_tokens=False), text
