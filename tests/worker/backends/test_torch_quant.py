"""Quantized weights on torch: the int4 kernel's effective weights against the gguf package's
dequantizer, quantized models against their float twins, and --quantize on a float model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.gguf_files import write_tiny_gguf

from muxworker.worker.backends.interface import SeqSpan
from muxworker.worker.backends.torch import executor as ex
from muxworker.worker.backends.torch.cache import KVCache
from muxworker.worker.backends.torch.quant import (
    Int4Linear,
    Int4Weight,
    Int8Linear,
    quantize_int4,
    quantize_int8,
)
from muxworker.worker.models.args import ModelArgs
from muxworker.worker.models.convert import convert_gguf
from muxworker.worker.models.gguf_tensors import GGUFTensorIndex
from muxworker.worker.models.loader import load_model_dir

K_QUANT = dict(hidden=256, n_head=4, n_kv_head=2, ffn=512)


def _linked(tmp_path: Path, linear_type: str, **kw) -> Path:
    write_tiny_gguf(tmp_path / "tiny.gguf", linear_type=linear_type, **kw)
    return convert_gguf(tmp_path / "tiny.gguf", tmp_path / "linked", progress=None, weights="link")


def _kernel_weight(layer: Int4Linear, dtype: torch.dtype) -> torch.Tensor:
    """The weight the kernel multiplies by: W^T = eye(K) @ W^T, each output one weight exactly."""
    eye = torch.eye(layer.in_features, dtype=dtype)
    return layer(eye).t().float()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_kernel_weights_equal_the_gguf_dequantization(tmp_path: Path, qtype: str) -> None:
    index = GGUFTensorIndex.open(_linked(tmp_path, qtype, **(K_QUANT if qtype == "Q4_K" else {})))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        oracle = torch.from_numpy(index.dequantize(name).copy())
        w = index.int4(name)
        weight = Int4Weight.from_numpy(w.codes, w.scales, w.zeros)
        # The float32 mapping is the GGUF's values up to float32 rounding (the dense copy holds it).
        torch.testing.assert_close(weight.dequantize(), oracle, rtol=0, atol=4e-6 * oracle.abs().max().item())
        dense = Int4Linear(weight, None, torch.float32).dense
        torch.testing.assert_close(dense, oracle, rtol=0, atol=4e-6 * oracle.abs().max().item())
        # The kernel keeps scales and zeros in bfloat16, the one rounding the mapping adds.
        s = weight.scales.bfloat16().float().repeat_interleave(32, 1)
        z = weight.zeros.bfloat16().float().repeat_interleave(32, 1)
        expected = ((weight.codes.float() - 8) * s + z).bfloat16().float()
        got = _kernel_weight(Int4Linear(weight, None, torch.bfloat16), torch.bfloat16)
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-6)


def _load(model_dir: Path, dtype: str, weights: str = "float", quantize: str | None = None):
    files = load_model_dir(model_dir)
    args = ModelArgs.from_dict(files.config)
    return ex.load_model(files, args, device="cpu", dtype=dtype, weights=weights, quantize=quantize), args


def _logits(model, args, ids: list[int]) -> torch.Tensor:
    model.setup_rope(64)
    cache = KVCache(
        args.windows, 1, 64, args.num_kv_heads, args.head_size, model.model.embed_tokens.weight.dtype, "cpu"
    )
    n = len(ids)
    return model(torch.tensor(ids), torch.arange(n), [SeqSpan(0, 0, n, 0)], cache, torch.arange(n))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_quantized_model_matches_its_float_twin(tmp_path: Path, qtype: str) -> None:
    d = _linked(tmp_path, qtype, **(K_QUANT if qtype == "Q4_K" else {}))
    ids = [5, 17, 33, 2, 90, 41, 7, 250, 11, 3]
    quantized, args = _load(d, "float32", "quantized")
    assert sum(isinstance(m, Int4Linear) for m in quantized.modules()) == 2 * args.num_hidden_layers * 2
    assert isinstance(quantized.lm_head, Int8Linear)  # the output layer: int8, requantized per row
    float_model, _ = _load(d, "float32", "float")
    assert not any(isinstance(m, (Int4Linear, Int8Linear)) for m in float_model.modules())
    a, b = _logits(quantized, args, ids), _logits(float_model, args, ids)
    assert (a - b).abs().max() < 0.02 * b.abs().max()
    # With the float head, a prefill (dense route) computes what the float layers do, to float32
    # rounding; a decode step (the bfloat16 kernel) agrees to bfloat16 rounding.
    quantized.lm_head = float_model.lm_head
    torch.testing.assert_close(_logits(quantized, args, ids), b, rtol=0, atol=1e-4)
    one = _logits(quantized, args, ids[:1])
    assert (one - b[:1]).abs().max() < 0.02 * b.abs().max()


def test_mixed_types_in_a_fused_projection_run_dense(tmp_path: Path) -> None:
    # The default tiny GGUF has F32 q/k/v/gate/up and a Q8_0 down: nothing to keep 4-bit.
    write_tiny_gguf(tmp_path / "tiny.gguf")
    d = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "linked", progress=None, weights="link")
    model, _ = _load(d, "float32", "quantized")
    assert not any(isinstance(m, Int4Linear) for m in model.modules())


def test_quantized_weights_need_a_quantized_model(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="--weights quantized needs a quantized GGUF"):
        _load(tiny_llama_dir, "float32", "quantized")


def test_quantize_int4_and_int8_error_bounds() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g)
    q4 = quantize_int4(w)
    step = (w.reshape(96, 4, 32).amax(-1) - w.reshape(96, 4, 32).amin(-1)) / 15
    err = (q4.dequantize() - w).abs().reshape(96, 4, 32)
    assert (err <= step[..., None] / 2 + 1e-6).all()  # round to nearest of 16 levels per group
    q8 = quantize_int8(w)
    assert ((q8.dequantize() - w).abs() <= (w.abs().amax(1, keepdim=True) / 127) / 2 + 1e-6).all()


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantize_a_float_model_at_load(tiny_llama_dir: Path, mode: str) -> None:
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    ids = [5, 17, 33, 2, 90, 41, 7, 250, 11, 3]
    base, args = _load(tiny_llama_dir, "float32")
    quantized, _ = _load(tiny_llama_dir, "float32", quantize=mode)
    kind = Int4Linear if mode == "int4" else Int8Linear
    assert sum(isinstance(m, kind) for m in quantized.modules()) == 4 * config["num_hidden_layers"]
    a, b = _logits(quantized, args, ids), _logits(base, args, ids)
    # Not equal (the weights were rounded), but the same model: the logits are close and mostly
    # agree on the top token.
    assert (a - b).abs().max() < 0.25 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.6


def test_prepared_weights_are_cached_and_reload_to_the_same_model(tmp_path: Path) -> None:
    from muxworker.worker.backends.torch.prepared import prepared_path

    d = _linked(tmp_path, "Q4_1")
    ids = [5, 17, 33, 2, 90, 41, 7, 250, 11, 3]
    first, args = _load(d, "bfloat16", "quantized")
    cache = prepared_path(d, torch.bfloat16, torch.device("cpu"))
    assert cache.is_file()
    again, _ = _load(d, "bfloat16", "quantized")  # memory-mapped from the cache
    assert sum(isinstance(m, Int4Linear) for m in again.modules()) == 4 * args.num_hidden_layers
    assert torch.equal(_logits(first, args, ids), _logits(again, args, ids))
    # A damaged cache is ignored and rewritten, never an error.
    cache.write_bytes(b"not a torch file")
    damaged, _ = _load(d, "bfloat16", "quantized")
    assert torch.equal(_logits(damaged, args, ids), _logits(first, args, ids))
    assert cache.stat().st_size > 1000


def test_a_prefill_runs_dense_and_a_decode_runs_the_kernel(tmp_path: Path) -> None:
    from muxworker.worker.backends.torch import quant

    d = _linked(tmp_path, "Q4_1")
    model, args = _load(d, "float32", "quantized")
    calls = {"dense": 0, "kernel": 0}
    layer = next(m for m in model.modules() if isinstance(m, Int4Linear))
    forward = layer.forward

    def counting(x):
        calls["dense" if quant._ROUTE.dense else "kernel"] += 1
        return forward(x)

    layer.forward = counting  # type: ignore[method-assign]
    _logits(model, args, list(range(1, quant.DENSE_ROWS + 1)))
    assert calls == {"dense": 1, "kernel": 0}
    _logits(model, args, [5])
    assert calls == {"dense": 1, "kernel": 1}
    # Both paths multiply by the same weights (the kernel's in bfloat16).
    x = torch.randn(3, layer.in_features)
    with quant.dense_route(True):
        dense = layer(x)
    assert (dense - layer(x)).abs().max() < 0.02 * dense.abs().max()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q5_1"])
def test_other_quantized_types_run_dense_with_their_exact_values(tmp_path: Path, qtype: str) -> None:
    d = _linked(tmp_path, qtype)
    ids = [5, 17, 33, 2, 90, 41, 7, 250, 11, 3]
    quantized, args = _load(d, "float32", "quantized")
    assert not any(isinstance(m, Int4Linear) for m in quantized.modules())  # dequantized, not 4-bit
    float_model, _ = _load(d, "float32", "float")
    quantized.lm_head = float_model.lm_head  # the head alone is requantized to int8
    torch.testing.assert_close(_logits(quantized, args, ids), _logits(float_model, args, ids), rtol=0, atol=1e-5)
