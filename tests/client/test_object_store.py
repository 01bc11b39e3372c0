"""The session store on object storage: the same tests against every backend, on real S3 on
127.0.0.1 (moto's server, started by a fixture of conftest.py and stopped after), obstore's
in-memory store and the local directory; and a real worker, the HTTP server and the chat saving
and resuming sessions through S3.

What is checked: host checkpoints round-trip bit for bit; a worker saves through the file
channel into memory files uploaded as immutable segments, incrementally, and resumes exactly
like the never-saved session; of two concurrent writers the later fails with SaveConflict and the
winner's save stays whole, and a writer killed mid-upload leaves the previous save loadable; a
damaged segment is refused; a missing bucket or a refused credential is a clear error at
start-up, not at the first save; a store that stops answering raises StoreUnavailable within its
timeout. Content-addressed blocks and clean() are test_object_store_blocks.py's.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time

import httpx
import pytest
import trio
from helpers.params import greedy

from muxworker.client import (
    CheckpointCorrupt,
    CheckpointNotFound,
    ObjectSessionStore,
    SaveConflict,
    SessionStore,
    open_store,
    spawn_multiplexed_worker,
)
from muxworker.client.stores import StorePermissionError, StoreUnavailable
from muxworker.client.stores.binding import MAX_RECORD_BYTES
from muxworker.client.stores.objects import connect
from muxworker.transport.checkpoint.file import write_checkpoint_segment
from muxworker.transport.errors import InvalidArgument

obstore = pytest.importorskip("obstore")
from helpers.s3 import BUCKET, moto_server  # noqa: E402
from test_store import CONFIG, assert_same, make_checkpoint  # noqa: E402

HANG_GUARD_S = 120.0


async def _open(url, model_files, **kw):
    return await open_store(url, model_files=model_files, configuration=CONFIG, **kw)


async def test_open_store_picks_the_backend(store_url, model_files):
    store = await _open(store_url, model_files)
    assert isinstance(store, SessionStore if "://" not in store_url else ObjectSessionStore)
    local = await _open("file://" + store_url, model_files) if "://" not in store_url else None
    assert local is None or isinstance(local, SessionStore)


async def test_host_checkpoints_round_trip(store_url, model_files):
    store = await _open(store_url, model_files)
    checkpoint = make_checkpoint(12, seed=3)
    await trio.to_thread.run_sync(store.save, "chat/1", checkpoint)
    assert_same(await trio.to_thread.run_sync(store.load, "chat/1"), checkpoint)
    assert [i.session_id for i in await trio.to_thread.run_sync(store.list_info)] == ["chat/1"]
    info = await trio.to_thread.run_sync(store.info, "chat/1")
    assert info.tokens == 12 and info.segments == 1
    replaced = make_checkpoint(20, seed=4)
    await trio.to_thread.run_sync(store.save, "chat/1", replaced)
    assert_same(await trio.to_thread.run_sync(store.load, "chat/1"), replaced)
    assert await trio.to_thread.run_sync(store.delete, "chat/1")
    assert not await trio.to_thread.run_sync(store.delete, "chat/1")
    with pytest.raises(CheckpointNotFound):
        await trio.to_thread.run_sync(store.load, "chat/1")


async def test_two_writers_the_later_fails_and_the_winner_stays_whole(store_url, model_files):
    if "://" not in store_url:
        pytest.skip("the local store's whole saves both win, in order (its own tests cover them)")
    a = await _open(store_url, model_files)
    if store_url.startswith("memory:"):  # one memory store, two writers
        b = ObjectSessionStore(a.store, url=store_url, identity=a.identity, inputs=a.inputs)
    else:  # two clients of the same bucket, as two machines would be
        b = await _open(store_url, model_files)
    first, second = make_checkpoint(8, seed=1), make_checkpoint(9, seed=2)

    def race() -> None:
        plan_a, plan_b = a.begin_save("s"), b.begin_save("s")  # both find no manifest
        for plan, store, checkpoint in ((plan_a, a, first), (plan_b, b, second)):
            plan.written = write_checkpoint_segment(plan.fd, "s", store.identity, checkpoint)
        a.commit_save(plan_a, plan_a.written)
        with pytest.raises(SaveConflict):
            b.commit_save(plan_b, plan_b.written)

    await trio.to_thread.run_sync(race)
    assert_same(await trio.to_thread.run_sync(b.load, "s"), first)
    # The loser left nothing behind: one manifest, one segment.
    cleaned, _ = await trio.to_thread.run_sync(lambda: a.clean(older_than=0))
    assert cleaned == []


async def test_a_missing_bucket_or_refused_credentials_fail_at_start(s3_env, moto_s3, model_files, monkeypatch):
    with pytest.raises(CheckpointNotFound, match="does not exist"):
        await _open("s3://no-such-bucket/x", model_files)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens there
    with pytest.raises(Exception, match="listing the session store"):
        await _open(
            f"s3://{BUCKET}/x",
            model_files,
            retry_config={"max_retries": 0, "retry_timeout": datetime.timedelta(seconds=1)},
        )
    assert StorePermissionError  # the class the store raises for refused credentials


# -- a real worker through S3 ---------------------------------------------------------------------


@pytest.mark.slow  # a real worker, a killed writer or a stalled server: the end-to-end tier
async def test_a_worker_saves_incrementally_and_resumes_exactly_through_s3(s3_env, tiny_model_factory):
    model_dir = tiny_model_factory("mistral")  # sliding-window rings: incremental saves must stay exact
    from muxworker.client import default_worker_command

    command = default_worker_command(model_dir, dtype="float32", max_sessions=4, max_session_tokens=512)
    url = f"s3://{BUCKET}/worker-{os.urandom(4).hex()}"
    files = [model_dir / "model.safetensors", model_dir / "tokenizer.json"]
    config = {"backend": "torch", "dtype": "float32", "max_session_tokens": 512}
    store = await open_store(url, model_files=files, configuration=config)
    prompt = list(range(5, 45))
    with trio.fail_after(HANG_GUARD_S):
        async with spawn_multiplexed_worker(command, session_store=store) as client:
            assert client.info.files  # the file channel: segments go through memory files
            await client.open_session("a")
            r1 = await client.generate(prompt, greedy("a", 8)).wait()
            first = await client.save_session("a")
            history = prompt + r1.generated_token_ids + [7, 8, 9]
            r2 = await client.generate(history, greedy("a", 8)).wait()
            second = await client.save_session("a")
            assert second.start == first.position and second.segments == 2  # only the new rows
            history += r2.generated_token_ids
            live = await client.generate(history + [11], greedy("a", 12)).wait()
        info = await trio.to_thread.run_sync(store.info, "a")
        assert info.segments == 2 and info.tokens == len(history) - 1  # the last token has no KV yet
        # Another worker, another store object on the same URL: as another machine would.
        other = await open_store(url, model_files=files, configuration=config)
        async with spawn_multiplexed_worker(command, session_store=other) as client:
            await client.resume_session("a")
            resumed = await client.generate(history + [11], greedy("a", 12)).wait()
            assert resumed.reused_prompt_tokens == len(history) - 1
            assert resumed.generated_token_ids == live.generated_token_ids

            # A damaged segment is refused by the worker's checks; the id stays unused.
            segment = (await trio.to_thread.run_sync(other._manifest, "a"))[0].segments[0].name
            data = bytearray(bytes(obstore.get(other.store, segment).bytes()))
            data[-64] ^= 1  # in the last layer's values
            obstore.put(other.store, segment, bytes(data))
            await client.close_session("a")
            with pytest.raises(CheckpointCorrupt, match="checksum"):
                await client.resume_session("a")
            await client.open_session("a")  # unused: the failed restore left nothing


@pytest.mark.slow
def test_the_http_server_resumes_sessions_from_s3_after_a_restart(s3_env, tmp_path):
    import openai

    from muxworker.serve.process import ServerProcess

    url = f"s3://{BUCKET}/server-{os.urandom(4).hex()}"
    args = ["--store", url, "--dtype", "float32", "--max_sessions", "2"]
    messages = [{"role": "user", "content": "List five animals that live in the sea, one per line."}]
    with ServerProcess(args, env=s3_env, log_path=tmp_path / "serve1.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        first = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=24, temperature=0, extra_headers={"X-Session-Id": "sea"}
        )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Which of them is the largest?"},
    ]
    with ServerProcess(args, env=s3_env, log_path=tmp_path / "serve2.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        again = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=8, temperature=0, extra_headers={"X-Session-Id": "sea"}
        )
        listed = httpx.get(server.url + "/v1/sessions").json()["data"]
    # Everything the first turn left (its prompt and reply) came back from S3; only the new turn is prefilled.
    held = first.usage.prompt_tokens + first.usage.completion_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= held - 2, (again.usage, held)
    assert [s["id"] for s in listed] == ["sea"]
    names = [m["path"] for batch in obstore.list(connect(url)) for m in batch]
    assert any(n.endswith(".mxckpt") for n in names) and any(n.endswith(".mxseg") for n in names), names
    assert not os.path.exists("s3:"), "the store went to a local directory named after the URL"


@pytest.mark.slow  # a real worker, a killed writer or a stalled server: the end-to-end tier
def test_the_chat_saves_and_resumes_a_session_on_s3(s3_env, tiny_llama_dir, tmp_path):
    from test_chat import STATS, Terminal

    url = f"s3://{BUCKET}/chat-{os.urandom(4).hex()}"
    env = {**os.environ, **s3_env, "PYTHONUNBUFFERED": "1"}
    argv = [
        sys.executable, "-m", "muxworker.chat", "--session", "t1", "--store", url,
        "--transcripts", str(tmp_path / "transcripts"), "--model", str(tiny_llama_dir), "--threads", "1",
        "--max_new_tokens", "12",
    ]  # fmt: skip
    term = Terminal(argv, env)
    try:
        term.expect(r"new session 't1'")
        term.expect(r"you> ")
        term.send("Hello there")
        term.expect(STATS)
        term.expect(r"you> ")
        term.send("/quit")
        saved = term.expect(r"saved (\d+) tokens to s3://")
        assert term.close() == 0
        term = Terminal(argv, env)
        assert term.expect(r"resumed session 't1': (\d+) tokens restored").group(1) == saved.group(1)
        term.expect(r"you> ")
        term.send("One more")
        assert int(term.expect(STATS).group(3)) == int(saved.group(1)) - 1  # all of it reused
        term.expect(r"you> ")
        term.send("/quit")
        term.expect(r"saved")
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
            term.proc.wait()
    assert [n for n in os.listdir(tmp_path / "transcripts") if n.endswith(".json")]


WRITER = r"""
import os, sys, trio
sys.path[:0] = [sys.argv[3], os.path.dirname(sys.argv[3])]  # test_store, and the helpers it imports
from test_store import CONFIG, make_checkpoint
from muxworker.client import open_store

async def main():
    store = await open_store(sys.argv[1], model_files=sys.argv[4:], configuration=CONFIG)
    for i in range(1000):
        await trio.to_thread.run_sync(store.save, "victim", make_checkpoint(int(sys.argv[2]), seed=i % 7))
        print(i, flush=True)

trio.run(main)
"""


@pytest.mark.slow  # a real worker, a killed writer or a stalled server: the end-to-end tier
async def test_a_writer_killed_mid_upload_leaves_the_previous_save_loadable(s3_env, model_files, tmp_path):
    # kill -9 at random moments of saves (each a segment upload, then a conditional manifest
    # write): every time, the session loads and is one of the checkpoints the writer saved.
    import random

    url = f"s3://{BUCKET}/kill-{os.urandom(4).hex()}"
    store = await _open(url, model_files)
    position = 2048  # ~1 MiB of rows: an upload takes long enough to be cut
    await trio.to_thread.run_sync(store.save, "victim", make_checkpoint(position, seed=0))
    known = {make_checkpoint(position, seed=i).token_ids.tobytes() for i in range(7)}
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    rng = random.Random(7)
    env = {**os.environ, **s3_env}
    saves = 0
    for k in range(6):
        log = tmp_path / f"writer-{k}.log"
        with open(log, "w") as out:
            writer = await trio.lowlevel.open_process(
                [sys.executable, "-c", WRITER, url, str(position), tests_dir, *map(str, model_files)],
                env=env,
                stdout=out,
            )
            await trio.sleep(1.5 + rng.random())  # past its start-up, into its saves
            writer.kill()
            await writer.wait()
        saves += len(log.read_text().split())
        loaded = await trio.to_thread.run_sync(store.load, "victim")
        assert loaded.position == position and loaded.token_ids.tobytes() in known
    assert saves >= 6, "the writers were killed before they saved anything"
    cleaned, _ = await trio.to_thread.run_sync(lambda: store.clean(older_than=0))  # what the kills left
    assert len(await trio.to_thread.run_sync(store.list_info)) == 1


# -- an unreachable store: StoreUnavailable within the store's timeout -----------------------------


async def _timed(call) -> float:
    """Seconds ``call`` took in a thread (a guard ends a hang, abandoning the thread)."""
    began = time.monotonic()
    with trio.fail_after(HANG_GUARD_S):
        await trio.to_thread.run_sync(call, abandon_on_cancel=True)
    return time.monotonic() - began


@pytest.mark.slow  # a real worker, a killed writer or a stalled server: the end-to-end tier
async def test_a_store_that_stops_answering_is_unavailable_within_its_timeout(s3_env, model_files):
    timeout = 4.0
    with moto_server() as (endpoint, server):
        store = await _open(f"s3://{BUCKET}/down", model_files, endpoint=endpoint, timeout=timeout)
        checkpoint = make_checkpoint(12, seed=3)
        await trio.to_thread.run_sync(store.save, "s", checkpoint)
        assert_same(await trio.to_thread.run_sync(store.load, "s"), checkpoint)
        server.terminate()  # the store goes away mid-session: connections are refused
        server.wait(timeout=30)
        for call in (store.info, store.load, store.begin_resume, lambda sid: store.save(sid, checkpoint)):

            def attempt(call=call) -> None:
                with pytest.raises(StoreUnavailable, match="s3://"):
                    call("s")

            assert await _timed(attempt) < timeout

    # A store that accepts connections and never answers: each try times out.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        hung = ObjectSessionStore(
            connect(f"s3://{BUCKET}/hung", timeout=timeout, endpoint=f"http://127.0.0.1:{silent.getsockname()[1]}"),
            url=f"s3://{BUCKET}/hung",
            identity=store.identity,
        )
        for call in (hung.info, hung.load):

            def attempt(call=call) -> None:
                with pytest.raises(StoreUnavailable, match="s3://"):
                    call("s")

            assert await _timed(attempt) < timeout


async def test_refused_reads_are_unavailable_and_refused_writes_a_permission_error(model_files, monkeypatch):
    store = await _open("memory:///", model_files)
    await trio.to_thread.run_sync(store.save, "s", make_checkpoint(8, seed=1))
    denied = obstore.exceptions.PermissionDeniedError("403 Forbidden (injected)")
    real_get, real_put = obstore.get, obstore.put

    def get(*args, **kwargs):
        raise denied

    monkeypatch.setattr(obstore, "get", get)
    for call in (store.info, store.load):
        with pytest.raises(StoreUnavailable, match="refused the credentials") as info:
            await trio.to_thread.run_sync(call, "s")
        assert not isinstance(info.value, StorePermissionError)  # the data may be whole: retry later
    monkeypatch.setattr(obstore, "get", real_get)

    def put(*args, **kwargs):
        raise denied

    monkeypatch.setattr(obstore, "put", put)
    with pytest.raises(StorePermissionError, match="refused the credentials"):
        await trio.to_thread.run_sync(store.save, "s", make_checkpoint(9, seed=2))
    monkeypatch.setattr(obstore, "put", real_put)
    assert_same(await trio.to_thread.run_sync(store.load, "s"), make_checkpoint(8, seed=1))


async def test_records_and_saved_tokens_on_every_backend(store_url, model_files):
    """Records (a stored response's document) sit beside the sessions, untouched by clean(); a
    save's token ids read back without its KV."""
    store = await _open(store_url, model_files)
    checkpoint = make_checkpoint(12, seed=3)
    await trio.to_thread.run_sync(store.save, "t/s", checkpoint)
    assert await trio.to_thread.run_sync(store.saved_tokens, "t/s") == checkpoint.token_ids.tolist()
    await trio.to_thread.run_sync(store.put_record, "t/response/resp_1", b'{"a": 1}')
    await trio.to_thread.run_sync(store.put_record, "t/response/resp_1", b'{"a": 2}')  # replaced whole
    assert await trio.to_thread.run_sync(store.get_record, "t/response/resp_1") == b'{"a": 2}'
    await trio.to_thread.run_sync(lambda: store.clean(older_than=0))
    assert await trio.to_thread.run_sync(store.get_record, "t/response/resp_1") == b'{"a": 2}'
    assert await trio.to_thread.run_sync(store.delete_record, "t/response/resp_1")
    assert not await trio.to_thread.run_sync(store.delete_record, "t/response/resp_1")
    with pytest.raises(CheckpointNotFound, match="no record"):
        await trio.to_thread.run_sync(store.get_record, "t/response/resp_1")
    with pytest.raises(InvalidArgument, match="at most"):
        await trio.to_thread.run_sync(store.put_record, "t/big", b"x" * (MAX_RECORD_BYTES + 1))
    assert [i.session_id for i in await trio.to_thread.run_sync(store.list_info)] == ["t/s"]
