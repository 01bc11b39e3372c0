"""Quantized models on torch: GGUF blocks read in place for the native step, dense copies for
prefill, the native step against the dense path, row independence, and --quantize on a float model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.gguf_files import write_tiny_gguf

from muxworker.worker.backends.interface import SeqSpan
from muxworker.worker.backends.torch import executor as ex
from muxworker.worker.backends.torch.cache import KVCache
from muxworker.worker.backends.torch.executor import TorchExecutor
from muxworker.worker.models.args import ModelArgs
from muxworker.worker.models.convert import convert_gguf
from muxworker.worker.models.gguf_tensors import GGUFTensorIndex
from muxworker.worker.models.loader import load_model_dir

K_QUANT = dict(hidden=256, n_head=4, n_kv_head=2, ffn=512)  # K-quants need multiples of 256
NATIVE_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
IDS = [5, 17, 33, 2, 90, 41, 7, 250, 11, 3]


def _linked(tmp_path: Path, linear_type: str, **kw) -> Path:
    if linear_type.endswith("_K"):
        kw = K_QUANT | kw
    write_tiny_gguf(tmp_path / "tiny.gguf", linear_type=linear_type, **kw)
    return convert_gguf(tmp_path / "tiny.gguf", tmp_path / "linked", progress=None, weights="link")


def _load(model_dir: Path, dtype: str, weights: str = "float", quantize: str | None = None):
    files = load_model_dir(model_dir)
    args = ModelArgs.from_dict(files.config)
    return ex.load_model(files, args, device="cpu", dtype=dtype, weights=weights, quantize=quantize), args


def _logits(model, args, ids: list[int]) -> torch.Tensor:
    """The torch model's dense path over a whole prompt."""
    model.setup_rope(64)
    cache = KVCache(
        args.windows, 1, 64, args.num_kv_heads, args.head_size, model.model.embed_tokens.weight.dtype, "cpu"
    )
    n = len(ids)
    return model(torch.tensor(ids), torch.arange(n), [SeqSpan(0, 0, n, 0)], cache, torch.arange(n))


def _decode(executor: TorchExecutor, slot: int, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill ``prompt`` into ``slot`` in one span, then decode greedily one row at a time."""
    n = len(prompt)
    logits = executor.forward(prompt, list(range(n)), [SeqSpan(slot, 0, n, 0)], [n - 1])
    tokens, rows = [int(logits.argmax())], []
    for i in range(steps):
        row = executor.forward([tokens[-1]], [n + i], [SeqSpan(slot, n + i, 1, 0)], [0])
        rows.append(row[0])
        tokens.append(int(row.argmax()))
    return tokens, rows


@pytest.mark.parametrize("qtype", NATIVE_TYPES)
def test_blocks_are_read_in_place_and_the_dense_copies_hold_the_files_values(tmp_path: Path, qtype: str) -> None:
    d = _linked(tmp_path, qtype)
    model, args = _load(d, "float32", "quantized")
    index = GGUFTensorIndex.open(d)
    assert model.quantized is not None
    for i in range(args.num_hidden_layers):
        q = f"model.layers.{i}.self_attn.q_proj.weight"
        blocks = model.quantized[q]
        assert blocks.type == qtype and blocks.row_map is not None  # rotary rows stay in GGML order
        # The file's bytes, memory-mapped, not a copy.
        assert isinstance(blocks.blocks, np.memmap) and not blocks.blocks.flags.owndata
        np.testing.assert_array_equal(blocks.blocks.reshape(-1), index.raw(q))
        oracle = index.dequantize(q)  # the gguf package's values, Hugging Face row order
        np.testing.assert_array_equal(blocks.dequantize(), oracle)
        dense = model.model.layers[i].self_attn.qkv_proj.weight[: oracle.shape[0]]
        np.testing.assert_array_equal(dense.numpy(), oracle)
        down = model.quantized[f"model.layers.{i}.mlp.down_proj.weight"]
        np.testing.assert_array_equal(model.model.layers[i].mlp.down_proj.weight.numpy(), down.dequantize())
    # The tiny GGUF's output layer is F32: quantized to Q8_0 for the native step, dense for prefill.
    assert model.quantized["lm_head.weight"].type == "Q8_0"


@pytest.mark.parametrize("qtype", NATIVE_TYPES)
def test_the_native_step_agrees_with_the_dense_path(tmp_path: Path, qtype: str) -> None:
    model, args = _load(_linked(tmp_path, qtype), "float32", "quantized")
    native = TorchExecutor(model, 1, 64)
    dense = TorchExecutor(model, 1, 64)
    assert native.native is not None and native.native_unavailable is None
    dense.native = None  # every span through torch's dense path
    got_tokens, got = _decode(native, 0, IDS, 6)
    want_tokens, want = _decode(dense, 0, IDS, 6)
    for a, b in zip(got, want):
        # The native step rounds activations to int8 per block of 32: close, not equal.
        assert (a - b).abs().max() < 0.03 * b.abs().max()
    assert got_tokens[:3] == want_tokens[:3]


def test_a_decode_row_does_not_depend_on_its_batch_or_its_pass(tmp_path: Path) -> None:
    model, args = _load(_linked(tmp_path, "Q4_1"), "bfloat16", "quantized")
    executor = TorchExecutor(model, 6, 64)
    n = len(IDS)
    alone_tokens, alone = _decode(executor, 0, IDS, 8)
    # The same session in slot 1, each decode row batched with other sessions' work: a long
    # prefill (torch's dense path), a short prompt chunk and a decode (the native step).
    executor.forward(IDS, list(range(n)), [SeqSpan(1, 0, n, 0)], [n - 1])
    long = IDS * 3
    for i in range(8):
        tokens = [alone_tokens[i], *long, 7, 8, 9, 4]
        spans = [SeqSpan(1, n + i, 1, 0), SeqSpan(2, 0, len(long), 1), SeqSpan(3, i * 3, 3, 1 + len(long))]
        spans.append(SeqSpan(4, i, 1, 4 + len(long)))
        positions = [n + i, *range(len(long)), i * 3, i * 3 + 1, i * 3 + 2, i]
        out = executor.forward(tokens, positions, spans, [0, len(long), len(long) + 3])
        assert torch.equal(out[0], alone[i]), i
    # A verify chunk (the pending token and k drafts in one span) gives each row what decoding
    # it alone gave.
    executor.forward(IDS, list(range(n)), [SeqSpan(5, 0, n, 0)], [n - 1])
    chunk = alone_tokens[:8]
    out = executor.forward(chunk, list(range(n, n + 8)), [SeqSpan(5, n, 8, 0)], list(range(8)))
    for i in range(8):
        assert torch.equal(out[i], alone[i]), i


def test_a_sliding_window_ring_takes_native_chunks_of_up_to_16_rows(tiny_mistral_dir: Path) -> None:
    """Rings get 15 spare rows on the native path, so a short chunk after a long history (a
    resumed turn, a verify chunk) runs natively, equal row for row to decoding it."""
    model, args = _load(tiny_mistral_dir, "float32", quantize="int4")
    assert any(w is not None for w in args.windows)
    executor = TorchExecutor(model, 2, 64)
    assert executor.native.max_rows == 16
    assert {layer.spare for layer in executor.cache.layers} == {15}
    assert TorchExecutor(model, 2, 64, rollback_rows=20).native.max_rows == 16  # more for drafts
    prompt = list(range(3, 23))  # past the window of 16
    alone_tokens, alone = _decode(executor, 0, prompt, 8)
    n = len(prompt)
    executor.forward(prompt, list(range(n)), [SeqSpan(1, 0, n, 0)], [n - 1])
    for start in (0, 4):
        chunk = alone_tokens[start : start + 4]
        out = executor.forward(
            chunk, list(range(n + start, n + start + 4)), [SeqSpan(1, n + start, 4, 0)], [0, 1, 2, 3]
        )
        for i in range(4):
            assert torch.equal(out[i], alone[start + i]), (start, i)


def test_a_type_the_native_step_lacks_runs_dense(tmp_path: Path) -> None:
    model, _ = _load(_linked(tmp_path, "Q5_1"), "float32", "quantized")
    executor = TorchExecutor(model, 1, 64)
    assert executor.native is None and "not quantized" in executor.native_unavailable
    tokens, _ = _decode(executor, 0, IDS, 2)  # still serves, through torch
    assert len(tokens) == 3


def test_quantized_weights_need_a_quantized_model(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="--weights quantized needs a quantized GGUF"):
        _load(tiny_llama_dir, "float32", "quantized")


@pytest.mark.parametrize("mode,qtype", [("int4", "Q4_1"), ("int8", "Q8_0")])
def test_quantize_a_float_model_at_load(tiny_llama_dir: Path, mode: str, qtype: str) -> None:
    base, args = _load(tiny_llama_dir, "float32")
    quantized, _ = _load(tiny_llama_dir, "float32", quantize=mode)
    assert base.quantized is None
    assert {q.type for q in quantized.quantized.values()} == {qtype}
    assert len(quantized.quantized) == 7 * args.num_hidden_layers + 1  # every linear layer and the head
    a, b = _logits(quantized, args, IDS), _logits(base, args, IDS)
    # Not equal (the weights were rounded), but the same model: the logits are close and mostly
    # agree on the top token.
    assert (a - b).abs().max() < 0.25 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.6
    assert TorchExecutor(quantized, 1, 64).native is not None
    with pytest.raises(ValueError, match="--quantize must be one of int4, int8"):
        _load(tiny_llama_dir, "float32", quantize="int2")


def test_prepared_weights_are_cached_and_reload_to_the_same_model(tmp_path: Path) -> None:
    from muxworker.worker.backends.torch.prepared import prepared_path

    d = _linked(tmp_path, "Q4_1")
    first, args = _load(d, "bfloat16", "quantized")
    cache = prepared_path(d, torch.bfloat16, torch.device("cpu"))
    assert cache.is_file()
    again, _ = _load(d, "bfloat16", "quantized")  # memory-mapped from the cache
    assert torch.equal(_logits(first, args, IDS), _logits(again, args, IDS))
    assert again.quantized is not None
    # A damaged cache is ignored and rewritten, never an error.
    cache.write_bytes(b"not a torch file")
    damaged, _ = _load(d, "bfloat16", "quantized")
    assert torch.equal(_logits(damaged, args, IDS), _logits(first, args, IDS))
    assert cache.stat().st_size > 1000


def test_attention_over_many_key_chunks_agrees_with_the_dense_path(tiny_llama_dir: Path) -> None:
    # 700 keys: the native step attends in chunks of 256 and merges them (quant.c, MUX_KEY_CHUNK).
    model, _ = _load(tiny_llama_dir, "float32", quantize="int8")
    native, dense = TorchExecutor(model, 1, 1024), TorchExecutor(model, 1, 1024)
    dense.native = None
    prompt = torch.randint(3, 384, (700,), generator=torch.Generator().manual_seed(1)).tolist()
    got_tokens, got = _decode(native, 0, prompt, 4)
    want_tokens, want = _decode(dense, 0, prompt, 4)
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 0.03 * b.abs().max()


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_the_native_step_runs_qwen3_and_gemma3_as_the_dense_path_does(tiny_model_factory, arch: str) -> None:
    """q/k norms, Gemma's four norms, GELU, scaled embeddings, the query scale and local rope in
    the native step: the same logits as the dense path over the same (Q8_0) weights, past the
    sliding window of Gemma's local layers (16)."""
    model, args = _load(tiny_model_factory(arch), "float32", quantize="int8")
    native = TorchExecutor(model, 1, 64)
    dense = TorchExecutor(model, 1, 64)
    assert native.native is not None
    dense.native = None
    prompt = (IDS * 3)[:24]
    got_tokens, got = _decode(native, 0, prompt, 8)
    want_tokens, want = _decode(dense, 0, prompt, 8)
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 0.03 * b.abs().max()
    assert got_tokens[:4] == want_tokens[:4]


def test_weight_groups_say_how_each_tensor_type_is_held(tmp_path: Path) -> None:
    """The start-up line and /v1/models report, by type: GGUF blocks mapped in place for decode,
    their dense copies for prefill, and the rest dense for every pass; every byte once."""
    model, args = _load(_linked(tmp_path, "Q5_0"), "bfloat16", "quantized")
    groups = {(g.type, g.held, g.runs): g for g in TorchExecutor(model, 1, 64).weight_groups}
    layers = 7 * args.num_hidden_layers
    assert groups["Q5_0", "mapped", "decode"].tensors == layers
    assert groups["Q8_0", "packed", "decode"].tensors == 1  # the F32 output layer, quantized for the native step
    assert groups["bfloat16", "dense", "prefill"].tensors == 4 * args.num_hidden_layers  # qkv, o, gate_up, down
    blocks = sum(q.nbytes for q in model.quantized.values())
    assert sum(g.nbytes for g in groups.values() if g.held != "dense") == blocks
    assert groups["Q5_0", "mapped", "decode"].nbytes == sum(
        q.nbytes for n, q in model.quantized.items() if n != "lm_head.weight"
    )
    (tmp_path / "f").mkdir()
    float_model, _ = _load(_linked(tmp_path / "f", "Q5_0"), "float32")
    assert {(g.held, g.runs) for g in TorchExecutor(float_model, 1, 64).weight_groups} == {("dense", "every pass")}
