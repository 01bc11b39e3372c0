"""GGUF -> Hugging Face conversion, checked against transformers' own GGUF loading (which
dequantizes independently) and against a tiny GGUF written from known tensors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.gguf_files import converted_smollm, exported_smollm, gguf_from_hf, write_tiny_gguf
from safetensors import safe_open

from muxworker.worker.models.convert import UnsupportedGGUFError, convert_gguf, main
from muxworker.worker.models.gguf_tensors import unpermute_rotary_rows
from muxworker.worker.models.loader import InvalidModelError, load_model_dir, load_state_dict


@pytest.fixture(scope="session")
def smollm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The exported (weights="copy") directory, which transformers loads."""
    return exported_smollm(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def linked_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What resolve_model caches: no weights copied, the GGUF linked and indexed."""
    return converted_smollm(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def reference_model(smollm2_reference):
    """transformers' model straight from the GGUF file."""
    return smollm2_reference[1]


# ------------------------------------------------------------------------------------------
# The bundled SmolLM2


@pytest.mark.slow
def test_smollm_tensors_equal_transformers_gguf_loading(smollm_dir: Path, reference_model) -> None:
    ours = load_state_dict(smollm_dir)
    reference = reference_model.state_dict()
    # Tied embeddings: transformers lists lm_head.weight as the same tensor; the file has none.
    assert reference_model.config.tie_word_embeddings
    assert set(ours) == set(reference) - {"lm_head.weight"}
    assert len(ours) == 272
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_smollm_config_equals_transformers(smollm_dir: Path, reference_model) -> None:
    transformers = pytest.importorskip("transformers")
    ours = load_model_dir(smollm_dir).config
    # Our config.json must read back in transformers as the same model.
    for ref in (reference_model.config, transformers.AutoConfig.from_pretrained(smollm_dir)):
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "max_position_embeddings",
            "tie_word_embeddings",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
        ):
            assert ours[key] == getattr(ref, key), key
        assert ours["rope_theta"] == ref.rope_parameters["rope_theta"]
        assert ref.model_type == "llama"
    assert ours["architectures"] == ["LlamaForCausalLM"]
    assert ours["torch_dtype"] == "float32"


@pytest.mark.slow
def test_smollm_dir_loads_in_transformers_with_identical_logits(smollm_dir: Path, reference_model) -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference_model(ids).logits, rtol=0, atol=0)


def test_smollm_generation_config_stops_on_im_end_and_endoftext(smollm_dir: Path) -> None:
    files = load_model_dir(smollm_dir)
    assert files.generation_config["eos_token_id"] == [2, 0]
    assert files.tokenizer_config["eos_token"] == "<|im_end|>"
    assert files.tokenizer_config["add_bos_token"] is False
    assert files.chat_template is not None and "<|im_start|>" in files.chat_template


# ------------------------------------------------------------------------------------------
# A tiny GGUF written from known tensors


def test_unpermute_inverts_llama_cpp_permute() -> None:
    from helpers.gguf_files import llama_cpp_permute

    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)  # 6 heads of 8 rows
    permuted = llama_cpp_permute(w, 6)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rotary_rows(permuted, 6), w)
    bias = np.arange(48, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_rotary_rows(llama_cpp_permute(bias, 6), 6), bias)


def test_tiny_gguf_round_trips_to_original_tensors(tmp_path: Path) -> None:
    original = write_tiny_gguf(tmp_path / "tiny.gguf", n_head=4, n_kv_head=2)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=None)
    converted = load_state_dict(out)
    assert set(converted) == set(original)
    for name, tensor in original.items():
        # q/k were permuted by llama.cpp's rule and must come back in Hugging Face order, exactly.
        assert torch.equal(converted[name], tensor), name

    config = load_model_dir(out).config
    assert config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2
    assert config["head_dim"] == 16
    assert config["vocab_size"] == 288  # embedding rows, not the tokenizer's 268 tokens
    assert config["tie_word_embeddings"] is False
    assert config["rope_theta"] == 50000.0
    assert config["max_position_embeddings"] == 256


def test_tiny_gguf_tied_embeddings_have_no_lm_head(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", tied=True)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=None)
    assert "lm_head.weight" not in load_state_dict(out)
    assert load_model_dir(out).config["tie_word_embeddings"] is True


def test_bfloat16_output(tmp_path: Path) -> None:
    original = write_tiny_gguf(tmp_path / "tiny.gguf", quantize_down=False)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", dtype=torch.bfloat16, progress=None)
    converted = load_state_dict(out)
    for name, tensor in original.items():
        assert converted[name].dtype == torch.bfloat16
        assert torch.equal(converted[name], tensor.to(torch.bfloat16)), name
    assert load_model_dir(out).config["torch_dtype"] == "bfloat16"


def test_safetensors_file_is_valid_and_tagged_pt(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=None)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [288, 64]


def test_progress_reports_tensor_count(tmp_path: Path) -> None:
    import io

    write_tiny_gguf(tmp_path / "tiny.gguf")
    progress = io.StringIO()
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=progress)
    assert "converted 21/21 tensors" in progress.getvalue()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gpt2"}, "general.architecture='gpt2'"),
        ({"extra_tensor": "blk.0.ffn_gate_exps.weight"}, "blk.0.ffn_gate_exps.weight"),
        ({"pre": "no-such-pre"}, "tokenizer.ggml.pre='no-such-pre'"),
    ],
)
def test_unsupported_gguf_is_refused_and_nothing_is_written(tmp_path: Path, kwargs: dict, message: str) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", **kwargs)
    with pytest.raises(UnsupportedGGUFError, match=message.replace("(", r"\(")):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_tensor_shapes_must_match_metadata(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", ffn=96, claimed_ffn=128)
    with pytest.raises(
        InvalidModelError, match=r"mlp.gate_proj.weight has shape \[96, 64\], the metadata implies \[128, 64\]"
    ):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=None)


def test_refuses_non_empty_output_dir(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=None)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_not_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(InvalidModelError, match="is not a GGUF file"):
        convert_gguf(tmp_path / "model.gguf", tmp_path / "out", progress=None)


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    assert main([str(tmp_path / "tiny.gguf"), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert "converted 21/21 tensors" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.gguf"), str(tmp_path / "out2")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_failure_while_writing_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import muxworker.worker.models.convert as convert_module

    write_tiny_gguf(tmp_path / "tiny.gguf")
    calls = []

    def disk_full(f, values, dtype):
        calls.append(values.shape)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        f.write(values.tobytes())

    monkeypatch.setattr(convert_module, "_write_tensor", disk_full)
    with pytest.raises(OSError, match="No space left"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


@pytest.mark.parametrize("arch,gguf_arch", [("llama3", "llama"), ("qwen3", "qwen3"), ("gemma3", "gemma3")])
def test_llama3_qwen3_and_gemma3_ggufs_run_as_transformers_runs_their_models(
    tmp_path: Path, tiny_model_factory, arch: str, gguf_arch: str
) -> None:
    """A tiny random model written as llama.cpp writes its GGUF (Llama 3's rope scaling as a
    rope_freqs tensor, Gemma's norms as 1 + weight, llama's q/k rows permuted), converted and run
    by our model: transformers' logits on the original directory."""
    import transformers

    from muxworker.worker.backends.interface import SeqSpan
    from muxworker.worker.backends.torch.cache import KVCache
    from muxworker.worker.backends.torch.model import build_model
    from muxworker.worker.models.args import ModelArgs

    # A GGUF carries neither Gemma's layer pattern nor its query scale: the model must have
    # transformers' defaults (GEMMA3_DEFAULTS), which conversion writes (a global sixth layer).
    gemma_defaults = dict(num_hidden_layers=7, layer_types=None, query_pre_attn_scalar=256)
    hf_dir = tiny_model_factory(arch, **(gemma_defaults if arch == "gemma3" else {}))
    out = convert_gguf(
        gguf_from_hf(hf_dir, tmp_path / "m.gguf", gguf_arch), tmp_path / "linked", progress=None, weights="link"
    )
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == json.loads((hf_dir / "config.json").read_text())["architectures"]
    args = ModelArgs.from_dict(config)
    model = build_model(args, load_state_dict(out), dtype=torch.float32, device="cpu")
    model.setup_rope(128)
    ids = torch.randint(0, 268, (40,), generator=torch.Generator().manual_seed(3))  # past gemma3's window of 16
    cache = KVCache(args.windows, 1, 128, args.num_kv_heads, args.head_size, torch.float32, "cpu")
    ours = model(ids, torch.arange(40), [SeqSpan(0, 0, 40, 0)], cache, torch.arange(40))
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    assert (ours - want).abs().max().item() <= 1e-4
