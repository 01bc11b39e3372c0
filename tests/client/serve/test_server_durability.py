"""What a red team found the server got wrong about stopping, saving and its own limits, each
checked end to end on a real ``python -m muxworker.serve`` process with its worker and the bundled
SmolLM2 (real pipes, real files, a real tmpfs for a full disk):

- EOF on ``--lifeline-fd`` saves and exits like SIGTERM (it used to log "stopping" and hang);
- a failed background save is never silent (the session's record, the next turn's header and
  final-chunk field, ``/health``, a metric), and ``--save sync`` answers only durable turns;
- a body of more messages than the context can hold is refused before it is rendered;
- per-tenant session and store quotas; a session whose first turn failed is not kept;
- what a browser could forge is refused by the real server, and an unusable manifest can be
  deleted over HTTP;
- one owner per store: a second server on a directory store exits naming the first, and of two
  --shared-store servers writing one session, the stale one answers 409 and overwrites nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers.fs import tmpfs
from helpers.s3 import BUCKET, CREDENTIALS, CuttableProxy, moto_server

from muxworker.client import SessionStore
from muxworker.serve.process import ServerProcess

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _chat(server: ServerProcess, sid: str | None, messages=QUESTION, stream: bool = False, **kw) -> httpx.Response:
    headers = {"X-Session-Id": sid} if sid else {}
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "stream": stream, **kw}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def _final_chunk(response: httpx.Response) -> dict:
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    return [e for e in events if e.get("choices") and e["choices"][0]["finish_reason"]][-1]


def test_lifeline_eof_saves_and_exits(tmp_path):
    store = tmp_path / "store"
    read_end, write_end = os.pipe()
    server = ServerProcess(
        ["--store", str(store), "--save", "evict", "--lifeline-fd", str(read_end)],
        log_path=tmp_path / "serve.log",
        pass_fds=(read_end,),
    )
    try:
        server.start()
        os.close(read_end)
        assert _chat(server, "kept").status_code == 200
        assert SessionStore.inspect(store).list_info() == []  # --save evict: not yet
        os.close(write_end)  # the process that started it is gone
        write_end = -1
        server.process.wait(timeout=120)
        assert server.process.returncode == 0, server.log_tail()
    finally:
        if write_end >= 0:
            os.close(write_end)
        server.stop(timeout=5)
    assert [i.session_id for i in SessionStore.inspect(store).list_info()] == ["local/kept"]


@pytest.fixture
def small_disk(tmp_path):
    with tmpfs(tmp_path / "disk", "24m") as mount:
        yield mount


def _fill(disk: Path) -> Path:
    filler = disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    return filler


def _metric(server: ServerProcess, name: str) -> float:
    total = 0.0
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_failed_save_is_never_silent_and_sync_saves_answer_durable_turns(tmp_path, small_disk):
    store = small_disk / "store"
    with ServerProcess(["--store", str(store)], log_path=tmp_path / "serve.log") as server:
        assert _chat(server, "s").status_code == 200
        deadline = time.monotonic() + 30
        while not SessionStore.inspect(store).list_info() and time.monotonic() < deadline:
            time.sleep(0.1)
        filler = _fill(small_disk)
        history = [*QUESTION, {"role": "assistant", "content": "Red."}, {"role": "user", "content": "More?"}]
        assert _chat(server, "s", history).status_code == 200  # answered; its background save fails
        deadline = time.monotonic() + 30
        while _metric(server, 'muxworker_session_saves_total{result="failed"}') < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _metric(server, 'muxworker_session_saves_total{result="failed"}') >= 1
        state = httpx.get(server.url + "/v1/sessions/s").json()
        assert state["last_save_error"] and state["live_tokens"] > state["durable_tokens"] > 0, state
        health = httpx.get(server.url + "/health").json()
        assert health["status"] == "degraded" and health["store"]["sessions_with_failed_saves"] == 1, health
        # The session's next turn carries it: a header, and the final chunk's session field.
        r = _chat(server, "s", history, stream=True)
        assert r.status_code == 200 and r.headers["x-muxworker-save-error"]
        session = _final_chunk(r)["session"]
        assert session["id"] == "s" and session["durable"] is False and session["save_error"]
        # Room again: the next save succeeds and clears it.
        filler.unlink()
        r = _chat(server, "s", history)
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/v1/sessions/s").json()["last_save_error"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(server.url + "/v1/sessions/s").json()["last_save_error"] is None
        assert httpx.get(server.url + "/health").json()["status"] == "ok"

    with ServerProcess(["--store", str(store), "--save", "sync"], log_path=tmp_path / "sync.log") as server:
        r = _chat(server, "t", stream=True)
        session = _final_chunk(r)["session"]
        assert session["durable"] is True and session["durable_tokens"] > 0 and session["save_error"] is None
        # Durable when answered: the store holds it already.
        saved = {i.session_id: i.tokens for i in SessionStore.inspect(store).list_info()}
        assert saved["local/t"] == session["durable_tokens"]
        filler = _fill(small_disk)
        body = _chat(server, "t", [*QUESTION, {"role": "assistant", "content": "Red."}]).json()
        assert body["session"]["durable"] is False and body["session"]["save_error"]
        filler.unlink()


def test_limits_refuse_before_any_work_and_bad_first_turns_leave_nothing(tmp_path):
    args = [
        "--store",
        str(tmp_path / "store"),
        "--api-key",
        "key-a",
        "--api-key",
        "key-b",
        "--max-sessions-per-tenant",
        "2",
        "--max_session_tokens",
        "1024",
    ]
    with ServerProcess(args, log_path=tmp_path / "serve.log") as server:

        def chat(key: str, sid: str | None, messages=QUESTION) -> httpx.Response:
            body = {"messages": messages, "max_tokens": 4, "temperature": 0}
            headers = {"Authorization": f"Bearer {key}", **({"X-Session-Id": sid} if sid else {})}
            return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)

        # Thousands of messages are refused by their count, before the worker renders them.
        many = [{"role": "user", "content": "hi"}] * 2000
        t0 = time.perf_counter()
        r = chat("key-a", None, many)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "cannot fit this model's context" in r.json()["error"]["message"], r.json()
        print(f"2,000 messages refused in {time.perf_counter() - t0:.3f} s")

        # A first turn that fails leaves no session behind, and does not count against the quota.
        r = chat("key-a", "too-long", [{"role": "user", "content": "word " * 3000}])
        assert r.status_code == 400
        for sid in ("one", "two"):
            assert chat("key-a", sid).status_code == 200
        listed = httpx.get(server.url + "/v1/sessions", headers={"Authorization": "Bearer key-a"}).json()["data"]
        assert sorted(s["id"] for s in listed) == ["one", "two"]
        r = chat("key-a", "three")
        assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_session_limit"
        assert chat("key-a", "one").status_code == 200  # existing sessions go on
        assert chat("key-b", "three").status_code == 200  # another tenant has its own quota
        r = httpx.delete(server.url + "/v1/sessions/two", headers={"Authorization": "Bearer key-a"})
        assert r.status_code == 200
        assert chat("key-a", "three").status_code == 200

        # A tenant deletes its own implicit session by the id GET /v1/sessions lists; another
        # tenant's key naming the same id finds nothing.
        assert chat("key-a", None).status_code == 200

        def implicit(key: str) -> list[str]:
            listed = httpx.get(server.url + "/v1/sessions", headers={"Authorization": f"Bearer {key}"}).json()
            return [s["id"] for s in listed["data"] if s["kind"] == "implicit"]

        (mine,) = implicit("key-a")
        r = httpx.delete(f"{server.url}/v1/sessions/{mine}", headers={"Authorization": "Bearer key-b"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        assert implicit("key-a") == [mine]
        r = httpx.delete(f"{server.url}/v1/sessions/{mine}", headers={"Authorization": "Bearer key-a"})
        assert r.status_code == 200 and r.json()["id"] == mine
        assert implicit("key-a") == []


def test_store_bytes_quota(tmp_path):
    args = ["--store", str(tmp_path / "store"), "--max-store-bytes-per-tenant", "4096"]
    with ServerProcess(args, log_path=tmp_path / "serve.log") as server:
        assert _chat(server, "a").status_code == 200  # the store was empty
        deadline = time.monotonic() + 30
        r = _chat(server, "b")
        while r.status_code == 200 and time.monotonic() < deadline:  # once the first save is counted
            time.sleep(0.2)
            r = _chat(server, "b")
        assert r.status_code == 507 and r.json()["error"]["code"] == "tenant_storage_limit", r.text


def test_forged_requests_are_refused_and_an_unusable_manifest_can_be_deleted(tmp_path):
    store = tmp_path / "store"
    with ServerProcess(["--store", str(store)], log_path=tmp_path / "serve.log") as server:
        port = server.url.rsplit(":", 1)[1]
        assert _chat(server, "victim").status_code == 200
        rebound = {"Host": f"attacker.example:{port}"}
        assert httpx.get(server.url + "/v1/sessions", headers=rebound).status_code == 421
        assert httpx.delete(server.url + "/v1/sessions/victim", headers=rebound).status_code == 421
        r = httpx.post(
            server.url + "/v1/chat/completions",
            content=json.dumps({"messages": QUESTION, "max_tokens": 2}),
            headers={"Content-Type": "text/plain", "X-Session-Id": "victim"},
        )
        assert r.status_code == 415
        r = httpx.get(server.url + "/v1/sessions", headers={"Origin": "https://attacker.example"})
        assert r.status_code == 403
        assert httpx.get(server.url + "/v1/sessions", headers={"Host": f"localhost:{port}"}).status_code == 200

        # A FIFO where a session's manifest belongs: DELETE clears it (and never blocks on it).
        fifo = SessionStore.inspect(store).path_for("local/jammed")
        os.mkfifo(fifo)
        r = httpx.delete(server.url + "/v1/sessions/jammed", timeout=30)
        assert r.status_code == 200, r.text
        assert not os.path.lexists(fifo)
        assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_an_unreachable_store_is_a_503_that_keeps_the_session(tmp_path):
    """During an object-store outage a resume is a 503 with Retry-After within the store's timeout
    (it waited 181 s and then told the client to DELETE a good session), ``/health`` says so, and
    the session resumes once the store answers again."""
    with moto_server() as (endpoint, _):
        proxy = CuttableProxy(endpoint)
        env = {**CREDENTIALS, "AWS_ENDPOINT_URL": proxy.endpoint}
        args = ["--store", f"s3://{BUCKET}/outage", "--store-timeout", "4"]
        try:
            with ServerProcess(args, env=env, log_path=tmp_path / "serve1.log") as server:
                assert _chat(server, "s").status_code == 200
                saved = _chat(server, "s", [*QUESTION, {"role": "assistant", "content": "Red."}])
                assert saved.status_code == 200
            with ServerProcess(args, env=env, log_path=tmp_path / "serve2.log") as server:
                proxy.cut()
                t0 = time.monotonic()
                r = _chat(server, "s", [*QUESTION, {"role": "assistant", "content": "Red."}])
                waited = time.monotonic() - t0
                assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable", r.text
                assert r.headers["retry-after"] and "DELETE" not in r.json()["error"]["message"]
                assert waited < 30, waited
                health = httpx.get(server.url + "/health").json()
                assert health["status"] == "degraded" and health["store"]["error"], health
                proxy.restore()
                r = _chat(server, "s", [*QUESTION, {"role": "assistant", "content": "Red."}])
                assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                assert httpx.get(server.url + "/health").json()["status"] == "ok"
        finally:
            proxy.close()


def test_the_server_collects_what_a_killed_save_left(tmp_path):
    """A kill -9 mid-save leaves a segment no manifest names (509 MiB in the red team's run); the
    server's collector removes it once it is old enough, and the session it belonged to is whole."""
    store = tmp_path / "store"
    with ServerProcess(["--store", str(store)], log_path=tmp_path / "serve1.log") as server:
        assert _chat(server, "s").status_code == 200
    (segment,) = store.glob("*.mxseg")
    orphan = segment.with_name(segment.name[:65] + "0123456789abcdef.mxseg")
    young = segment.with_name(segment.name[:65] + "fedcba9876543210.mxseg")
    orphan.write_bytes(segment.read_bytes())
    young.write_bytes(segment.read_bytes())
    two_hours_ago = time.time() - 7200
    os.utime(orphan, (two_hours_ago, two_hours_ago))  # a save in progress is younger than an hour
    with ServerProcess(["--store", str(store), "--collect-interval", "1"], log_path=tmp_path / "s2.log") as server:
        deadline = time.monotonic() + 30
        while orphan.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not orphan.exists() and young.exists() and segment.exists()
        r = _chat(server, "s", [*QUESTION, {"role": "assistant", "content": "Red."}])
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_second_server_on_a_directory_store_exits_naming_the_holder(tmp_path):
    """Two servers on one directory store overwrote each other's sessions, every reply 200 (issue
    40): the first holds the store alone, and a second one (with --shared-store or without), the
    sessions command's changes and the chat exit at start with one line naming it (pid, host,
    start time), no traceback. (A server that stopped frees it: the tests above restart on theirs.)"""
    store = tmp_path / "store"
    with ServerProcess(["--store", str(store)], log_path=tmp_path / "serve.log") as server:
        holder = f"pid {server.pid} on "
        tools = [
            ([sys.executable, "-m", "muxworker.serve", "--store", str(store), "--port", "0"], 2),
            ([sys.executable, "-m", "muxworker.serve", "--store", str(store), "--port", "0", "--shared-store"], 2),
            ([sys.executable, "-m", "muxworker.sessions", str(store), "delete", "local/s"], 2),
            ([sys.executable, "-m", "muxworker.chat", "--store", str(store), "--session", "s"], 1),
        ]
        for argv, status in tools:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
            assert done.returncode == status, (argv, done.stderr)
            (line,) = [ln for ln in done.stderr.splitlines() if holder in ln]
            assert " since " in line and "Traceback" not in done.stderr, done.stderr
        assert _chat(server, "s").status_code == 200  # the holder serves on


def test_two_servers_on_one_shared_store_one_409_and_nothing_acknowledged_is_lost(tmp_path):
    """Servers A and B on one store, turns of one session on both (issue 40: every reply 200 while
    the store kept only B's history). Every save is conditional on the manifest its server last
    saved or resumed: a server whose copy the other's save superseded publishes nothing; under
    --save turn its session's next request gets 409 save_conflict (under --save sync the turn
    itself), and the request after that continues from what the store holds."""
    store = tmp_path / "store"
    base = ["--store", str(store), "--shared-store", "--max_sessions", "2"]
    turn = [{"role": "user", "content": "Name a colour."}]

    def session(server) -> dict:
        return httpx.get(server.url + "/v1/sessions/x", timeout=30).json()

    def until(server, ready, what: str) -> dict:
        deadline = time.monotonic() + 60  # a hang guard
        while time.monotonic() < deadline:
            state = session(server)
            if ready(state):
                return state
            time.sleep(0.1)
        raise AssertionError(f"the session was never {what}: {state}")

    def saved(server) -> dict:  # a background save landed
        return until(server, lambda s: s.get("durable_tokens") == s.get("live_tokens") is not None, "saved")

    def more(messages, r) -> list:
        return [*messages, {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}, *turn]

    def cached(r) -> int:
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with (
        ServerProcess([*base, "--save", "sync"], log_path=tmp_path / "a.log") as a,
        ServerProcess(base, log_path=tmp_path / "b.log") as b,
    ):
        r = _chat(b, "x", turn)
        assert r.status_code == 200
        saved(b)
        history = more(turn, r)
        r = _chat(a, "x", history)  # A resumes B's save; under --save sync durable when answered
        assert r.status_code == 200 and r.json()["session"]["durable"] is True, r.text
        a_tokens = r.json()["session"]["durable_tokens"]
        stale = more(history, r)
        r = _chat(b, "x", stale)  # B's copy is stale: answered, but its save must not replace A's
        assert r.status_code == 200
        until(b, lambda s: "SaveConflict" in (s.get("last_save_error") or ""), "refused")
        assert session(a)["saved_tokens"] == a_tokens  # A's acknowledged turn is whole in the store
        r = _chat(b, "x", stale)  # told: the turn B answered from its stale copy was not kept
        assert r.status_code == 409 and r.json()["error"]["code"] == "save_conflict", r.text
        r = _chat(b, "x", stale)  # then it continues from what the store holds (A's turn)
        assert r.status_code == 200 and cached(r) >= a_tokens - 2, r.text
        b_tokens = saved(b)["durable_tokens"]
        assert b_tokens > a_tokens
        r = _chat(a, "x", stale)  # now A's copy is stale: under --save sync the turn itself is refused
        assert r.status_code == 409 and r.json()["error"]["code"] == "save_conflict", r.text
        assert session(b)["saved_tokens"] == b_tokens  # B's turn is whole
        r = _chat(a, "x", stale)  # then it continues from B's
        assert r.status_code == 200 and r.json()["session"]["durable"] is True, r.text
        assert cached(r) >= a_tokens - 2
