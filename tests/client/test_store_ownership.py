"""One owner per session's durable state (issue 40): every save is conditional on the manifest this
process last published or resumed for the session, on every backend, so a save over another
writer's fails with SaveConflict and leaves the other writer's save whole; and a directory store is
held by one server at a time through an owner lock that dies with its holder.

Two store objects on one directory, memory store or S3 bucket (moto's, two clients) stand for two
servers; the saves are the store's own begin_save / commit_save, with the segment a worker would
write made from a host checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
from test_store import CONFIG
from test_store import make_checkpoint as checkpoint

from muxworker.client.stores import ObjectSessionStore, SaveConflict, SessionStore, StoreBusy, open_store
from muxworker.client.stores.binding import OWNER_LOCK
from muxworker.transport.checkpoint import CheckpointNotFound, CPUCheckpoint
from muxworker.transport.checkpoint.file import write_checkpoint_segment


def owned_save(store, sid: str, ckpt: CPUCheckpoint) -> None:
    """A save as a worker's goes (begin_save, the segment, commit_save): conditional on what this
    store object last published or resumed of ``sid``."""
    ckpt = store.checked_for_save(ckpt)
    plan = store.begin_save(sid)
    plan.base = None
    try:
        written = write_checkpoint_segment(plan.fd, sid, store.identity, ckpt)
    except BaseException:
        store.abort_save(plan)
        raise
    store.commit_save(plan, written)


def resume(store, sid: str) -> None:
    """What a resume into a worker records (client/sessions.py): the version the worker holds."""
    plan = store.begin_resume(sid)
    plan.close()
    store.adopt(sid, plan.version)


@pytest.fixture
async def two_writers(store_url, model_files):
    """Two store objects on one store (a directory, obstore's memory store, a prefix of moto's
    S3 reached by two clients): two servers' views of it."""
    first = await open_store(store_url, model_files=model_files, configuration=CONFIG)
    if store_url.startswith("memory:"):  # one memory store, two writers
        return [first, ObjectSessionStore(first.store, url=store_url, identity=first.identity, inputs=first.inputs)]
    return [first, await open_store(store_url, model_files=model_files, configuration=CONFIG)]


async def test_a_save_over_another_writers_save_conflicts_and_keeps_it_whole(two_writers):
    a, b = two_writers
    owned_save(a, "s", checkpoint(8, seed=1))  # A created it
    with pytest.raises(SaveConflict, match="did not resume"):
        owned_save(b, "s", checkpoint(4, seed=2))  # B never resumed it: creating it again conflicts
    assert b.take_conflict("s") is not None and b.take_conflict("s") is None  # told once
    assert a.load("s").position == 8
    owned_save(a, "s", checkpoint(9, seed=3))  # A still owns it
    resume(b, "s")
    owned_save(b, "s", checkpoint(12, seed=4))  # B resumed A's save: B's is the newer one
    with pytest.raises(SaveConflict, match="another writer saved it"):
        owned_save(a, "s", checkpoint(10, seed=5))  # A's copy is stale: refused, nothing published
    assert a.load("s").position == 12 and b.load("s").position == 12
    with pytest.raises(SaveConflict):
        owned_save(a, "s", checkpoint(10, seed=5))  # still not A's until A resumes it
    resume(a, "s")
    owned_save(a, "s", checkpoint(13, seed=6))
    assert b.load("s").position == 13


async def test_a_save_conflicts_when_another_writer_commits_between_its_begin_and_its_commit(two_writers):
    a, b = two_writers
    owned_save(a, "s", checkpoint(8, seed=1))
    resume(b, "s")
    plan = a.begin_save("s")  # A's copy is current here
    plan.base = None
    written = write_checkpoint_segment(plan.fd, "s", a.identity, a.checked_for_save(checkpoint(9, seed=2)))
    owned_save(b, "s", checkpoint(11, seed=3))  # B commits first
    with pytest.raises(SaveConflict):
        a.commit_save(plan, written)
    assert a.load("s").position == 11  # B's save, whole


async def test_a_session_deleted_by_another_writer_conflicts_and_a_delete_frees_it(two_writers):
    a, b = two_writers
    owned_save(a, "s", checkpoint(8, seed=1))
    assert b.delete("s")
    with pytest.raises(SaveConflict, match="deleted it"):
        owned_save(a, "s", checkpoint(9, seed=2))
    with pytest.raises(CheckpointNotFound):
        a.load("s")
    owned_save(b, "s", checkpoint(5, seed=3))  # B found nothing: a new session of B's
    assert a.delete("s")
    owned_save(a, "s", checkpoint(6, seed=4))  # A's own delete: a new session of A's
    assert b.load("s").position == 6


async def test_a_host_checkpoint_save_replaces_what_the_store_holds(two_writers):
    a, b = two_writers
    owned_save(a, "s", checkpoint(8, seed=1))
    b.save("s", checkpoint(3, seed=2))  # an explicit replace (save()), as migrate writes
    assert a.load("s").position == 3
    owned_save(b, "s", checkpoint(4, seed=3))  # B published it, so B owns it
    with pytest.raises(SaveConflict):
        owned_save(a, "s", checkpoint(9, seed=4))


# -- the directory store's owner lock -----------------------------------------------------------


def _record(path) -> list[dict]:
    return [json.loads(line) for line in (path / OWNER_LOCK).read_text().splitlines()]


async def test_an_exclusive_holder_keeps_every_other_out_and_is_named(tmp_path, model_files):
    path = tmp_path / "store"
    first = await open_store(path, model_files=model_files, configuration=CONFIG, hold="exclusive", role="server A")
    (holder,) = _record(path)
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and holder["started"]
    for mode in ("exclusive", "shared"):
        with pytest.raises(StoreBusy, match=f"pid {os.getpid()} on .*server A"):
            await open_store(path, model_files=model_files, configuration=CONFIG, hold=mode)
    assert isinstance(first, SessionStore)
    first.release()
    second = await open_store(path, model_files=model_files, configuration=CONFIG, hold="exclusive", role="B")
    assert [h["role"] for h in _record(path)] == ["B"]
    second.release()


async def test_shared_holders_write_beside_each_other_but_not_beside_an_exclusive_one(tmp_path, model_files):
    path = tmp_path / "store"
    kw = dict(model_files=model_files, configuration=CONFIG)
    one = await open_store(path, **kw, hold="shared", role="chat")
    two = await open_store(path, **kw, hold="shared", role="sessions")
    assert sorted(h["role"] for h in _record(path)) == ["chat", "sessions"]
    with pytest.raises(StoreBusy, match="shared writers.*--shared-store"):
        await open_store(path, **kw, hold="exclusive")
    one.release()
    two.release()
    (await open_store(path, **kw, hold="exclusive")).release()


def test_the_lock_of_a_killed_holder_is_taken_over_and_its_record_rewritten(tmp_path):
    path = tmp_path / "store"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from pathlib import Path
                from muxworker.client.stores.directory import hold_store, prepare_directory
                prepare_directory(Path({str(path)!r}))
                hold_store(Path({str(path)!r}), shared=False, role="doomed")
                print("held", flush=True)
                time.sleep(600)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        from muxworker.client.stores.directory import hold_store

        with pytest.raises(StoreBusy, match=f"pid {holder.pid} .*doomed"):
            hold_store(path, shared=False, role="next")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    fd = hold_store(path, shared=False, role="next")  # the kernel released the dead holder's lock
    try:
        assert [(h["pid"], h["role"]) for h in _record(path)] == [(os.getpid(), "next")]
    finally:
        os.close(fd)
