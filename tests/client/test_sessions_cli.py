"""``python -m muxworker.sessions``: the store's command line, run as a real process on a real store."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers.fs import place_unusable

from muxworker.client import SessionStore
from muxworker.transport.checkpoint import CPUCheckpoint, LayerState

FORMAT = {"backend": "torch", "dtype": "float32", "layout_version": 1}
GEOMETRY = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "windows": [None, 3]}


def checkpoint(n: int, seed: int = 0) -> CPUCheckpoint:
    rng = np.random.default_rng(seed)
    layers = []
    for window in GEOMETRY["windows"]:
        start = 0 if window is None else max(0, n - window)
        k = rng.standard_normal((n - start, 2, 4)).astype(np.float32)
        layers.append(LayerState(start, k, -k))
    return CPUCheckpoint(FORMAT, GEOMETRY, n, np.arange(n, dtype=np.int32), layers)


def cli(store_dir, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "muxworker.sessions", str(store_dir), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def store(tmp_path):
    s = SessionStore(tmp_path / "sessions", identity="feedface" * 8)
    s.save("chat: one", checkpoint(20, 1))
    s.save("agent/2", checkpoint(7, 2))
    return s


def test_list_and_show_name_sessions_by_id_with_tokens_bytes_identity_and_times(store):
    out = cli(store.path, "list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:6] == ["session", "tokens", "MiB", "segments", "dtype", "identity"]
    assert lines[1].startswith("agent/2") and " 7 " in lines[1] and "feedfacefeed" in lines[1]
    assert lines[2].startswith("chat: one") and " 20 " in lines[2]
    assert lines[-1].startswith("2 session(s)")
    show = cli(store.path, "show", "chat: one")
    assert show.returncode == 0, show.stderr
    assert "tokens:        20" in show.stdout and "dtype:         float32" in show.stdout
    assert show.stdout.count("file:") == 2  # the manifest and its one segment
    missing = cli(store.path, "show", "nope")
    assert missing.returncode == 1 and "no saved checkpoint" in missing.stderr


def test_verify_finds_a_damaged_segment_and_names_its_session(store):
    assert cli(store.path, "verify").returncode == 0
    segment = store.files_of("agent/2")[1]
    data = bytearray(segment.read_bytes())
    data[-40] ^= 0x10
    segment.write_bytes(data)
    out = cli(store.path, "verify")
    assert out.returncode == 1
    assert "BAD  agent/2" in out.stdout and "checksum" in out.stdout and "ok   chat: one" in out.stdout
    manifest = store.path_for("chat: one")
    manifest.write_bytes(manifest.read_bytes()[:-3])  # a damaged manifest: list skips it, verify says so
    out = cli(store.path, "verify")
    assert out.returncode == 1 and f"BAD  {manifest.name}" in out.stdout


def test_delete_and_prune(store):
    assert cli(store.path, "delete", "agent/2").stdout.strip() == "deleted agent/2"
    assert store.list() == ["chat: one"]
    assert cli(store.path, "delete", "agent/2").returncode == 1
    assert cli(store.path, "prune", "--older-than", "1h").stdout == ""  # saved just now
    old = time.time() - 3 * 86400
    store.save("old", checkpoint(5, 3))
    # Age "old" by rewriting its manifest's saved time through the store's own API.
    from muxworker.transport.checkpoint.manifest import encode_session_manifest

    dir_fd = os.open(store.path, os.O_RDONLY)
    try:
        m = store._manifest(dir_fd, "old")
    finally:
        os.close(dir_fd)
    m.saved = old
    store.path_for("old").write_bytes(encode_session_manifest(m))
    out = cli(store.path, "prune", "--older-than", "2d")
    assert out.returncode == 0 and out.stdout.strip() == "deleted old"
    assert store.list() == ["chat: one"]
    assert cli(store.path, "prune", "--older-than", "soon").returncode == 2


def test_clean_removes_leftovers_only_when_no_writer_holds_the_store(store):
    stray = store.path / (store.path_for("x").stem + ".0123456789abcdef.mxseg")
    stray.write_bytes(b"x" * 100)
    temp = store.path / f".{store.path_for('x').stem}.fedcba9876543210.tmp"
    temp.write_bytes(b"y" * 50)
    plan = store.begin_save("busy")
    try:
        busy = cli(store.path, "clean")
        assert busy.returncode == 2 and "is writing to the session store" in busy.stderr
        assert stray.exists()
    finally:
        store.abort_save(plan)
    out = cli(store.path, "clean")
    assert out.returncode == 0
    assert not stray.exists() and not temp.exists()
    assert "2 file(s)" in out.stdout
    assert sorted(store.list()) == ["agent/2", "chat: one"]
    assert cli(store.path, "verify").returncode == 0


def test_a_missing_store_is_a_clear_error(tmp_path):
    out = cli(tmp_path / "nowhere", "list")
    assert out.returncode == 2 and "no session store" in out.stderr


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_an_unusable_manifest_never_hangs_a_command_and_delete_removes_it(store, tmp_path, kind):
    # Every command finishes (cli() times out after 60 s: a FIFO opened for a blocking read would
    # hang), says what is wrong in one line, never with a traceback, and delete makes the id usable.
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    path = store.path_for("bad")
    place_unusable(kind, path, outside)
    listed = cli(store.path, "list")
    assert listed.returncode == 0 and "2 session(s)" in listed.stdout
    for args, status, where in (
        (("show", "bad"), 1, "stderr"),
        (("verify",), 1, "stdout"),
        (("verify", "bad"), 1, "stdout"),
        (("clean",), 1, "stderr"),
    ):
        out = cli(store.path, *args)
        assert out.returncode == status, (args, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr + out.stdout
        assert path.name in getattr(out, where) or "not a regular file" in getattr(out, where), (args, out)
    clean = cli(store.path, "clean")
    assert "could not be read" in clean.stderr and f"muxworker.sessions {store.path} verify" in clean.stderr
    deleted = cli(store.path, "delete", "bad")
    assert (deleted.returncode, deleted.stdout.strip(), deleted.stderr) == (0, "deleted bad", "")
    assert not os.path.lexists(path) and outside.read_bytes() == b"precious"
    for args in (("verify",), ("clean",)):
        out = cli(store.path, *args)
        assert out.returncode == 0, (args, out.stdout, out.stderr)
    assert sorted(store.list()) == ["agent/2", "chat: one"]


def test_clean_keeps_the_segments_of_a_manifest_it_cannot_read_and_says_so(store):
    manifest = store.path_for("agent/2")
    segment = store.files_of("agent/2")[1]
    original = manifest.read_bytes()
    manifest.write_bytes(original[:30] + bytes([original[30] ^ 0x01]) + original[31:])  # one flipped bit
    stray = store.path / (store.path_for("x").stem + ".0123456789abcdef.mxseg")  # provably unnamed
    stray.write_bytes(b"x" * 100)
    out = cli(store.path, "clean")
    assert out.returncode == 1
    assert f"removed {stray.name}" in out.stdout and "1 file(s)" in out.stdout
    assert f"unreadable {manifest.name}: " in out.stderr and "checksum" in out.stderr
    assert "kept 1 file(s) of 1 manifest(s) that could not be read" in out.stderr  # its segment
    assert segment.exists() and not stray.exists()
    # A leftover of that session (a killed writer's segment) is kept too while it cannot be read.
    leftover = store.path / (manifest.stem + ".0123456789abcdef.mxseg")
    leftover.write_bytes(b"y" * 100)
    out = cli(store.path, "clean")
    assert out.returncode == 1 and "kept 2 file(s)" in out.stderr and leftover.exists() and segment.exists()
    manifest.write_bytes(original)
    assert cli(store.path, "verify").returncode == 0
    out = cli(store.path, "clean")
    assert out.returncode == 0 and f"removed {leftover.name}" in out.stdout and out.stderr == ""
    assert segment.exists() and cli(store.path, "verify").returncode == 0


def test_a_store_error_is_one_line_not_a_traceback(store):
    done = subprocess.run(["chattr", "+i", str(store.path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"chattr +i is unavailable here: {done.stderr.strip()}")
    try:
        out = cli(store.path, "delete", "agent/2", "chat: one")
    finally:
        subprocess.run(["chattr", "-i", str(store.path)], check=True)
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 2 and all(line.startswith("error: cannot delete session") for line in lines)
    assert sorted(store.list()) == ["agent/2", "chat: one"]


def test_migrate_converts_version_1_and_2_files_once_and_they_load_as_saved(tmp_path):
    """Files the version 2 writer wrote (tests/data/legacy): unreadable until migrated (the error
    names the command), then sessions and single checkpoints hold exactly what was saved."""
    import shutil

    from helpers.legacy import DATA, IDENTITY, INPUTS, SESSIONS, legacy_checkpoint

    from muxworker.transport.checkpoint import CheckpointIncompatible, load_checkpoint

    shutil.copytree(DATA, tmp_path / "legacy")
    root = tmp_path / "legacy"
    stores = {v: SessionStore(root / f"store-v{v}", identity=IDENTITY, inputs=INPUTS) for v in (1, 2)}
    with pytest.raises(CheckpointIncompatible, match="sessions DIR migrate"):
        stores[2].load("plain")
    assert stores[2].list() == []  # unreadable, so not listed; clean keeps it (it protects its files)
    clean = cli(stores[2].path, "clean")
    assert clean.returncode == 1 and "sessions DIR migrate" in clean.stderr  # the collector says what to do
    for version in (1, 2):
        out = cli(root / f"store-v{version}", "migrate")
        assert out.returncode == 0, out.stderr
        assert "session 'plain'" in out.stdout and "session 'with-draft'" in out.stdout
        assert out.stdout.splitlines()[-1] == "2 file(s) converted, 0 left as they were"
        for seed, (sid, draft) in enumerate(SESSIONS.items()):
            got, want = stores[version].load(sid), legacy_checkpoint(draft=draft, seed=seed)
            assert got.token_ids.tobytes() == want.token_ids.tobytes()
            for a, b in zip(got.layers, want.layers):
                assert (a.start, a.keys.tobytes(), a.values.tobytes()) == (
                    b.start,
                    b.keys.tobytes(),
                    b.values.tobytes(),
                )
            assert (got.draft is None) == (not draft)
            if draft:
                assert got.draft_position == want.draft_position
                assert got.draft["pending_token_ids"].tolist() == want.draft["pending_token_ids"].tolist()
                (a,), (b,) = got.draft["layers"], want.draft["layers"]
                assert a.keys.tobytes() == b.keys.tobytes() and a.values.tobytes() == b.values.tobytes()
        again = cli(root / f"store-v{version}", "migrate")
        assert again.stdout.splitlines()[-1] == "0 file(s) converted, 0 left as they were"
    # Standalone save_checkpoint files, and one damaged file, which stays as it was.
    damaged = root / "damaged.mxckpt"
    data = bytearray((root / "single-v2.mxckpt").read_bytes())
    data[4096] ^= 0xFF  # the first payload (the token ids), whose CRC then fails
    damaged.write_bytes(bytes(data))
    out = cli(root, "migrate")
    assert out.returncode == 1
    assert "converted single-v1.mxckpt (a checkpoint file)" in out.stdout
    assert "BAD  damaged.mxckpt" in out.stderr and damaged.read_bytes() == bytes(data)
    want = legacy_checkpoint(draft=True, seed=7)
    for name in ("single-v1.mxckpt", "single-v2.mxckpt"):
        got = load_checkpoint(root / name, expected_identity=IDENTITY)
        assert got.token_ids.tobytes() == want.token_ids.tobytes() and got.draft_position == want.draft_position
