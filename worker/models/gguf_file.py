"""A GGUF file's header: its metadata and where each tensor lies, read in one pass.

``gguf.GGUFReader`` builds a numpy view per array element: for Gemma 3's 262,144-token vocabulary
(three such arrays) it takes 12 s to open the file. This reader parses the same header with
``struct`` (strings) and ``np.frombuffer`` (numeric arrays) in a fraction of a second; the gguf
package stays the reference for types, block sizes and dequantization. Format: GGUF v2 and v3,
little-endian (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from muxworker.worker.models.base import InvalidModelError

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
        return int(np.prod(self.shape, dtype=np.int64))


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

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise InvalidModelError(f"{self.path}: a string of {n} bytes at byte {self.pos} runs past the file")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidModelError(f"{self.path}: a GGUF string at byte {self.pos - n} is not UTF-8: {e}") from None

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise InvalidModelError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")
        item, n = self.take("<I"), self.take("<Q")
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
            end = self.pos + n * dtype.itemsize
            if end > len(self.buf):
                raise InvalidModelError(f"{self.path}: an array of {n} values at byte {self.pos} runs past the file")
            values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).tolist()
            self.pos = end
            return values
        return [self.value(item) for _ in range(n)]


class GGUFFile:
    """The header of a GGUF file: ``metadata`` (key -> str, int, float, bool or list, as
    ``GGUFReader``'s ``contents()`` gives them) and ``tensors`` in file order."""

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
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
            type_id, offset = cur.take("<I"), cur.take("<Q")
            infos.append((name, dims, type_id, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        start = -(-cur.pos // alignment) * alignment
        self.tensors: list[GGUFTensorInfo] = []
        for name, dims, type_id, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(type_id)
            except ValueError:
                raise InvalidModelError(f"{self.path}: tensor {name} has unknown GGML type {type_id}") from None
            values, size = gguf.GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims, dtype=np.int64))
            if n % values:
                raise InvalidModelError(f"{self.path}: tensor {name} of {n} values is not whole {qtype.name} blocks")
            info = GGUFTensorInfo(
                name, qtype, tuple(int(d) for d in reversed(dims)), start + offset, n // values * size
            )
            if info.offset + info.nbytes > len(self._map):
                raise InvalidModelError(f"{self.path}: tensor {name} runs past the end of the file")
            self.tensors.append(info)

    def data(self, tensor: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes (uint8, a read-only view of the memory map)."""
        return self._map[tensor.offset : tensor.offset + tensor.nbytes]
