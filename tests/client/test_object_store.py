"""The session store on object storage: the same tests against every backend, on real S3 on
127.0.0.1 (moto's server, started by the fixture and stopped after), obstore's in-memory store
and the local directory; and a real worker saving and resuming sessions through S3.

What is checked: host checkpoints round-trip bit for bit; a worker saves through the file
channel into memory files uploaded as immutable segments, incrementally, and resumes exactly
like the never-saved session; of two concurrent writers the later fails with SaveConflict and the
winner's save stays whole; a damaged segment is refused; a missing bucket or a refused
credential is a clear error at start-up, not at the first save.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import trio

from muxworker.client import (
    CheckpointCorrupt,
    CheckpointNotFound,
    GenerationParams,
    ObjectSessionStore,
    SaveConflict,
    SessionStore,
    open_store,
    spawn_multiplexed_worker,
)
from muxworker.client.object_store import connect
from muxworker.client.store import StorePermissionError
from muxworker.transport.checkpoint.segments import write_checkpoint_segment

obstore = pytest.importorskip("obstore")
from test_store import CONFIG, assert_same, make_checkpoint  # noqa: E402

BUCKET = "muxworker-sessions"
HANG_GUARD_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def moto_s3():
    """A real S3 API on 127.0.0.1 (moto's server mode) with one bucket; yields its endpoint."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(endpoint + "/moto-api/", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.1)
        assert httpx.put(f"{endpoint}/{BUCKET}").status_code == 200  # CreateBucket
        yield endpoint
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture
def s3_env(moto_s3, monkeypatch):
    env = {
        "AWS_ENDPOINT_URL": moto_s3,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture(params=["local", "memory", "s3"])
def store_url(request, tmp_path):
    """Where a store lives: a directory, obstore's memory store, or a fresh prefix in moto's S3."""
    if request.param == "local":
        return str(tmp_path / "sessions")
    if request.param == "memory":
        return "memory:///"
    request.getfixturevalue("s3_env")
    return f"s3://{BUCKET}/t-{os.urandom(6).hex()}"


@pytest.fixture
def model_files(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(os.urandom(4096))
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_bytes(b'{"vocab": {}}')
    return [weights, tokenizer]


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
        a.commit_save(plan_a, plan_a.written, first.format, first.geometry)
        with pytest.raises(SaveConflict):
            b.commit_save(plan_b, plan_b.written, second.format, second.geometry)

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


def greedy(session_id: str, n: int = 8) -> GenerationParams:
    return GenerationParams(session_id=session_id, max_new_tokens=n, temperature=0.0, stop_token_ids=[])


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
            r1 = await client.generate(prompt, greedy("a")).wait()
            first = await client.save_session("a")
            history = prompt + r1.generated_token_ids + [7, 8, 9]
            r2 = await client.generate(history, greedy("a")).wait()
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


WRITER = r"""
import sys, trio
sys.path.insert(0, sys.argv[3])
from test_store import CONFIG, make_checkpoint
from muxworker.client import open_store

async def main():
    store = await open_store(sys.argv[1], model_files=sys.argv[4:], configuration=CONFIG)
    for i in range(1000):
        await trio.to_thread.run_sync(store.save, "victim", make_checkpoint(int(sys.argv[2]), seed=i % 7))
        print(i, flush=True)

trio.run(main)
"""


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
