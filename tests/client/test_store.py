from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import trio

from muxworker.client.checkpoint import (
    CheckpointCorrupt,
    CheckpointIncompatible,
    CheckpointNotFound,
    CheckpointTooLarge,
    CheckpointUnsafePath,
    CPUCheckpoint,
    LayerState,
    checkpoint_identity,
)
from muxworker.client.store import SessionStore, StorePermissionError
from muxworker.transport.errors import InvalidArgument
from muxworker.transport.schema import MAX_SESSION_ID_BYTES, validate

CONFIG = {"backend": "torch", "dtype": "float32", "rope": None, "draft": None}


def make_checkpoint(position: int = 8, *, seed: int = 0, identity: str | None = None) -> CPUCheckpoint:
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal((position, 2, 4)).astype(np.float32) for _ in range(4)]
    return CPUCheckpoint(
        format={"backend": "torch", "dtype": "float32", "layout_version": 1},
        geometry={"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "windows": [None, None]},
        position=position,
        token_ids=rng.integers(0, 1000, size=position, dtype=np.int32),
        layers=[LayerState(0, rows[0], rows[1]), LayerState(0, rows[2], rows[3])],
        identity=identity,
    )


def assert_same(a: CPUCheckpoint, b: CPUCheckpoint) -> None:
    assert a.position == b.position and a.geometry == b.geometry and a.format == b.format
    assert a.token_ids.tobytes() == b.token_ids.tobytes()
    for x, y in zip(a.layers, b.layers):
        assert x.start == y.start
        assert x.keys.tobytes() == y.keys.tobytes() and x.values.tobytes() == y.values.tobytes()


@pytest.fixture
def model_files(tmp_path):
    weights = tmp_path / "model.safetensors"
    tokenizer = tmp_path / "tokenizer.json"
    weights.write_bytes(os.urandom(4096))
    tokenizer.write_bytes(b'{"vocab": {}}')
    return [weights, tokenizer]


@pytest.fixture
async def store(tmp_path, model_files):
    return await SessionStore.create(tmp_path / "sessions", model_files=model_files, configuration=CONFIG)


def leftovers(store: SessionStore) -> list[str]:
    return sorted(n for n in os.listdir(store.path) if not n.endswith(".mxckpt"))


# ---------------------------------------------------------------------------------------------
# The directory


async def test_create_makes_a_private_directory_and_binds_the_identity(tmp_path, model_files):
    old = os.umask(0o000)  # mkdir's mode must not depend on the umask
    try:
        store = await SessionStore.create(tmp_path / "a" / "b", model_files=model_files, configuration=CONFIG)
    finally:
        os.umask(old)
    assert os.stat(store.path).st_mode & 0o777 == 0o700
    assert store.identity == checkpoint_identity(model_files, CONFIG)
    assert store.max_bytes == 16 * 2**30
    other = await SessionStore.create(tmp_path / "c", model_files=model_files, configuration={**CONFIG, "dtype": "bfloat16"})
    assert other.identity != store.identity


async def test_an_existing_owned_0755_directory_is_accepted(tmp_path, model_files):
    existing = tmp_path / "shared-read"
    existing.mkdir()
    os.chmod(existing, 0o755)
    store = await SessionStore.create(existing, model_files=model_files, configuration=CONFIG)
    assert os.stat(existing).st_mode & 0o777 == 0o755  # left as it was
    store.save("s", make_checkpoint())
    assert store.list() == ["s"]


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777, 0o720])
async def test_a_directory_writable_by_others_is_rejected(tmp_path, model_files, mode):
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, mode)
    with pytest.raises(StorePermissionError, match="writable by group or others"):
        await SessionStore.create(loose, model_files=model_files, configuration=CONFIG)


async def test_a_directory_owned_by_someone_else_is_rejected(tmp_path, model_files):
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    try:
        os.chown(foreign, os.geteuid() + 1, -1)
    except PermissionError:
        pytest.skip("changing a directory's owner needs privileges this test run lacks")
    with pytest.raises(StorePermissionError, match="owned by uid"):
        await SessionStore.create(foreign, model_files=model_files, configuration=CONFIG)


async def test_a_symlinked_directory_is_rejected(tmp_path, model_files):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(StorePermissionError, match="symlink"):
        await SessionStore.create(link, model_files=model_files, configuration=CONFIG)


async def test_a_regular_file_as_directory_is_rejected(tmp_path, model_files):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StorePermissionError):
        await SessionStore.create(tmp_path / "file", model_files=model_files, configuration=CONFIG)


async def test_loosened_permissions_after_creation_are_caught_per_call(store):
    store.save("s", make_checkpoint())
    os.chmod(store.path, 0o777)
    try:
        with pytest.raises(StorePermissionError):
            store.load("s")
        with pytest.raises(StorePermissionError):
            store.save("s", make_checkpoint())
    finally:
        os.chmod(store.path, 0o700)
    assert_same(make_checkpoint(), store.load("s"))


# ---------------------------------------------------------------------------------------------
# Sessions


WEIRD_IDS = ["a/b", "../../escape", "..", ".", "/etc/passwd", "con", "ü∂ 🙂", " ", "x" * 1000, "a\\b", "\n"]


async def test_any_session_id_maps_to_a_hashed_file_inside_the_directory(store):
    for i, sid in enumerate(WEIRD_IDS):
        path = store.path_for(sid)
        assert path.parent == store.path
        assert path.name == hashlib.sha256(sid.encode()).hexdigest() + ".mxckpt"
        store.save(sid, make_checkpoint(seed=i))
    for i, sid in enumerate(WEIRD_IDS):
        assert_same(make_checkpoint(seed=i), store.load(sid))
    assert store.list() == sorted(WEIRD_IDS)
    assert sorted(os.listdir(store.path)) == sorted(store.path_for(s).name for s in WEIRD_IDS)
    assert not (store.path.parent / "escape").exists()


@pytest.mark.parametrize("sid", ["", None, 7, b"bytes", "\ud800", "x" * (MAX_SESSION_ID_BYTES + 1)])
async def test_invalid_session_ids_are_invalid_arguments(store, sid):
    for call in (store.path_for, store.load, store.delete, lambda s: store.save(s, make_checkpoint())):
        with pytest.raises(InvalidArgument):
            call(sid)


@pytest.mark.parametrize("unit", ["x", "ü", "🙂"])  # 1, 2 and 4 UTF-8 bytes
async def test_the_store_accepts_exactly_the_session_ids_the_wire_accepts(store, unit):
    # One limit for both ends: an id the worker takes can be saved, and a saved id can be resumed.
    from muxworker.worker import engine

    assert engine.MAX_SESSION_ID_BYTES == MAX_SESSION_ID_BYTES
    n = MAX_SESSION_ID_BYTES // len(unit.encode())
    for sid in (unit * n, unit * n + "x", unit * (n + 1)):
        try:
            validate({"kind": "open", "id": 1, "session_id": sid}, sender="client")
        except InvalidArgument:
            wire_accepts = False
        else:
            wire_accepts = True
        try:
            store.path_for(sid)
        except InvalidArgument:
            store_accepts = False
        else:
            store_accepts = True
        assert store_accepts == wire_accepts == (len(sid.encode()) <= MAX_SESSION_ID_BYTES), len(sid.encode())


async def test_bad_arguments_are_invalid(store):
    with pytest.raises(InvalidArgument, match="CPUCheckpoint"):
        store.save("s", {"position": 1})
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgument, match="max_bytes"):
            SessionStore(store.path, identity=store.identity, max_bytes=bad)
    with pytest.raises(InvalidArgument, match="identity"):
        SessionStore(store.path, identity="")
    assert store.list() == []


async def test_save_replace_load_and_stamped_identity(store):
    store.save("chat-42", make_checkpoint(seed=1))
    first = store.load("chat-42")
    assert first.identity == store.identity  # a checkpoint without identity is stamped
    store.save("chat-42", make_checkpoint(12, seed=2, identity=store.identity))
    assert_same(make_checkpoint(12, seed=2), store.load("chat-42"))
    assert os.stat(store.path_for("chat-42")).st_mode & 0o777 == 0o600
    assert leftovers(store) == []


async def test_load_missing_is_not_found(store):
    with pytest.raises(CheckpointNotFound, match="nobody"):
        store.load("nobody")


async def test_delete_returns_whether_a_file_existed(store):
    store.save("a", make_checkpoint())
    store.save("b", make_checkpoint())
    assert store.delete("a") is True
    assert store.delete("a") is False
    assert store.delete("never") is False
    with pytest.raises(CheckpointNotFound):
        store.load("a")
    assert store.list() == ["b"]


async def test_list_skips_temp_foreign_and_damaged_files(store):
    store.save("kept", make_checkpoint())
    digest = hashlib.sha256(b"kept").hexdigest()
    (store.path / f".{digest}.0123456789abcdef.tmp").write_bytes(b"half written")
    (store.path / "notes.txt").write_text("hello")
    (store.path / ("0" * 64 + ".mxckpt")).write_bytes(b"garbage")
    assert store.list() == ["kept"]


async def test_a_file_copied_under_another_session_name_is_corrupt(store):
    store.save("a", make_checkpoint())
    os.link(store.path_for("a"), store.path_for("b"))
    with pytest.raises(CheckpointCorrupt, match="holds session 'a'"):
        store.load("b")
    assert store.list() == ["a"]


async def test_identity_mismatch_is_incompatible(tmp_path, store, model_files):
    store.save("s", make_checkpoint())
    model_files[0].write_bytes(os.urandom(4096))  # new weights, same directory
    retrained = await SessionStore.create(store.path, model_files=model_files, configuration=CONFIG)
    with pytest.raises(CheckpointIncompatible):
        retrained.load("s")
    with pytest.raises(CheckpointIncompatible):
        retrained.save("s", make_checkpoint(identity=store.identity))
    assert_same(make_checkpoint(), store.load("s"))


async def test_symlinks_and_fifos_in_the_store_are_refused(store, tmp_path):
    outside = tmp_path / "outside.mxckpt"
    outside.write_bytes(b"precious")
    store.path_for("link").symlink_to(outside)
    with pytest.raises(CheckpointUnsafePath):
        store.load("link")
    with pytest.raises(CheckpointUnsafePath):
        store.save("link", make_checkpoint())
    with pytest.raises(CheckpointUnsafePath):
        store.delete("link")
    assert outside.read_bytes() == b"precious"
    os.mkfifo(store.path_for("fifo"))
    with pytest.raises(CheckpointUnsafePath):
        store.load("fifo")
    with pytest.raises(CheckpointUnsafePath):
        store.save("fifo", make_checkpoint())
    assert leftovers(store) == []


async def test_max_bytes_is_enforced_on_save_and_load(tmp_path, store, model_files):
    small = make_checkpoint(8)
    big = make_checkpoint(64, seed=5)
    bounded = SessionStore(store.path, identity=store.identity, max_bytes=small.nbytes)
    bounded.save("s", small)
    with pytest.raises(CheckpointTooLarge):
        bounded.save("s", big)
    assert_same(small, bounded.load("s"))  # the previous file stays loadable
    assert leftovers(bounded) == []
    store.save("s", big)  # a store with a larger bound wrote it ...
    with pytest.raises(CheckpointTooLarge):
        bounded.load("s")  # ... the bounded one refuses to read it
    assert bounded.list() == ["s"]


async def test_a_failed_rename_keeps_the_previous_file_and_removes_the_temp(store, monkeypatch):
    store.save("s", make_checkpoint(seed=1))

    def crash(*args, **kwargs):
        raise OSError("simulated crash between temp write and replace")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        store.save("s", make_checkpoint(seed=2))
    monkeypatch.undo()
    assert_same(make_checkpoint(seed=1), store.load("s"))
    assert leftovers(store) == []
    assert store.list() == ["s"]


CHILD = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    from muxworker.client.store import SessionStore
    from muxworker.client.checkpoint import CPUCheckpoint, LayerState

    path, identity = sys.argv[1], sys.argv[2]
    store = SessionStore(path, identity=identity)
    rows = np.full((8, 2, 4), 7.0, np.float32)
    ckpt = CPUCheckpoint(
        format={"backend": "torch", "dtype": "float32", "layout_version": 1},
        geometry={"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "windows": [None, None]},
        position=8, token_ids=np.arange(8, dtype=np.int32),
        layers=[LayerState(0, rows, rows), LayerState(0, rows, rows)],
    )

    def hang(fd):  # the temp file is fully written; block where a crash would hurt most
        print("in-fsync", flush=True)
        time.sleep(3600)

    os.fsync = hang
    store.save("s", ckpt)
    """
)


async def test_a_writer_killed_after_writing_its_temp_file_leaves_the_previous_file(store):
    store.save("s", make_checkpoint(seed=1))
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", CHILD, str(store.path), store.identity],
        stdout=subprocess.PIPE,
    )
    try:
        with trio.fail_after(120):  # a guard against a hang, not a timing assertion
            line = b""
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(64)
                assert chunk, "child exited before reaching fsync"
                line += chunk
        assert line == b"in-fsync\n"
    finally:
        proc.kill()
        await proc.wait()
        await proc.stdout.aclose()
    assert proc.returncode == -signal.SIGKILL
    temps = leftovers(store)
    digest = hashlib.sha256(b"s").hexdigest()
    assert len(temps) == 1 and temps[0].startswith(f".{digest}.") and temps[0].endswith(".tmp")
    assert os.path.getsize(store.path / temps[0]) > 0
    assert_same(make_checkpoint(seed=1), store.load("s"))
    assert store.list() == ["s"]
    store.save("s", make_checkpoint(seed=2))  # a later save is unaffected by the leftover
    assert_same(make_checkpoint(seed=2), store.load("s"))


async def test_concurrent_saves_from_threads_never_corrupt_the_file(store):
    versions = [make_checkpoint(16_000 + 100 * i, seed=i) for i in range(6)]  # ~1 MiB each
    store.save("s", versions[0])
    loaded: list[CPUCheckpoint] = []

    def reader():
        for _ in range(10):
            loaded.append(store.load("s"))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            for version in versions:
                nursery.start_soon(trio.to_thread.run_sync, store.save, "s", version)
        nursery.start_soon(trio.to_thread.run_sync, reader)
        nursery.start_soon(trio.to_thread.run_sync, reader)
    final = store.load("s")
    for ckpt in loaded + [final]:
        match = [v for v in versions if v.position == ckpt.position]
        assert len(match) == 1
        assert_same(match[0], ckpt)
    assert leftovers(store) == []
    assert store.list() == ["s"]
