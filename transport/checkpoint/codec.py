"""The checkpoint's wire codec: a manifest map plus payloads named by index.

On the wire a checkpoint is a small control map (the *manifest*) plus a list of binary payloads that
the map names by index. The bytes never ride inside the map, so a 300,000-token history keeps the map
under a kilobyte. Decoding validates every field and returns zero-copy views of the payloads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from muxworker.transport.framing import attach_payload

from .errors import CheckpointMalformed
from .state import (
    _DRAFT_RESERVED,
    _MAX_LAYERS,
    _MAX_POSITION,
    _MAX_STR,
    _PAYLOAD_DTYPES,
    CPUCheckpoint,
    LayerState,
    _check_format,
    _check_geometry,
    _check_int,
    _expect_keys,
    _expect_map,
    _payload_dtype_name,
)

__all__ = ["MANIFEST_VERSION", "MAX_PAYLOADS", "checkpoint_to_wire", "checkpoint_from_wire"]

#: Version of the manifest map produced by :func:`checkpoint_to_wire`.
MANIFEST_VERSION = 1
_MAX_EXTENT = 1 << 40  # bound on one dimension of a payload
#: Most payloads one checkpoint may have: keys and values of every target and draft layer, the
#: token ids and a few draft arrays.
MAX_PAYLOADS = 4 * _MAX_LAYERS + 64


def checkpoint_to_wire(ckpt: CPUCheckpoint) -> tuple[dict, list[np.ndarray]]:
    """Encode ``ckpt`` as ``(manifest, payloads)``; the manifest names payload ``i`` by index.

    The payloads are the checkpoint's own arrays (no copy). A payload reference is the frame's
    (:func:`~muxworker.transport.framing.attach_payload`): ``{"payload": i, "dtype": <declared
    dtype>, "shape": [...]}``, so a frame carrying the manifest carries exactly these payloads, in
    this order.
    """
    ckpt.validate()
    payloads: list[np.ndarray] = []
    dtype = ckpt.format["dtype"]

    def layers_out(layers: list[LayerState]) -> list[dict]:
        return [
            {
                "start": int(layer.start),
                "rows": layer.rows,
                "keys": attach_payload(payloads, layer.keys, dtype=dtype),
                "values": attach_payload(payloads, layer.values, dtype=dtype),
            }
            for layer in layers
        ]

    manifest: dict[str, Any] = {
        "version": MANIFEST_VERSION,
        "format": dict(ckpt.format),
        "geometry": _geometry_out(ckpt.geometry),
        "position": int(ckpt.position),
        "identity": ckpt.identity,
        "token_ids": attach_payload(payloads, ckpt.token_ids, dtype="int32"),
        "layers": layers_out(ckpt.layers),
        "draft": None,
    }
    if ckpt.draft is not None:
        draft_layers = layers_out(ckpt.draft["layers"])
        arrays = {
            name: attach_payload(payloads, value, dtype=_payload_dtype_name(value, dtype))
            for name, value in ckpt.draft.items()
            if name not in _DRAFT_RESERVED
        }
        manifest["draft"] = {
            "geometry": _geometry_out(ckpt.draft["geometry"]),
            "layers": draft_layers,
            "arrays": arrays,
        }
    return manifest, payloads


def checkpoint_from_wire(manifest: Any, payloads: Sequence[Any]) -> CPUCheckpoint:
    """Decode a manifest and its payload buffers into a :class:`CPUCheckpoint`.

    The arrays are zero-copy views of ``payloads`` (read-only when the buffers are). Every field is
    validated; a malformed manifest or a payload of the wrong size raises :class:`CheckpointMalformed`.
    """
    m = _expect_map(manifest, "manifest")
    _expect_keys(
        m,
        "manifest",
        {"version", "format", "geometry", "position", "identity", "token_ids", "layers", "draft"},
    )
    version = _check_int(m["version"], "manifest.version", 0, 1 << 31)
    if version != MANIFEST_VERSION:
        raise CheckpointMalformed(f"manifest version {version} is not supported (expected {MANIFEST_VERSION})")
    if len(payloads) > MAX_PAYLOADS:
        raise CheckpointMalformed(f"{len(payloads)} payloads is over the bound of {MAX_PAYLOADS}")
    used = [False] * len(payloads)

    def array_of(r: Any, where: str) -> np.ndarray:
        r = _expect_map(r, where)
        _expect_keys(r, where, {"payload", "dtype", "shape"})
        index = r["payload"]
        if type(index) is not int or not 0 <= index < len(payloads):
            raise CheckpointMalformed(f"{where}.payload must index one of the {len(payloads)} payloads, got {index!r}")
        if used[index]:
            raise CheckpointMalformed(f"{where} reuses payload {index}")
        used[index] = True
        name = r["dtype"]
        if not isinstance(name, str) or name not in _PAYLOAD_DTYPES:
            raise CheckpointMalformed(f"{where}.dtype must be one of {sorted(_PAYLOAD_DTYPES)}, got {name!r}")
        dtype = _PAYLOAD_DTYPES[name]
        shape = r["shape"]
        if not isinstance(shape, list) or not 1 <= len(shape) <= 4:
            raise CheckpointMalformed(f"{where}.shape must be a list of 1 to 4 sizes, got {shape!r}")
        if not all(type(n) is int and 0 <= n <= _MAX_EXTENT for n in shape):
            raise CheckpointMalformed(f"{where}.shape must list integers in [0, {_MAX_EXTENT}], got {shape!r}")
        expected = math.prod(shape) * dtype.itemsize
        try:
            view = memoryview(payloads[index])
        except TypeError:
            raise CheckpointMalformed(f"payload {index} is not a buffer") from None
        if not view.c_contiguous:
            raise CheckpointMalformed(f"payload {index} is not contiguous")
        if view.nbytes != expected:
            raise CheckpointMalformed(
                f"payload {index} ({where}) holds {view.nbytes} bytes; {name} {list(shape)} needs {expected}"
            )
        if view.ndim != 1 or view.format not in ("B", "b", "c"):
            view = view.cast("B") if view.nbytes else memoryview(b"")
        return np.frombuffer(view, dtype=dtype).reshape(shape)

    dtype_name = _check_format(m["format"], where="manifest.format")
    geometry = _geometry_in(m["geometry"], "manifest.geometry")
    position = _check_int(m["position"], "manifest.position", 1, _MAX_POSITION)
    identity = m["identity"]
    if identity is not None and not isinstance(identity, str):
        raise CheckpointMalformed("manifest.identity must be a string or nil")
    token_ids = array_of(m["token_ids"], "manifest.token_ids")
    if m["token_ids"]["dtype"] != "int32":
        raise CheckpointMalformed("manifest.token_ids must be int32")

    def layers_in(raw: Any, where: str) -> list[LayerState]:
        if not isinstance(raw, list) or len(raw) > _MAX_LAYERS:
            raise CheckpointMalformed(f"{where} must be a list of at most {_MAX_LAYERS} layers")
        out = []
        for i, entry in enumerate(raw):
            w = f"{where}[{i}]"
            entry = _expect_map(entry, w)
            _expect_keys(entry, w, {"start", "rows", "keys", "values"})
            start = _check_int(entry["start"], f"{w}.start", 0, _MAX_POSITION)
            rows = _check_int(entry["rows"], f"{w}.rows", 0, _MAX_POSITION)
            for part in ("keys", "values"):
                if _expect_map(entry[part], f"{w}.{part}").get("dtype") != dtype_name:
                    raise CheckpointMalformed(f"{w}.{part}.dtype must be the format dtype {dtype_name!r}")
            keys = array_of(entry["keys"], f"{w}.keys")
            values = array_of(entry["values"], f"{w}.values")
            if keys.shape[0] != rows:
                raise CheckpointMalformed(f"{w}.rows is {rows} but its keys hold {keys.shape[0]} rows")
            out.append(LayerState(start=start, keys=keys, values=values))
        return out

    layers = layers_in(m["layers"], "manifest.layers")
    draft = None
    if m["draft"] is not None:
        d = _expect_map(m["draft"], "manifest.draft")
        _expect_keys(d, "manifest.draft", {"geometry", "layers", "arrays"})
        draft = {
            "geometry": _geometry_in(d["geometry"], "manifest.draft.geometry"),
            "layers": layers_in(d["layers"], "manifest.draft.layers"),
        }
        arrays = _expect_map(d["arrays"], "manifest.draft.arrays")
        for name, r in arrays.items():
            if not isinstance(name, str) or name in _DRAFT_RESERVED or len(name) > _MAX_STR:
                raise CheckpointMalformed(f"manifest.draft.arrays has an invalid name {name!r}")
            if _expect_map(r, f"manifest.draft.arrays.{name}").get("dtype") not in ("int32", dtype_name):
                raise CheckpointMalformed(f"manifest.draft.arrays.{name}.dtype must be int32 or {dtype_name!r}")
            draft[name] = array_of(r, f"manifest.draft.arrays.{name}")
    unused = [i for i, u in enumerate(used) if not u]
    if unused:
        raise CheckpointMalformed(f"payloads {unused} are not referenced by the manifest")
    return CPUCheckpoint(
        format=dict(m["format"]),
        geometry=geometry,
        position=position,
        token_ids=token_ids,
        layers=layers,
        draft=draft,
        identity=identity,
    )


def _geometry_out(geometry: dict) -> dict:
    out = dict(geometry)
    out["windows"] = [None if w is None else int(w) for w in geometry["windows"]]
    return out


def _geometry_in(raw: Any, where: str) -> dict:
    _check_geometry(raw, where)
    return dict(raw)
