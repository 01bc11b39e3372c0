"""The checkpoint identity (version 2) and the model files' digest cache behind it."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import muxworker.transport.checkpoint.identity as identity
from muxworker.native import crc32c
from muxworker.transport.cache_dir import cache_root
from muxworker.transport.checkpoint import checkpoint_identity, checkpoint_identity_inputs
from muxworker.transport.errors import InvalidArgument

CONFIG = {"backend": "torch", "dtype": "float32", "rope": {"theta": 10000.0}, "draft": None}
# CONFIG's canonical JSON, written out by hand: sorted keys, no spaces, ASCII.
CONFIG_JSON = b'{"backend":"torch","draft":null,"dtype":"float32","rope":{"theta":10000.0}}'
DAY_NS = 86_400 * 10**9


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Each test starts with an empty in-process memo, and the default cache file is its own."""
    monkeypatch.setattr(identity, "_memo", identity._Memo())
    monkeypatch.setenv(identity.DIGEST_CACHE_ENV, str(tmp_path / "default-digests.json"))


@pytest.fixture
def cache_file(tmp_path):
    return tmp_path / "cache" / "digests.json"


def _files(tmp_path, *contents: bytes, dated: bool = False):
    """One file per content; ``dated``: with an mtime a day old, so that the cache keeps them."""
    paths = []
    for i, content in enumerate(contents):
        p = tmp_path / f"f{i}.bin"
        p.write_bytes(content)
        if dated:
            _date(p, time.time_ns() - DAY_NS - i)
        paths.append(p)
    return paths


def _subdir(tmp_path, name):
    d = tmp_path / f"v{name}"
    d.mkdir()
    return d


def _date(path, mtime_ns: int) -> int:
    """Set a file's mtime (old enough to be cached) and check the filesystem kept every digit."""
    os.utime(path, ns=(mtime_ns, mtime_ns))
    assert os.stat(path).st_mtime_ns == mtime_ns
    return mtime_ns


def _rewrite_in_place(path, content: bytes) -> None:
    """New bytes in the same inode, then the old mtime back: what a cache keyed by stat cannot see."""
    before = os.stat(path)
    assert len(content) == before.st_size
    with open(path, "r+b") as f:
        f.write(content)
    _date(path, before.st_mtime_ns)
    assert os.stat(path).st_ino == before.st_ino


def _entries(cache_file) -> list[dict]:
    doc = json.loads(cache_file.read_bytes())
    assert doc.keys() == {"format", "version", "entries"}
    return doc["entries"]


def _identity_v2(contents: list[bytes], config_json: bytes) -> str:
    """The identity from its definition in docs/CHECKPOINT_FORMAT.md, without the code under test."""
    h = hashlib.sha256(b"muxworker-checkpoint-identity-v2\0" + struct.pack("<Q", len(contents)))
    for content in contents:
        h.update(struct.pack("<Q", len(content)) + hashlib.sha256(content).digest())
    h.update(b"\0configuration\0" + struct.pack("<Q", len(config_json)) + config_json)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# What the identity is


def test_identity_v2_is_its_definition_computed_by_hand(tmp_path, cache_file):
    contents = [os.urandom(2**20 + 5), b"", b'{"vocab": {}}']
    files = _files(tmp_path, *contents)
    for i, f in enumerate(files):
        _date(f, time.time_ns() - DAY_NS - i)
    expected = _identity_v2(contents, CONFIG_JSON)
    assert checkpoint_identity(files, CONFIG, digest_cache=cache_file) == expected  # hashed
    assert checkpoint_identity(files, CONFIG, digest_cache=cache_file) == expected  # from the memo
    identity._memo.clear()
    assert checkpoint_identity(files, CONFIG, digest_cache=cache_file) == expected  # from the cache file
    assert checkpoint_identity([], {}) == _identity_v2([], b"{}")
    # Pinned: a change here orphans every saved store, so it must be a deliberate version bump.
    (fixed,) = _files(_subdir(tmp_path, "fixed"), b"muxworker")
    pinned = "e20829dbf45daaa2744a6f7136a25366b35a19a0244f6db50c5d56f288364807"
    assert _identity_v2([b"muxworker"], b'{"dtype":"float32"}') == pinned
    assert checkpoint_identity([fixed], {"dtype": "float32"}, digest_cache=None) == pinned


def test_inputs_record_each_files_name_size_and_crc32c(tmp_path, cache_file):
    files = _files(tmp_path, b"weights" * 1000, b"tokenizer")
    for f in files:
        _date(f, time.time_ns() - DAY_NS)
    for _ in range(2):  # hashed, then cached: the same inputs
        digest, inputs = checkpoint_identity_inputs(files, CONFIG, digest_cache=cache_file)
        assert digest == checkpoint_identity(files, CONFIG, digest_cache=None)
        assert [(f.name, f.size, f.crc32c) for f in inputs.files] == [
            ("f0.bin", 7000, crc32c(b"weights" * 1000)),
            ("f1.bin", 9, crc32c(b"tokenizer")),
        ]
        assert inputs.configuration == json.loads(CONFIG_JSON)


def test_identity_is_stable_for_the_same_files_and_configuration(tmp_path):
    a = _files(tmp_path, b"weights" * 1000, b"tokenizer")
    first = checkpoint_identity(a, CONFIG)
    assert len(first) == 64 and int(first, 16) >= 0
    assert checkpoint_identity([str(p) for p in a], dict(reversed(CONFIG.items()))) == first
    copies = tmp_path / "elsewhere"
    copies.mkdir()
    moved = _files(copies, b"weights" * 1000, b"tokenizer")
    assert checkpoint_identity(moved, CONFIG) == first  # paths do not count, bytes do


@pytest.mark.parametrize("dated", [False, True], ids=["hashed", "cached"])
def test_identity_changes_with_any_byte_order_boundary_or_setting(tmp_path, dated):
    base_bytes = bytearray(os.urandom(3 * 2**20 + 17))  # spans several 1 MiB hashing chunks
    a, b = _files(tmp_path, bytes(base_bytes), b"tok", dated=dated)
    reference = checkpoint_identity([a, b], CONFIG)
    seen = {reference}

    def variant(files, config=CONFIG):
        digest = checkpoint_identity(files, config)
        assert digest not in seen
        assert checkpoint_identity(files, config) == digest  # again, from the cache when dated
        seen.add(digest)

    for offset in (0, 2**20 - 1, 2**20, len(base_bytes) - 1):
        changed = bytearray(base_bytes)
        changed[offset] ^= 1
        (x,) = _files(_subdir(tmp_path, offset), bytes(changed), dated=dated)
        variant([x, b])
    (longer,) = _files(_subdir(tmp_path, "long"), bytes(base_bytes) + b"\0", dated=dated)
    variant([longer, b])
    variant([b, a])  # order
    ab, c = _files(_subdir(tmp_path, "split1"), b"ab", b"c", dated=dated)
    a2, bc = _files(_subdir(tmp_path, "split2"), b"a", b"bc", dated=dated)
    variant([ab, c])
    variant([a2, bc])  # same concatenation, other boundary
    variant([a], CONFIG)
    variant([a, b], {**CONFIG, "dtype": "bfloat16"})
    variant([a, b], {**CONFIG, "rope": {"theta": 500000.0}})
    variant([a, b], {**CONFIG, "draft": {"n_draft": 7}})


def test_identity_rejects_a_single_path_and_non_json_configuration(tmp_path):
    (a,) = _files(tmp_path, b"x")
    with pytest.raises(InvalidArgument, match="single path"):
        checkpoint_identity(str(a), CONFIG)
    with pytest.raises(InvalidArgument, match="list of paths"):
        checkpoint_identity(7, CONFIG)
    with pytest.raises(InvalidArgument, match="hold paths"):
        checkpoint_identity([a, 7], CONFIG)
    with pytest.raises(InvalidArgument, match="configuration must be a dict"):
        checkpoint_identity([a], [("backend", "torch")])
    with pytest.raises(InvalidArgument, match="NaN"):
        checkpoint_identity([a], {"x": float("nan")})
    with pytest.raises(InvalidArgument, match="JSON"):
        checkpoint_identity([a], {"x": object()})
    with pytest.raises(InvalidArgument, match="missing.*cannot be read"):
        checkpoint_identity([tmp_path / "missing"], CONFIG)
    with pytest.raises(InvalidArgument, match="digest_cache must be a path or None"):
        checkpoint_identity([a], CONFIG, digest_cache=7)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# The digest cache


def test_a_cached_digest_stands_while_device_inode_size_and_mtime_ns_hold(tmp_path, cache_file):
    """The documented trade-off (make's and rsync's): bytes replaced in place with the size and
    mtime_ns put back are not seen, so a cache hit reads nothing."""
    (weights,) = _files(tmp_path, os.urandom(4096), dated=True)
    first = checkpoint_identity([weights], CONFIG, digest_cache=cache_file)
    assert len(_entries(cache_file)) == 1
    _rewrite_in_place(weights, os.urandom(4096))
    assert checkpoint_identity([weights], CONFIG, digest_cache=cache_file) == first  # the memo
    identity._memo.clear()
    assert checkpoint_identity([weights], CONFIG, digest_cache=cache_file) == first  # the cache file
    identity._memo.clear()
    honest = checkpoint_identity([weights], CONFIG, digest_cache=None)  # no cache file, empty memo
    assert honest == _identity_v2([weights.read_bytes()], CONFIG_JSON) != first
    cache_file.unlink()  # how to clear it; a new process then hashes the bytes again
    identity._memo.clear()
    assert checkpoint_identity([weights], CONFIG, digest_cache=cache_file) == honest


CHILD = textwrap.dedent(
    """
    import sys
    import muxworker.transport.checkpoint.identity as identity

    def no_reading(f):
        raise AssertionError("a model file was read")

    if sys.argv[3] == "cached":
        identity._hash_open_file = no_reading
    print(identity.checkpoint_identity([sys.argv[1]], {}, digest_cache=sys.argv[2]))
    """
)


def test_a_new_process_takes_digests_from_the_cache_file_without_reading_the_bytes(tmp_path, cache_file):
    (weights,) = _files(tmp_path, os.urandom(3 * 2**20), dated=True)

    def child(mode: str) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, "-c", CHILD, str(weights), str(cache_file), mode]
        return subprocess.run(args, capture_output=True, text=True, timeout=120)

    first = child("hashing")
    assert first.stdout.strip() == _identity_v2([weights.read_bytes()], b"{}")
    assert child("cached").stdout == first.stdout
    _date(weights, time.time_ns() - 2 * DAY_NS)  # touched: the bytes must be read again
    refused = child("cached")
    assert refused.returncode != 0 and "a model file was read" in refused.stderr
    assert child("hashing").stdout == first.stdout
    assert child("cached").stdout == first.stdout  # and the new mtime is cached


def test_a_modified_file_is_hashed_again(tmp_path, cache_file):
    (weights,) = _files(tmp_path, os.urandom(4096), dated=True)
    first = checkpoint_identity([weights], CONFIG, digest_cache=cache_file)
    old = os.stat(weights).st_mtime_ns
    weights.write_bytes(os.urandom(4096))  # same size, new mtime
    _date(weights, old + 1)
    second = checkpoint_identity([weights], CONFIG, digest_cache=cache_file)
    assert second == _identity_v2([weights.read_bytes()], CONFIG_JSON) != first
    weights.write_bytes(os.urandom(4097))  # the size alone differs
    _date(weights, old + 1)
    assert checkpoint_identity([weights], CONFIG, digest_cache=cache_file) == _identity_v2(
        [weights.read_bytes()], CONFIG_JSON
    )
    copy = tmp_path / "copy.bin"  # the same bytes and mtime in another inode: hashed, same identity
    copy.write_bytes(weights.read_bytes())
    _date(copy, old + 1)
    assert checkpoint_identity([copy], CONFIG, digest_cache=cache_file) == checkpoint_identity(
        [weights], CONFIG, digest_cache=cache_file
    )
    assert len(_entries(cache_file)) == 4  # one per (inode, size, mtime_ns) seen, newest last


def test_a_file_written_moments_ago_is_not_cached(tmp_path, cache_file):
    """A filesystem's mtime ticks coarsely: a second write in the same tick would keep size and
    mtime_ns, so a file younger than a few seconds is hashed at every call."""
    (weights,) = _files(tmp_path, os.urandom(4096))
    first = checkpoint_identity([weights], CONFIG, digest_cache=cache_file)
    _rewrite_in_place(weights, os.urandom(4096))
    second = checkpoint_identity([weights], CONFIG, digest_cache=cache_file)
    assert second == _identity_v2([weights.read_bytes()], CONFIG_JSON) != first
    assert not cache_file.exists()  # nothing cacheable, nothing written


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x00\xff garbage",
        b'{"format": "muxworker-model-digests", "version": 1, "entries": [',  # a torn write
        b"[" * 100_000,
        b'{"format": "muxworker-model-digests", "version": 2, "entries": []}',
        b'{"format": "muxworker-model-digests", "version": 1, "entries": [{"dev": 1}]}',
        b'{"format": "muxworker-model-digests", "version": 1, "entries": [{"dev": true, "ino": 1, "size": 1,'
        b' "mtime_ns": 1, "sha256": "' + b"0" * 64 + b'", "crc32c": 0}]}',
        b'{"format": "muxworker-model-digests", "version": 1, "entries": [{"dev": 1, "ino": 1, "size": 1,'
        b' "mtime_ns": 1, "sha256": "XYZ", "crc32c": 0}]}',
        b" " * (2**20 + 1),
        "directory",
    ],
    ids=["empty", "binary", "torn", "deep", "newer", "short-entry", "bool", "bad-hex", "huge", "directory"],
)
def test_a_corrupt_or_unreadable_cache_file_is_ignored_and_rewritten(tmp_path, cache_file, content):
    (weights,) = _files(tmp_path, os.urandom(4096), dated=True)
    cache_file.parent.mkdir()
    if content == "directory":
        cache_file.mkdir()
    else:
        cache_file.write_bytes(content)
    expected = _identity_v2([weights.read_bytes()], CONFIG_JSON)
    assert checkpoint_identity([weights], CONFIG, digest_cache=cache_file) == expected
    if content == "directory":  # cannot be replaced: no error, no temp file left
        assert os.listdir(cache_file.parent) == [cache_file.name]
        return
    st = os.stat(weights)
    assert _entries(cache_file) == [
        {
            "dev": st.st_dev,
            "ino": st.st_ino,
            "size": 4096,
            "mtime_ns": st.st_mtime_ns,
            "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
            "crc32c": crc32c(weights.read_bytes()),
        }
    ]
    identity._memo.clear()
    _rewrite_in_place(weights, os.urandom(4096))
    assert checkpoint_identity([weights], CONFIG, digest_cache=cache_file) == expected  # it is used again


def test_the_cache_keeps_the_most_recently_used_entries(tmp_path, cache_file, monkeypatch):
    monkeypatch.setattr(identity, "_MAX_ENTRIES", 3)
    files = _files(tmp_path, *(bytes([i]) * 100 for i in range(5)), dated=True)
    for f in files:
        checkpoint_identity([f], CONFIG, digest_cache=cache_file)
    inodes = [os.stat(f).st_ino for f in files]
    assert [e["ino"] for e in _entries(cache_file)] == inodes[2:]
    checkpoint_identity([files[2]], CONFIG, digest_cache=cache_file)  # in the memo: the file is untouched
    assert [e["ino"] for e in _entries(cache_file)] == inodes[2:]
    checkpoint_identity([files[0], files[2]], CONFIG, digest_cache=cache_file)  # 0 was evicted: hashed
    assert [e["ino"] for e in _entries(cache_file)] == [inodes[4], inodes[0], inodes[2]]


def _append(path) -> None:
    with open(path, "ab") as f:
        f.write(b"more")


def _truncate(path) -> None:
    os.truncate(path, os.stat(path).st_size - 1)


def _overwrite_last_byte(path) -> None:  # same size: only the mtime tells
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))


@pytest.mark.parametrize("writer", [_append, _truncate, _overwrite_last_byte], ids=["append", "truncate", "overwrite"])
def test_a_file_that_changes_while_it_is_hashed_is_refused_and_not_cached(tmp_path, cache_file, monkeypatch, writer):
    (weights,) = _files(tmp_path, os.urandom(3 * 2**20), dated=True)
    real = identity.crc32c

    def meanwhile(data, crc=0):  # the first chunk's checksum: another writer changes the file
        monkeypatch.setattr(identity, "crc32c", real)
        writer(weights)
        return real(data, crc)

    monkeypatch.setattr(identity, "crc32c", meanwhile)
    with pytest.raises(InvalidArgument, match="f0.bin' changed while it was being hashed"):
        checkpoint_identity([weights], CONFIG, digest_cache=cache_file)
    assert not cache_file.exists()
    _date(weights, time.time_ns() - DAY_NS)  # settled again: hashed and cached as it is now
    expected = _identity_v2([weights.read_bytes()], CONFIG_JSON)
    assert checkpoint_identity([weights], CONFIG, digest_cache=cache_file) == expected
    assert len(_entries(cache_file)) == 1


def test_concurrent_writers_leave_one_whole_cache_file(tmp_path, cache_file):
    groups = [_files(_subdir(tmp_path, i), os.urandom(2**16), os.urandom(100), dated=True) for i in range(6)]
    results: dict[int, str] = {}

    def compute(i: int) -> None:
        results[i] = checkpoint_identity(groups[i], CONFIG, digest_cache=cache_file)

    threads = [threading.Thread(target=compute, args=(i,)) for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, files in enumerate(groups):
        assert results[i] == _identity_v2([f.read_bytes() for f in files], CONFIG_JSON)
    assert 2 <= len(_entries(cache_file)) <= 12  # the last writer's view, at least its own two files
    assert os.listdir(cache_file.parent) == [cache_file.name]  # no temp file left


def test_where_the_cache_file_is(tmp_path, monkeypatch, cache_file):
    monkeypatch.setenv("MUXWORKER_CACHE", str(tmp_path / "mux"))
    monkeypatch.delenv(identity.DIGEST_CACHE_ENV)
    assert (
        identity.default_digest_cache()
        == cache_root() / "model-digests.json"
        == tmp_path / "mux" / "model-digests.json"
    )
    (weights,) = _files(tmp_path, b"x" * 10, dated=True)
    checkpoint_identity([weights], CONFIG)
    assert len(_entries(tmp_path / "mux" / "model-digests.json")) == 1
    monkeypatch.setenv(identity.DIGEST_CACHE_ENV, str(cache_file))
    assert identity.default_digest_cache() == cache_file
    monkeypatch.setenv(identity.DIGEST_CACHE_ENV, "off")
    assert identity.default_digest_cache() is None
    identity._memo.clear()
    (other,) = _files(_subdir(tmp_path, "off"), b"y" * 10, dated=True)
    checkpoint_identity([other], CONFIG)
    assert not cache_file.exists()
