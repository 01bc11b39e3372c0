"""The checkpoint data model (transport/checkpoint/state.py) and a checkpoint's round trip through
a segment in a memory file, the way it travels to and from a worker."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muxworker.transport.checkpoint import (
    CheckpointError,
    CheckpointMalformed,
    CheckpointRetentionError,
    CPUCheckpoint,
    LayerState,
    numpy_storage_dtype,
    required_rows,
)
from muxworker.transport.checkpoint.container import memory_file
from muxworker.transport.checkpoint.file import assemble_checkpoint, write_checkpoint_segment
from muxworker.transport.checkpoint.segments import read_segment_header
from muxworker.transport.errors import CheckpointRejected, MuxError, error_from_wire

DTYPES = ("float32", "float16", "bfloat16")


def make_checkpoint(
    *,
    position: int = 10,
    windows: list[int | None] = (None, 4),
    dtype: str = "float32",
    kv: int = 2,
    d: int = 3,
    draft_windows: list[int | None] | None = None,
    identity: str | None = "id-1",
    seed: int = 0,
    draft_lag: int = 3,
) -> CPUCheckpoint:
    """A checkpoint shaped as a cache would export it: full layers keep all rows, a sliding layer
    with window W keeps the last W (a ring)."""
    rng = np.random.default_rng(seed)
    storage = numpy_storage_dtype(dtype)

    def rows(n: int) -> np.ndarray:  # random bit patterns: NaNs and all, compared as bytes
        return rng.integers(0, 256, size=(n, kv, d, storage.itemsize), dtype=np.uint8).view(storage)[..., 0]

    def layers(ws, at: int = position) -> list[LayerState]:
        out = []
        for w in ws:
            start = 0 if w is None else max(0, at - w)
            out.append(LayerState(start, rows(at - start), rows(at - start)))
        return out

    tokens = rng.integers(0, 50_000, size=position, dtype=np.int32)
    draft = None
    if draft_windows is not None:
        at = max(0, position - draft_lag)  # the draft lags: committed tokens are pending for it
        draft = {
            "geometry": {
                "num_layers": len(draft_windows),
                "num_kv_heads": kv,
                "head_dim": d,
                "windows": list(draft_windows),
            },
            "layers": layers(draft_windows, at),
            "pending_token_ids": tokens[at:].copy(),
        }
    return CPUCheckpoint(
        format={"backend": "torch", "dtype": dtype, "layout_version": 1},
        geometry={"num_layers": len(windows), "num_kv_heads": kv, "head_dim": d, "windows": list(windows)},
        position=position,
        token_ids=tokens,
        layers=layers(windows),
        draft=draft,
        identity=identity,
    )


def through_a_memory_file(ckpt: CPUCheckpoint) -> CPUCheckpoint:
    """Written as one segment into a memory file and read back, as export and restore move it."""
    fd = memory_file("test")
    try:
        write_checkpoint_segment(fd, "s", ckpt.identity or "", ckpt)
        return assemble_checkpoint([(fd, read_segment_header(fd, "the segment"), "the segment")])
    finally:
        os.close(fd)


def assert_same(a: CPUCheckpoint, b: CPUCheckpoint) -> None:
    assert (a.format, a.geometry, a.position, a.identity) == (b.format, b.geometry, b.position, b.identity)
    assert a.token_ids.tobytes() == b.token_ids.tobytes()
    pairs = list(zip(a.layers, b.layers))
    assert len(a.layers) == len(b.layers)
    if a.draft is not None or b.draft is not None:
        assert a.draft.keys() == b.draft.keys()
        assert a.draft["geometry"] == b.draft["geometry"]
        pairs += list(zip(a.draft["layers"], b.draft["layers"]))
        for name in a.draft.keys() - {"geometry", "layers"}:
            assert a.draft[name].dtype == b.draft[name].dtype
            assert a.draft[name].shape == b.draft[name].shape
            assert a.draft[name].tobytes() == b.draft[name].tobytes()
    for x, y in pairs:
        assert x.start == y.start
        for p, q in ((x.keys, y.keys), (x.values, y.values)):
            assert p.dtype == q.dtype and p.shape == q.shape
            assert p.tobytes() == q.tobytes()


# ---------------------------------------------------------------------------------------------
# Round trip

windows_st = st.lists(st.one_of(st.none(), st.integers(1, 12)), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    windows=windows_st,
    draft_windows=st.one_of(st.none(), windows_st),
    position=st.integers(1, 40),
    kv=st.integers(1, 3),
    d=st.integers(1, 8),
    identity=st.one_of(st.none(), st.text(min_size=1, max_size=70)),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_is_byte_exact(dtype, windows, draft_windows, position, kv, d, identity, seed):
    ckpt = make_checkpoint(
        position=position,
        windows=windows,
        dtype=dtype,
        kv=kv,
        d=d,
        draft_windows=draft_windows,
        identity=identity,
        seed=seed,
    )
    assert_same(ckpt, through_a_memory_file(ckpt))


def test_bfloat16_is_stored_as_uint16_bits_under_its_declared_name():
    ckpt = make_checkpoint(dtype="bfloat16")
    out = through_a_memory_file(ckpt)
    assert ckpt.layers[0].keys.dtype == np.uint16 and out.layers[0].keys.dtype == np.uint16
    assert out.format["dtype"] == "bfloat16"
    assert numpy_storage_dtype("bfloat16") == np.dtype("<u2")
    assert numpy_storage_dtype("float16") == np.dtype("<f2")
    assert numpy_storage_dtype("float32") == np.dtype("<f4")
    with pytest.raises(CheckpointMalformed, match="bfloat8"):
        numpy_storage_dtype("bfloat8")


def test_nbytes_counts_every_array():
    ckpt = make_checkpoint(draft_windows=[None])
    layers = ckpt.layers + ckpt.draft["layers"]
    expected = ckpt.token_ids.nbytes + ckpt.draft["pending_token_ids"].nbytes
    expected += sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
    assert ckpt.nbytes == expected


def test_truncated_keeps_what_each_layer_needs_and_the_draft_follows():
    ckpt = make_checkpoint(position=10, windows=[None, 4], draft_windows=[None])
    cut = ckpt.truncated(9)
    assert cut.position == 9 and np.array_equal(cut.token_ids, ckpt.token_ids[:9])
    assert cut.layers[0].start == 0 and cut.layers[0].rows == 9
    assert cut.layers[1].start == 6 and cut.layers[1].rows == 3  # the rows the window-4 ring held
    assert cut.draft_position == 7 and np.array_equal(cut.draft["pending_token_ids"], ckpt.token_ids[7:9])
    assert_same(cut, through_a_memory_file(cut))
    with pytest.raises(CheckpointRetentionError):
        ckpt.truncated(8)  # the window-4 layer no longer holds position 5, which 8 needs


# ---------------------------------------------------------------------------------------------
# Malformed input


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["geometry"].update(num_layers=2),
        lambda d: d.pop("layers"),
        lambda d: d.update(pending_token_ids=d["pending_token_ids"].astype(np.int64)),
        lambda d: d.update(pending_token_ids=d["pending_token_ids"][1:]),
        lambda d: d.update(pending_features=np.zeros((2, 6), np.float32)),
    ],
    ids=["draft-layers-count", "draft-no-layers", "draft-int64-pending", "draft-pending-not-history", "draft-extra"],
)
def test_malformed_draft_is_rejected(mutate):
    ckpt = make_checkpoint(draft_windows=[None])
    draft = dict(ckpt.draft, geometry=dict(ckpt.draft["geometry"]))
    mutate(draft)
    with pytest.raises(CheckpointMalformed):
        CPUCheckpoint(ckpt.format, ckpt.geometry, ckpt.position, ckpt.token_ids, ckpt.layers, draft)


@pytest.mark.parametrize(
    "change",
    [
        dict(token_ids=np.arange(10, dtype=np.int64)),
        dict(token_ids=np.arange(9, dtype=np.int32)),
        dict(token_ids=np.arange(20, dtype=np.int32)[::2]),
        dict(position=0, token_ids=np.zeros(0, np.int32)),
        dict(layers=[]),
        dict(identity=""),
        dict(format={"backend": "torch", "dtype": "float32"}),
    ],
    ids=["int64-tokens", "short-tokens", "strided-tokens", "empty", "no-layers", "empty-identity", "no-layout"],
)
def test_constructing_an_inconsistent_checkpoint_raises(change):
    ckpt = make_checkpoint()
    fields = dict(
        format=ckpt.format,
        geometry=ckpt.geometry,
        position=ckpt.position,
        token_ids=ckpt.token_ids,
        layers=ckpt.layers,
        identity=ckpt.identity,
    )
    fields.update(change)
    with pytest.raises(CheckpointMalformed):
        CPUCheckpoint(**fields)


def test_non_contiguous_or_mistyped_layer_rows_are_rejected():
    ckpt = make_checkpoint()
    wide = np.zeros((10, 2, 6), np.float32)[:, :, ::2]
    bad = [LayerState(0, wide, wide), ckpt.layers[1]]
    with pytest.raises(CheckpointMalformed, match="C-contiguous"):
        CPUCheckpoint(ckpt.format, ckpt.geometry, 10, ckpt.token_ids, bad)
    f16 = np.zeros((10, 2, 3), np.float16)
    with pytest.raises(CheckpointMalformed, match="float32"):
        CPUCheckpoint(ckpt.format, ckpt.geometry, 10, ckpt.token_ids, [LayerState(0, f16, f16), ckpt.layers[1]])


def test_checkpoint_errors_travel_as_checkpoint_rejected():
    for cls in (CheckpointMalformed, CheckpointRetentionError):
        assert issubclass(cls, CheckpointRejected) and issubclass(cls, MuxError)
        assert cls.code == "checkpoint_rejected"
        assert type(error_from_wire(cls.code, "x")) is CheckpointRejected
    # The file layer's root is a different family: no file error is a worker's rejection.
    assert not issubclass(CheckpointError, CheckpointRejected) and issubclass(CheckpointError, MuxError)


# ---------------------------------------------------------------------------------------------
# Retention


def test_full_layer_restores_any_position_in_history():
    ckpt = make_checkpoint(position=10, windows=[None])
    for p in range(1, 11):
        ckpt.validate_restore_position(p)
    ckpt.validate_restore_position(np.int64(7))


@pytest.mark.parametrize("bad", [11, -1, 10**12])
def test_positions_outside_history_are_rejected(bad):
    ckpt = make_checkpoint(position=10, windows=[None])
    with pytest.raises(CheckpointRetentionError, match=r"outside \[1, 10\]"):
        ckpt.validate_restore_position(bad)


def test_position_zero_says_open_a_fresh_session():
    ckpt = make_checkpoint(position=10, windows=[None])
    with pytest.raises(CheckpointRetentionError, match="open a fresh session"):
        ckpt.validate_restore_position(0)


@pytest.mark.parametrize("bad", [True, 3.0, "3", None])
def test_non_integer_positions_are_rejected(bad):
    with pytest.raises(CheckpointRetentionError, match="integer"):
        make_checkpoint().validate_restore_position(bad)


def test_full_layer_missing_its_first_rows_is_rejected():
    ckpt = make_checkpoint(position=10, windows=[None])
    layer = ckpt.layers[0]
    ckpt.layers[0] = LayerState(2, layer.keys[2:].copy(), layer.values[2:].copy())
    ckpt.validate()
    with pytest.raises(CheckpointRetentionError, match=r"layer 0 \(window None\) needs positions \[0, 10\)"):
        ckpt.validate_restore_position(10)


def test_sliding_ring_export_restores_at_its_position_and_one_before():
    # A ring of window 4 exported at 10 keeps [6, 10); continuing from p needs [p - 3, p).
    ckpt = make_checkpoint(position=10, windows=[None, 4])
    assert (ckpt.layers[1].start, ckpt.layers[1].rows) == (6, 4)
    ckpt.validate_restore_position(10)
    ckpt.validate_restore_position(9)  # earliest valid: needs [6, 9)
    with pytest.raises(CheckpointRetentionError, match=r"layer 1 \(window 4\) needs positions \[5, 8\)"):
        ckpt.validate_restore_position(8)


def test_sliding_layer_keeping_more_rows_restores_down_to_the_exact_boundary():
    ckpt = make_checkpoint(position=10, windows=[4])
    keys = np.zeros((7, 2, 3), np.float32)
    ckpt.layers[0] = LayerState(3, keys, keys.copy())
    assert required_rows(4, 6) == (3, 6)
    ckpt.validate_restore_position(6)  # needs [3, 6): exactly the first retained row
    with pytest.raises(CheckpointRetentionError):
        ckpt.validate_restore_position(5)  # needs [2, 5)


def test_short_history_needs_only_rows_from_zero():
    ckpt = make_checkpoint(position=3, windows=[8])
    assert required_rows(8, 1) == (0, 1)
    for p in (1, 2, 3):
        ckpt.validate_restore_position(p)


def test_draft_layers_must_retain_their_history_too():
    ckpt = make_checkpoint(position=10, windows=[None], draft_windows=[3], draft_lag=0)
    ckpt.validate_restore_position(10)
    ckpt.validate_restore_position(9)  # draft ring keeps [7, 10); p=9 needs [7, 9)
    with pytest.raises(CheckpointRetentionError, match="draft layer 0"):
        ckpt.validate_restore_position(8)


# ---------------------------------------------------------------------------------------------
# Prefix matching


def test_common_prefix_length():
    ckpt = make_checkpoint(position=10)
    ids = ckpt.token_ids.tolist()
    assert ckpt.common_prefix_length(ids) == 10
    assert ckpt.common_prefix_length(ids + [1, 2, 3]) == 10
    assert ckpt.common_prefix_length(np.array(ids[:4], dtype=np.int64)) == 4
    assert ckpt.common_prefix_length(ids[:6] + [ids[6] + 1] + ids[7:]) == 6
    assert ckpt.common_prefix_length([]) == 0
    assert ckpt.common_prefix_length([ids[0] + 1]) == 0
    # no int32 wrap-around: 2**32 + id is a different token
    assert ckpt.common_prefix_length([ids[0] + 2**32] + ids[1:]) == 0
    with pytest.raises(ValueError):
        ckpt.common_prefix_length([[1, 2]])
    with pytest.raises(ValueError):
        ckpt.common_prefix_length([1.5, 2.0])
