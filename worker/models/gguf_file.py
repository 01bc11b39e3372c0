"""A GGUF file's header: its metadata and where each tensor lies, read in one pass.

``gguf.GGUFReader`` builds a numpy view per array element: for Gemma 3's 262,144-token vocabulary
(three such arrays) it takes 12 s to open the file. This reader parses the same header with
``struct`` (strings) and ``np.frombuffer`` (numeric arrays) in a fraction of a second; the gguf
package stays the reference for types, block sizes and dequantization. Format: GGUF v2 and v3,
little-endian (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from muxworker.worker.models.base import InvalidModelError
from muxworker.worker.models.bounds import (
    MAX_ARRAY_LENGTH,
    MAX_KEY_BYTES,
    MAX_METADATA_KEYS,
    MAX_STRING_BYTES,
    MAX_TENSOR_DIMS,
    MAX_TENSOR_NAME_BYTES,
    MAX_TENSORS,
    MAX_VOCAB,
)

__all__ = ["GGUFFile", "GGUFTensorInfo"]

_MAGIC = b"GGUF"
# GGUF value type -> (struct format, numpy dtype) of the fixed-size scalar types.
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy/torch order (reversed GGML ne)
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class _Cursor:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise InvalidModelError(f"{self.path} ends inside its GGUF header (at byte {self.pos})") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self, what: str, limit: int = MAX_STRING_BYTES) -> str:
        """A length-prefixed UTF-8 string; ``what`` names it in errors (a key, a tensor's name)."""
        start = self.pos
        n = self.take("<Q")
        if n > limit:
            raise InvalidModelError(f"{self.path}: {what} is a string of {n} bytes (at byte {start}); at most {limit}")
        if self.pos + n > len(self.buf):
            raise InvalidModelError(
                f"{self.path}: {what} is a string of {n} bytes at byte {start}: past the file's end"
            )
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidModelError(f"{self.path}: {what} (a string at byte {start}) is not UTF-8: {e}") from None

    def value(self, vtype: int, key: str, *, in_array: bool = False) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string(f"metadata {key}")
        if vtype != _ARRAY:
            raise InvalidModelError(
                f"{self.path}: metadata {key} has unknown GGUF value type {vtype} (byte {self.pos})"
            )
        if in_array:  # llama.cpp refuses them too; unbounded nesting would recurse without bound
            raise InvalidModelError(f"{self.path}: metadata {key} is an array of arrays, which GGUF readers refuse")
        item, n = self.take("<I"), self.take("<Q")
        if n > MAX_ARRAY_LENGTH:
            raise InvalidModelError(
                f"{self.path}: metadata {key} is an array of {n} entries; at most {MAX_ARRAY_LENGTH} "
                f"(twice the largest vocabulary, {MAX_VOCAB})"
            )
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
            end = self.pos + n * dtype.itemsize
            if end > len(self.buf):
                raise InvalidModelError(
                    f"{self.path}: metadata {key} is an array of {n} values at byte {self.pos}: past the file's end"
                )
            values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).tolist()
            self.pos = end
            return values
        if item == _STRING and self.pos + 8 * n > len(self.buf):  # each string has an 8-byte length
            raise InvalidModelError(
                f"{self.path}: metadata {key} is an array of {n} strings at byte {self.pos}: past the file's end"
            )
        return [self.value(item, key, in_array=True) for _ in range(n)]


class GGUFFile:
    """The header of a GGUF file: ``metadata`` (key -> str, int, float, bool or list, as
    ``GGUFReader``'s ``contents()`` gives them) and ``tensors`` in file order.

    The header is untrusted: every count and length is checked against bounds.py before anything
    is allocated for it, and every tensor must lie inside the file; a malformed file raises one
    InvalidModelError naming the file and the field."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise InvalidModelError(f"{self.path} cannot be read as a GGUF file: {e}") from None
        cur = _Cursor(memoryview(self._map.data), self.path)
        if bytes(self._map[:4]) != _MAGIC:
            raise InvalidModelError(f"{self.path} is not a GGUF file (it does not start with b'GGUF')")
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            swapped = version > 0xFFFF
            raise InvalidModelError(
                f"{self.path} is a byte-swapped (big-endian) GGUF" if swapped else f"{self.path} is GGUF v{version}"
            )
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        if n_tensors > MAX_TENSORS:
            raise InvalidModelError(f"{self.path}: the header's tensor count is {n_tensors}; at most {MAX_TENSORS}")
        if n_kv > MAX_METADATA_KEYS:
            raise InvalidModelError(f"{self.path}: the header's metadata count is {n_kv}; at most {MAX_METADATA_KEYS}")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key {i}", MAX_KEY_BYTES)
            if key in self.metadata:
                raise InvalidModelError(f"{self.path}: metadata {key} appears twice")
            self.metadata[key] = cur.value(cur.take("<I"), key)
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"the name of tensor {i}", MAX_TENSOR_NAME_BYTES)
            n_dims = cur.take("<I")
            if not 1 <= n_dims <= MAX_TENSOR_DIMS:
                raise InvalidModelError(
                    f"{self.path}: tensor {name} has {n_dims} dimensions; expected 1 to {MAX_TENSOR_DIMS}"
                )
            dims = [cur.take("<Q") for _ in range(n_dims)]
            type_id, offset = cur.take("<I"), cur.take("<Q")
            infos.append((name, dims, type_id, offset))
        alignment = self.metadata.get("general.alignment", 32)
        if (
            isinstance(alignment, bool)
            or not isinstance(alignment, int)
            or alignment < 1
            or alignment & (alignment - 1)
        ):
            raise InvalidModelError(f"{self.path}: general.alignment = {alignment!r} is not a power of two")
        start = -(-cur.pos // alignment) * alignment
        self.tensors: list[GGUFTensorInfo] = []
        size = len(self._map)
        for name, dims, type_id, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(type_id)
                values, block = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise InvalidModelError(f"{self.path}: tensor {name} has unknown GGML type {type_id}") from None
            n = math.prod(dims)  # exact: a product of crafted uint64 dims would wrap in int64
            if n % values:
                raise InvalidModelError(f"{self.path}: tensor {name} of {n} values is not whole {qtype.name} blocks")
            if offset % alignment:
                raise InvalidModelError(
                    f"{self.path}: tensor {name}'s data offset {offset} is not a multiple of the alignment {alignment}"
                )
            info = GGUFTensorInfo(
                name, qtype, tuple(int(d) for d in reversed(dims)), start + offset, n // values * block
            )
            if info.offset + info.nbytes > size:
                raise InvalidModelError(
                    f"{self.path}: tensor {name} ({list(info.shape)}, {qtype.name}) lies at bytes "
                    f"[{info.offset}, {info.offset + info.nbytes}), past the file's end ({size} bytes)"
                )
            self.tensors.append(info)

    def data(self, tensor: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes (uint8, a read-only view of the memory map)."""
        return self._map[tensor.offset : tensor.offset + tensor.nbytes]
