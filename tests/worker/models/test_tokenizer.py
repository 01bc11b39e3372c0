"""The tokenizer built from the GGUF, checked against transformers' tokenizer loaded from the same
file, its chat template rendering, and streaming detokenization."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.gguf_files import TINY_TEMPLATE, converted_smollm, write_tiny_gguf
from tokenizers import pre_tokenizers

from muxworker.worker.models.convert import convert_gguf
from muxworker.worker.models.loader import bundled_gguf_path
from muxworker.worker.models.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

CORPUS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog. It's, they're, we'll, I'd've.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "naïve café, Ünïcödé façade — “quotes” and ‘apostrophes’ … ellipsis",
    "日本語のテキストです。中文文本也在这里。한국어 텍스트.",
    "emoji 😀👍🏽 flags 🇫🇷🇯🇵 family 👨‍👩‍👧‍👦 and ❤️",
    "tabs\tand\t\ttabs, spaces    inside   and trailing   ",
    "   leading spaces\n\n\nblank lines\r\nwindows\r\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>start and end<|endoftext|>",
    "numbers 0 12 345 6789 3.14159 1e-9 2,000,000 and  42 with two spaces",
    "",
    " ",
    "Ĝ weird bytes \x00\x01\x7f ok",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}],
    [
        {"role": "user", "content": "What's 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And in 日本語? 🤔"},
    ],
]


@pytest.fixture(scope="session")
def smollm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return converted_smollm(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def tokenizer(smollm_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm_dir)


@pytest.fixture(scope="module")
def transformers_gguf_tokenizer(smollm2_reference):
    """transformers' tokenizer built from the GGUF file itself."""
    return smollm2_reference[0]


@pytest.fixture(scope="module")
def reference_tokenizer(transformers_gguf_tokenizer):
    """transformers' GGUF tokenizer with the pre-tokenizer SmolLM2 is meant to have.

    The file says tokenizer.ggml.pre = "smollm". llama.cpp splits such text into single digits
    first and then by the GPT-2 pattern, as does the tokenizer.json SmolLM2 was published with
    (Digits(individual_digits=True) then ByteLevel). transformers has no entry for "smollm" and
    falls back to plain GPT-2 splitting, which differs where whitespace precedes a digit.
    """
    transformers = pytest.importorskip("transformers")
    path = bundled_gguf_path()
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return reference


# ------------------------------------------------------------------------------------------
# Encoding and decoding


@pytest.mark.slow
@pytest.mark.parametrize("text", CORPUS)
def test_encode_equals_reference(tokenizer: Tokenizer, reference_tokenizer, text: str) -> None:
    assert tokenizer.encode(text, parse_special=True) == reference_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_only_digit_splitting_differs_from_transformers_gguf(tokenizer: Tokenizer, transformers_gguf_tokenizer) -> None:
    differing = [
        t
        for t in CORPUS
        if tokenizer.encode(t, parse_special=True) != transformers_gguf_tokenizer.encode(t, add_special_tokens=False)
    ]
    assert all(any(c.isdigit() for c in t) for t in differing), differing
    # The known case: two spaces before a digit are one token ("ĠĠ") when digits split first.
    ours = [tokenizer.id_to_token(i) for i in tokenizer.encode("x  1", parse_special=True)]
    theirs = transformers_gguf_tokenizer.convert_ids_to_tokens(
        transformers_gguf_tokenizer.encode("x  1", add_special_tokens=False)
    )
    assert ours == ["x", "ĠĠ", "1"]
    assert theirs == ["x", "Ġ", "Ġ", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("text", CORPUS)
def test_decode_round_trips_and_equals_transformers(tokenizer: Tokenizer, reference_tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, parse_special=True)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids) == reference_tokenizer.decode(ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == reference_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("text", CORPUS)
def test_plain_text_never_yields_special_tokens(tokenizer: Tokenizer, reference_tokenizer, text: str) -> None:
    """Markers in plain text (user text, tool output) are characters, not role turns: the oracle is
    transformers with split_special_tokens=True."""
    ids = tokenizer.encode(text)
    assert not {0, 1, 2} & set(ids)  # <|endoftext|>, <|im_start|>, <|im_end|>
    assert tokenizer.decode(ids) == text
    reference_tokenizer.split_special_tokens = True
    try:
        assert ids == reference_tokenizer.encode(text, add_special_tokens=False)
    finally:
        reference_tokenizer.split_special_tokens = False


def test_special_tokens(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("<|im_start|>") == tokenizer.encode("<|im_start|>", parse_special=False)
    assert 1 not in tokenizer.encode("<|im_start|>user")
    assert tokenizer.encode("<|im_start|>", parse_special=True) == [1]
    assert tokenizer.encode("<|im_end|><|endoftext|>", parse_special=True) == [2, 0]
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == [2, 0]  # <|im_end|>, <|endoftext|>
    assert tokenizer.vocab_size == 49152
    # SmolLM2 adds no BOS even when asked for special tokens (tokenizer.ggml.add_bos_token = false).
    assert tokenizer.encode("hi", add_special_tokens=True, parse_special=True) == tokenizer.encode(
        "hi", parse_special=True
    )
    assert tokenizer.decode([1, 2], skip_special_tokens=True) == ""
    # A tokenizer_config asking for BOS whose tokenizer.json does not add it: we add it, once.
    with_bos = Tokenizer(tokenizer.backend, tokenizer_config={"add_bos_token": True, "bos_token": "<|im_start|>"})
    assert with_bos.encode("hi", add_special_tokens=True, parse_special=True) == [
        1,
        *tokenizer.encode("hi", parse_special=True),
    ]
    assert with_bos.encode("hi", parse_special=True) == tokenizer.encode("hi", parse_special=True)


@pytest.mark.slow
def test_transformers_reads_our_tokenizer_files(smollm_dir: Path, tokenizer: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    for text in CORPUS:
        assert theirs.encode(text, add_special_tokens=False) == tokenizer.encode(text, parse_special=True)
    assert theirs.eos_token == "<|im_end|>"
    for messages in CONVERSATIONS:
        assert theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
            tokenizer.apply_chat_template(messages)
        )


# ------------------------------------------------------------------------------------------
# Chat template


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_equals_transformers(
    tokenizer: Tokenizer, transformers_gguf_tokenizer, messages: list, add_generation_prompt: bool
) -> None:
    expected = transformers_gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


FEATURE_TEMPLATE = """
{%- set ns = namespace(count=0) -%}
{%- for m in messages -%}
  {%- if m['role'] not in ['user', 'assistant', 'system'] -%}
    {{ raise_exception('unknown role ' + m['role']) }}
  {%- endif -%}
  {%- if m['role'] == 'system' %}{% continue %}{% endif -%}
  {%- set ns.count = ns.count + 1 -%}
  {{ bos_token }}{{ m['role'] }}: {{ m['content'] | tojson }}
  {%- if m['role'] == 'assistant' %}{% generation %} [{{ ns.count }}]{% endgeneration %}{% endif %}
{{ eos_token }}
{% endfor -%}
{%- if tools %}tools={{ tools | tojson(indent=2) }}{% endif -%}
{%- if add_generation_prompt %}assistant:{% endif -%}
{%- if 'reasoning_content' in messages[-1] %} thinking={{ messages[-1]['thinking'] }}{% endif -%}
"""


@pytest.mark.slow
def test_template_environment_matches_transformers(tokenizer: Tokenizer, transformers_gguf_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "skipped"},
        {"role": "user", "content": '<b>html & "quotes"</b> 日本'},
        {"role": "assistant", "content": "ok", "tool_calls": None},
        {"role": "user", "content": "more", "reasoning": "hmm"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": "é"}}}]
    ours = Tokenizer(
        tokenizer.backend, tokenizer_config={"bos_token": "<s>", "eos_token": "</s>"}, chat_template=FEATURE_TEMPLATE
    )
    expected = transformers_gguf_tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
        chat_template=FEATURE_TEMPLATE,
        bos_token="<s>",
        eos_token="</s>",
    )
    assert ours.apply_chat_template(messages, tools=tools) == expected
    assert "thinking=hmm" in expected and '"<b>html' in expected


def test_template_errors_are_chat_template_errors(tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        tokenizer.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="must be dicts"):
        tokenizer.apply_chat_template(["hello"])
    strict = Tokenizer(tokenizer.backend, chat_template=FEATURE_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        strict.apply_chat_template([{"role": "tool", "content": "x"}])
    no_template = Tokenizer(tokenizer.backend)
    assert not no_template.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        Tokenizer(tokenizer.backend, chat_template="{% for %}").apply_chat_template([{"role": "user", "content": "x"}])


def test_strftime_now_is_available(tokenizer: Tokenizer) -> None:
    dated = Tokenizer(tokenizer.backend, chat_template="{{ strftime_now('%Y') }}")
    assert dated.apply_chat_template([{"role": "user", "content": "x"}]).isdigit()


# ------------------------------------------------------------------------------------------
# Streaming detokenization

STREAMS = [
    "emoji 😀👍🏽🇫🇷 and a family 👨‍👩‍👧‍👦!",
    "日本語のテキストと中文，还有한국어",
    "mixed ascii, ünïcödé, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math, and 🤖🦀🐍 animals " * 3,
    "<|im_start|>assistant\n你好 👋<|im_end|>",
]


@pytest.mark.parametrize("skip_special_tokens", [False, True])
@pytest.mark.parametrize("text", STREAMS)
def test_incremental_detokenizer_one_token_at_a_time(
    tokenizer: Tokenizer, text: str, skip_special_tokens: bool
) -> None:
    ids = tokenizer.encode(text, parse_special=True)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # multi-byte characters spanning tokens were held back


@pytest.mark.parametrize("text", STREAMS)
def test_incremental_detokenizer_chunks_and_prompt_context(tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", parse_special=True)
    ids = tokenizer.encode(text, parse_special=True)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.push(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_flushes_incomplete_bytes(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 😀", parse_special=True)
    partial = ids[:-1]  # the emoji's bytes span tokens; drop the last one
    assert tokenizer.decode(partial).endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detok.push(i) for i in partial)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tokenizer.decode(partial)
    assert detok.flush() == ""


def test_incremental_detokenizer_decodes_a_bounded_window(tokenizer: Tokenizer) -> None:
    lengths: list[int] = []

    class Counting(Tokenizer):
        def decode(self, ids, skip_special_tokens=False):  # type: ignore[override]
            lengths.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    counting = Counting(tokenizer.backend)
    ids = tokenizer.encode(STREAMS[2] * 5, parse_special=True)
    detok = IncrementalDetokenizer(counting)
    assert "".join(detok.push(i) for i in ids) + detok.flush() == tokenizer.decode(ids)
    assert len(ids) > 300
    assert max(lengths) <= 8  # never the whole history


# ------------------------------------------------------------------------------------------
# Tokenizers built from a tiny GGUF, for pre-tokenizers transformers knows


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe"])
def test_tiny_gguf_tokenizer_equals_transformers(tmp_path: Path, pre: str) -> None:
    transformers = pytest.importorskip("transformers")
    write_tiny_gguf(tmp_path / "tiny.gguf", pre=pre)
    ours = Tokenizer.from_dir(convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=None))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    for text in [*CORPUS, "the thing 12 1 121  1", "<think>inside</think> the"]:
        assert ours.encode(text, parse_special=True) == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text, parse_special=True)) == text
    assert ours.encode("<think>", parse_special=True) == [267]  # a user-defined token stays whole
    messages = CONVERSATIONS[2]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours.chat_template == TINY_TEMPLATE


def test_tiny_gguf_add_bos_token(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    write_tiny_gguf(tmp_path / "tiny.gguf", add_bos=True)
    ours = Tokenizer.from_dir(convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=None))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    for text in ["the thing", "<|im_start|>the", ""]:
        # BOS exactly once, and only when special tokens are asked for.
        assert ours.encode(text, add_special_tokens=True, parse_special=True) == [
            1,
            *ours.encode(text, parse_special=True),
        ]
        assert ours.encode(text, add_special_tokens=True, parse_special=True) == theirs.encode(
            text, add_special_tokens=True
        )
        assert ours.encode(text, parse_special=True) == theirs.encode(text, add_special_tokens=False)


def test_tiny_gguf_pre_tokenizers_split_digits_differently(tmp_path: Path) -> None:
    pieces = {}
    for pre in ["gpt2", "llama-bpe", "smollm"]:
        write_tiny_gguf(tmp_path / f"{pre}.gguf", pre=pre)
        tok = Tokenizer.from_dir(convert_gguf(tmp_path / f"{pre}.gguf", tmp_path / pre, progress=None))
        pieces[pre] = [tok.id_to_token(i) for i in tok.encode("a 12", parse_special=True)]
    assert pieces == {
        "gpt2": ["a", "Ġ1", "2"],  # " ?\p{N}+" keeps the space with the digits
        "llama-bpe": ["a", "Ġ", "12"],  # "\p{N}{1,3}" without the space
        "smollm": ["a", "Ġ", "1", "2"],  # single digits first
    }
