"""The session store's content-addressed blocks and its collector, on every backend (a directory,
obstore's in-memory store, and real S3 on 127.0.0.1: moto's server, started by a fixture of
conftest.py); and a real worker saving in blocks through the file channel.

What is checked: sessions sharing a prefix store its blocks once, and a worker's sessions served
from one prompt name the same blocks and resume exactly; clean() deletes only what no manifest
may name (one it cannot read protects its session's segments and every block), also beside
concurrent saves; blocks are shared within a namespace only, unless the store opts in.
test_object_store.py has the store's other behaviour.
"""

from __future__ import annotations

import os
import struct
import time

import pytest
import trio
from helpers.params import greedy

from muxworker.client import (
    CheckpointCorrupt,
    SessionStore,
    open_store,
    spawn_multiplexed_worker,
)
from muxworker.client.stores import StoreUnavailable, session_hash
from muxworker.native import crc32c
from muxworker.transport.checkpoint import CheckpointIncompatible

obstore = pytest.importorskip("obstore")
from test_object_store import HANG_GUARD_S, _open  # noqa: E402
from test_store import assert_same, make_checkpoint  # noqa: E402

# -- content-addressed blocks, on every backend ---------------------------------------------------


def _stored(store) -> dict[str, int]:
    """Every file or object in the store and its size (lock files aside)."""
    if isinstance(store, SessionStore):
        return {n: os.path.getsize(store.path / n) for n in os.listdir(store.path) if not n.startswith(".muxworker")}
    return {m["path"]: m["size"] for batch in obstore.list(store.store) for m in batch}


def _blocks(store) -> set[str]:
    return {n for n in _stored(store) if n.endswith(".mxblk")}


def _manifest(store, sid):
    if isinstance(store, SessionStore):
        return store._manifest(store._open_dir(), sid)
    return store._manifest(sid)[0]


def _named(store, *sids) -> set[str]:
    """The blocks the saved sessions ``sids`` name."""
    return {r.name for sid in sids for r in _manifest(store, sid).segments if r.shared}


def _keys(store) -> set[str]:
    return _keys_of(_blocks(store))


def _keys_of(names) -> set[str]:
    return {n[:64] for n in names}


async def _open_fast(url, model_files, refresh=0.3, **kw):
    """A store whose collector may take unnamed blocks after 2 x ``refresh`` + 1 s (S3's
    Last-Modified is in whole seconds), on object storage; the local store needs no wait."""
    if "://" in url:
        kw["block_refresh"] = refresh
    kw.setdefault("block_tokens", 256)
    return await _open(url, model_files, **kw)


async def _aged(store) -> None:
    """Wait until what the store holds may be collected."""
    if not isinstance(store, SessionStore):
        await trio.sleep(2 * store.block_refresh + 1.1)


def sharing(position: int, shared: int, *, seed: int, base_seed: int = 100):
    """A checkpoint whose first ``shared`` positions (tokens and rows) are those of every other
    checkpoint made with the same ``base_seed``."""
    a, b = make_checkpoint(1024, seed=base_seed), make_checkpoint(position, seed=seed)
    tokens = b.token_ids.copy()
    tokens[:shared] = a.token_ids[:shared]
    layers = []
    for la, lb in zip(a.layers, b.layers):
        keys, values = lb.keys.copy(), lb.values.copy()
        keys[:shared], values[:shared] = la.keys[:shared], la.values[:shared]
        layers.append(type(lb)(0, keys, values))
    return type(b)(format=b.format, geometry=b.geometry, position=position, token_ids=tokens, layers=layers)


async def test_sessions_sharing_a_prefix_store_its_blocks_once_and_clean_keeps_named_ones(store_url, model_files):
    store = await _open_fast(store_url, model_files)
    one, two = sharing(600, 520, seed=1), sharing(700, 520, seed=2)
    for sid, ckpt in (("one", one), ("two", two)):
        await trio.to_thread.run_sync(store.save, sid, ckpt)
    # [0, 256) and [256, 512) are stored once: rows 512.. differ. (An object store dates its
    # copies in steps of block_refresh, here 0.4 s: a slow S3 may hold two copies of one key.)
    assert len(_keys(store)) == 2 and len(_blocks(store)) <= 4
    if not store_url.startswith("s3"):
        assert len(_blocks(store)) == 2
    for sid, ckpt in (("one", one), ("two", two)):
        assert_same(await trio.to_thread.run_sync(store.load, sid), ckpt)
        assert (await trio.to_thread.run_sync(store.info, sid)).segments == 3  # two blocks and a tail
    # A longer version of "one" with the same rows: only its new block [512, 768) is stored.
    longer = sharing(900, 520, seed=1)
    for a, b in zip(longer.layers, one.layers):
        a.keys[:600], a.values[:600] = b.keys, b.values
    longer.token_ids[:600] = one.token_ids
    before = _blocks(store)
    await trio.to_thread.run_sync(store.save, "one", longer)
    added = _blocks(store) - before
    assert before < _blocks(store) and len({n[:64] for n in added} - _keys_of(before)) == 1
    assert_same(await trio.to_thread.run_sync(store.load, "one"), longer)
    # Deleting a session leaves the blocks another names; clean removes only unnamed ones.
    await _aged(store)
    assert await trio.to_thread.run_sync(store.delete, "one")
    removed, _ = await trio.to_thread.run_sync(lambda: store.clean(older_than=0))
    assert added <= {n for n in removed if n.endswith(".mxblk")}
    assert _blocks(store) == _named(store, "two") and _keys(store) == _keys_of(before)
    assert_same(await trio.to_thread.run_sync(store.load, "two"), two)
    assert await trio.to_thread.run_sync(store.delete, "two")
    await _aged(store)
    await trio.to_thread.run_sync(lambda: store.clean(older_than=0))
    assert _blocks(store) == set() and _stored(store) == {}


async def test_a_collector_beside_concurrent_saves_never_takes_a_named_block(store_url, model_files):
    # Writers save and delete sessions that share prefixes (so they name blocks others stored,
    # and blocks go unnamed), while a collector runs clean() in a loop with the shortest ages it
    # allows. Every save that returned must load, bit for bit, until it is replaced.
    import random
    import threading

    from muxworker.client.stores import StoreBusy

    store = await _open_fast(store_url, model_files, refresh=1.0)  # a writer publishes within 0.5 s
    stop = threading.Event()
    saved: dict[str, object] = {}
    locks = [threading.Lock() for _ in range(3)]  # writer k's saves and what it records of them
    errors: list[BaseException] = []
    collected = [0]

    def writer(k: int) -> None:
        rng = random.Random(k)
        try:
            for _ in range(12):
                sid = f"w{k}-{rng.randrange(3)}"
                position = rng.choice((300, 520, 800))
                ckpt = sharing(position, min(position, rng.choice((0, 256, 512))), seed=rng.randrange(4))
                with locks[k]:
                    store.save(sid, ckpt)
                    saved[sid] = ckpt
                if rng.random() < 0.25:
                    with locks[k]:
                        store.delete(sid)
                        saved.pop(sid)
                time.sleep(rng.random() * 0.05)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    # The shortest age that is safe beside writers: 0 for the local store (clean() excludes
    # writers), 2 x block_refresh on object storage (clean()'s docstring).
    age = 0 if isinstance(store, SessionStore) else 2 * store.block_refresh

    def collector() -> None:
        while not stop.is_set():
            try:
                removed, _ = store.clean(older_than=age)
                collected[0] += sum(n.endswith(".mxblk") for n in removed)
            except StoreBusy:
                pass  # the local store collects only while no writer holds it
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return
            time.sleep(0.01)

    def check() -> None:
        for lock in locks:
            lock.acquire()
        try:
            for sid, ckpt in saved.items():
                assert_same(store.load(sid), ckpt)
        finally:
            for lock in locks:
                lock.release()

    with trio.fail_after(HANG_GUARD_S):
        threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
        gc = threading.Thread(target=collector)
        for t in [*threads, gc]:
            t.start()
        for _ in range(5):
            await trio.to_thread.run_sync(check)
            await trio.sleep(0.1)
        for t in threads:
            await trio.to_thread.run_sync(t.join)
        stop.set()
        await trio.to_thread.run_sync(gc.join)
    assert not errors, errors
    await trio.to_thread.run_sync(check)
    assert sorted(saved) == await trio.to_thread.run_sync(store.list)
    # Nothing named went, and what went unnamed is eventually collected.
    await _aged(store)
    await trio.to_thread.run_sync(lambda: store.clean(older_than=0))
    await trio.to_thread.run_sync(check)
    assert _blocks(store) == _named(store, *saved)


@pytest.mark.slow  # a real worker, a killed writer or a stalled server: the end-to-end tier
async def test_a_worker_saves_in_blocks_and_sessions_from_one_prompt_share_them(store_url, tiny_model_factory):
    # Through the file channel: a save that stays inside a block appends a tail segment; one that
    # completes a block is written from the end of the last block, which the store cuts into a
    # new block and a tail. A second session whose prompt the prefix cache served from the first
    # holds the same rows, so it names the same blocks; both resume exactly on another worker.
    from muxworker.client import default_worker_command

    model_dir = tiny_model_factory("llama")
    command = default_worker_command(
        model_dir, dtype="float32", max_sessions=4, max_session_tokens=1024, prefix_cache_entries=2
    )
    files = [model_dir / "model.safetensors", model_dir / "tokenizer.json"]
    config = {"backend": "torch", "dtype": "float32", "max_session_tokens": 1024}
    store = await open_store(store_url, model_files=files, configuration=config, block_tokens=256)
    prompt = [5 + (i * 7) % 90 for i in range(300)]
    with trio.fail_after(HANG_GUARD_S):
        async with spawn_multiplexed_worker(command, session_store=store) as client:
            await client.open_session("a")
            r1 = await client.generate(prompt, greedy("a", 8)).wait()
            s1 = await client.save_session("a")
            assert (s1.start, s1.segments) == (0, 2)  # [0, 256) and a tail
            history = prompt + r1.generated_token_ids + [7] * 10
            r2 = await client.generate(history, greedy("a", 8)).wait()
            s2 = await client.save_session("a")
            assert (s2.start, s2.segments) == (s1.position, 3)  # inside the second block: a new tail only
            history += r2.generated_token_ids + [9 + i % 50 for i in range(200)]
            r3 = await client.generate(history, greedy("a", 8)).wait()
            s3 = await client.save_session("a")
            assert s3.position > 512 and (s3.start, s3.segments) == (256, 3)  # from the last block: 2 blocks, a tail
            history += r3.generated_token_ids
            live_a = await client.generate(history + [11], greedy("a", 10)).wait()

            await client.open_session("b")
            rb = await client.generate(prompt, greedy("b", 8)).wait()
            assert rb.reused_prompt_tokens >= 256
            await client.save_session("b")
            live_b = await client.generate(prompt + rb.generated_token_ids + [12], greedy("b", 10)).wait()
        a, b = _manifest(store, "a").segments[0], _manifest(store, "b").segments[0]
        assert a.shared and a.name[:64] == b.name[:64]  # the same rows: one key
        assert len(_keys(store)) == 2

        async with spawn_multiplexed_worker(command, session_store=store) as client:
            for sid, tail, live in (
                ("a", history + [11], live_a),
                ("b", prompt + rb.generated_token_ids + [12], live_b),
            ):
                await client.resume_session(sid)
                resumed = await client.generate(tail, greedy(sid, 10)).wait()
                assert resumed.reused_prompt_tokens == len(tail) - 2  # the saved position
                assert resumed.generated_token_ids == live.generated_token_ids


# -- a collector deletes only what it can prove unnamed, on every backend --------------------------


def _read_object(store, name: str) -> bytes:
    if isinstance(store, SessionStore):
        return (store.path / name).read_bytes()
    return bytes(obstore.get(store.store, name).bytes())


def _write_object(store, name: str, data: bytes) -> None:
    if isinstance(store, SessionStore):
        (store.path / name).write_bytes(data)
    else:
        obstore.put(store.store, name, data)


def _newer_version(manifest: bytes) -> bytes:
    """``manifest`` as a newer build would write it: file version 4, every checksum valid."""
    data = bytearray(manifest)
    head_end = 16 + struct.unpack_from("<I", data, 12)[0]
    struct.pack_into("<I", data, 8, 4)
    head_crc = crc32c(bytes(data[:head_end]))
    struct.pack_into("<I", data, head_end, head_crc)
    struct.pack_into("<I", data, len(data) - 8, head_crc)  # the trailer repeats it, then its own CRC
    struct.pack_into("<I", data, len(data) - 4, crc32c(bytes(data[-24:-4])))
    return bytes(data)


def _refuse_reads(store, monkeypatch, name: str) -> None:
    """Reads of ``name`` fail as a transient fault would: EACCES on a file, a 403 from a bucket."""
    if isinstance(store, SessionStore):
        real_open = os.open

        def refusing_open(path, flags, *args, **kwargs):
            if os.fspath(path) == name and not flags & os.O_CREAT:
                raise PermissionError(13, "Permission denied (injected)", name)
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refusing_open)
    else:
        real_get = obstore.get

        def refusing_get(target, path, *args, **kwargs):
            if path == name:
                raise obstore.exceptions.PermissionDeniedError(f"403 Forbidden for {path} (injected)")
            return real_get(target, path, *args, **kwargs)

        monkeypatch.setattr(obstore, "get", refusing_get)


@pytest.mark.parametrize("fault", ["refused_read", "newer_version", "flipped_bit"])
async def test_clean_keeps_everything_a_manifest_it_cannot_read_may_name(store_url, model_files, monkeypatch, fault):
    # A manifest clean() cannot read, for whatever reason, may name its session's segments and any
    # block: clean() keeps them all and says so, and once the fault is gone every save loads.
    store = await _open_fast(store_url, model_files)
    victim, keeper = sharing(600, 520, seed=1, base_seed=7), sharing(600, 520, seed=2, base_seed=8)
    for sid, ckpt in (("victim", victim), ("keeper", keeper), ("gone", sharing(300, 300, seed=3, base_seed=9))):
        await trio.to_thread.run_sync(store.save, sid, ckpt)
    assert await trio.to_thread.run_sync(store.delete, "gone")  # its block is named by no one now
    unnamed = _blocks(store) - _named(store, "victim", "keeper")
    assert unnamed
    digest = session_hash("victim")
    manifest = digest + ".mxckpt"
    leftover = f"{digest}.0123456789abcdef.mxseg"  # a killed writer's segment of the victim
    ghost = f"{session_hash('ghost')}.0123456789abcdef.mxseg"  # one of a session never saved
    for name in (leftover, ghost):
        _write_object(store, name, b"x" * 100)
    victims = {manifest, *(r.name for r in _manifest(store, "victim").segments)}
    original = _read_object(store, manifest)
    if fault == "refused_read":
        _refuse_reads(store, monkeypatch, manifest)
        with pytest.raises(StoreUnavailable, match="not known to be damaged|refused"):
            await trio.to_thread.run_sync(store.info, "victim")
    elif fault == "newer_version":
        _write_object(store, manifest, _newer_version(original))
        with pytest.raises(CheckpointIncompatible, match="version 4"):
            await trio.to_thread.run_sync(store.load, "victim")
    else:
        _write_object(store, manifest, original[:40] + bytes([original[40] ^ 0x04]) + original[41:])
        with pytest.raises(CheckpointCorrupt, match="checksum"):
            await trio.to_thread.run_sync(store.load, "victim")
    await _aged(store)

    result = await trio.to_thread.run_sync(lambda: store.clean(older_than=0))
    assert victims <= set(_stored(store)) and leftover in _stored(store) and unnamed <= _blocks(store)
    assert not set(result.removed) & {leftover, *unnamed, *victims}
    assert [name for name, _ in result.unreadable] == [manifest]
    assert {leftover, *unnamed} <= set(result.kept) and ghost not in result.kept
    if isinstance(store, SessionStore):  # an object store takes segments only once older_than/4 old
        assert result.removed == [ghost]

    monkeypatch.undo()
    _write_object(store, manifest, original)
    assert_same(await trio.to_thread.run_sync(store.load, "victim"), victim)
    assert_same(await trio.to_thread.run_sync(store.load, "keeper"), keeper)
    # Once every manifest reads, what no session names goes.
    result = await trio.to_thread.run_sync(lambda: store.clean(older_than=0))
    assert (result.unreadable, result.kept) == ([], [])
    assert unnamed <= set(result.removed) and _blocks(store) == _named(store, "victim", "keeper")
    assert_same(await trio.to_thread.run_sync(store.load, "victim"), victim)


# -- blocks are shared within a namespace (the id's part before its first "/") ---------------------


async def test_blocks_are_shared_within_a_namespace_and_across_only_when_the_store_opts_in(store_url, model_files):
    store = await _open_fast(store_url, model_files)
    sids = ("t1/a", "t1/b", "t2/a", "plain", "other")
    saved = {sid: sharing(600, 520, seed=i) for i, sid in enumerate(sids)}
    for sid, ckpt in saved.items():
        await trio.to_thread.run_sync(store.save, sid, ckpt)
    keys = {sid: _keys_of(_named(store, sid)) for sid in sids}
    assert len(keys["t1/a"]) == 2 and keys["t1/a"] == keys["t1/b"]  # one namespace: shared
    assert not keys["t1/a"] & keys["t2/a"]  # another: its own blocks, so its saves tell nothing
    assert keys["plain"] == keys["other"] and not keys["plain"] & (keys["t1/a"] | keys["t2/a"])
    for sid, ckpt in saved.items():
        assert_same(await trio.to_thread.run_sync(store.load, sid), ckpt)

    # Trusted tenants: one store sharing across namespaces names the blocks that ids without a
    # namespace name (the keys of stores that never had namespaces).
    url = "memory:///" if store_url.startswith("memory:") else store_url + "-shared"
    trusting = await _open_fast(url, model_files, share_blocks_across_namespaces=True)
    for sid in ("t1/a", "t2/a"):
        await trio.to_thread.run_sync(trusting.save, sid, saved[sid])
        assert _keys_of(_named(trusting, sid)) == keys["plain"]
        assert_same(await trio.to_thread.run_sync(trusting.load, sid), saved[sid])
    assert len(_keys(trusting)) == 2
