from __future__ import annotations

import errno
import hashlib
import os
import resource
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import trio
from helpers.fs import place_unusable, tmpfs

from muxworker.client.params import ModelInfo, WorkerInfo
from muxworker.client.stores import ConfigurationMismatch, SessionStore, StorePermissionError, StoreUnavailable
from muxworker.native import crc32c
from muxworker.transport.checkpoint import (
    CheckpointCorrupt,
    CheckpointIncompatible,
    CheckpointNotFound,
    CheckpointReadError,
    CheckpointTooLarge,
    CheckpointUnsafePath,
    CheckpointWriteError,
    CPUCheckpoint,
    LayerState,
    checkpoint_identity,
)
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


LOCKS = {".muxworker-writers.lock", ".muxworker-commit.lock"}


def leftovers(store: SessionStore) -> list[str]:
    """Files in the store that no saved session holds (the lock files aside)."""
    held = {p.name for sid in store.list() for p in store.files_of(sid)}
    return sorted(n for n in os.listdir(store.path) if n not in held and n not in LOCKS and not n.endswith(".mxckpt"))


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
    other = await SessionStore.create(
        tmp_path / "c", model_files=model_files, configuration={**CONFIG, "dtype": "bfloat16"}
    )
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
    manifests = sorted(n for n in os.listdir(store.path) if n.endswith(".mxckpt"))
    assert manifests == sorted(store.path_for(s).name for s in WEIRD_IDS)
    assert leftovers(store) == []
    assert not (store.path.parent / "escape").exists()


@pytest.mark.parametrize("sid", ["", None, 7, b"bytes", "\ud800", "x" * (MAX_SESSION_ID_BYTES + 1)])
async def test_invalid_session_ids_are_invalid_arguments(store, sid):
    for call in (store.path_for, store.load, store.delete, lambda s: store.save(s, make_checkpoint())):
        with pytest.raises(InvalidArgument):
            call(sid)


@pytest.mark.parametrize("unit", ["x", "ü", "🙂"])  # 1, 2 and 4 UTF-8 bytes
async def test_the_store_accepts_exactly_the_session_ids_the_wire_accepts(store, unit):
    # One limit for both ends: an id the worker takes can be saved, and a saved id can be resumed.
    from muxworker.worker.engine import core as engine

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


async def test_identity_mismatch_is_incompatible_and_names_what_differs(tmp_path, store, model_files):
    store.save("s", make_checkpoint())
    weights, tokenizer = (f.read_bytes() for f in model_files)
    model_files[0].write_bytes(os.urandom(4096))  # new weights, same directory
    retrained = await SessionStore.create(store.path, model_files=model_files, configuration=CONFIG)
    with pytest.raises(CheckpointIncompatible) as info:
        retrained.load("s")
    assert str(info.value).endswith(
        f"model file 1 (model.safetensors): file 4096 bytes, crc32c {crc32c(weights):08x}; "
        f"store 4096 bytes, crc32c {crc32c(model_files[0].read_bytes()):08x}"
    )
    with pytest.raises(CheckpointIncompatible):
        retrained.save("s", make_checkpoint(identity=store.identity))
    assert_same(make_checkpoint(), store.load("s"))
    reconfigured = await SessionStore.create(
        store.path, model_files=model_files[1:], configuration={**CONFIG, "rope": {"theta": 1e6}}
    )
    with pytest.raises(CheckpointIncompatible) as info:
        reconfigured.load("s")
    assert str(info.value).endswith(
        'rope: file null, store {"theta": 1000000.0}; '
        "model files: file 2 (model.safetensors, tokenizer.json), store 1 (tokenizer.json); "
        f"model file 1 (model.safetensors / tokenizer.json): file 4096 bytes, crc32c {crc32c(weights):08x}; "
        f"store {len(tokenizer)} bytes, crc32c {crc32c(tokenizer):08x}"
    )


def _worker_info(**overrides) -> WorkerInfo:
    limits = {"max_sessions": 8, "max_session_tokens": 512, "n_draft": 0, **overrides.pop("limits", {})}
    model = ModelInfo(name="tiny", architecture="llama", vocab_size=300, context_length=2048, has_chat_template=False)
    fields = {
        "protocol": (1, 0),
        "model": model,
        "backend": "torch",
        "device": "cpu",
        "dtype": "float32",
        "limits": limits,
        **overrides,
    }
    return WorkerInfo(**fields)


async def test_check_worker_names_every_declared_field_the_worker_contradicts(tmp_path, model_files):
    async def store_with(**config):
        return await SessionStore.create(tmp_path / "s", model_files=model_files, configuration=config)

    agreeing = await store_with(**CONFIG, device="cpu", max_session_tokens=512, n_draft=0, architecture="llama")
    agreeing.check_worker(_worker_info())
    (await store_with(device="cuda")).check_worker(_worker_info(device="cuda:1"))  # any cuda device
    # Keys the hello does not report (rope here) are the identity's business alone.
    (await store_with(rope={"theta": 1.0}, anything="else")).check_worker(_worker_info())
    with pytest.raises(ConfigurationMismatch) as info:
        (await store_with(**CONFIG, max_session_tokens=4096, vocab_size=300)).check_worker(
            _worker_info(dtype="bfloat16", backend="mlx")
        )
    assert str(info.value).endswith(
        "backend: store torch, worker mlx; dtype: store float32, worker bfloat16; "
        "max_session_tokens: store 4096, worker 512"
    )
    assert isinstance(info.value, CheckpointIncompatible)
    with pytest.raises(ConfigurationMismatch, match=r"draft: store null, worker a draft model \(n_draft 4\)"):
        (await store_with(draft=None)).check_worker(_worker_info(limits={"n_draft": 4}))
    with pytest.raises(ConfigurationMismatch, match="draft: store tiny-draft, worker none"):
        (await store_with(draft="tiny-draft")).check_worker(_worker_info())
    # A store made from a bare identity declares nothing to compare.
    SessionStore(tmp_path / "bare", identity=agreeing.identity).check_worker(_worker_info(dtype="bfloat16"))


async def test_save_and_load_refuse_a_checkpoint_of_another_dtype_than_declared(store, tmp_path):
    import dataclasses

    other = make_checkpoint()
    other = dataclasses.replace(
        other,
        format={**other.format, "dtype": "float16"},
        layers=[LayerState(0, x.keys.astype(np.float16), x.values.astype(np.float16)) for x in other.layers],
    )
    with pytest.raises(ConfigurationMismatch, match="dtype: store float32, checkpoint float16"):
        store.save("s", other)
    assert store.list() == []
    # A file written before save() checked it (here: through a store that declared no dtype).
    SessionStore(store.path, identity=store.identity).save("s", other)
    with pytest.raises(ConfigurationMismatch, match="dtype: store float32, checkpoint float16"):
        store.load("s")


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
async def test_an_unusable_manifest_path_is_refused_and_delete_removes_it(store, tmp_path, kind):
    # A symlink, FIFO or directory where a manifest belongs is never followed, opened for a
    # blocking read or replaced; delete() removes it (not what a symlink points to), so the id
    # is usable again.
    outside = tmp_path / "outside.mxckpt"
    outside.write_bytes(b"precious")
    store.save("other", make_checkpoint(seed=1))
    path = store.path_for("bad")
    place_unusable(kind, path, outside)

    def use() -> None:  # in a thread: a blocking open of the FIFO would hang it, not the test
        for call in (store.load, store.info, store.files_of, lambda sid: store.save(sid, make_checkpoint())):
            with pytest.raises(CheckpointUnsafePath):
                call("bad")
        assert store.list() == ["other"]
        assert [name for name, _ in store.unreadable()] == [path.name]
        assert [name for name, _ in store.clean().unreadable] == [path.name]
        assert store.delete("bad") is True

    with trio.fail_after(60):
        await trio.to_thread.run_sync(use, abandon_on_cancel=True)
    assert not os.path.lexists(path) and outside.read_bytes() == b"precious"
    assert store.delete("bad") is False
    store.save("bad", make_checkpoint(seed=2))
    assert_same(make_checkpoint(seed=2), store.load("bad"))
    assert_same(make_checkpoint(seed=1), store.load("other"))
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
    with pytest.raises(CheckpointWriteError, match="simulated"):
        store.save("s", make_checkpoint(seed=2))
    monkeypatch.undo()
    assert_same(make_checkpoint(seed=1), store.load("s"))
    assert leftovers(store) == []
    assert store.list() == ["s"]


CHILD = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    from muxworker.client.stores import SessionStore
    from muxworker.transport.checkpoint import CPUCheckpoint, LayerState

    path, identity = sys.argv[1], sys.argv[2]
    store = SessionStore(path, identity=identity)
    rows = np.full((8, 2, 4), 7.0, np.float32)
    ckpt = CPUCheckpoint(
        format={"backend": "torch", "dtype": "float32", "layout_version": 1},
        geometry={"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "windows": [None, None]},
        position=8, token_ids=np.arange(8, dtype=np.int32),
        layers=[LayerState(0, rows, rows), LayerState(0, rows, rows)],
    )

    fsync = os.fsync

    def hang(fd):  # the file is fully written; block where a crash would hurt most
        if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
            return fsync(fd)  # the staging memory file (a block store's), not a file of the store
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
    # The killed writer leaves its new segment, which no manifest names, and clean() removes it.
    temps = leftovers(store)
    digest = hashlib.sha256(b"s").hexdigest()
    assert len(temps) == 1 and temps[0].startswith(f"{digest}.") and temps[0].endswith(".mxseg")
    size = os.path.getsize(store.path / temps[0])
    assert size > 0
    assert store.clean() == (temps, size)
    assert leftovers(store) == []
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
    # The replaced versions' blocks stay until clean() (another session could name them); no
    # segment or temporary file is left.
    assert all(name.endswith(".mxblk") for name in leftovers(store))
    store.clean()
    assert leftovers(store) == []
    assert store.list() == ["s"]


# ---------------------------------------------------------------------------------------------
# Failures of the system: named muxworker errors, never a raw OSError; the previous file stays


def _failing(real, err: int, *, when=lambda *args, **kwargs: True):
    def call(*args, **kwargs):
        if when(*args, **kwargs):
            raise OSError(err, os.strerror(err))
        return real(*args, **kwargs)

    return call


def _creating(path, flags, *args, **kwargs) -> bool:
    return bool(flags & os.O_CREAT)


@pytest.mark.parametrize(
    "call, err, reason, phrase",
    [
        ("writev", errno.ENOSPC, "disk_full", "disk full"),
        ("writev", errno.EDQUOT, "disk_full", "disk quota exceeded"),
        ("writev", errno.EFBIG, "file_too_large", "file too large"),
        ("writev", errno.EIO, "io_error", "I/O error"),
        ("open", errno.EACCES, "permission_denied", "permission denied"),
        ("open", errno.EROFS, "read_only", "read-only file system"),
        ("open", errno.ENOSPC, "disk_full", "disk full"),  # no inode left
        ("fsync", errno.EIO, "io_error", "I/O error"),
        ("replace", errno.EPERM, "permission_denied", "permission denied"),
    ],
)
async def test_save_failures_name_their_reason_and_keep_the_previous_file(
    store, monkeypatch, call, err, reason, phrase
):
    store.save("s", make_checkpoint(seed=1))
    real = getattr(os, call)
    monkeypatch.setattr(os, call, _failing(real, err, when=_creating if call == "open" else lambda *a, **k: True))
    with pytest.raises(CheckpointWriteError) as info:
        store.save("s", make_checkpoint(seed=2))
    monkeypatch.undo()
    assert (info.value.reason, info.value.errno) == (reason, err)
    message = str(info.value)
    assert phrase in message and errno.errorcode[err] in message and "'s'" in message
    assert "previous file" in message
    assert not isinstance(info.value, OSError)
    assert_same(make_checkpoint(seed=1), store.load("s"))
    assert leftovers(store) == []


def _of(suffix: str):
    """A ``when`` for _failing: calls on an open file (its fd first) whose name ends with ``suffix``."""
    return lambda fd, *args, **kwargs: os.readlink(f"/proc/self/fd/{fd}").endswith(suffix)


async def test_read_and_delete_failures_name_their_reason(store, monkeypatch):
    store.save("s", make_checkpoint(seed=1))
    monkeypatch.setattr(os, "preadv", _failing(os.preadv, errno.EIO, when=_of(".mxseg")))
    with pytest.raises(CheckpointReadError, match="I/O error") as info:
        store.load("s")
    assert info.value.reason == "io_error"
    monkeypatch.undo()
    segment = lambda path, flags, *a, **k: str(path).endswith(".mxseg")  # noqa: E731
    monkeypatch.setattr(os, "open", _failing(os.open, errno.EACCES, when=segment))
    with pytest.raises(CheckpointReadError, match="permission denied"):
        store.load("s")
    monkeypatch.undo()
    monkeypatch.setattr(os, "unlink", _failing(os.unlink, errno.EROFS))
    with pytest.raises(CheckpointWriteError, match="cannot delete session 's'.*read-only file system") as info:
        store.delete("s")
    assert info.value.reason == "read_only"
    monkeypatch.undo()
    assert_same(make_checkpoint(seed=1), store.load("s"))


@pytest.mark.parametrize(
    "call, err",
    [("open", errno.EACCES), ("open", errno.EIO), ("preadv", errno.EIO), ("fstat", errno.EIO)],
)
async def test_a_manifest_the_system_cannot_read_is_unavailable_not_damaged(store, monkeypatch, call, err):
    # The session's files may be whole: the error must not read as a damaged checkpoint (which
    # tells a user to delete it), and a save must not replace a manifest it could not read.
    store.save("s", make_checkpoint(seed=1))
    if call == "open":
        when = lambda path, flags, *a, **k: str(path).endswith(".mxckpt") and not flags & os.O_CREAT  # noqa: E731
    else:
        when = _of(".mxckpt")
    monkeypatch.setattr(os, call, _failing(getattr(os, call), err, when=when))
    for operation in (store.info, store.load, store.verify, store.begin_resume, store.files_of):
        with pytest.raises(StoreUnavailable, match=f"{errno.errorcode[err]}.*not known to be damaged"):
            operation("s")
    with pytest.raises(StoreUnavailable):
        store.save("s", make_checkpoint(seed=2))
    monkeypatch.undo()
    assert_same(make_checkpoint(seed=1), store.load("s"))
    assert leftovers(store) == []


async def test_a_store_directory_that_cannot_be_created_names_the_reason(tmp_path, model_files, monkeypatch):
    monkeypatch.setattr(os, "mkdir", _failing(os.mkdir, errno.EROFS))
    with pytest.raises(CheckpointWriteError, match="cannot create the store directory.*read-only") as info:
        await SessionStore.create(tmp_path / "new", model_files=model_files, configuration=CONFIG)
    assert info.value.reason == "read_only"


# Real failures. Tests run as root here, where chmod does not deny anything, so these use what does
# bind root: a small tmpfs (full, then remounted read-only), the immutable attribute, RLIMIT_FSIZE.


@pytest.fixture
def small_tmpfs(tmp_path):
    with tmpfs(tmp_path / "small", "256k") as mount_point:
        yield mount_point


async def test_a_full_disk_then_a_read_only_file_system_keep_the_previous_file(small_tmpfs, model_files):
    store = await SessionStore.create(small_tmpfs / "sessions", model_files=model_files, configuration=CONFIG)
    store.save("s", make_checkpoint(seed=1))
    too_big = make_checkpoint(20_000, seed=2)  # about 1.3 MB on a 256 KiB file system
    with pytest.raises(CheckpointWriteError, match="disk full") as info:
        store.save("s", too_big)
    assert info.value.reason == "disk_full"
    assert_same(make_checkpoint(seed=1), store.load("s"))
    # Blocks the failed save stored stay until clean() (another save may already name them).
    assert all(name.endswith(".mxblk") for name in leftovers(store))
    store.clean()
    assert leftovers(store) == []
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    try:
        with pytest.raises(CheckpointWriteError, match="read-only file system") as info:
            store.save("s", make_checkpoint(seed=3))
        assert info.value.reason == "read_only"
        with pytest.raises(CheckpointWriteError, match="read-only file system"):
            store.delete("s")
        assert_same(make_checkpoint(seed=1), store.load("s"))
        assert store.list() == ["s"]
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_tmpfs)], check=True)


async def test_an_immutable_store_directory_is_permission_denied_and_keeps_the_previous_file(store):
    store.save("s", make_checkpoint(seed=1))
    done = subprocess.run(["chattr", "+i", str(store.path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"chattr +i is unavailable here: {done.stderr.strip()}")
    try:
        with pytest.raises(CheckpointWriteError, match="permission denied") as info:
            store.save("s", make_checkpoint(seed=2))
        assert info.value.reason == "permission_denied"
        with pytest.raises(CheckpointWriteError, match="permission denied"):
            store.delete("s")
        assert_same(make_checkpoint(seed=1), store.load("s"))
    finally:
        subprocess.run(["chattr", "-i", str(store.path)], check=True)
    assert leftovers(store) == []


async def test_the_file_size_limit_is_file_too_large_and_keeps_the_previous_file(store):
    store.save("s", make_checkpoint(seed=1))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.raises(CheckpointWriteError, match="file too large") as info:
            store.save("s", make_checkpoint(20_000, seed=2))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert info.value.reason == "file_too_large"
    assert_same(make_checkpoint(seed=1), store.load("s"))
    assert leftovers(store) == []
