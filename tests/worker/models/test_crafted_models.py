"""Crafted model files and chat templates: each is refused with one clear error naming the file and
the field (worker/models/bounds.py, worker/models/template_sandbox.py). How long each refusal takes
and how much memory it needs is measured by scripts/bench_crafted_models.py, not asserted here."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
from helpers.gguf_files import TINY_TEMPLATE, write_tiny_gguf
from helpers.raw_worker import RawWorker
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from muxworker.worker.models.args import ConfigError, ModelArgs
from muxworker.worker.models.convert import convert_gguf
from muxworker.worker.models.gguf_file import GGUFFile
from muxworker.worker.models.loader import InvalidModelError
from muxworker.worker.models.template_sandbox import TemplateLimits, compile_chat_template
from muxworker.worker.models.tokenizer import ChatTemplateError, Tokenizer
from muxworker.worker.server import EXIT_USAGE

BIG = 2**31

# ------------------------------------------------------------------------------------------
# Writers


def rewritten(src: Path, dst: Path, changes: dict[str, Any]) -> Path:
    """A copy of the GGUF ``src`` with metadata ``changes`` (key -> (value, GGUFValueType), or
    None to drop the key), its tensors byte for byte."""
    source = GGUFFile(src)
    w = gguf.GGUFWriter(str(dst), source.metadata["general.architecture"])
    for key, value in source.metadata.items():
        if key == "general.architecture" or key in changes:
            continue
        w.add_key_value(key, value, *_type_of(value))
    for key, change in changes.items():
        if change is not None:
            w.add_key_value(key, *change)
    for t in source.tensors:
        data = source.data(t)
        if t.type == gguf.GGMLQuantizationType.F32:
            w.add_tensor(t.name, data.view("<f4").reshape(t.shape))
        elif t.type == gguf.GGMLQuantizationType.F16:
            w.add_tensor(t.name, data.view("<f2").reshape(t.shape))
        else:
            w.add_tensor(t.name, data.reshape(t.shape[0], -1), raw_dtype=t.type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _type_of(value: Any) -> tuple:
    t = gguf.GGUFValueType
    if isinstance(value, bool):
        return (t.BOOL,)
    if isinstance(value, str):
        return (t.STRING,)
    if isinstance(value, float):
        return (t.FLOAT32,)
    if isinstance(value, int):
        return (t.INT32 if value < 0 else t.UINT32,)
    item = value[0] if value else ""
    return t.ARRAY, (t.STRING if isinstance(item, str) else t.FLOAT32 if isinstance(item, float) else t.INT32)


def _string(s: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(s) if length is None else length) + s


def raw_gguf(
    path: Path, *, n_tensors: int = 0, n_kv: int | None = None, kvs: bytes = b"", tensors: bytes = b""
) -> Path:
    """A GGUF v3 header written byte by byte (``kvs`` and ``tensors`` already encoded), then 64 bytes."""
    count = n_kv if n_kv is not None else 0
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, count) + kvs + tensors + bytes(64))
    return path


def kv_u32(key: str, value: int) -> bytes:
    return _string(key.encode()) + struct.pack("<II", 4, value)


# ------------------------------------------------------------------------------------------
# GGUF headers


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda p: raw_gguf(p, n_tensors=BIG), "tensor count is 2147483648"),
        (lambda p: raw_gguf(p, n_kv=BIG), "metadata count is 2147483648"),
        (lambda p: raw_gguf(p, n_kv=1, kvs=_string(b"k", BIG)), "metadata key 0 is a string of 2147483648 bytes"),
        (
            lambda p: raw_gguf(p, n_kv=1, kvs=_string(b"general.name") + struct.pack("<I", 8) + _string(b"", 2**40)),
            "metadata general.name is a string of 1099511627776 bytes",
        ),
        (
            lambda p: raw_gguf(p, n_kv=1, kvs=_string(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, BIG)),
            "metadata tokenizer.ggml.tokens is an array of 2147483648 entries",
        ),
        (
            lambda p: raw_gguf(p, n_kv=1, kvs=_string(b"tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 2**40)),
            "metadata tokenizer.ggml.scores is an array of 1099511627776 entries",
        ),
        (
            lambda p: raw_gguf(
                p, n_kv=1, kvs=_string(b"nested") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 4, 0)
            ),
            "metadata nested is an array of arrays",
        ),
        (
            lambda p: raw_gguf(p, n_kv=1, kvs=_string(b"odd") + struct.pack("<IIQ", 9, 8, 1000)),
            "metadata odd is an array of 1000 strings",
        ),
        (lambda p: raw_gguf(p, n_kv=1, kvs=_string(b"t") + struct.pack("<I", 99)), "metadata t has unknown GGUF"),
        (
            lambda p: raw_gguf(p, n_tensors=1, tensors=_string(b"w") + struct.pack("<I", 5) + bytes(8 * 5 + 12)),
            "tensor w has 5 dimensions",
        ),
        (
            lambda p: raw_gguf(p, n_tensors=1, tensors=_string(b"w" * 100) + bytes(64)),
            "the name of tensor 0 is a string of 100 bytes",
        ),
        (
            lambda p: raw_gguf(p, n_tensors=1, tensors=_string(b"w") + struct.pack("<IQQIQ", 2, 2**62, 2**62, 0, 0)),
            "tensor w .* past the file's end",
        ),
        (
            lambda p: raw_gguf(p, n_tensors=1, tensors=_string(b"w") + struct.pack("<IQIQ", 1, 4, 0, 2**40)),
            "tensor w .* past the file's end",
        ),
        (
            lambda p: raw_gguf(p, n_tensors=1, tensors=_string(b"w") + struct.pack("<IQIQ", 1, 4, 0, 7)),
            "tensor w's data offset 7 is not a multiple of the alignment 32",
        ),
        (lambda p: raw_gguf(p, n_kv=1, kvs=kv_u32("general.alignment", 0)), "general.alignment = 0"),
        (
            lambda p: raw_gguf(p, n_tensors=1, tensors=_string(b"w") + struct.pack("<IQIQ", 1, 4, 1000, 0)),
            "tensor w has unknown GGML type 1000",
        ),
    ],
)
def test_a_crafted_header_is_refused_naming_the_field(tmp_path: Path, build, message: str) -> None:
    path = build(tmp_path / "crafted.gguf")
    with pytest.raises(InvalidModelError, match=message) as info:
        GGUFFile(path)
    assert str(path) in str(info.value)


# ------------------------------------------------------------------------------------------
# Hyperparameters


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path, quantize_down=False)
    return path


U32, I32, F32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32, gguf.GGUFValueType.FLOAT32
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("key", "value", "kind", "message"),
    [
        ("llama.block_count", BIG, U32, "llama.block_count = 2147483648 is out of range: expected 1 to 512"),
        ("llama.block_count", 0, U32, "llama.block_count = 0 is out of range"),
        ("llama.block_count", 513, U32, "llama.block_count = 513 is out of range"),
        ("llama.attention.head_count", 0, U32, "llama.attention.head_count = 0 is out of range"),
        ("llama.attention.head_count", BIG, U32, "llama.attention.head_count = 2147483648 is out of range"),
        ("llama.attention.head_count_kv", 0, U32, "llama.attention.head_count_kv = 0 is out of range"),
        ("llama.attention.head_count_kv", BIG, U32, "llama.attention.head_count_kv = 2147483648 is out of range"),
        ("llama.attention.head_count_kv", 3, U32, "head_count \\(4\\) is not a multiple of .*head_count_kv \\(3\\)"),
        ("llama.embedding_length", 0, U32, "llama.embedding_length = 0 is out of range"),
        ("llama.embedding_length", BIG, U32, "llama.embedding_length = 2147483648 is out of range"),
        ("llama.feed_forward_length", 0, U32, "llama.feed_forward_length = 0 is out of range"),
        ("llama.feed_forward_length", BIG, U32, "llama.feed_forward_length = 2147483648 is out of range"),
        ("llama.context_length", 0, U32, "llama.context_length = 0 is out of range"),
        ("llama.context_length", BIG, U32, "llama.context_length = 2147483648 is out of range"),
        ("llama.attention.key_length", BIG, U32, "llama.attention.key_length = 2147483648 is out of range"),
        ("llama.rope.freq_base", -1.0, F32, "llama.rope.freq_base = -1.0 is out of range"),
        ("llama.rope.freq_base", 0.0, F32, "llama.rope.freq_base = 0.0 is out of range"),
        ("llama.rope.freq_base", NAN, F32, "llama.rope.freq_base = nan is out of range"),
        ("llama.rope.freq_base", INF, F32, "llama.rope.freq_base = inf is out of range"),
        ("llama.attention.layer_norm_rms_epsilon", 0.0, F32, "layer_norm_rms_epsilon = 0.0 is out of range"),
        ("llama.attention.layer_norm_rms_epsilon", NAN, F32, "layer_norm_rms_epsilon = nan is out of range"),
        ("llama.attention.layer_norm_rms_epsilon", -0.5, F32, "layer_norm_rms_epsilon = -0.5 is out of range"),
        ("llama.block_count", -1, I32, "llama.block_count = -1 is out of range"),
        ("llama.block_count", "many", gguf.GGUFValueType.STRING, "llama.block_count = 'many' is not an integer"),
        ("tokenizer.ggml.merges", (["Ġ t", "q z"], gguf.GGUFValueType.STRING), gguf.GGUFValueType.ARRAY,
         "tokenizer.ggml.merges\\[1\\] = 'q z' names 'qz', which is not in the vocabulary"),
        ("tokenizer.ggml.merges", (["Ġt"], gguf.GGUFValueType.STRING), gguf.GGUFValueType.ARRAY,
         "tokenizer.ggml.merges\\[0\\] = 'Ġt' is malformed"),
    ],
)  # fmt: skip
def test_a_crafted_hyperparameter_is_refused_naming_the_file_and_field(
    tiny_gguf: Path, tmp_path: Path, key: str, value: Any, kind: Any, message: str
) -> None:
    change = (value[0], kind, value[1]) if isinstance(value, tuple) else (value, kind)
    path = rewritten(tiny_gguf, tmp_path / "crafted.gguf", {key: change})
    with pytest.raises(InvalidModelError, match=message) as info:
        convert_gguf(path, tmp_path / "out", progress=None, weights="link")
    assert str(info.value).startswith(f"{path}: ")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_the_bounds_hold_for_a_config_json_too() -> None:
    base = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4}
    ModelArgs.from_dict({**base, "num_hidden_layers": 2})
    for change, field in [
        ({"num_hidden_layers": BIG}, "num_hidden_layers = 2147483648"),
        ({"num_hidden_layers": 2, "num_attention_heads": 0}, "num_attention_heads = 0"),
        ({"num_hidden_layers": 2, "rope_theta": -1.0}, "rope_theta = -1.0"),
        ({"num_hidden_layers": 2, "rope_theta": NAN}, "rope_theta = nan"),
        ({"num_hidden_layers": 2, "vocab_size": BIG}, "vocab_size = 2147483648"),
        ({"num_hidden_layers": 2, "max_position_embeddings": BIG}, "max_position_embeddings = 2147483648"),
        ({"num_hidden_layers": 2, "rms_norm_eps": 0.0}, "rms_norm_eps = 0.0"),
    ]:
        with pytest.raises(ConfigError, match=field):
            ModelArgs.from_dict({**base, **change})


# ------------------------------------------------------------------------------------------
# Chat templates

BOMBS = {
    "repeat": "{{ 'x' * 1000000000 }}",
    "range": "{% for i in range(10**9) %}x{% endfor %}",
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested output": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "set block": "{% set x %}{% for i in range(99999) %}{% for j in range(99999) %}ab{% endfor %}{% endfor %}"
    "{% endset %}{{ x }}",
    "recursive macro": "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
    "doubling macro": "{% macro m(s) %}{{ m(s ~ s) }}{% endmacro %}{{ m('x') }}",
    "recursive loop": "{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}",
    "center filter": "{{ 'x' | center(1000000000) }}",
    "center method": "{{ 'x'.center(1000000000) }}",
    "printf width": "{{ '%1000000000s' % 'x' }}",
    "format width": "{{ '{:>1000000000}'.format('x') }}",
    "power": "{{ 2 ** 100000000 }}",
    "list repeat": "{% set l = ['x' * 1000000] * 1000 %}{{ l }}",
    "join": "{{ range(100000) | join('x' * 100000) }}",
    "replace": "{% set s = 'x' * 1000000 %}{{ s.replace('x', s) }}",
    "sum of lists": "{{ ([[1]] * 100000) | sum(start=[]) }}",
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "indent": "{% set s = 'a\n' * 1000000 %}{{ s | indent(1000) }}",
    "tojson": "{{ (['x' * 100000] * 10000) | tojson }}",
    "growing list": "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
    "{% set ns.l = ns.l + ['x' * 1000000] %}{% endfor %}",
}


def _tokenizer(template: str) -> Tokenizer:
    backend = BackendTokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    return Tokenizer(backend, chat_template=template, template_origin="crafted/tokenizer_config.json: chat_template")


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_a_template_bomb_is_stopped_at_start_and_on_every_request(name: str) -> None:
    tokenizer = _tokenizer(BOMBS[name])
    with pytest.raises(ChatTemplateError, match="^crafted/tokenizer_config.json: chat_template: .*stopped"):
        tokenizer.check_chat_template()
    with pytest.raises(ChatTemplateError, match="the chat template was stopped rendering these messages"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_template_that_bombs_only_on_some_messages_is_stopped_per_request() -> None:
    tokenizer = _tokenizer(
        "{% for m in messages %}{% if m.content == 'boom' %}{{ m.content * 1000000000 }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    tokenizer.check_chat_template()  # the probe passes
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "hi"
    with pytest.raises(ChatTemplateError, match="the \\* operator would build 4000000000 characters"):
        tokenizer.apply_chat_template([{"role": "user", "content": "boom"}])
    # The limit is per render: the next one has the whole budget again.
    assert tokenizer.apply_chat_template([{"role": "user", "content": "ok"}], add_generation_prompt=False) == "ok"


def test_each_limit_stops_a_render() -> None:
    limits = TemplateLimits(max_chars=100, max_alloc_bytes=10_000, max_steps=1_000, max_seconds=60)
    chat = {"messages": [{"role": "user", "content": "x" * 60}]}
    for source, message in [
        ("{% for i in range(2000) %}{% endfor %}", "more than 1000 steps"),
        ("{{ messages[0].content }}{{ messages[0].content }}", "output passed 100 characters"),
        ("{{ messages[0].content + messages[0].content }}", "would build 120 characters"),
        ("{% for i in range(300) %}{% set s = messages[0].content ~ i %}{% endfor %}", "more than 10000 bytes"),
    ]:
        with pytest.raises(jinja2_error(), match=message):
            compile_chat_template(source, limits).render(**chat)
    with pytest.raises(ChatTemplateError, match="has 20 characters; at most 10"):
        compile_chat_template("x" * 20, TemplateLimits(max_source_chars=10))


def jinja2_error() -> type[Exception]:
    import jinja2

    return jinja2.TemplateError


def test_real_templates_render_as_before() -> None:
    tokenizer = _tokenizer(TINY_TEMPLATE)
    tokenizer.check_chat_template()
    messages = [{"role": "user", "content": "x" * 3_000_000}, {"role": "assistant", "content": "ok"}]
    text = tokenizer.apply_chat_template(messages)
    assert text.startswith("<|im_start|>user\nxxx") and text.endswith("<|im_start|>assistant\n")
    assert len(text) == 3_000_000 + len("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n") + len(
        "<|im_start|>assistant\n"
    )


def test_a_gguf_whose_template_bombs_is_refused_at_conversion(tiny_gguf: Path, tmp_path: Path) -> None:
    path = rewritten(
        tiny_gguf, tmp_path / "bomb.gguf", {"tokenizer.chat_template": (BOMBS["repeat"], gguf.GGUFValueType.STRING)}
    )
    with pytest.raises(InvalidModelError, match=f"^{path}: tokenizer.chat_template: .*would build 1000000000"):
        convert_gguf(path, tmp_path / "out", progress=None, weights="link")


# ------------------------------------------------------------------------------------------
# End to end: the commands exit 2 with one line


@pytest.mark.slow
def test_serve_exits_2_with_one_line_on_a_crafted_gguf(tiny_gguf: Path, tmp_path: Path) -> None:
    path = rewritten(tiny_gguf, tmp_path / "crafted.gguf", {"llama.block_count": (BIG, U32)})
    env = {**os.environ, "MUXWORKER_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-m", "muxworker.serve", "--model", str(path), "--port", "0", "--store", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if "llama.block_count" in line]
    assert lines == [f"muxworker serve: cannot load the model: {path}: llama.block_count = {BIG} is out of range: "
                     "expected 1 to 512"], out.stderr  # fmt: skip
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_the_worker_exits_2_on_a_template_bomb(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A model directory (no conversion) whose chat template bombs: the worker's start refuses it."""
    from helpers.gguf_files import converted_smollm

    source = converted_smollm(tmp_path_factory.getbasetemp())
    model = tmp_path / "bomb"
    model.mkdir()
    for item in source.iterdir():
        (model / item.name).symlink_to(item.resolve())
    (model / "chat_template.jinja").write_text(BOMBS["nested loops"])
    with RawWorker(["--model", str(model)], tmp_path, hello=False) as w:
        frame = w.read()
        assert frame is not None and frame.control["kind"] == "error", frame
        assert w.wait() == EXIT_USAGE
        stderr = w.stderr()
    assert f"{model / 'chat_template.jinja'}: the model's chat template was stopped" in stderr
    assert "Traceback" not in stderr
