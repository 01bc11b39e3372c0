"""Our torch model against transformers' reference implementations (the oracle), float32."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from muxworker.worker.backends.interface import SeqSpan
from muxworker.worker.backends.torch.cache import KVCache
from muxworker.worker.backends.torch.model import build_model
from muxworker.worker.models.args import ModelArgs

ARCHS = ["llama", "llama3", "qwen2", "mistral", "qwen3", "gemma3"]


def _ours(model_dir, slots=2, max_tokens=256):
    args = ModelArgs.from_dict(json.loads((model_dir / "config.json").read_text()))
    model = build_model(args, load_file(model_dir / "model.safetensors"), dtype=torch.float32, device="cpu")
    model.setup_rope(max_tokens)
    cache = KVCache(args.windows, slots, max_tokens, args.num_kv_heads, args.head_dim, torch.float32, "cpu")
    return model, cache


def _reference_logits(model_dir, ids):
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref.eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def _run(model, cache, slot, start, ids):
    n = len(ids)
    return model(
        torch.tensor(ids),
        torch.arange(start, start + n),
        [SeqSpan(slot, start, n, 0)],
        cache,
        torch.arange(n),
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(tiny_model_factory, arch):
    d = tiny_model_factory(arch)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 384, (70,), generator=g).tolist()  # 70 > mistral's window of 16
    ref = _reference_logits(d, ids)
    model, cache = _ours(d)
    ours = _run(model, cache, 0, 0, ids)
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_match_transformers(tiny_model_factory, arch):
    d = tiny_model_factory(arch)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 384, (60,), generator=g).tolist()
    ref = _reference_logits(d, ids)
    model, cache = _ours(d)
    pos = 0
    for n in (13, 1, 20, 1, 1, 5, 19):  # chunks wider and narrower than the window, and decode steps
        out = _run(model, cache, 1, pos, ids[pos : pos + n])
        assert (out - ref[pos : pos + n]).abs().max().item() <= 1e-4, f"chunk at {pos} of {n}"
        pos += n
    assert pos == len(ids)


def test_packed_batch_equals_separate_runs(tiny_model_factory):
    """Two sequences in one packed forward give the logits each gets alone."""
    d = tiny_model_factory("mistral")
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 384, (30,), generator=g).tolist()
    b = torch.randint(0, 384, (23,), generator=g).tolist()
    model, cache = _ours(d)
    alone_a = _run(model, cache, 0, 0, a)
    alone_b = _run(model, cache, 1, 0, b)
    model2, cache2 = _ours(d)
    both = model2(
        torch.tensor(a + b),
        torch.tensor(list(range(30)) + list(range(23))),
        [SeqSpan(0, 0, 30, 0), SeqSpan(1, 0, 23, 30)],
        cache2,
        torch.arange(53),
    )
    assert torch.allclose(both[:30], alone_a, atol=1e-5)
    assert torch.allclose(both[30:], alone_b, atol=1e-5)


def test_build_model_rejects_mismatched_weights(tiny_llama_dir):
    args = ModelArgs.from_dict(json.loads((tiny_llama_dir / "config.json").read_text()))
    sd = load_file(tiny_llama_dir / "model.safetensors")
    sd.pop("model.norm.weight")
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        build_model(args, sd, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3"])
def test_batched_decode_equals_reference(tiny_model_factory, arch):
    """Several single-token decodes in one padded attention call (ring layers wrapped past the
    window included) give transformers' logits for each sequence."""
    d = tiny_model_factory(arch)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 384, (n,), generator=g).tolist() for n in (9, 25, 40)]  # window is 16
    refs = [_reference_logits(d, s) for s in seqs]
    model, cache = _ours(d, slots=3)
    steps = 5
    for slot, s in enumerate(seqs):
        _run(model, cache, slot, 0, s[: len(s) - steps])
    for i in range(steps):
        pos = [len(s) - steps + i for s in seqs]
        out = model(
            torch.tensor([s[p] for s, p in zip(seqs, pos)]),
            torch.tensor(pos),
            [SeqSpan(slot, p, 1, slot) for slot, p in enumerate(pos)],
            cache,
            torch.arange(3),
        )
        for slot, p in enumerate(pos):
            assert (out[slot] - refs[slot][p]).abs().max().item() <= 1e-4
