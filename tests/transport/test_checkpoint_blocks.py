"""Content-addressed blocks: how a worker's segment is cut, and what a block's key covers."""

from __future__ import annotations

import os

import numpy as np

from muxworker.transport.checkpoint import CPUCheckpoint, LayerState
from muxworker.transport.checkpoint.blocks import (
    BLOCK_NAME,
    BLOCK_SESSION,
    MAX_BLOCKS,
    SegmentMemory,
    split_segment,
)
from muxworker.transport.checkpoint.file import write_checkpoint_segment
from muxworker.transport.checkpoint.segments import (
    LayerRows,
    SegmentRef,
    byte_view,
    read_payload_into,
    read_segment_header,
    write_segment,
)

FORMAT = {"backend": "torch", "dtype": "float32", "layout_version": 1}


def checkpoint(position: int, *, seed: int = 0, windows=(None, None), tokens=None) -> CPUCheckpoint:
    rng = np.random.default_rng(seed)
    layers = []
    for window in windows:
        start = 0 if window is None else max(0, position - window)
        rows = position - start
        layers.append(LayerState(start, *(rng.standard_normal((rows, 2, 4)).astype(np.float32) for _ in range(2))))
    return CPUCheckpoint(
        format=FORMAT,
        geometry={"num_layers": len(windows), "num_kv_heads": 2, "head_dim": 4, "windows": list(windows)},
        position=position,
        token_ids=np.arange(position, dtype=np.int32) if tokens is None else tokens,
        layers=layers,
        identity="id",
    )


def cut(ckpt: CPUCheckpoint, block_tokens: int = 16, parent=None):
    fd = os.memfd_create("segment")
    try:
        write_checkpoint_segment(fd, "s", "id", ckpt)
        header = read_segment_header(fd, "segment")
        memory = SegmentMemory(fd)
        pieces = split_segment(memory, header, session_id="s", block_tokens=block_tokens, parent_key=parent)
        return pieces, memory
    finally:
        os.close(fd)


def rows_of(piece) -> tuple[np.ndarray, list[tuple[int, bytes, bytes]]]:
    """Read a piece back as the store would: written to a file, its header and payloads verified."""
    fd = os.memfd_create("piece")
    try:
        os.writev(fd, piece.plan.buffers)
        ref = SegmentRef("p", piece.start, piece.end, piece.plan.file_length, piece.plan.header_crc)
        header = read_segment_header(fd, "piece", ref)
        tokens = np.empty(piece.end - piece.start, np.int32)
        read_payload_into(fd, header, 0, [memoryview(tokens).cast("B")], "piece")
        layers = []
        for i, (lo, _) in enumerate(header.layers):
            parts = []
            for part in (0, 1):
                buf = bytearray(header.payloads[header.payload_index(i, part)][1])
                read_payload_into(fd, header, header.payload_index(i, part), [memoryview(buf)], "piece")
                parts.append(bytes(buf))
            layers.append((lo, *parts))
        return tokens, layers, header
    finally:
        os.close(fd)


def test_a_segment_is_cut_into_whole_blocks_and_one_tail_that_hold_its_rows():
    ckpt = checkpoint(50)
    pieces, memory = cut(ckpt)
    assert [(p.start, p.end, p.key is not None) for p in pieces] == [
        (0, 16, True),
        (16, 32, True),
        (32, 48, True),
        (48, 50, False),
    ]
    for p in pieces:
        tokens, layers, header = rows_of(p)
        assert tokens.tolist() == list(range(p.start, p.end))
        assert header.session_id == (BLOCK_SESSION if p.key else "s")
        for (lo, keys, values), state in zip(layers, ckpt.layers):
            assert lo == p.start
            want = state.keys[p.start : p.end].transpose(1, 0, 2)
            assert keys == np.ascontiguousarray(want).tobytes()
            assert values == np.ascontiguousarray(state.values[p.start : p.end].transpose(1, 0, 2)).tobytes()
        assert p.name is None or BLOCK_NAME.fullmatch(p.name)
    memory.close()


def test_equal_rows_give_equal_keys_and_any_difference_another_key():
    a, _ = cut(checkpoint(40, seed=1))
    b, _ = cut(checkpoint(40, seed=1))
    assert [p.key for p in a] == [p.key for p in b]
    # One bit of one row of the second block: that block's key and every later one change.
    flipped = checkpoint(40, seed=1)
    flipped.layers[1].values[20, 1, 3] = np.nextafter(flipped.layers[1].values[20, 1, 3], np.float32(9))
    c, _ = cut(flipped)
    assert c[0].key == a[0].key and c[1].key != a[1].key
    # Other tokens before a block: the chain covers the whole prefix.
    tokens = np.arange(40, dtype=np.int32)
    tokens[3] = 999
    d, _ = cut(checkpoint(40, seed=1, tokens=tokens))
    assert all(x.key != y.key for x, y in zip(a[:2], d[:2]))
    # Another block size or parent: other keys.
    e, _ = cut(checkpoint(40, seed=1), parent="ab" * 32)
    assert e[0].key != a[0].key


def test_a_sliding_window_layer_holds_only_its_rows_and_its_layout_is_in_the_key():
    ckpt = checkpoint(40, windows=(None, 10))  # layer 1 keeps positions [30, 40)
    pieces, _ = cut(ckpt)
    for p in pieces:
        _, layers, _ = rows_of(p)
        lo, keys, _ = layers[1]
        assert lo == max(30, p.start) if p.end > 30 else lo == p.end
        assert len(keys) == (p.end - lo) * 2 * 4 * 4
    full, _ = cut(checkpoint(40, windows=(None, None)))
    assert pieces[0].key != full[0].key


def test_a_segment_starting_inside_a_block_is_all_tail_and_blocks_stop_at_the_cap():
    # An incremental save that stays inside one block: rows [5, 50) are the tail.
    rows = np.ones((2, 45, 4), np.float32)
    fd = os.memfd_create("segment")
    write_segment(
        fd,
        session_id="s",
        identity="id",
        format=FORMAT,
        geometry={"num_layers": 1, "num_kv_heads": 2, "head_dim": 4, "windows": [None]},
        start=5,
        token_ids=np.arange(5, 50, dtype=np.int32),
        layers=[LayerRows(5, 45, [byte_view(rows)], [byte_view(rows)])],
    )
    header = read_segment_header(fd, "segment")
    pieces = split_segment(SegmentMemory(fd), header, session_id="s", block_tokens=16, parent_key="ab" * 32)
    os.close(fd)
    assert [(p.start, p.end, p.key) for p in pieces] == [(5, 50, None)]
    # Past MAX_BLOCKS blocks, the rest stays in the tail.
    pieces, _ = cut(checkpoint(MAX_BLOCKS + 50), block_tokens=1)
    assert sum(p.key is not None for p in pieces) == MAX_BLOCKS
    assert pieces[-1].key is None and (pieces[-1].start, pieces[-1].end) == (MAX_BLOCKS, MAX_BLOCKS + 50)
