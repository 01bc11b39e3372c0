"""Our GGUF header reader against the gguf package's GGUFReader (the reference)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from helpers.gguf_files import write_tiny_gguf

from muxworker.worker.models.base import InvalidModelError
from muxworker.worker.models.gguf_file import GGUFFile
from muxworker.worker.models.loader import bundled_gguf_path


def _same_as_reader(path: Path) -> None:
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, float) or (isinstance(value, list) and value and isinstance(value[0], float)):
            np.testing.assert_array_equal(np.float32(ours.metadata[key]), np.float32(value), err_msg=key)
        else:
            assert ours.metadata[key] == value, key
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.type, a.shape, a.offset, a.nbytes) == (
            b.name,
            b.tensor_type,
            tuple(int(d) for d in reversed(b.shape.tolist())),
            int(b.data_offset),
            int(b.n_bytes),
        )
        np.testing.assert_array_equal(ours.data(a), np.asarray(b.data).view(np.uint8).reshape(-1))


def test_the_header_equals_the_gguf_packages_reading(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", linear_type="Q4_K", hidden=256, ffn=512)
    _same_as_reader(tmp_path / "tiny.gguf")
    _same_as_reader(bundled_gguf_path())  # 49,152 tokens, merges, a chat template


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda b: b[:100], "ends inside its GGUF header|past the file.s end"),
        (lambda b: b"GGUF" + (3).to_bytes(4, "big") + b[8:], "byte-swapped"),
        (lambda b: b"GGUX" + b[4:], "not a GGUF file"),
        (lambda b: b[: len(b) - 64], "past the file.s end"),
    ],
)
def test_a_damaged_file_is_refused_with_what_is_wrong(tmp_path: Path, damage, message: str) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "bad.gguf").write_bytes(damage((tmp_path / "tiny.gguf").read_bytes()))
    with pytest.raises(InvalidModelError, match=message):
        GGUFFile(tmp_path / "bad.gguf")
