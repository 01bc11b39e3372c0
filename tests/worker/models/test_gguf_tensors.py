"""Reading a GGUF's tensors in place: the linked directory, the tensor index, and the int4 mapping of
Q4_0/Q4_1/Q4_K blocks, with the gguf package's own dequantizer as the oracle."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from helpers.gguf_files import write_tiny_gguf

from muxworker.worker.models.convert import convert_gguf
from muxworker.worker.models.gguf_tensors import (
    GGUF_LINK,
    TENSOR_INDEX,
    GGUFTensorError,
    GGUFTensorIndex,
)
from muxworker.worker.models.identity import model_identity_files
from muxworker.worker.models.loader import load_model_dir, load_state_dict, resolve_model

# K-quants need input sizes that are multiples of 256.
SHAPES = {"Q4_0": {}, "Q4_1": {}, "Q4_K": dict(hidden=256, n_head=4, n_kv_head=2, ffn=512)}


def _linked(tmp_path: Path, linear_type: str, **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    original = write_tiny_gguf(tmp_path / "tiny.gguf", linear_type=linear_type, **kw)
    return original, convert_gguf(tmp_path / "tiny.gguf", tmp_path / "linked", progress=None, weights="link")


@pytest.mark.parametrize("qtype", sorted(SHAPES))
def test_int4_codes_reproduce_the_gguf_dequantization(tmp_path: Path, qtype: str) -> None:
    original, out = _linked(tmp_path, qtype, **SHAPES[qtype])
    index = GGUFTensorIndex.open(out)
    for name, oracle in original.items():
        if not name.endswith("_proj.weight"):
            continue
        assert index.type_of(name) == qtype
        w = index.int4(name)
        assert w.codes.dtype == np.uint8 and int(w.codes.max()) <= 15
        assert w.scales.shape == (w.codes.shape[0], w.codes.shape[1] // 32)
        # (codes - 8) * scale + zero in float32 against the gguf package's dequantizer: the same
        # values up to the float32 rounding of zero = m + 8 d (Q4_1) or 8 d sc - dmin m (Q4_K).
        np.testing.assert_allclose(w.dequantize(), oracle.numpy(), rtol=0, atol=4e-6 * np.abs(oracle.numpy()).max())
        np.testing.assert_array_equal(index.dequantize(name), oracle.numpy())  # q/k rows unpermuted


def test_q4_0_zero_is_exactly_zero_and_q4_1_matches_bit_for_bit(tmp_path: Path) -> None:
    _, out = _linked(tmp_path / "a", "Q4_0")
    w = GGUFTensorIndex.open(out).int4("model.layers.0.mlp.up_proj.weight")
    assert not w.zeros.any()
    _, out = _linked(tmp_path / "b", "Q4_1")
    index = GGUFTensorIndex.open(out)
    name = "model.layers.1.self_attn.v_proj.weight"
    np.testing.assert_array_equal(index.int4(name).dequantize(), index.dequantize(name))


def test_index_offsets_are_the_readers_bytes(tmp_path: Path) -> None:
    _, out = _linked(tmp_path, "Q4_1")
    index = GGUFTensorIndex.open(out)
    reader = gguf.GGUFReader(tmp_path / "tiny.gguf")
    by_gguf = {t.name: t for t in reader.tensors}
    for entry in index.entries.values():
        t = by_gguf[entry.gguf_name]
        np.testing.assert_array_equal(index._bytes(entry), np.asarray(t.data).view(np.uint8).reshape(-1))


def test_linked_directory_copies_no_weights(tmp_path: Path) -> None:
    _, out = _linked(tmp_path, "Q4_1")
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        ["config.json", "generation_config.json", GGUF_LINK, TENSOR_INDEX, "tokenizer.json", "tokenizer_config.json"]
    )
    assert (out / GGUF_LINK).resolve() == (tmp_path / "tiny.gguf").resolve()
    files = load_model_dir(out)
    assert files.gguf and files.weight_files == (out / GGUF_LINK,)
    assert "torch_dtype" not in files.config
    # The identity covers the GGUF's own bytes and the index.
    identity = model_identity_files(out)
    assert (tmp_path / "tiny.gguf").resolve() in identity and out / TENSOR_INDEX in identity


def test_float_state_of_a_linked_directory_equals_the_copy(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", linear_type="Q4_1")
    linked = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "linked", progress=None, weights="link")
    copied = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "copied", progress=None)
    a, b = load_state_dict(linked), load_state_dict(copied)
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] == b[name]).all(), name


def test_resolve_model_relinks_a_moved_gguf(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    write_tiny_gguf(tmp_path / "a" / "tiny.gguf")
    cache = tmp_path / "cache"
    first = resolve_model(tmp_path / "a" / "tiny.gguf", progress=None, cache_dir=cache)
    (tmp_path / "b").mkdir()
    os.replace(tmp_path / "a" / "tiny.gguf", tmp_path / "b" / "tiny.gguf")  # same content, same mtime
    assert not (first / GGUF_LINK).is_file()
    with pytest.raises(Exception, match="does not point at a GGUF"):
        load_model_dir(first)
    second = resolve_model(tmp_path / "b" / "tiny.gguf", progress=None, cache_dir=cache)
    assert second == first  # the cache is keyed by content, not path
    assert (second / GGUF_LINK).resolve() == (tmp_path / "b" / "tiny.gguf").resolve()
    assert load_model_dir(second).gguf


def test_a_changed_gguf_is_refused_not_misread(tmp_path: Path) -> None:
    _, out = _linked(tmp_path, "Q4_1")
    st = os.stat(tmp_path / "tiny.gguf")
    with open(tmp_path / "tiny.gguf", "r+b") as f:  # other bytes, same size and mtime: not detected
        f.seek(st.st_size - 4)
        f.write(b"\0\0\0\0")
    os.utime(tmp_path / "tiny.gguf", ns=(st.st_atime_ns, st.st_mtime_ns))
    GGUFTensorIndex.open(out)
    os.utime(tmp_path / "tiny.gguf", ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # rewritten: refused
    with pytest.raises(GGUFTensorError, match="changed since conversion"):
        GGUFTensorIndex.open(out)
    with open(tmp_path / "tiny.gguf", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(GGUFTensorError, match="changed since conversion"):
        GGUFTensorIndex.open(out)


def test_a_damaged_index_is_refused(tmp_path: Path) -> None:
    _, out = _linked(tmp_path, "Q4_1")
    doc = json.loads((out / TENSOR_INDEX).read_text())
    (out / TENSOR_INDEX).write_text(json.dumps({**doc, "tensors": [{"name": "x"}]}))
    with pytest.raises(GGUFTensorError, match="malformed tensor entry"):
        GGUFTensorIndex.open(out)
    (out / TENSOR_INDEX).write_text("{")
    with pytest.raises(GGUFTensorError, match="cannot be read"):
        GGUFTensorIndex.open(out)


def test_int4_of_a_non_4bit_tensor_says_what_it_is(tmp_path: Path) -> None:
    _, out = _linked(tmp_path, "Q8_0")
    with pytest.raises(GGUFTensorError, match="Q8_0"):
        GGUFTensorIndex.open(out).int4("model.layers.0.mlp.up_proj.weight")
