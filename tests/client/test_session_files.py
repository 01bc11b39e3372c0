"""Sessions saved and resumed through the worker's file channel: a real worker process, real pipes,
a real socket passing real files, a tiny random model (greedy, float32: continuations must match).

What is checked: the worker writes and reads the store's files itself (the hello says it takes
files); a save after a turn writes only the new positions; a resumed session continues exactly as
the never-saved one; a kill -9 at any moment (of the client process that saves, or of the worker
mid-save) leaves the last completed save loadable; damaged or foreign files are refused with the
destination id unused and the worker serving; clean() removes what killed writers left only when
no writer holds the store.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest
import trio

from muxworker.client import (
    CheckpointCorrupt,
    CheckpointNotFound,
    GenerationParams,
    SessionNotFound,
    SessionStore,
    StoreBusy,
    Unsaveable,
    WorkerDiedError,
    default_worker_command,
    spawn_multiplexed_worker,
)

pytestmark = pytest.mark.slow  # real worker processes: the end-to-end tier (make test)

HANG_GUARD_S = 120.0


def greedy(session_id: str, n: int = 8) -> GenerationParams:
    return GenerationParams(session_id=session_id, max_new_tokens=n, temperature=0.0, stop_token_ids=[])


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("mistral")  # sliding-window rings: incremental saves must keep them exact


@pytest.fixture(scope="module")
def worker_command(model_dir):
    return default_worker_command(model_dir, dtype="float32", max_sessions=4, max_session_tokens=512)


async def _store(path, model_dir, **kw) -> SessionStore:
    return await SessionStore.create(
        path,
        model_files=[model_dir / "model.safetensors", model_dir / "tokenizer.json"],
        configuration={"backend": "torch", "dtype": "float32", "max_session_tokens": 512},
        **kw,
    )


def _turn_prompt(i: int) -> list[int]:
    return [3 + (7 * i + 13 * j) % 250 for j in range(9)]


async def _turn(client, sid: str, history: list[int], i: int, n: int = 6) -> list[int]:
    prompt = history + _turn_prompt(i)
    result = await client.generate(prompt, greedy(sid, n)).wait()
    return prompt + result.generated_token_ids


@pytest.mark.parametrize("block_tokens", [0, 256])
async def test_saves_are_incremental_and_resumes_are_exact(worker_command, model_dir, tmp_path, block_tokens):
    # Without blocks the worker writes straight into the store's file; with blocks (none is
    # completed here: 134 positions) through a memory file the store copies. Both append.
    store = await _store(tmp_path / "store", model_dir, block_tokens=block_tokens)
    with trio.fail_after(HANG_GUARD_S):
        async with spawn_multiplexed_worker(worker_command, session_store=store) as live:
            assert live.info.files
            await live.open_session("chat")
            history = [3 + (5 * j) % 250 for j in range(60)]  # a long first turn (a system prompt)
            results = []
            for i in range(4):
                history = await _turn(live, "chat", history, i)
                results.append(await live.save_session("chat"))
            assert [r.start for r in results] == [0, *(r.position for r in results[:-1])]
            assert all(r.incremental for r in results[1:])
            assert results[-1].segments == 4
            # The later saves write their 15 new positions only; the first wrote 75 (its ring
            # layers, of window 16, their last 16 rows).
            assert all(r.position - r.start == 15 for r in results[1:])
            assert all(r.payload_bytes < results[0].payload_bytes for r in results[1:])
            again = await live.save_session("chat")  # nothing new since the last save
            assert again.start == again.position and again.payload_bytes == 0
            reference = await _turn(live, "chat", history, 99)

        async with spawn_multiplexed_worker(worker_command, session_store=store) as resumed:
            await resumed.resume_session("chat")
            assert await _turn(resumed, "chat", history, 99) == reference
            # A save right after a resume appends to what it resumed from.
            after = await resumed.save_session("chat")
            assert after.incremental and after.start == results[-1].position


async def test_compaction_rewrites_the_session_and_removes_its_old_segments(worker_command, model_dir, tmp_path):
    store = await _store(tmp_path / "store", model_dir, compact_after=3)
    with trio.fail_after(HANG_GUARD_S):
        async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
            await client.open_session("s")
            history: list[int] = []
            seen = []
            for i in range(5):
                history = await _turn(client, "s", history, i)
                seen.append((await client.save_session("s")).segments)
            assert seen == [1, 2, 3, 1, 2]
            files = {p.name for p in store.files_of("s")}
            on_disk = {n for n in os.listdir(store.path) if n.endswith(".mxseg")}
            assert on_disk == files - {store.path_for("s").name}
            reference = await _turn(client, "s", history, 50)
        async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
            await client.resume_session("s")
            assert await _turn(client, "s", history, 50) == reference


async def test_bad_files_are_refused_and_the_worker_keeps_serving(worker_command, model_dir, tmp_path):
    store = await _store(tmp_path / "store", model_dir)
    with trio.fail_after(HANG_GUARD_S):
        async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
            await client.open_session("a")
            await client.open_session("b")
            history_a = await _turn(client, "a", [], 1)
            await _turn(client, "b", [], 2)
            await client.save_session("a")
            await client.save_session("b")
            await client.close_session("a")
            segment = store.files_of("a")[1]
            data = bytearray(segment.read_bytes())
            data[-64] ^= 1
            segment.write_bytes(data)
            with pytest.raises(CheckpointCorrupt, match="checksum"):
                await client.resume_session("a")
            with pytest.raises(SessionNotFound):  # the id stayed unused
                await client.save_session("a")
            with pytest.raises(CheckpointNotFound):
                await client.resume_session("never-saved")
            # A busy session is not saved; the others go on.
            stream = client.generate(history_a, greedy("b", 30))
            with pytest.raises(Unsaveable, match="busy"):
                await client.save_session("b")
            await stream.wait()
            data[-64] ^= 1
            segment.write_bytes(data)
            await client.resume_session("a")
            assert (await client.save_session("b")).position > 0


async def test_a_worker_killed_mid_save_leaves_the_previous_save(worker_command, model_dir, tmp_path):
    store = await _store(tmp_path / "store", model_dir)
    with trio.fail_after(HANG_GUARD_S):
        async with spawn_multiplexed_worker(worker_command, session_store=store) as client:
            await client.open_session("s")
            history = await _turn(client, "s", [], 1)
            first = await client.save_session("s")
            history = await _turn(client, "s", history, 2)
            os.kill(client.pid, signal.SIGKILL)
            with pytest.raises(WorkerDiedError):
                await client.save_session("s")
        loaded = store.load("s")
        assert loaded.position == first.position
        assert [n for n in os.listdir(store.path) if n.endswith(".mxseg")] == [store.files_of("s")[1].name]


SAVER = textwrap.dedent(
    """
    import sys, trio
    from muxworker.client import GenerationParams, SessionStore, default_worker_command, spawn_multiplexed_worker

    model, store_dir = sys.argv[1], sys.argv[2]

    async def main():
        store = await SessionStore.create(store_dir, model_files=[model + "/model.safetensors", model + "/tokenizer.json"],
            configuration={"backend": "torch", "dtype": "float32", "max_session_tokens": 512})
        command = default_worker_command(model, dtype="float32", max_sessions=2, max_session_tokens=512)
        async with spawn_multiplexed_worker(command, session_store=store) as client:
            try:
                await client.resume_session("s")
                history = list(store.load("s").token_ids)
            except Exception:
                await client.open_session("s")
                history = []
            i = len(history)
            while len(history) < 400:
                params = GenerationParams(session_id="s", max_new_tokens=4, temperature=0.0, stop_token_ids=[])
                prompt = history + [3 + (i * 7 + j) % 250 for j in range(5)]
                history = prompt + (await client.generate(prompt, params).wait()).generated_token_ids
                saved = await client.save_session("s")
                print("saved", saved.position, flush=True)
                i += 1
            print("done", flush=True)

    trio.run(main)
    """
)


async def test_kill_9_of_the_saving_process_at_random_moments_keeps_the_last_completed_save(model_dir, tmp_path):
    store = await _store(tmp_path / "store", model_dir)
    rng = random.Random(16)
    completed = 0
    kills = 0
    with trio.fail_after(240):
        for _ in range(12):
            proc = subprocess.Popen(
                [sys.executable, "-c", SAVER, str(model_dir), str(store.path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            saves = []
            assert proc.stdout is not None
            target = rng.randint(1, 4)
            line = ""
            while len(saves) < target:
                line = await trio.to_thread.run_sync(proc.stdout.readline)
                if not line.startswith("saved"):
                    break
                saves.append(int(line.split()[1]))
            if line.startswith("saved"):
                # Somewhere in the next turn or save: its generation, its segment write or its
                # manifest replacement.
                await trio.sleep(rng.uniform(0.0, 0.15))
                proc.kill()
                kills += 1
            proc.wait()
            proc.stdout.close()
            if saves:
                completed = saves[-1]
            loaded = store.load("s")  # always loadable, never older than the last completed save
            assert loaded.position >= completed
            completed = loaded.position
            if line.startswith("done"):
                break
    assert kills >= 5
    # What the killed writers left behind (their unpublished segments, and blocks of saves they
    # did not publish) goes with clean(), and the session is still whole after it.
    removed, _ = store.clean()
    assert all(name.endswith((".mxseg", ".tmp", ".mxblk")) for name in removed)
    assert store.verify("s").tokens == store.load("s").position


async def test_clean_refuses_while_a_writer_holds_the_store(model_dir, tmp_path):
    store = await _store(tmp_path / "store", model_dir)
    plan = store.begin_save("s")
    try:
        with pytest.raises(StoreBusy):
            store.clean()
    finally:
        store.abort_save(plan)
    assert store.clean() == ([], 0)
