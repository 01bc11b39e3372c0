"""Saving sessions into segment files and restoring them, in the engine (worker/engine/checkpoint_files.py).

A restored session must hold exactly the rows the saved one held (compared byte for byte through
export_checkpoint), continue exactly as the never-saved session does, and an incremental save must
write only the new positions. The tiny Mistral has a window of 16, so its rings wrap; the tiny
Llama has only full layers. Both backends: torch reads and writes its cache in place, MLX through
host copies (and torch too in "torch-host-copies", as on a GPU). Every job's write or read runs on
another thread, as on the worker's I/O thread, and while one is blocked there the engine keeps
decoding other sessions.
"""

from __future__ import annotations

import functools
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from helpers.engine import greedy, prompt_ids, run

from muxworker.transport.checkpoint.segments import SegmentRef
from muxworker.transport.errors import (
    CapacityExhausted,
    CheckpointCorrupt,
    CheckpointRejected,
    CheckpointTooLarge,
    CheckpointWriteError,
    SessionBusy,
    SessionNotFound,
    Unsaveable,
)
from muxworker.transport.messages import SaveBase
from muxworker.worker.backends.torch.executor import TorchExecutor
from muxworker.worker.build import load_engine
from muxworker.worker.engine.config import EngineConfig

IDENTITY = "test-identity"
BIG = 1 << 40
HANG_GUARD_S = 60.0


def on_io_thread(work):
    """Run ``work`` on another thread, as the worker's I/O thread does; return what it raised."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(work).exception()


def save_file(engine, sid, fd, *, tag, base=None):
    job = engine.begin_save(sid, fd, tag=tag, base=base, identity=IDENTITY, max_bytes=BIG)
    return engine.finish_save(job, on_io_thread(job.write)).to_wire()


@pytest.fixture(params=["torch", "torch-host-copies", "mlx"])
def backend(request, monkeypatch):
    if request.param == "mlx":
        pytest.importorskip("mlx.core")
    if request.param == "torch-host-copies":  # the path of a GPU, which lends no host views: on the CPU
        monkeypatch.setattr(TorchExecutor, "direct_kv_io", property(lambda self: False))
        return "torch"
    return request.param


@pytest.fixture(scope="module", params=["mistral", "llama"])
def model_dir(request, tiny_model_factory):
    return tiny_model_factory(request.param)


def make(model_dir, backend="torch", **cfg):
    cfg.setdefault("max_session_tokens", 512)
    return load_engine(model_dir, EngineConfig(**cfg), dtype="float32", backend=backend, progress=None)


class Store:
    """Segment files in a directory, as the client's store would keep them."""

    def __init__(self, path):
        self.path = path
        self.refs: list[SegmentRef] = []
        self.tag: str | None = None

    def save(self, engine, sid, *, incremental=True):
        self.saved_id = sid
        name = f"{secrets.token_hex(4)}.mxseg"
        fd = os.open(self.path / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        tag = secrets.token_hex(8)
        base = SaveBase(self.tag, self.refs[-1].end) if incremental and self.refs else None
        try:
            out = save_file(engine, sid, fd, tag=tag, base=base)
        finally:
            os.close(fd)
        if out["start"] == out["position"]:
            self.tag = tag
            return out
        ref = SegmentRef(name, out["start"], out["position"], out["file_length"], out["header_crc"])
        self.refs = [*self.refs, ref] if out["start"] else [ref]
        self.tag = tag
        return out

    def restore(self, engine, sid, refs=None, **kw):
        refs = self.refs if refs is None else refs
        fds = [os.open(self.path / r.name, os.O_RDONLY) for r in refs]
        try:
            job = self.begin_restore(engine, sid, fds, refs, **kw)
            return engine.finish_restore(job, on_io_thread(job.read))
        finally:
            for fd in fds:
                os.close(fd)

    def begin_restore(self, engine, sid, fds, refs, **kw):
        return engine.begin_restore(
            sid,
            fds,
            refs,
            tag=self.tag,
            identity=kw.get("identity", IDENTITY),
            max_bytes=kw.get("max_bytes", BIG),
            saved_id=self.saved_id,
        )


def saved_session(model_dir, tmp_path, seed, n=30):
    """An engine with session "s" after one turn on ``n`` prompt tokens, saved to a new Store."""
    live = make(model_dir)
    live.open_session("s")
    store = Store(tmp_path)
    history = prompt_ids(n, seed=seed)
    history += turn(live, "s", history)
    store.save(live, "s")
    return live, store, history


def turn(engine, sid, prompt, n=6, rid=[0]):  # noqa: B006 - a counter shared by every call
    rid[0] += 1
    engine.submit(rid[0], sid, prompt, greedy(n))
    result = run(engine)[rid[0]][1]
    return result["generated_token_ids"]


def assert_same_state(a, sid_a, b, sid_b):
    """Both sessions hold the same history and byte-identical KV rows."""
    x, y = a.export_checkpoint(sid_a), b.export_checkpoint(sid_b)
    assert x.token_ids.tolist() == y.token_ids.tolist()
    for la, lb in zip(x.layers, y.layers):
        assert la.start == lb.start
        assert np.array_equal(la.keys, lb.keys) and np.array_equal(la.values, lb.values)


def test_full_and_incremental_saves_restore_exactly(model_dir, backend, tmp_path):
    live = make(model_dir, backend)
    live.open_session("s")
    store = Store(tmp_path)
    history = prompt_ids(40, seed=1)
    history += turn(live, "s", history)
    first = store.save(live, "s")
    assert first["start"] == 0 and first["position"] == len(history) - 1
    history += prompt_ids(12, seed=2)
    history += turn(live, "s", history)
    second = store.save(live, "s")
    # Only the new positions: from where the first save ended.
    assert second["start"] == first["position"]
    # 18 new positions: a full-attention layer writes 18 of its 63 rows, a ring layer of window 16
    # at most its window (it held 16 after the first save too).
    rings = any(w is not None for w in live.geometry()["windows"])
    assert (
        second["payload_bytes"] <= first["payload_bytes"]
        if rings
        else second["payload_bytes"] < first["payload_bytes"] / 2
    )
    assert len(store.refs) == 2
    again = store.save(live, "s")  # nothing new: nothing written
    assert again["payload_bytes"] == 0 and len(store.refs) == 2

    other = make(model_dir, backend)
    position = store.restore(other, "r")
    assert position == len(history) - 1
    assert_same_state(live, "s", other, "r")
    nxt = history + prompt_ids(5, seed=3)
    assert turn(other, "r", nxt) == turn(live, "s", nxt)


def test_restored_session_saves_incrementally_on_its_restored_tag(model_dir, tmp_path):
    live, store, history = saved_session(model_dir, tmp_path, seed=4)
    other = make(model_dir)  # as after a restart: the same session id in a new worker
    store.restore(other, "s")
    history += prompt_ids(8, seed=5)
    history += turn(other, "s", history)
    out = store.save(other, "s")
    assert out["start"] > 0  # the restored rows are in the store already
    third = make(model_dir)
    store.restore(third, "s")
    assert_same_state(other, "s", third, "s")


def test_a_session_restored_from_files_enters_the_prefix_cache_only_after_a_request(model_dir, tmp_path):
    live, store, history = saved_session(model_dir, tmp_path, seed=9)
    other = make(model_dir, prefix_cache_entries=1)
    store.restore(other, "r")
    other.close_session("r")  # no request named its prefix-cache namespace since the restore
    assert len(other.prefix_cache) == 0
    store.restore(other, "r")
    history += prompt_ids(3, seed=10)
    history += turn(other, "r", history, n=1)
    other.close_session("r")
    assert other.prefix_cache.entries() == [history[:-1]]


def test_a_cut_history_or_another_base_saves_in_full(model_dir, tmp_path):
    live, store, history = saved_session(model_dir, tmp_path, seed=6)
    # A new prompt that diverges at position 10 cuts the history below the saved rows.
    turn(live, "s", history[:10] + prompt_ids(25, seed=7))
    assert store.save(live, "s")["start"] == 0
    # A base the session does not hold (another save's tag) also gets a full save.
    store.tag = "someone-else"
    turn(live, "s", live.session_tokens("s") + prompt_ids(3, seed=8))
    assert store.save(live, "s")["start"] == 0
    other = make(model_dir)
    store.restore(other, "r")
    assert_same_state(live, "s", other, "r")


def test_a_base_below_the_saved_rows_and_a_block_crossing_save_start_where_the_store_says(model_dir, tmp_path):
    # The store's save holds rows [0, 40): a base at position 16 of it writes from 16. A store
    # saving blocks of 32 gets rows from its last block's end (block_start) when the new rows
    # cross a block boundary, and from base.position when they stay inside one block.
    live = make(model_dir)
    live.open_session("s")
    history = prompt_ids(41, seed=11)
    turn(live, "s", history, n=1)
    fd = os.memfd_create("seg")
    try:
        first = save_file(live, "s", fd, tag="t1")
    finally:
        os.close(fd)
    assert (first["start"], first["position"]) == (0, 41)

    def save(tag, base):
        fd = os.memfd_create("seg")
        try:
            return save_file(live, "s", fd, tag=tag, base=base)
        finally:
            os.close(fd)

    assert save("t2", SaveBase("t1", 16))["start"] == 16  # a position the save holds rows up to
    history = live.session_tokens("s") + prompt_ids(10, seed=12)
    turn(live, "s", history, n=1)  # to position 52: still inside the block [32, 64)
    assert save("t3", SaveBase("t2", 41, block_start=32, block_tokens=32))["start"] == 41
    history = live.session_tokens("s") + prompt_ids(20, seed=13)
    turn(live, "s", history, n=1)  # past 64: completes the block [32, 64)
    assert save("t4", SaveBase("t3", 51, block_start=32, block_tokens=32))["start"] == 32
    # A base beyond what the slot holds for that tag, or another tag, is a full save.
    assert save("t5", SaveBase("t4", 10_000))["start"] == 0
    assert save("t6", SaveBase("t1", 8))["start"] == 0


def test_damaged_or_foreign_segments_are_refused_and_publish_nothing(model_dir, tmp_path):
    live, store, history = saved_session(model_dir, tmp_path, seed=9)
    other = make(model_dir, max_sessions=1)
    path = tmp_path / store.refs[0].name
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40  # a byte of the last payload (the last layer's values)
    path.write_bytes(data)
    with pytest.raises(CheckpointCorrupt, match="checksum"):
        store.restore(other, "r")
    with pytest.raises(SessionNotFound):
        other.session_tokens("r")
    data[-100] ^= 0x40
    path.write_bytes(data)
    with pytest.raises(CheckpointCorrupt):  # the header checksum the manifest recorded differs
        store.restore(other, "r", refs=[SegmentRef(path.name, 0, store.refs[0].end, len(data), 1)])
    with pytest.raises(Exception, match="identity"):
        store.restore(other, "r", identity="another-model")
    with pytest.raises(CheckpointTooLarge):
        store.restore(other, "r", max_bytes=1000)
    # The one slot is still free and the session restores once the file is right.
    store.restore(other, "r")
    assert_same_state(live, "s", other, "r")


def test_non_finite_rows_are_refused_and_the_slot_is_zeroed(tmp_path, tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    live = make(model_dir)
    live.open_session("s")
    history = prompt_ids(20, seed=10)
    turn(live, "s", history)
    # Poison one row of the live cache, save it (the file's CRCs are then right), restore it.
    layer = live.executor.cache.layers[0]
    slot = live._session("s").slot
    layer.k[slot, 0, 3, 0] = float("nan")
    store = Store(tmp_path)
    store.save(live, "s")
    other = make(model_dir, max_sessions=1)
    with pytest.raises(CheckpointRejected, match="NaN or infinite"):
        store.restore(other, "r")
    for cache in other.executor.cache.layers:
        assert not cache.k.isnan().any() and not cache.k.any()


def test_busy_empty_and_draft_sessions_are_unsaveable(tmp_path, tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    engine = make(model_dir)
    engine.open_session("s")
    with pytest.raises(Unsaveable, match="empty"):
        Store(tmp_path).save(engine, "s")
    engine.submit(99, "s", prompt_ids(10), greedy(4))
    with pytest.raises(Unsaveable, match="busy"):
        Store(tmp_path).save(engine, "s")
    run(engine)


class Gate:
    """Stands in for an os call (``os.writev``, ``os.preadv``): records the threads that call it and
    holds every call until :attr:`opened` is set, then makes the real call."""

    def __init__(self, real):
        self.real = real
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.threads: set[int] = set()

    def __call__(self, *args):
        self.threads.add(threading.get_ident())
        self.entered.set()
        if not self.opened.wait(HANG_GUARD_S):
            raise TimeoutError("the test never opened the gate")
        return self.real(*args)


def decode(engine, rid, n):
    """Step until request ``rid`` has produced ``n`` more tokens; return them."""
    tokens: list[int] = []
    while len(tokens) < n:
        assert engine.has_work(), f"request {rid} ended after {len(tokens)} tokens"
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.token_ids
    return tokens


def test_a_save_is_written_on_another_thread_while_other_sessions_decode(tmp_path, tiny_model_factory, monkeypatch):
    model_dir = tiny_model_factory("llama")
    engine = make(model_dir)
    engine.open_session("s")
    history = prompt_ids(60, seed=20)
    history += turn(engine, "s", history)
    engine.open_session("b")
    engine.submit(500, "b", prompt_ids(8, seed=21), greedy(40))
    decode(engine, 500, 2)
    gate = Gate(os.writev)
    monkeypatch.setattr(os, "writev", gate)
    fd = os.open(tmp_path / "seg.mxseg", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    job = engine.begin_save("s", fd, tag="t1", base=None, identity=IDENTITY, max_bytes=BIG)
    with ThreadPoolExecutor(1) as pool:
        written = pool.submit(job.write)
        assert gate.entered.wait(HANG_GUARD_S)  # the writer holds views of the slot; no byte is written
        streamed = decode(engine, 500, 10)  # the other session decodes meanwhile
        # A call on the session being saved is refused at once: the client's per-session order
        # (SessionRuntime's leases) never sends one before the save's reply.
        with pytest.raises(SessionBusy, match="being saved"):
            engine.submit(501, "s", history, greedy(2))
        for call in (engine.close_session, engine.reset_session, engine.export_checkpoint):
            with pytest.raises(SessionBusy, match="being saved"):
                call("s")
        with pytest.raises(SessionBusy, match="being saved"):
            engine.begin_save("s", fd, tag="t2", base=None, identity=IDENTITY, max_bytes=BIG)
        assert engine.session_tokens("s") == history  # reading the history is fine
        assert not written.done()
        gate.opened.set()
        error = written.exception()
    monkeypatch.undo()
    out = engine.finish_save(job, error).to_wire()
    os.close(fd)
    assert gate.threads and threading.get_ident() not in gate.threads
    assert len(streamed) == 10
    run(engine)
    # The rows written after those 10 steps are exactly the session's: they restore bit for bit.
    store = Store(tmp_path)
    store.refs = [SegmentRef("seg.mxseg", 0, out["position"], out["file_length"], out["header_crc"])]
    store.tag, store.saved_id = "t1", "s"
    other = make(model_dir)
    assert store.restore(other, "r") == out["position"] == len(history) - 1
    assert_same_state(engine, "s", other, "r")
    # Idle again: it generates, and its next save builds on this one.
    history += prompt_ids(4, seed=22)
    history += turn(engine, "s", history)
    assert store.save(engine, "s")["start"] == out["position"]


def test_a_failed_write_raises_its_error_and_leaves_the_session_idle_with_its_durable_base(
    tmp_path, tiny_model_factory
):
    model_dir = tiny_model_factory("llama")
    engine = make(model_dir)
    engine.open_session("s")
    store = Store(tmp_path)
    history = prompt_ids(30, seed=23)
    history += turn(engine, "s", history)
    first = store.save(engine, "s")
    history += prompt_ids(5, seed=24)
    history += turn(engine, "s", history)
    full = os.open("/dev/full", os.O_WRONLY)  # every write fails with ENOSPC
    try:
        job = engine.begin_save(
            "s", full, tag="lost", base=SaveBase(store.tag, first["position"]), identity=IDENTITY, max_bytes=BIG
        )
        assert job.start == first["position"]
        with pytest.raises(CheckpointWriteError, match="disk full") as failed:
            engine.finish_save(job, on_io_thread(job.write))
    finally:
        os.close(full)
    assert failed.value.reason == "disk_full"
    # Idle again, and its durable base is still the first save's: the next save appends to that.
    assert store.save(engine, "s")["start"] == first["position"]
    other = make(model_dir)
    store.restore(other, "r")
    assert_same_state(engine, "s", other, "r")


def test_a_restore_reads_into_a_reserved_slot_on_another_thread_while_other_sessions_decode(
    tmp_path, tiny_model_factory, monkeypatch
):
    model_dir = tiny_model_factory("llama")
    live, store, history = saved_session(model_dir, tmp_path, seed=25)
    other = make(model_dir, max_sessions=2)
    other.open_session("b")
    other.submit(600, "b", prompt_ids(8, seed=26), greedy(40))
    decode(other, 600, 2)
    gate = Gate(os.preadv)
    monkeypatch.setattr(os, "preadv", gate)
    fds = [os.open(tmp_path / r.name, os.O_RDONLY) for r in store.refs]
    job = store.begin_restore(other, "r", fds, store.refs)
    with ThreadPoolExecutor(1) as pool:
        read = pool.submit(job.read)
        assert gate.entered.wait(HANG_GUARD_S)
        assert len(decode(other, 600, 10)) == 10
        assert other.session_ids() == ["b"]  # published only once every row is read and checked
        with pytest.raises(SessionBusy, match="being restored"):
            other.open_session("r")
        with pytest.raises(SessionBusy, match="being restored"):
            other.submit(601, "r", history, greedy(2))
        with pytest.raises(CapacityExhausted):  # its slot is reserved
            other.open_session("x")
        gate.opened.set()
        error = read.exception()
    monkeypatch.undo()
    position = other.finish_restore(job, error)
    for fd in fds:
        os.close(fd)
    assert gate.threads and threading.get_ident() not in gate.threads
    assert position == len(history) - 1
    run(other)
    assert_same_state(live, "s", other, "r")


def test_a_paced_save_and_restore_move_the_same_bytes(tmp_path, tiny_model_factory):
    # The worker's I/O thread passes a pace (server.py) that pauses between slices while the engine
    # steps: the files and the restored rows are the same as without one.
    model_dir = tiny_model_factory("llama")
    engine = make(model_dir, max_session_tokens=1024)
    engine.open_session("s")
    turn(engine, "s", prompt_ids(600, seed=27), n=1)
    paces: list[int] = []
    files = []
    for paced in (False, True):
        fd = os.memfd_create("seg")
        job = engine.begin_save("s", fd, tag="t1", base=None, identity=IDENTITY, max_bytes=BIG)
        write = functools.partial(job.write, lambda: paces.append(1)) if paced else job.write
        engine.finish_save(job, on_io_thread(write))
        files.append(os.pread(fd, 1 << 30, 0))
        os.close(fd)
    assert files[0] == files[1] and len(paces) > len(files[0]) // (256 * 1024)
    (tmp_path / "seg.mxseg").write_bytes(files[1])
    out = job.reply().to_wire()
    store = Store(tmp_path)
    store.refs = [SegmentRef("seg.mxseg", 0, out["position"], out["file_length"], out["header_crc"])]
    store.tag, store.saved_id = "t1", "s"
    other = make(model_dir, max_session_tokens=1024)
    fd = os.open(tmp_path / "seg.mxseg", os.O_RDONLY)
    restore = store.begin_restore(other, "r", [fd], store.refs)
    paces.clear()
    other.finish_restore(restore, on_io_thread(functools.partial(restore.read, lambda: paces.append(1))))
    os.close(fd)
    assert len(paces) > len(files[1]) // (256 * 1024)
    assert_same_state(engine, "s", other, "r")
