"""The defaults of what a request leaves out (client/serve/defaults.py): read from a model's
generation_config.json and a GGUF's general.sampling.* metadata (written with the gguf package),
layered over the server's flags, and a default max_tokens cut to the room a prompt leaves."""

from __future__ import annotations

import json
import logging
import shutil

import gguf
import pytest

from muxworker.client.params import CheckedParams
from muxworker.serve import defaults
from muxworker.serve.__main__ import _request_defaults
from muxworker.serve.defaults import GenerationDefaults, clamp, model_defaults
from muxworker.serve.options import check_flags, parser


@pytest.fixture
def model_dir(tiny_llama_dir, tmp_path):
    """A copy of the tiny HF model whose generation_config.json says what a model card would."""
    path = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    config = json.loads((path / "generation_config.json").read_text())
    config.update(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=512, repetition_penalty=None)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_generation_config_gives_the_models_defaults(model_dir):
    layers = model_defaults(model_dir)
    assert layers == [
        ("generation_config.json", {"max_tokens": 512, "temperature": 0.6, "top_p": 0.95, "top_k": 20}),
    ]
    d = GenerationDefaults.resolve(*layers, ("flags", {"max_tokens": 4096, "temperature": 0.2, "min_p": 0.05}))
    # The model first, then the flags where it says nothing.
    assert (d.max_tokens, d.temperature, d.top_p, d.top_k, d.min_p, d.repetition_penalty) == (
        512,
        0.6,
        0.95,
        20,
        0.05,
        None,
    )
    assert d.origins["temperature"] == "generation_config.json" and d.origins["min_p"] == "flags"
    assert "temperature 0.6 (generation_config.json)" in d.describe()
    assert d.fill({"temperature": 0.0}) == {"temperature": 0.0, "top_p": 0.95, "top_k": 20, "min_p": 0.05}
    assert GenerationDefaults().fill({}) == {"temperature": 1.0}  # nobody said: OpenAI's
    assert GenerationDefaults().describe() == "OpenAI's"


def test_a_bad_value_in_a_model_file_is_left_out_with_a_warning(model_dir, caplog):
    (model_dir / "generation_config.json").write_text(json.dumps({"top_p": 0, "top_k": 2.5, "temperature": 0.3}))
    with caplog.at_level(logging.WARNING, "muxworker.serve"):
        assert model_defaults(model_dir) == [("generation_config.json", {"temperature": 0.3})]
    assert "top_p" in caplog.text and "top_k" in caplog.text
    (model_dir / "generation_config.json").write_text("{not json")
    assert model_defaults(model_dir) == []
    (model_dir / "generation_config.json").unlink()
    assert model_defaults(model_dir) == []


def _write_gguf(path, **sampling):
    w = gguf.GGUFWriter(path, "llama")
    for name, value in sampling.items():
        getattr(w, f"add_sampling_{name}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_converted_ggufs_sampling_metadata(model_dir):
    """A converted GGUF's directory links its source file (model.gguf), whose general.sampling.*
    keys come after its generation_config.json (which the converter writes without sampling)."""
    (model_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    _write_gguf(model_dir / "model.gguf", temp=0.7, top_k=40, top_p=0.9, min_p=0.05, penalty_repeat=1.1)
    layers = model_defaults(model_dir)
    assert layers[-1] == (
        "the GGUF's general.sampling",
        {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    _write_gguf(model_dir / "model.gguf")  # a GGUF that says nothing (the bundled SmolLM2's)
    assert GenerationDefaults.resolve(*model_defaults(model_dir)) == GenerationDefaults()


def test_flags_and_generation_config_none(model_dir):
    p = parser()
    args, _ = p.parse_known_args(["--default-temperature", "0.2", "--default-top-k", "5", "--max_sessions", "2"])
    d = _request_defaults(args, model_dir)
    assert (d.max_tokens, d.temperature, d.top_k) == (512, 0.6, 20)  # the model's
    args, _ = p.parse_known_args(
        ["--generation-config", "none", "--default-temperature", "0.2", "--default-top-k", "5"]
    )
    d = _request_defaults(args, model_dir)
    assert (d.max_tokens, d.temperature, d.top_k, d.top_p) == (defaults.DEFAULT_MAX_TOKENS, 0.2, 5, None)
    args, _ = p.parse_known_args(["--generation-config", "none", "--default-max-tokens", "0"])
    assert _request_defaults(args, model_dir).max_tokens is None  # to the end of the context
    for bad, says in [
        (["--default-top-p", "0"], "--default-top-p: top_p must be in (0, 1]"),
        (["--default-max-tokens", "-1"], "--default-max-tokens: max_tokens must be at least 1"),
        (["--served-model-name", "a", ""], "--served-model-name"),
    ]:
        problem = check_flags(p.parse_known_args(["--port", "0", *bad])[0])
        assert problem is not None and problem.startswith(says), problem
    args, rest = p.parse_known_args(["--served-model-name", "a", "b", "--max_sessions", "2"])
    assert args.served_model_name == ["a", "b"] and rest == ["--max_sessions", "2"]


@pytest.mark.parametrize(
    ("wanted", "prompt", "room", "sent"),
    [
        (4096, 100, 2048, 1948),  # cut to the room the prompt leaves
        (512, 100, 2048, 512),  # fits as it is
        (4096, 2047, 2048, 1),
        (4096, 2048, 2048, -1),  # the prompt fills the session: the worker refuses it with its own error
        (4096, None, 2048, -1),  # an unknown prompt size: to the end of the context
        (4096, 100, None, 4096),  # no worker yet to say
        (-1, 100, 2048, -1),
    ],
)
def test_clamp(wanted, prompt, room, sent):
    params = CheckedParams("", {"max_new_tokens": wanted, "temperature": 0.0})
    out = clamp(params, prompt, room)
    assert out.fields == {"max_new_tokens": sent, "temperature": 0.0}
    assert params.fields["max_new_tokens"] == wanted  # not changed in place
