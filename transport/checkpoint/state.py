"""The checkpoint data model: what a checkpoint holds and the rules it obeys.

A checkpoint is the committed state of one session in a backend-independent logical layout:
the token history plus, per attention layer, the retained KV rows ``[n, KV, D]`` for the positions
``[start, start + n)``. The worker exports it, the client saves it to a file, a worker restores it.
The retention rule (:func:`required_rows`) is the one the worker's caches answer to as well.
Only numpy here: no torch, no device state.

The draft model's state stays a dict (``{"geometry", "layers", "pending_token_ids"}``): the worker's
speculative decoder builds it by key. ``pending_token_ids`` are the committed tokens after the
draft's rows (derived: segments store only the rows and where they end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from muxworker.transport.framing import DTYPES

from .errors import CheckpointMalformed, CheckpointRetentionError

__all__ = [
    "CPUCheckpoint",
    "LayerState",
    "LAYOUT_VERSION",
    "numpy_storage_dtype",
    "required_rows",
    "retained_from",
]

#: Version of the logical KV layout in ``format["layout_version"]``.
LAYOUT_VERSION = 1

# Declared KV dtype -> how its bytes are held in numpy, as the frame's payload table has it (always
# little-endian). numpy has no bfloat16, so bfloat16 travels as its raw 16-bit patterns in uint16.
_STORAGE_DTYPES: dict[str, np.dtype] = {name: DTYPES[name] for name in ("float32", "float16", "bfloat16")}
# Dtypes a checkpoint payload reference may name: the KV dtypes plus the token-id dtype.
_PAYLOAD_DTYPES: dict[str, np.dtype] = {**_STORAGE_DTYPES, "int32": DTYPES["int32"]}

_MAX_LAYERS = 4096
_MAX_DIM = 1 << 20  # bound on KV heads, head_dim and window sizes
_MAX_POSITION = (1 << 31) - 1
_MAX_STR = 256
_DRAFT_KEYS = {"geometry", "layers", "pending_token_ids"}


def same_layout(a: dict, b: dict) -> bool:
    """Whether rows of format ``a`` can be used where format ``b`` is expected: the same dtype and
    layout version. The backend is not compared: rows are logical, so torch and MLX read each other's."""
    return a.get("dtype") == b.get("dtype") and a.get("layout_version") == b.get("layout_version")


def numpy_storage_dtype(name: str) -> np.dtype:
    """The numpy dtype that holds KV rows of the declared dtype ``name`` (bfloat16 -> uint16 bits)."""
    try:
        return _STORAGE_DTYPES[name]
    except (KeyError, TypeError):
        raise CheckpointMalformed(f"unsupported KV dtype {name!r}; expected one of {sorted(_STORAGE_DTYPES)}") from None


def required_rows(window: int | None, position: int) -> tuple[int, int]:
    """Positions ``[lo, position)`` a layer must retain to continue from ``position``.

    A full-attention layer (``window is None``) attends to all of history. A sliding layer with
    window W attends to the new token and the W - 1 before it, so it needs ``W - 1`` prior rows.
    """
    if window is None:
        return 0, position
    return max(0, position - (window - 1)), position


def retained_from(window: int | None, position: int) -> int:
    """First position a layer still holds at ``position``: 0 with full attention, the last
    ``window`` positions for a sliding-window ring (one more than continuing needs, so a slot can
    also truncate to ``position - 1``, the exact retry). What an export writes and a restore claims."""
    return 0 if window is None else max(0, position - window)


@dataclass(eq=False)  # == on numpy fields is ambiguous; compare arrays explicitly
class LayerState:
    """The retained KV rows of one layer: positions ``[start, start + n)``."""

    start: int
    keys: np.ndarray  # [n, KV, D] in the checkpoint's storage dtype, C-contiguous
    values: np.ndarray  # [n, KV, D], same shape and dtype as keys

    @property
    def rows(self) -> int:
        return int(self.keys.shape[0]) if self.keys.ndim >= 1 else 0

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)


@dataclass(eq=False)
class CPUCheckpoint:
    """Committed state of one session, in host memory, independent of any worker.

    ``format``: ``{"backend": str, "dtype": "float32"|"bfloat16"|"float16", "layout_version": 1}``.
    ``geometry``: ``{"num_layers": L, "num_kv_heads": KV, "head_dim": D, "windows": [None|W] * L}``.
    ``position``: the committed boundary captured, ``== len(token_ids)``.
    ``draft``: ``None`` or ``{"geometry": {...}, "layers": [LayerState], "pending_token_ids": int32}``.
    The draft's layers may end before ``position`` (:attr:`draft_position`): a draft continues from
    there, and ``pending_token_ids`` are ``token_ids[draft_position:]``.
    ``identity``: the model/configuration identity it was exported under, if the caller gave one.

    Construction validates internal consistency (:meth:`validate`); restoring at a position also
    needs :meth:`validate_restore_position`.
    """

    format: dict
    geometry: dict
    position: int
    token_ids: np.ndarray  # [position] int32
    layers: list[LayerState]
    draft: dict | None = None
    identity: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def dtype(self) -> str:
        return self.format["dtype"]

    @property
    def nbytes(self) -> int:
        """Bytes of every array: token ids, target KV and draft state."""
        return sum(int(a.nbytes) for a in _arrays_of(self))

    def validate(self) -> None:
        """Check internal consistency; raise :class:`CheckpointMalformed` naming the bad field."""
        _check_format(self.format)
        _check_geometry(self.geometry, "geometry")
        position = _check_int(self.position, "position", 1, _MAX_POSITION)
        tok = self.token_ids
        if not isinstance(tok, np.ndarray) or tok.dtype != _PAYLOAD_DTYPES["int32"] or tok.ndim != 1:
            raise CheckpointMalformed(f"token_ids must be a 1-D int32 numpy array, got {_describe(tok)}")
        if tok.shape[0] != position:
            raise CheckpointMalformed(
                f"len(token_ids) == {tok.shape[0]} but position == {position}; they must be equal"
            )
        if not tok.flags.c_contiguous:
            raise CheckpointMalformed("token_ids must be C-contiguous")
        if int(tok.min()) < 0:
            raise CheckpointMalformed("token_ids must be nonnegative")
        storage = numpy_storage_dtype(self.format["dtype"])
        _check_layers(self.layers, self.geometry, storage, position, "layers")
        if self.draft is not None:
            _check_draft(self.draft, self.format["dtype"], tok)
        if self.identity is not None and not (isinstance(self.identity, str) and 0 < len(self.identity) <= _MAX_STR):
            raise CheckpointMalformed(f"identity must be None or a nonempty string of at most {_MAX_STR} characters")

    @property
    def draft_position(self) -> int | None:
        """Where the draft's KV ends: the position its layers reach (<= ``position``), None without a
        draft. A draft may lag the target by committed tokens it has not been fed yet; an engine
        carries those in a draft array (``pending_token_ids``)."""
        if self.draft is None:
            return None
        return max(layer.start + layer.rows for layer in self.draft["layers"])

    def common_prefix_length(self, token_ids: Sequence[int] | np.ndarray) -> int:
        """How many leading tokens of ``token_ids`` equal this checkpoint's history."""
        other = np.asarray(token_ids)
        if other.ndim != 1:
            raise ValueError(f"token_ids must be one-dimensional, got shape {other.shape}")
        n = min(int(other.shape[0]), self.position)
        if n == 0:
            return 0
        if other.dtype.kind not in "iu":
            raise ValueError(f"token_ids must be integers, got dtype {other.dtype}")
        mismatch = np.flatnonzero(self.token_ids[:n] != other[:n])
        return int(mismatch[0]) if mismatch.size else n

    def validate_restore_position(self, position: int) -> None:
        """Raise :class:`CheckpointRetentionError` unless every layer can continue from ``position``."""
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)):
            raise CheckpointRetentionError(f"restore position must be an integer, got {type(position).__name__}")
        position = int(position)
        if position == 0:
            raise CheckpointRetentionError("restore position 0 restores nothing; open a fresh session instead")
        if not 1 <= position <= self.position:
            raise CheckpointRetentionError(
                f"restore position {position} is outside [1, {self.position}] (the checkpoint's committed history)"
            )
        groups = [("layer", self.geometry, self.layers, position)]
        if self.draft is not None:
            # A draft that lags the target continues from where its own rows end.
            draft_at = self.draft_position
            assert draft_at is not None  # a draft always has a position
            at = min(position, draft_at)
            groups.append(("draft layer", self.draft["geometry"], self.draft["layers"], at))
        for what, geometry, layers, at in groups:
            for i, (window, layer) in enumerate(zip(geometry["windows"], layers)):
                lo, hi = required_rows(window, at)
                if lo < layer.start or hi > layer.start + layer.rows:
                    raise CheckpointRetentionError(
                        f"{what} {i} (window {window}) needs positions [{lo}, {hi}) to continue "
                        f"from {at} but retains only [{layer.start}, "
                        f"{layer.start + layer.rows}); choose another checkpoint or a fresh prefill"
                    )

    def truncated(self, position: int) -> CPUCheckpoint:
        """This checkpoint cut back to ``position`` (views, no copy), after
        :meth:`validate_restore_position`. The draft keeps what it holds up to there."""
        self.validate_restore_position(position)
        if position == self.position:
            return self
        draft = None
        if self.draft is not None:
            at = min(position, self.draft_position or 0)
            draft = {
                "geometry": self.draft["geometry"],
                "layers": _cut_layers(self.draft["layers"], self.draft["geometry"], at),
                "pending_token_ids": self.token_ids[at:position].copy(),
            }
        return CPUCheckpoint(
            format=self.format,
            geometry=self.geometry,
            position=position,
            token_ids=self.token_ids[:position].copy(),
            layers=_cut_layers(self.layers, self.geometry, position),
            draft=draft,
            identity=self.identity,
        )


def _cut_layers(layers: list[LayerState], geometry: dict, position: int) -> list[LayerState]:
    """Each layer's rows up to ``position``, from where its window needs them (at most what it holds)."""
    out = []
    for window, layer in zip(geometry["windows"], layers):
        lo = min(max(layer.start, retained_from(window, position)), position)
        a, b = lo - layer.start, position - layer.start
        out.append(LayerState(lo, layer.keys[a:b], layer.values[a:b]))
    return out


# ----------------------------------------------------------------------------------------------
# Validation helpers


def _arrays_of(ckpt: CPUCheckpoint):
    yield ckpt.token_ids
    for layer in ckpt.layers:
        yield layer.keys
        yield layer.values
    if ckpt.draft is not None:
        for layer in ckpt.draft["layers"]:
            yield layer.keys
            yield layer.values
        yield ckpt.draft["pending_token_ids"]


def _describe(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"{x.dtype} array of shape {x.shape}"
    return type(x).__name__


def _check_int(value: Any, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise CheckpointMalformed(f"{where} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise CheckpointMalformed(f"{where} must lie in [{lo}, {hi}], got {value}")
    return int(value)


def _expect_map(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise CheckpointMalformed(f"{where} must be a map, got {type(value).__name__}")
    return value


def _check_extras(m: dict, where: str, known: set[str]) -> None:
    """Unknown fields of format/geometry may carry scalars (room for later backends), nothing else."""
    for key, value in m.items():
        if key in known:
            continue
        if not isinstance(key, str) or len(key) > _MAX_STR:
            raise CheckpointMalformed(f"{where} has an invalid field name {key!r}")
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise CheckpointMalformed(f"{where}.{key} must be a scalar, got {type(value).__name__}")
        if isinstance(value, str) and len(value) > _MAX_STR:
            raise CheckpointMalformed(f"{where}.{key} is longer than {_MAX_STR} characters")


def _check_format(fmt: Any, where: str = "format") -> str:
    fmt = _expect_map(fmt, where)
    missing = {"backend", "dtype", "layout_version"} - fmt.keys()
    if missing:
        raise CheckpointMalformed(f"{where} lacks {sorted(missing)}")
    if not isinstance(fmt["backend"], str) or not 0 < len(fmt["backend"]) <= _MAX_STR:
        raise CheckpointMalformed(f"{where}.backend must be a nonempty string")
    numpy_storage_dtype(fmt["dtype"])
    layout = _check_int(fmt["layout_version"], f"{where}.layout_version", 0, 1 << 31)
    if layout != LAYOUT_VERSION:
        raise CheckpointMalformed(f"{where}.layout_version {layout} is not supported (expected {LAYOUT_VERSION})")
    _check_extras(fmt, where, {"backend", "dtype", "layout_version"})
    return fmt["dtype"]


_GEOMETRY_KEYS = {"num_layers", "num_kv_heads", "head_dim", "windows"}


def _check_geometry(geometry: Any, where: str) -> None:
    g = _expect_map(geometry, where)
    missing = _GEOMETRY_KEYS - g.keys()
    if missing:
        raise CheckpointMalformed(f"{where} lacks {sorted(missing)}")
    num_layers = _check_int(g["num_layers"], f"{where}.num_layers", 1, _MAX_LAYERS)
    _check_int(g["num_kv_heads"], f"{where}.num_kv_heads", 1, _MAX_DIM)
    _check_int(g["head_dim"], f"{where}.head_dim", 1, _MAX_DIM)
    windows = g["windows"]
    if not isinstance(windows, (list, tuple)) or len(windows) != num_layers:
        raise CheckpointMalformed(f"{where}.windows must list one entry per layer ({num_layers})")
    for i, w in enumerate(windows):
        if w is not None:
            _check_int(w, f"{where}.windows[{i}]", 1, _MAX_POSITION)
    _check_extras(g, where, _GEOMETRY_KEYS)


def _check_layers(layers: Any, geometry: dict, storage: np.dtype, position: int, where: str) -> None:
    if not isinstance(layers, list) or len(layers) != geometry["num_layers"]:
        raise CheckpointMalformed(
            f"{where} must be a list of {geometry['num_layers']} LayerState "
            f"(geometry.num_layers), got {_describe(layers) if not isinstance(layers, list) else len(layers)}"
        )
    kv, d = geometry["num_kv_heads"], geometry["head_dim"]
    for i, layer in enumerate(layers):
        w = f"{where}[{i}]"
        if not isinstance(layer, LayerState):
            raise CheckpointMalformed(f"{w} must be a LayerState, got {type(layer).__name__}")
        start = _check_int(layer.start, f"{w}.start", 0, position)
        for part in ("keys", "values"):
            a = getattr(layer, part)
            if not isinstance(a, np.ndarray) or a.ndim != 3 or a.shape[1:] != (kv, d) or a.dtype != storage:
                raise CheckpointMalformed(
                    f"{w}.{part} must be a {storage} array of shape [n, {kv}, {d}], got {_describe(a)}"
                )
            if not a.flags.c_contiguous:
                raise CheckpointMalformed(f"{w}.{part} must be C-contiguous")
        if layer.keys.shape != layer.values.shape:
            raise CheckpointMalformed(f"{w}: keys {layer.keys.shape} and values {layer.values.shape} differ in shape")
        if start + layer.rows > position:
            raise CheckpointMalformed(
                f"{w} holds positions [{start}, {start + layer.rows}) past the committed position {position}"
            )


def _check_draft(draft: Any, kv_dtype: str, token_ids: np.ndarray) -> None:
    d = _expect_map(draft, "draft")
    if d.keys() != _DRAFT_KEYS:
        raise CheckpointMalformed(f"draft must have exactly the fields {sorted(_DRAFT_KEYS)}, got {sorted(d)}")
    _check_geometry(d["geometry"], "draft.geometry")
    position = int(token_ids.shape[0])
    _check_layers(d["layers"], d["geometry"], _STORAGE_DTYPES[kv_dtype], position, "draft.layers")
    at = max((layer.start + layer.rows for layer in d["layers"]), default=0)
    pending = d["pending_token_ids"]
    if not isinstance(pending, np.ndarray) or pending.dtype != np.int32 or not np.array_equal(pending, token_ids[at:]):
        raise CheckpointMalformed(
            f"draft pending_token_ids must be the committed tokens [{at}, {position}) after the draft's rows "
            f"(int32), got {_describe(pending)}"
        )
