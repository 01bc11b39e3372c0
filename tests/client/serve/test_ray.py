"""Many workers on Ray Serve (muxworker.serve.ray): a real local Ray cluster (num_cpus=2) with two
replicas, each a real server and worker (the bundled SmolLM2, float32), sharing one store directory.

What is checked: the session-affinity router splits 8 sessions 4/4 over two replicas of 4 slots
with no eviction, and keeps each on its replica; when the replica holding a session is killed, the
next turn is answered within 5 s by the other, resumed from the store (only the new turn
prefilled), with the tokens a cold run gives; the dead replica's worker process is gone within
5 s; everything together stays under 4 GiB of RSS.
"""

from __future__ import annotations

import os
import socket
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

from muxworker.serve.process import tree_rss  # noqa: E402
from muxworker.serve.ray import REPLICA_HEADER, WORKER_PID_HEADER, ReplicaView, rank_replicas  # noqa: E402

SLOTS = 4


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
        args += ["--max_sessions", str(SLOTS), "--max_session_tokens", "512", "--threads", "1"]
        serve.run(deployment(args, replicas=2, log_dir=str(logs)), name="muxworker", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def chat(url: str, messages, session: str | None, max_tokens: int = 8) -> httpx.Response:
    headers = {"X-Session-Id": session} if session else {}
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
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
    stats = httpx.get(cluster + "/v1/sessions", timeout=30)
    assert stats.status_code == 200
    assert tree_rss(os.getpid()) < 4 * 2**30


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
    cold = chat(cluster, messages, None, max_tokens=12).json()  # stateless: prefilled from scratch

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


def test_the_ray_command_passes_every_other_flag_to_the_replicas_servers():
    from muxworker.serve.__main__ import _without

    argv = ["--ray", "--replicas", "3", "--port=9000", "--host", "0.0.0.0", "--store", "s3://b/p", "--dtype", "f"]
    flags = {"--ray": 0, "--replicas": 1, "--ray-num-cpus": 1, "--host": 1, "--port": 1}
    assert _without(argv, flags) == ["--store", "s3://b/p", "--dtype", "f"]
