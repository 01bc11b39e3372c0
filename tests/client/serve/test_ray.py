"""Many workers on Ray Serve (muxworker.serve.ray): a real local Ray cluster (num_cpus=2) with two
replicas, each a real server and worker (the bundled SmolLM2, float32), sharing one store directory
and one API key.

What is checked: the session-affinity router splits 8 sessions 4/4 over two replicas of 4 slots
with no eviction, and keeps each on its replica; when the replica holding a session is killed, the
next turn is answered within 5 s by the other, resumed from the store (only the new turn
prefilled), with the tokens a cold run gives; the dead replica's worker process is gone within
5 s; the cluster's processes together stay under 4 GiB of RSS. A replica refuses a foreign Host, a body that
is not JSON, one too large and a caller without a key before it reads the body (a 256 MiB keyless
body leaves it under 200 MB larger), and streams an accepted body to its server. A replica whose
server died answers 503s with Retry-After until Serve, told by its health check, replaces it; the
session then resumes on another replica. And, on a cluster of its own started by ``python -m
muxworker.serve --ray``: when the Ray head's processes are killed, every server and worker exits.
"""

from __future__ import annotations

import ipaddress
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

from muxworker.serve.process import ProcStat, descendants, process_table  # noqa: E402
from muxworker.serve.ray import REPLICA_HEADER, WORKER_PID_HEADER, ReplicaView, rank_replicas  # noqa: E402

SLOTS = 4
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray import serve

    from muxworker.serve.ray import deployment

    store = tmp_path_factory.mktemp("ray-store") / "sessions"
    logs = tmp_path_factory.mktemp("ray-logs")
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # The bundled SmolLM2, whose tokenizer gives back the tokens of a reply from its text (so a
        # chat's next turn reuses the whole history); float32, so a resumed session equals cold.
        args = ["--served-model-name", "m", "--store", str(store), "--dtype", "float32"]
        args += ["--max_sessions", str(SLOTS), "--max_session_tokens", "512", "--threads", "1", "--api-key", KEY]
        app = deployment(args, replicas=2, log_dir=str(logs), host="127.0.0.1", port=port)
        serve.run(app, name="muxworker", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def chat(url: str, messages, session: str | None, max_tokens: int = 8, ok: bool = True) -> httpx.Response:
    headers = {**AUTH, **({"X-Session-Id": session} if session else {})}
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    if ok:
        assert response.status_code == 200, response.text
    return response


def test_the_ranking_prefers_the_holder_then_a_free_slot_in_hash_order_then_the_least_loaded():
    a, b, c = (ReplicaView(n, frozenset(s), free, load) for n, s, free, load in (
        ("a", {"x"}, 0, 5), ("b", set(), 2, 1), ("c", set(), 0, 0),
    ))  # fmt: skip
    assert rank_replicas("x", [a, b, c])[0] == "a"  # it holds x, full or not
    assert rank_replicas("y", [a, b, c])[0] == "b"  # the only free slot
    assert rank_replicas("y", [a, b, c], placed="c")[0] == "c"  # this router put y there just now
    assert rank_replicas(None, [a, b, c]) == ["c", "b", "a"]  # no session: least loaded
    # Among free replicas the order is the session's own and stable when one leaves.
    free = [ReplicaView(n, frozenset(), 3, 0) for n in "pqrs"]
    first = {sid: rank_replicas(sid, free)[0] for sid in map(str, range(200))}
    assert len(set(first.values())) == 4
    without_s = {sid: rank_replicas(sid, free[:3])[0] for sid in first}
    assert all(without_s[sid] == r for sid, r in first.items() if r != "s")


# -- processes, from /proc (Linux) --------------------------------------------------------------------


def _procs() -> dict[int, ProcStat]:
    """Every process that has not exited (a zombie has)."""
    return {pid: stat for pid, stat in process_table().items() if stat.state != "Z"}


def _muxworker_module(argv: list[str]) -> str | None:
    """``muxworker.serve``, ``muxworker.worker``...: the module a ``python -m`` process runs."""
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1]
        if module.startswith("muxworker."):
            return module
    return None


def _ray_processes(title: str) -> list[int]:
    """This test's Ray processes whose title (``ray::ServeReplica...``) starts with ``title``."""
    procs = _procs()
    argvs = {pid: procs[pid].argv(pid) for pid in descendants(os.getpid(), procs)}
    return [pid for pid, argv in argvs.items() if argv and argv[0].startswith(title)]


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss(pid: int) -> None:
    # Linux >= 4.0: VmHWM (the peak RSS) starts again from the present RSS.
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def _alive(pid: int, started: str) -> bool:
    entry = _procs().get(pid)
    return entry is not None and entry.start_ticks == started


def _listening(pids: list[int]) -> dict[int, list[ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """{pid: the local addresses of its listening TCP sockets}, from /proc/net/tcp{,6} and each
    process's fds (Linux)."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone meanwhile
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[link[8:-1]] = pid
    out: dict[int, list[ipaddress.IPv4Address | ipaddress.IPv6Address]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in owner:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(local.split(":")[0])  # 32-bit words in host (little-endian) order
                addr = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
                out.setdefault(owner[inode], []).append(addr)
    return out


def _is_loopback(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1, an IPv6 socket bound to 127.0.0.1
    return (mapped or addr).is_loopback


def test_the_health_check_waits_out_a_worker_restart_and_a_store_outage_but_not_a_dead_server():
    """Serve's health check on a replica, over a fake child (its /health as the server answers it)."""
    import trio

    from muxworker.serve.ray import WORKER_DOWN_GRACE_S, MuxworkerReplica, ReplicaUnhealthy

    health = {"status": 200, "body": {"status": "degraded", "store": {"status": "unavailable"}}}

    class FakeServer:
        class process:  # noqa: N801 - stands for a Popen
            returncode: int | None = None

            @classmethod
            def poll(cls) -> int | None:
                return cls.returncode

        @staticmethod
        def log_tail(lines: int = 30) -> str:
            return "(the log)"

    replica = MuxworkerReplica.__new__(MuxworkerReplica)
    replica._server = FakeServer()
    replica._unready_since = None
    handler = lambda request: httpx.Response(health["status"], json=health["body"])  # noqa: E731
    replica._http = httpx.AsyncClient(base_url="http://child", transport=httpx.MockTransport(handler))

    async def main() -> None:
        await replica.check_health()  # the store is down: "degraded", still 200, still healthy
        health.update(status=503, body={"status": "unavailable", "reason": "the worker died"})
        await replica.check_health()  # the server is restarting its worker
        assert replica._unready_since is not None
        replica._unready_since -= WORKER_DOWN_GRACE_S - 5  # 5 s before the bound
        await replica.check_health()
        replica._unready_since -= 10
        with pytest.raises(ReplicaUnhealthy, match="down for"):
            await replica.check_health()
        health.update(status=200, body={"status": "ok"})
        await replica.check_health()  # back: the clock starts again
        assert replica._unready_since is None
        FakeServer.process.returncode = -9
        with pytest.raises(ReplicaUnhealthy, match="exited with status -9"):
            await replica.check_health()
        await replica._http.aclose()

    trio.run(main)


def test_when_the_ray_head_dies_every_server_and_worker_exits(tmp_path):
    """``python -m muxworker.serve --ray`` with one replica; SIGKILL of the head's process group
    (the driver, the GCS, the raylet, their agents: the replicas are Ray workers in groups of their
    own). The replica's actor exits when it loses its raylet, its server sees EOF on its lifeline
    and stops, closing its worker: nothing of muxworker's is left. Run before the module's cluster
    starts, so the two never share the 2 cores."""
    from muxworker.serve.process import READY_PREFIX

    port = _free_port()
    command = [sys.executable, "-m", "muxworker.serve", "--ray", "--replicas", "1", "--ray-num-cpus", "1"]
    command += ["--port", str(port), "--served-model-name", "m", "--store", str(tmp_path / "sessions")]
    command += ["--api-key", KEY, "--dtype", "float32", "--max_sessions", "2", "--max_session_tokens", "256"]
    command += ["--threads", "1"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(tmp_path / "driver.log", "w") as log:
        driver = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True
        )
    cluster: dict[int, int] = {}  # pid -> start time of each process it started: all killed at the end
    reader: threading.Thread | None = None
    try:
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert driver.stdout is not None
            for line in driver.stdout:
                lines.put(line)
            lines.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + 300
        line = ""
        while not line.startswith(READY_PREFIX):
            got = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert got is not None, (tmp_path / "driver.log").read_text()[-3000:]
            line = got
        url = line.split(" on ", 1)[1].split()[0]
        chat(url, [{"role": "user", "content": "Hello"}], "before-the-end")

        procs = _procs()
        tree = descendants(driver.pid, procs)
        cluster.update((pid, procs[pid].start_ticks) for pid in tree)
        modules = {pid: _muxworker_module(procs[pid].argv(pid)) for pid in tree}
        ours = {pid: module for pid, module in modules.items() if module}
        assert sorted(ours.values()) == ["muxworker.serve", "muxworker.worker"], ours
        # --host 127.0.0.1 (the default): every socket the cluster listens on (the GCS, the raylet,
        # the agents, the workers, Serve's proxy, the replica's server) is a loopback one.
        listening = _listening([driver.pid, *tree])
        assert len(listening) >= 3, listening  # the driver, the GCS, the raylet at least
        wide = {
            f"{pid} {' '.join(procs[pid].argv(pid) if pid in procs else [])[:80]}": [str(a) for a in addrs]
            for pid, addrs in listening.items()
            if not all(map(_is_loopback, addrs))
        }
        assert not wide, wide

        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=10)
        killed = time.monotonic()
        while time.monotonic() < killed + 60 and any(_alive(pid, cluster[pid]) for pid in ours):
            time.sleep(0.2)
        left = {pid: module for pid, module in ours.items() if _alive(pid, cluster[pid])}
        assert not left, f"still running {time.monotonic() - killed:.0f} s after the head died: {left}"
        print(f"every server and worker exited {time.monotonic() - killed:.1f} s after the head died")
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=10)
        for pid, started in cluster.items():
            if _alive(pid, started):
                os.kill(pid, signal.SIGKILL)
        if reader is not None:
            reader.join(timeout=10)  # EOF: every process holding the pipe is gone
        assert driver.stdout is not None
        driver.stdout.close()


def test_sessions_split_over_the_replicas_and_stay_there(cluster):
    placed: dict[str, str] = {}
    for i in range(2 * SLOTS):
        sid = f"s{i}"
        response = chat(cluster, [{"role": "user", "content": f"Hello number {i}"}], sid)
        placed[sid] = response.headers[REPLICA_HEADER]
        time.sleep(0.1)
    counts = sorted(list(placed.values()).count(r) for r in set(placed.values()))
    assert counts == [SLOTS, SLOTS], placed
    # Second turns land on the same replicas, which still hold every session: nothing was evicted.
    time.sleep(1.5)  # past a routing-stats period: the routers also know from the replicas' reports
    for i in range(2 * SLOTS):
        sid = f"s{i}"
        first = [{"role": "user", "content": f"Hello number {i}"}]
        response = chat(
            cluster, first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "More"}], sid
        )
        assert response.headers[REPLICA_HEADER] == placed[sid]
    stats = httpx.get(cluster + "/v1/sessions", headers=AUTH, timeout=30)
    assert stats.status_code == 200
    # The cluster's processes (Ray's, the replicas, their servers and workers); not this pytest
    # process, whose memory is that of every test that ran before in it.
    table = process_table()
    cluster_rss = sum(table[pid].rss_bytes for pid in descendants(os.getpid(), table))
    assert cluster_rss < 4 * 2**30, f"{cluster_rss / 2**30:.2f} GiB"


def test_a_replica_refuses_before_it_reads_a_body_and_streams_what_it_accepts(cluster):
    url = cluster + "/v1/chat/completions"
    as_json = {"Content-Type": "application/json"}

    def spaces(total: int, piece: int = 2**20):
        for _ in range(total // piece):
            yield b" " * piece

    def refused(response: httpx.Response, status: int, code: str) -> None:
        assert response.status_code == status, response.text
        assert response.json()["error"]["code"] == code
        assert response.headers[REPLICA_HEADER]  # a replica answered, not Serve's proxy

    # 256 MiB without a key, chunked (no Content-Length to refuse it by): 401 without reading it.
    replicas, proxies = _ray_processes("ray::ServeReplica"), _ray_processes("ray::ProxyActor")
    assert len(replicas) == 2 and len(proxies) == 1
    for pid in replicas + proxies:
        _reset_peak_rss(pid)
    before = {pid: _status_kib(pid, "VmRSS") for pid in replicas + proxies}
    started = time.monotonic()
    refused(httpx.post(url, content=spaces(256 * 2**20), headers=as_json, timeout=60), 401, "invalid_api_key")
    took = time.monotonic() - started
    growth = {pid: (_status_kib(pid, "VmHWM") - before[pid]) / 1024 for pid in replicas + proxies}
    print(f"256 MiB keyless body: answered in {took:.2f} s; peak RSS growth (MiB) {growth}")
    assert took < 30
    assert all(growth[pid] < 200 for pid in replicas), growth

    # The server's own refusals, before the body: Host (DNS rebinding), Origin, Content-Type, sizes.
    refused(httpx.get(cluster + "/v1/models", headers={**AUTH, "Host": "evil.example"}), 421, "host_not_allowed")
    evil = {**AUTH, "Origin": "https://evil.example"}
    refused(httpx.get(cluster + "/v1/models", headers=evil), 403, "origin_not_allowed")
    plain = {**AUTH, "Content-Type": "text/plain"}
    refused(httpx.post(url, content=b"{}", headers=plain), 415, "unsupported_media_type")
    big = b" " * (5 * 2**20)  # over the default 4 MiB, by its Content-Length
    refused(httpx.post(url, content=big, headers={**AUTH, **as_json}, timeout=60), 413, "request_too_large")
    chunked = spaces(8 * 2**20)  # over it while it streams
    refused(httpx.post(url, content=chunked, headers={**AUTH, **as_json}, timeout=60), 413, "request_too_large")
    refused(httpx.get(cluster + "/v1/internal/routing", headers=AUTH), 404, "not_found")
    # The page's own origin is served (the replica does not pass it on to a server on another port).
    own = httpx.get(cluster + "/v1/models", headers={**AUTH, "Origin": cluster})
    assert own.status_code == 200, own.text

    # An accepted body is streamed to the server as it comes.
    request = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    text = json.dumps(request).encode()
    pieces = (text[i : i + 7] for i in range(0, len(text), 7))
    streamed = httpx.post(url, content=pieces, headers={**AUTH, **as_json}, timeout=60)
    assert streamed.status_code == 200, streamed.text
    assert streamed.json()["usage"]["completion_tokens"] == 4


def test_killing_the_replica_of_a_session_resumes_it_on_the_other_exactly(cluster):
    from muxworker.serve.ray import replica_actors

    messages = [{"role": "user", "content": "Count from one to twenty, please."}]
    first = chat(cluster, messages, "victim", max_tokens=24)
    holder = first.headers[REPLICA_HEADER]
    messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "And back down?"}]
    time.sleep(1.5)  # a stats period: the replica reports its worker's pid
    second = chat(cluster, messages, "victim", max_tokens=16)
    assert second.headers[REPLICA_HEADER] == holder
    worker_pid = int(second.headers[WORKER_PID_HEADER])
    messages += [second.json()["choices"][0]["message"], {"role": "user", "content": "Thanks!"}]
    # Naming no session: prefilled from scratch (a named session's history is never reused by it).
    cold = chat(cluster, messages, None, max_tokens=12).json()

    ray.kill(ray.get_actor(replica_actors()[holder], namespace="serve"), no_restart=True)
    killed = time.monotonic()
    again = chat(cluster, messages, "victim", max_tokens=12)
    assert time.monotonic() - killed < 5.0
    assert again.headers[REPLICA_HEADER] != holder
    body = again.json()
    # Everything the second turn left (its prompt and reply) came back from the store.
    held = second.json()["usage"]["total_tokens"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= held - 2, (body["usage"], held)
    assert body["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    deadline = killed + 5.0
    while time.monotonic() < deadline and _running(worker_pid):
        time.sleep(0.1)
    assert not _running(worker_pid), "the dead replica's worker is still running"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _wait_running(replicas: int, timeout: float) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout
    while True:
        states = serve.status().applications["muxworker"].deployments["muxworker"].replica_states
        running = {str(getattr(k, "value", k)): v for k, v in states.items()}.get("RUNNING", 0)
        if running == replicas and sum(states.values()) == replicas:
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.5)


def test_a_replica_whose_server_died_answers_503_until_serve_replaces_it(cluster):
    from muxworker.serve.ray import replica_actors

    _wait_running(2, 180)  # the replica the test before killed has been replaced
    messages = [{"role": "user", "content": "Name three colours."}]
    first = chat(cluster, messages, "orphan", max_tokens=12)
    holder = first.headers[REPLICA_HEADER]
    messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "Three more?"}]
    time.sleep(1.5)  # a stats period: the replica reports its worker's pid
    second = chat(cluster, messages, "orphan", max_tokens=12)
    assert second.headers[REPLICA_HEADER] == holder
    worker_pid = int(second.headers[WORKER_PID_HEADER])
    procs = _procs()
    server_pid = procs[worker_pid].ppid
    assert _muxworker_module(procs[server_pid].argv(server_pid)) == "muxworker.serve"
    messages += [second.json()["choices"][0]["message"], {"role": "user", "content": "Thanks!"}]
    time.sleep(1.5)  # the second turn is in the store

    os.kill(server_pid, signal.SIGKILL)  # the server crashes; its replica lives on
    killed = time.monotonic()
    answer = chat(cluster, messages, "orphan", ok=False)
    assert answer.status_code == 503, answer.text
    assert answer.headers[REPLICA_HEADER] == holder
    assert answer.json()["error"]["code"] == "replica_unavailable"
    # Its health check fails, Serve replaces it, and the session resumes on another replica.
    while answer.status_code != 200:
        assert answer.status_code == 503 and answer.headers["retry-after"], (answer.status_code, answer.text)
        assert answer.json()["error"]["type"] == "server_error"
        assert time.monotonic() - killed < 60, "Serve did not replace the replica whose server died"
        time.sleep(float(answer.headers["retry-after"]))
        answer = chat(cluster, messages, "orphan", ok=False)
    assert answer.headers[REPLICA_HEADER] != holder
    held = second.json()["usage"]["total_tokens"]
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= held - 2
    while holder in replica_actors() or _running(worker_pid):
        assert time.monotonic() - killed < 60, "the replica, or its dead server's worker, is still running"
        time.sleep(0.2)


def test_the_ray_command_passes_every_other_flag_to_the_replicas_servers():
    from muxworker.serve.__main__ import _without

    argv = ["--ray", "--replicas", "3", "--port=9000", "--host", "0.0.0.0", "--store", "s3://b/p", "--dtype", "f"]
    flags = {"--ray": 0, "--replicas": 1, "--ray-num-cpus": 1, "--host": 1, "--port": 1}
    assert _without(argv, flags) == ["--store", "s3://b/p", "--dtype", "f"]
