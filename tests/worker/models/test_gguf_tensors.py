"""Reading a GGUF's tensors in place: the linked directory, the tensor index, the raw blocks and
the dequantized values, with the gguf package's own dequantizer as the oracle."""

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
    unpermute_rotary_rows,
)
from muxworker.worker.models.identity import model_identity_files
from muxworker.worker.models.loader import load_model_dir, load_state_dict, resolve_model

# K-quants need input sizes that are multiples of 256.
K_SHAPE = dict(hidden=256, n_head=4, n_kv_head=2, ffn=512)
SHAPES = {"Q4_0": {}, "Q4_1": {}, "Q8_0": {}, "Q4_K": K_SHAPE, "Q5_K": K_SHAPE, "Q6_K": K_SHAPE}


def _linked(tmp_path: Path, linear_type: str, **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    original = write_tiny_gguf(tmp_path / "tiny.gguf", linear_type=linear_type, **kw)
    return original, convert_gguf(tmp_path / "tiny.gguf", tmp_path / "linked", progress=None, weights="link")


@pytest.mark.parametrize("qtype", sorted(SHAPES))
def test_raw_blocks_and_dequantized_values_are_the_files(tmp_path: Path, qtype: str) -> None:
    original, out = _linked(tmp_path, qtype, **SHAPES[qtype])
    index = GGUFTensorIndex.open(out)
    for name, oracle in original.items():
        if not name.endswith("_proj.weight"):
            continue
        assert index.type_of(name) == qtype
        raw = index.raw(name)
        assert raw.dtype == np.uint8 and not raw.flags.writeable  # a view of the read-only map
        e = index.entries[name]
        unpermuted = unpermute_rotary_rows if e.rotary_heads else None
        values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(e.shape)
        if unpermuted is not None:
            values = unpermuted(values, e.rotary_heads)
        np.testing.assert_array_equal(values, oracle.numpy())
        np.testing.assert_array_equal(index.dequantize(name), oracle.numpy())  # q/k rows unpermuted


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


def test_raw_of_a_tensor_whose_bytes_are_not_whole_blocks_says_so(tmp_path: Path) -> None:
    _, out = _linked(tmp_path, "Q8_0")
    index = GGUFTensorIndex.open(out)
    name = "model.layers.0.mlp.up_proj.weight"
    entry = index.entries[name]
    index.entries[name] = type(entry)(**{**entry.__dict__, "nbytes": entry.nbytes - 34})
    with pytest.raises(GGUFTensorError, match="Q8_0"):
        index.raw(name)
