from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import textwrap

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import muxworker.transport.checkpoint.segments as segments
from muxworker.native import crc32c
from muxworker.transport.checkpoint import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointIncompatible,
    CheckpointNotFound,
    CheckpointReadError,
    CheckpointRetentionError,
    CheckpointTooLarge,
    CheckpointUnsafePath,
    CheckpointWriteError,
    CPUCheckpoint,
    LayerState,
    load_checkpoint,
    save_checkpoint,
)
from muxworker.transport.errors import CheckpointRejected, InvalidArgument, MuxError, error_from_wire
from muxworker.transport.schema import error_control


def make_checkpoint(
    *, position=12, windows=(None, 5), dtype="bfloat16", kv=2, d=4, draft=True, identity="model-a", seed=0
) -> CPUCheckpoint:
    rng = np.random.default_rng(seed)
    storage = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[dtype]

    def rows(n):
        return rng.integers(0, 256, size=(n, kv, d * np.dtype(storage).itemsize), dtype=np.uint8).view(storage)

    def layers(ws, at=position):
        out = []
        for w in ws:
            start = 0 if w is None else max(0, at - w)
            out.append(LayerState(start, rows(at - start), rows(at - start)))
        return out

    tokens = rng.integers(0, 50_000, size=position, dtype=np.int32)
    return CPUCheckpoint(
        format={"backend": "torch", "dtype": dtype, "layout_version": 1},
        geometry={"num_layers": len(windows), "num_kv_heads": kv, "head_dim": d, "windows": list(windows)},
        position=position,
        token_ids=tokens,
        layers=layers(windows),
        draft=None
        if not draft
        else {  # the draft lags by 3 committed tokens, which are pending for it
            "geometry": {"num_layers": 1, "num_kv_heads": kv, "head_dim": d, "windows": [3]},
            "layers": layers([3], position - 3),
            "pending_token_ids": tokens[position - 3 :].copy(),
        },
        identity=identity,
    )


def stored(ckpt: CPUCheckpoint) -> list[np.ndarray]:
    """The arrays a checkpoint file stores, in order (the draft's pending tokens are derived)."""
    out = [ckpt.token_ids]
    for layer in ckpt.layers + (ckpt.draft["layers"] if ckpt.draft else []):
        out += [layer.keys, layer.values]
    return out


def arrays(ckpt: CPUCheckpoint) -> list[np.ndarray]:
    out = [ckpt.token_ids]
    for layer in ckpt.layers + (ckpt.draft["layers"] if ckpt.draft else []):
        out += [layer.keys, layer.values]
    if ckpt.draft:
        out.append(ckpt.draft["pending_token_ids"])
    return out


def assert_same(a: CPUCheckpoint, b: CPUCheckpoint) -> None:
    assert (a.format, a.geometry, a.position, a.identity) == (b.format, b.geometry, b.position, b.identity)
    assert [x.start for x in a.layers] == [y.start for y in b.layers]
    xs, ys = arrays(a), arrays(b)
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def layout(data: bytes) -> dict:
    """The file's regions, parsed independently of the loader (per docs/CHECKPOINT_FORMAT.md)."""
    magic, version, manifest_len = struct.unpack_from("<8sII", data, 0)
    assert (magic, version) == (b"MUXCKPT\0", 3)
    manifest = msgpack.unpackb(data[16 : 16 + manifest_len])
    head_end = 16 + manifest_len + 4
    payloads = [(p["offset"], p["length"]) for p in manifest["payloads"]]
    padding, cursor = [], head_end
    for offset, length in payloads:
        padding.append((cursor, offset))
        cursor = offset + length
    return {
        "magic": (0, 8),
        "version": (8, 12),
        "manifest_len": (12, 16),
        "manifest": (16, 16 + manifest_len),
        "header_crc": (16 + manifest_len, head_end),
        "payloads": payloads,
        "padding": [p for p in padding if p[0] < p[1]],
        "trailer": (len(data) - 24, len(data)),
        "manifest_obj": manifest,
    }


@pytest.fixture
def saved(tmp_path):
    ckpt = make_checkpoint()
    path = tmp_path / "a.mxckpt"
    save_checkpoint(ckpt, path)
    return ckpt, path


# ---------------------------------------------------------------------------------------------
# Round trip and layout


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("draft", [False, True])
def test_save_load_round_trip_is_byte_equal(tmp_path, dtype, draft):
    ckpt = make_checkpoint(dtype=dtype, draft=draft)
    path = tmp_path / "c.mxckpt"
    save_checkpoint(ckpt, path)
    out = load_checkpoint(path, expected_identity="model-a")
    assert_same(ckpt, out)
    assert all(type(a) is np.ndarray for a in arrays(out))


def test_file_layout_is_aligned_and_private(saved):
    ckpt, path = saved
    data = path.read_bytes()
    regions = layout(data)
    assert [off % 4096 for off, _ in regions["payloads"]] == [0] * len(stored(ckpt))
    assert [length for _, length in regions["payloads"]] == [a.nbytes for a in stored(ckpt)]
    assert all(data[lo:hi] == bytes(hi - lo) for lo, hi in regions["padding"])
    assert data[-24:-16] == b"MUXEND\0\0"
    assert struct.unpack_from("<Q", data, len(data) - 16)[0] == len(data)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.listdir(path.parent) == [path.name]  # no temp file left behind


def test_save_replaces_atomically_and_previous_survives_a_failed_rename(saved, monkeypatch):
    ckpt, path = saved
    other = make_checkpoint(seed=1)
    save_checkpoint(other, path)
    assert_same(other, load_checkpoint(path))

    def boom(*args, **kwargs):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(CheckpointWriteError, match="simulated"):
        save_checkpoint(ckpt, path)
    monkeypatch.undo()
    assert_same(other, load_checkpoint(path))
    assert os.listdir(path.parent) == [path.name]


def test_saving_something_else_is_invalid(tmp_path):
    with pytest.raises(InvalidArgument, match="CPUCheckpoint"):
        save_checkpoint({"position": 1}, tmp_path / "x.mxckpt")
    assert os.listdir(tmp_path) == []


def test_missing_file_is_not_found(tmp_path):
    with pytest.raises(CheckpointNotFound):
        load_checkpoint(tmp_path / "nope.mxckpt")


def test_file_errors_share_one_root_that_is_not_the_workers_rejection():
    # A missing or damaged file is not "the worker rejected this checkpoint": `except
    # CheckpointRejected` around a restore must not catch it. A worker that reads or writes a
    # passed file sends each with its own code, and the client raises the same class (with the
    # system's reason for a read or write error).
    codes = set()
    for cls in (
        CheckpointNotFound,
        CheckpointCorrupt,
        CheckpointIncompatible,
        CheckpointTooLarge,
        CheckpointUnsafePath,
        CheckpointWriteError,
        CheckpointReadError,
    ):
        assert issubclass(cls, CheckpointError) and issubclass(cls, MuxError)
        assert not issubclass(cls, CheckpointRejected)
        assert cls.code.startswith("checkpoint_") and cls.code not in codes
        codes.add(cls.code)
        error = error_from_wire(cls.code, "what happened", "disk_full")
        assert type(error) is cls and str(error) == "what happened"
        if issubclass(cls, (CheckpointWriteError, CheckpointReadError)):
            assert error.reason == "disk_full"
            assert error_control(7, error)["reason"] == "disk_full"
        assert cls.__doc__ and "\n" not in cls.__doc__.strip()
    # A checkpoint whose contents are refused is the worker's wire error, on either end.
    assert issubclass(CheckpointRetentionError, CheckpointRejected)
    assert not issubclass(CheckpointRetentionError, CheckpointError)


# ---------------------------------------------------------------------------------------------
# Identity (how it is computed and cached: tests/transport/test_checkpoint_identity.py)


def test_expected_identity_mismatch_is_incompatible(saved, tmp_path):
    ckpt, path = saved
    with pytest.raises(CheckpointIncompatible, match="model-b"):
        load_checkpoint(path, expected_identity="model-b")
    anonymous = tmp_path / "anon.mxckpt"
    save_checkpoint(make_checkpoint(identity=None), anonymous)
    assert load_checkpoint(anonymous).identity is None
    with pytest.raises(CheckpointIncompatible):
        load_checkpoint(anonymous, expected_identity="model-a")


# ---------------------------------------------------------------------------------------------
# Corruption: every region, every byte where it is cheap


def _flip(path, offset, mask=0x01):
    """XOR one byte in place (flipping it again restores it)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def test_every_flipped_byte_outside_padding_is_corrupt(saved):
    ckpt, path = saved
    original = path.read_bytes()
    regions = layout(original)
    checked = set()
    spans = [regions[k] for k in ("magic", "version", "manifest_len", "manifest", "header_crc", "trailer")]
    spans += [(off, off + length) for off, length in regions["payloads"]]
    for lo, hi in spans:
        for offset in range(lo, hi):
            _flip(path, offset)
            with pytest.raises(CheckpointCorrupt):
                load_checkpoint(path)
            _flip(path, offset)
            checked.add(offset)
    assert len(checked) == sum(hi - lo for lo, hi in spans)
    assert path.read_bytes() == original


@pytest.mark.parametrize("region", ["magic", "version", "manifest_len", "manifest", "header_crc", "trailer"])
def test_each_fixed_region_detects_a_whole_byte_change(saved, region):
    _, path = saved
    lo, hi = layout(path.read_bytes())[region]
    for offset in (lo, (lo + hi) // 2, hi - 1):
        _flip(path, offset, 0xFF)
        with pytest.raises(CheckpointCorrupt):
            load_checkpoint(path)
        _flip(path, offset, 0xFF)


def test_padding_is_not_checked_and_never_changes_the_result(saved):
    ckpt, path = saved
    regions = layout(path.read_bytes())
    assert regions["padding"], "the fixture must have padding to test"
    for lo, hi in regions["padding"]:
        for offset in (lo, hi - 1):
            _flip(path, offset, 0xFF)
    assert_same(ckpt, load_checkpoint(path))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_damage_is_corrupt_or_harmless(saved, data):
    ckpt, path = saved
    original = path.read_bytes()
    padding = layout(original)["padding"]
    offset = data.draw(st.integers(0, len(original) - 1))
    mask = data.draw(st.integers(1, 255))
    _flip(path, offset, mask)
    try:
        if any(lo <= offset < hi for lo, hi in padding):
            assert_same(ckpt, load_checkpoint(path))
        else:
            with pytest.raises(CheckpointCorrupt):
                load_checkpoint(path)
    finally:
        _flip(path, offset, mask)


def test_truncation_at_any_offset_is_corrupt(saved):
    _, path = saved
    original = path.read_bytes()
    n = len(original)
    offsets = set(range(0, 600)) | set(range(0, n, 61)) | set(range(n - 64, n))
    for cut in sorted(offsets, reverse=True):
        os.truncate(path, cut)
        with pytest.raises(CheckpointCorrupt):
            load_checkpoint(path)


def test_appended_bytes_are_corrupt(saved):
    _, path = saved
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointCorrupt, match="truncated or extended"):
        load_checkpoint(path)


def _rewrite_header(path, manifest_obj=None, *, version=3, manifest_bytes=None, manifest_len=None, keep_offsets=False):
    """Rebuild the header and its CRC around a chosen manifest; keep everything after it (with
    ``keep_offsets``, keep the payloads where they were, re-padding the header block)."""
    data = path.read_bytes()
    old_len = struct.unpack_from("<I", data, 12)[0]
    rest = data[16 + old_len + 4 :]
    body = manifest_bytes if manifest_bytes is not None else msgpack.packb(manifest_obj)
    length = len(body) if manifest_len is None else manifest_len
    head = struct.pack("<8sII", b"MUXCKPT\0", version, length) + body
    head += struct.pack("<I", crc32c(head))
    if keep_offsets:  # and a trailer that names the new header CRC
        first = manifest_obj["payloads"][0]["offset"]
        assert len(head) <= first
        trailer = struct.pack("<8sQI", b"MUXEND\0\0", len(data), crc32c(head[:-4]))
        head, rest = head + bytes(first - len(head)), data[first:-24] + trailer + struct.pack("<I", crc32c(trailer))
    path.write_bytes(head + rest)


def test_a_valid_checksum_over_a_huge_declared_payload_allocates_nothing(saved):
    _, path = saved
    manifest = layout(path.read_bytes())["manifest_obj"]
    manifest["payloads"][-1]["length"] = 2**50
    _rewrite_header(path, manifest)
    with pytest.raises(CheckpointTooLarge):
        load_checkpoint(path)
    with pytest.raises(CheckpointCorrupt):
        load_checkpoint(path, max_bytes=2**60)  # fits the limit, but not the file


def test_huge_manifest_length_is_corrupt_without_reading_it(saved):
    _, path = saved
    data = bytearray(path.read_bytes())
    data[12:16] = struct.pack("<I", 0xFFFFFFFF)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="manifest"):
        load_checkpoint(path)


def test_deeply_nested_manifest_is_corrupt(saved):
    _, path = saved
    nested = "leaf"
    for _ in range(40):
        nested = [nested]
    _rewrite_header(path, {"session_id": None, "checkpoint": nested, "payloads": [], "file_length": 0})
    with pytest.raises(CheckpointCorrupt, match="nests deeper"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    "body",
    [b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"session_id": None}), msgpack.packb({"a": 1}) + b"\x00"],
    ids=["invalid-msgpack", "not-a-map", "missing-fields", "trailing-bytes"],
)
def test_well_checksummed_but_malformed_manifests_are_corrupt(saved, body):
    _, path = saved
    _rewrite_header(path, manifest_bytes=body)
    with pytest.raises(CheckpointCorrupt):
        load_checkpoint(path)


def test_inconsistent_checkpoint_manifest_with_valid_checksums_is_corrupt(saved):
    _, path = saved
    manifest = layout(path.read_bytes())["manifest_obj"]
    manifest["geometry"]["num_kv_heads"] += 1
    _rewrite_header(path, manifest)
    data = bytearray(path.read_bytes())
    head_len = 16 + struct.unpack_from("<I", data, 12)[0]
    head_crc = struct.unpack_from("<I", data, head_len)[0]
    trailer = struct.pack("<8sQI", b"MUXEND\0\0", len(data), head_crc)
    data[-24:] = trailer + struct.pack("<I", crc32c(trailer))
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="payload size disagrees"):
        load_checkpoint(path)


def test_a_newer_file_version_is_incompatible_not_corrupt(saved):
    _, path = saved
    manifest = layout(path.read_bytes())["manifest_obj"]
    _rewrite_header(path, manifest, version=4)
    with pytest.raises(CheckpointIncompatible, match="version 4"):
        load_checkpoint(path)


@pytest.mark.parametrize("name", ["single-v1.mxckpt", "single-v2.mxckpt"])
def test_a_version_1_or_2_file_names_the_migrate_command(tmp_path, name):
    from tests.helpers.legacy import DATA

    path = tmp_path / name
    shutil.copy(DATA / name, path)
    with pytest.raises(CheckpointIncompatible, match=r"version \d; .*python -m muxworker.sessions DIR migrate"):
        load_checkpoint(path)


def test_unknown_manifest_fields_are_corrupt(saved):
    _, path = saved
    manifest = layout(path.read_bytes())["manifest_obj"]
    for extra in ({"identity_inputs": None}, {"checkpoint": {}}):
        _rewrite_header(path, {**manifest, **extra}, keep_offsets=True)
        with pytest.raises(CheckpointCorrupt, match="fields"):
            load_checkpoint(path)


def test_a_newer_kv_layout_is_incompatible(saved):
    _, path = saved
    manifest = layout(path.read_bytes())["manifest_obj"]
    manifest["format"]["layout_version"] = 2
    _rewrite_header(path, manifest)
    with pytest.raises(CheckpointIncompatible, match="layout version 2"):
        load_checkpoint(path)


def test_garbage_and_empty_files_are_corrupt(tmp_path):
    for name, content in [("empty", b""), ("short", b"MUXCKPT\0"), ("text", b"hello world" * 100)]:
        p = tmp_path / name
        p.write_bytes(content)
        with pytest.raises(CheckpointCorrupt):
            load_checkpoint(p)


# ---------------------------------------------------------------------------------------------
# Size limits and unsafe paths


def test_max_bytes_on_save_keeps_the_previous_file(saved):
    ckpt, path = saved
    bigger = make_checkpoint(position=40, seed=3)
    with pytest.raises(CheckpointTooLarge):
        save_checkpoint(bigger, path, max_bytes=bigger.nbytes - 1)
    assert_same(ckpt, load_checkpoint(path))
    assert os.listdir(path.parent) == [path.name]
    save_checkpoint(bigger, path, max_bytes=bigger.nbytes)  # the bound is inclusive
    assert_same(bigger, load_checkpoint(path, max_bytes=bigger.nbytes))


def test_max_bytes_on_load(saved):
    ckpt, path = saved
    payload_bytes = sum(a.nbytes for a in stored(ckpt))
    with pytest.raises(CheckpointTooLarge):
        load_checkpoint(path, max_bytes=payload_bytes - 1)
    assert_same(ckpt, load_checkpoint(path, max_bytes=payload_bytes))


def test_symlinks_are_rejected_on_load_and_save(saved, tmp_path):
    ckpt, path = saved
    link = tmp_path / "link.mxckpt"
    link.symlink_to(path)
    with pytest.raises(CheckpointUnsafePath):
        load_checkpoint(link)
    before = path.read_bytes()
    with pytest.raises(CheckpointUnsafePath):
        save_checkpoint(make_checkpoint(seed=9), link)
    assert link.is_symlink() and path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["a.mxckpt", "link.mxckpt"]


def test_fifo_and_directory_are_rejected_without_blocking(tmp_path):
    fifo = tmp_path / "fifo.mxckpt"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointUnsafePath):
        load_checkpoint(fifo)  # would block forever if opened without O_NONBLOCK
    with pytest.raises(CheckpointUnsafePath):
        save_checkpoint(make_checkpoint(), fifo)
    directory = tmp_path / "dir.mxckpt"
    directory.mkdir()
    with pytest.raises(CheckpointUnsafePath):
        load_checkpoint(directory)
    with pytest.raises(CheckpointUnsafePath):
        save_checkpoint(make_checkpoint(), directory)
    assert sorted(os.listdir(tmp_path)) == ["dir.mxckpt", "fifo.mxckpt"]


# ---------------------------------------------------------------------------------------------
# A loaded checkpoint is an independent snapshot of the file


def test_overwriting_the_file_in_place_does_not_change_a_loaded_checkpoint(saved, tmp_path):
    ckpt, path = saved
    loaded = load_checkpoint(path)
    other = tmp_path / "other.mxckpt"
    save_checkpoint(make_checkpoint(seed=7), other)
    inode = os.stat(path).st_ino
    shutil.copyfile(other, path)  # what `cp other path` does: new bytes in the same inode
    assert os.stat(path).st_ino == inode
    assert_same(ckpt, loaded)
    os.truncate(path, 0)
    assert_same(ckpt, loaded)


def test_truncating_the_file_after_loading_does_not_crash_the_process(saved):
    # In a child process: before loads owned their bytes, reading a loaded array after the file
    # shrank raised SIGBUS, which would take the test run down with it.
    _, path = saved
    script = textwrap.dedent(
        f"""
        import os
        from muxworker.transport.checkpoint import load_checkpoint
        loaded = load_checkpoint({str(path)!r})
        expected = [layer.keys.tobytes() + layer.values.tobytes() for layer in loaded.layers]
        os.truncate({str(path)!r}, 0)
        got = [layer.keys.tobytes() + layer.values.tobytes() for layer in loaded.layers]
        print("same" if got == expected else "changed")
        """
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (child.returncode, child.stdout.strip()) == (0, "same"), child.stderr


def test_a_file_changed_while_it_is_read_fails_its_checksum(saved, monkeypatch):
    # The CRC is computed on the bytes this load owns, so a change racing with the read is caught.
    ckpt, path = saved
    real = segments.read_payload

    def read_then_change(fd, header, index, views, path, pace=None):
        real(fd, header, index, views, path, pace)
        if index == 0:  # as if the file changed under the read
            views[0][0] ^= 0xFF

    monkeypatch.setattr(segments, "read_payload", read_then_change)
    with pytest.raises(CheckpointCorrupt, match="payload 0 checksum mismatch"):
        load_checkpoint(path)
