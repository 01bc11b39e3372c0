"""Many workers behind one endpoint, on Ray Serve: session-affinity routing, failover by resume.

``pip install 'muxworker[serve]'``; ``python -m muxworker.serve --ray --replicas N [server flags]
[worker flags]`` (docs/SCALE_OUT.md).

- **A replica** (:class:`MuxworkerReplica`, one Ray actor) owns one ``python -m muxworker.serve``
  child on 127.0.0.1, which owns one worker subprocess: the same OpenAI-compatible app, sessions,
  tenants and saves as a single server. The replica forwards each request to it (streaming) and
  reports what the router needs through Serve's routing-stats hook: the sessions live in its worker
  and its free session slots. The child holds a lifeline pipe to the replica: when the replica dies
  (killed, or its node lost) the child sees EOF, stops and its worker exits with it.
- **The router** (:class:`SessionAffinityRouter`, a Serve request router) places a request that
  names a session (``X-Session-Id``, which Serve's proxy hands to the router as the request's
  session id): first on the replica that holds the session live, then on a replica with a free slot
  in a stable order for that session (rendezvous hashing, so every proxy agrees and a replica
  joining or leaving moves only its own share), then on the least loaded. A request without a
  session goes to the least loaded.
- **Failover.** What is shared is only the store (an ``s3://`` URL, or a directory every replica
  reaches). A session whose replica is busy, full or gone is resumed from the store by another:
  the client always sends the whole conversation and the worker reuses only the exactly matching
  prefix, so a routing mistake costs recompute time, never a wrong answer, and no lock is needed.
- **Health.** A replica whose child server has exited, or whose worker has been down past
  :data:`WORKER_DOWN_GRACE_S` (the server restarts its worker by itself, in seconds), fails Serve's
  health check, so Serve replaces it and the router stops sending it sessions; until then it
  answers 503 with Retry-After. A store outage is not a replica's fault and fails no check.
- **Refusals before the body.** A replica applies the server's own :class:`~.policy.HttpPolicy`
  (Host against the public address, Origin, Content-Type, Content-Length, the API key) before it
  reads a byte of the body, then streams the body to its child, counting it against the limit.

Owners: the router's state (a session -> replica table of its own placements) is per proxy
process; each replica's state is its child server's.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from . import openai_api as oa
from .policy import HttpPolicy, is_loopback, is_wildcard

__all__ = [
    "SessionAffinityRouter",
    "MuxworkerReplica",
    "ReplicaView",
    "rank_replicas",
    "deployment",
    "REPLICA_HEADER",
    "WORKER_PID_HEADER",
    "ReplicaUnhealthy",
]

#: Response header naming the replica that served a request (its Serve unique id).
REPLICA_HEADER = "x-muxworker-replica"
#: Response header with the pid of that replica's worker process (once it reported its stats).
WORKER_PID_HEADER = "x-muxworker-worker-pid"
#: Routing stats period: how stale the replicas' reports of their sessions may be. The router's own
#: table of placements covers the sessions it placed since.
STATS_PERIOD_S = 0.5
#: How long a replica's worker may be down before the replica fails Serve's health check. Its
#: server restarts a dead worker by itself, which takes seconds (backing off to 30 s between
#: failed starts), so only a worker down for longer than that is worth a new replica.
WORKER_DOWN_GRACE_S = 60.0
#: Serve's health-check period for the replicas (three failures in a row replace one).
HEALTH_CHECK_PERIOD_S = 1.0
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}
# Request headers not forwarded to the child: hop-by-hop ones (a streamed body keeps the client's
# Content-Length, or goes chunked), and Host, so httpx names the child's own address, which it serves.
_REQUEST_DROP = {"connection", "keep-alive", "transfer-encoding", "host"}


class ReplicaUnhealthy(RuntimeError):
    """This replica's server has exited, or its worker has been down past WORKER_DOWN_GRACE_S."""


class _BodyTooLarge(Exception):
    """A request body without a declared length went over the limit while it streamed."""


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica: its id, its last routing stats, its queue length."""

    replica_id: str
    sessions: frozenset[str]
    free_slots: int | None  # None: not reported yet
    load: int


def _weight(session_id: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session_id}\0{replica_id}".encode(), digest_size=8).digest(), "big")


def rank_replicas(session_id: str | None, replicas: Sequence[ReplicaView], placed: str | None = None) -> list[str]:
    """Replica ids in the order to try for a request of ``session_id``: the replica this router
    placed it on last (``placed``), the ones reporting it live, the ones with a free slot in the
    session's rendezvous-hash order, then all by load. Sans-Ray, for tests and the router."""
    order: list[str] = []

    def add(ids: Iterable[str]) -> None:
        for rid in ids:
            if rid not in order:
                order.append(rid)

    known = {r.replica_id for r in replicas}
    if session_id:
        if placed is not None and placed in known:
            add([placed])
        add(r.replica_id for r in replicas if session_id in r.sessions)
        hashed = sorted(replicas, key=lambda r: _weight(session_id, r.replica_id), reverse=True)
        add(r.replica_id for r in hashed if r.free_slots is None or r.free_slots > 0)
    add(r.replica_id for r in sorted(replicas, key=lambda r: (r.load, r.replica_id)))
    return order


def _router_base() -> type:
    from ray.serve.request_router import RequestRouter

    return RequestRouter


class SessionAffinityRouter(_router_base()):  # type: ignore[misc]
    """Ray Serve request router: session affinity (module docstring), one replica per rank so the
    order is kept. No FIFOMixin: the replica found goes to the request it was found for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # session id -> (ReplicaID this router sent it to last, when)
        self._placed: dict[str, tuple[Any, float]] = {}

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        if not candidate_replicas:
            return []
        if pending_request is None:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # all full: back off, do not spin
        session_id = pending_request.metadata.session_id or None
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        recent = time.monotonic() - 3 * STATS_PERIOD_S
        views = []
        for r in candidate_replicas:
            stats = r.routing_stats or {}
            reported = frozenset(stats.get("sessions", ()))
            queued = self.replica_queue_len_cache.get(r.replica_id)
            free = stats.get("free_slots")
            if isinstance(free, int):
                # Sessions this router placed there since its last report hold slots it has not counted.
                free -= sum(
                    1
                    for s, (rid, at) in self._placed.items()
                    if rid == r.replica_id and at > recent and s not in reported
                )
            views.append(
                ReplicaView(
                    r.replica_id.unique_id,
                    reported,
                    free if isinstance(free, int) else None,
                    queued if queued is not None else int(stats.get("ongoing", 0)),
                )
            )
        placed = self._placed.get(session_id) if session_id else None
        order = rank_replicas(session_id, views, placed[0].unique_id if placed is not None else None)
        return [[by_id[rid]] for rid in order]

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        session_id = pending_request.metadata.session_id
        if session_id:
            self._placed[session_id] = (replica_id, time.monotonic())

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._placed = {s: p for s, p in self._placed.items() if p[0] != replica_id}

    def update_replicas(self, replicas: list[Any]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        self._placed = {s: p for s, p in self._placed.items() if p[0] in live}


def _bind_serve_grpc_to_loopback() -> None:
    """In a replica on a node whose address is the loopback one (the local cluster :func:`run`
    starts for a loopback ``--host``): Serve 2.60's replica opens its inter-deployment gRPC port on
    every interface (``"[::]:0"``, hard-coded in ``ray.serve._private.replica``); it binds the
    loopback address instead, as every other Ray port there does. Elsewhere nothing changes (other
    nodes may reach that port)."""
    import ray

    try:
        from ray.serve._private import replica as serve_replica
    except ImportError:  # another Serve layout: test_ray.py's socket check says so
        return
    node = ray.util.get_node_ip_address()
    original = getattr(serve_replica, "add_port_to_grpc_server", None)
    if not is_loopback(node) or original is None or getattr(original, "muxworker_loopback", False):
        return

    def add_port(server: Any, address: str) -> Any:
        if address.startswith("[::]:") or address.startswith("0.0.0.0:"):
            port = address.rsplit(":", 1)[1]
            address = f"[{node}]:{port}" if ":" in node else f"{node}:{port}"
        return original(server, address)

    add_port.muxworker_loopback = True  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = add_port


def _http_policy(server_args: Sequence[str]) -> HttpPolicy:
    """The refusals of the server ``server_args`` start, built by the server's own parser and
    :func:`~.options.http_policy` (keys also from the environment, as the child reads them)."""
    from .options import http_policy, parser

    args, _ = parser().parse_known_args(list(server_args))
    return http_policy(args)


class MuxworkerReplica:
    """One Serve replica: a ``python -m muxworker.serve`` child and its worker (module docstring).
    ``server_args`` are the server's and the worker's flags (no --host or --port); ``public`` is
    the (host, port) Serve's proxies listen on, which a request's Host must name (None, or a
    wildcard host: the address the proxy's connection came in on, as a single server checks)."""

    def __init__(
        self, server_args: Sequence[str], log_dir: str | None = None, public: tuple[str, int] | None = None
    ) -> None:
        import httpx
        from ray import serve

        from .process import ServerProcess

        _bind_serve_grpc_to_loopback()
        self._policy = _http_policy(server_args)  # a bad flag fails the deployment before a child starts
        self._public = None if public is None or is_wildcard(public[0]) else (public[0], int(public[1]))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._token = secrets.token_hex(16)
        read_end, self._lifeline = os.pipe()  # the child's EOF on read_end: this process is gone
        os.set_inheritable(read_end, True)
        log_path = None if log_dir is None else os.path.join(log_dir, f"replica-{self.replica_id}.log")
        self._server = ServerProcess(
            [
                *server_args,
                # Every replica writes the one store: a directory store is shared, not held by one.
                *([] if "--shared-store" in server_args else ["--shared-store"]),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--internal-token",
                self._token,
                "--lifeline-fd",
                str(read_end),
            ],
            log_path=log_path,
            pass_fds=(read_end,),
        )
        try:
            self._server.start()
        finally:
            os.close(read_end)
        self._http = httpx.AsyncClient(base_url=self._server.url, timeout=httpx.Timeout(None, connect=10.0))
        self._stats: dict[str, Any] = {}
        self._unready_since: float | None = None  # when the child last began to say its worker is down

    def _exited(self) -> int | None:
        """The child server's exit status once it has exited (reaped here), else None."""
        assert self._server.process is not None
        return self._server.process.poll()

    async def check_health(self) -> None:
        """Serve's health check (every HEALTH_CHECK_PERIOD_S; three failures replace the replica):
        raises :class:`ReplicaUnhealthy` when the child server has exited, or when its worker has
        been down (or the child silent) for WORKER_DOWN_GRACE_S. A store outage does not count:
        the child's /health says "degraded" then, with status 200."""
        import httpx

        code = self._exited()
        if code is not None:
            raise ReplicaUnhealthy(f"the replica's server exited with status {code}: {self._server.log_tail(5)}")
        try:
            response = await self._http.get("/health", timeout=5.0)
            ready, reason = response.status_code == 200, response.text[:200]
        except httpx.HTTPError as exc:
            ready, reason = False, f"the server did not answer /health: {type(exc).__name__}: {exc}"
        now = time.monotonic()
        if ready:
            self._unready_since = None
            return
        if self._unready_since is None:
            self._unready_since = now
        if now - self._unready_since > WORKER_DOWN_GRACE_S:
            raise ReplicaUnhealthy(
                f"the replica's worker has been down for {now - self._unready_since:.0f} s: {reason}"
            )

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing-stats hook (every STATS_PERIOD_S): the sessions live in this replica's
        worker and its free slots, from the child server (none while the child is gone)."""
        if self._exited() is not None:
            self._stats = {"ready": False, "sessions": [], "free_slots": 0, "evictions": 0, "worker_pid": None}
            return self._stats
        response = await self._http.get(
            "/v1/internal/routing", headers={"authorization": f"Bearer {self._token}"}, timeout=2.0
        )
        response.raise_for_status()
        self._stats = response.json()
        return self._stats

    def _admit(self, request: Any) -> None:
        """Raise the APIError a request is refused with before its body is read: the server's own
        refusals (Host against the public address, Origin, Content-Type, Content-Length), then the
        key (the child checks both again, on what it is sent)."""
        headers, method, path = request.headers, request.method, request.url.path
        server = self._public if self._public is not None else request.scope.get("server")
        err = self._policy.refusal(method, headers, server)
        if err is not None:
            raise err
        if path.startswith("/v1/internal/"):
            raise oa.APIError(404, f"no route for {path!r:.100}", code="not_found")
        if method == "OPTIONS" or path == "/health":
            return  # a preflight carries no key; the child answers it
        if path == "/metrics":
            self._policy.check_admin(headers)
        else:
            self._policy.tenant(headers)

    def _error(self, err: oa.APIError, origin: str | None) -> Any:
        from starlette.responses import JSONResponse

        headers = {**err.headers, REPLICA_HEADER: self.replica_id}
        if err.status == 413:
            headers["Connection"] = "close"  # the unread rest of the body must not reach the next request
        headers.update((k.decode(), v.decode("latin-1")) for k, v in self._policy.cors_headers(origin))
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    def _unavailable(self, why: str) -> oa.APIError:
        return oa.APIError(
            503,
            f"this replica's server is unavailable ({why}); retry, another replica will take the session",
            type="server_error",
            code="replica_unavailable",
            headers={"Retry-After": str(oa.RETRY_AFTER_S)},
        )

    async def _body(self, request: Any) -> AsyncIterator[bytes]:
        """The request body as it arrives, at most the policy's limit (a declared Content-Length
        over it was refused before a byte was read)."""
        limit, seen = self._policy.max_request_bytes, 0
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > limit:
                raise _BodyTooLarge(seen)
            if chunk:
                yield chunk

    async def __call__(self, request: Any) -> Any:
        """Refuse what the server would refuse before reading the body, then forward the request
        to the child server, body streamed, and stream its response back."""
        import httpx
        from starlette.background import BackgroundTask
        from starlette.requests import ClientDisconnect
        from starlette.responses import StreamingResponse

        origin = request.headers.get("origin")
        try:
            self._admit(request)
        except oa.APIError as refusal:
            return self._error(refusal, origin)
        code = self._exited()
        if code is not None:
            return self._error(self._unavailable(f"it exited with status {code}"), origin)
        # An Origin that passed and is not a --cors-origin is the public address's own, which the
        # child (serving its own 127.0.0.1 address) would take for a foreign one: not forwarded.
        drop = _REQUEST_DROP if self._policy.cors_headers(origin) else _REQUEST_DROP | {"origin"}
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in drop]
        has_body = request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers
        upstream = self._http.build_request(
            request.method,
            request.url.path,
            params=request.url.query,
            headers=headers,
            content=self._body(request) if has_body else None,
        )
        try:
            response = await self._http.send(upstream, stream=True)
        except _BodyTooLarge:
            limit = self._policy.max_request_bytes
            too_large = oa.APIError(
                413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large"
            )
            return self._error(too_large, origin)
        except ClientDisconnect:
            return self._error(oa.bad_request("the client went away during the body", code="invalid_request"), origin)
        except httpx.TransportError as exc:
            code = self._exited()
            why = f"it exited with status {code}" if code is not None else f"{type(exc).__name__}: {exc}"
            return self._error(self._unavailable(why), origin)
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}
        out_headers[REPLICA_HEADER] = self.replica_id
        if self._stats.get("worker_pid"):
            out_headers[WORKER_PID_HEADER] = str(self._stats["worker_pid"])
        return StreamingResponse(
            response.aiter_raw(),
            status_code=response.status_code,
            headers=out_headers,
            background=BackgroundTask(response.aclose),
        )

    def __del__(self) -> None:
        try:
            os.close(self._lifeline)  # the child stops; a killed actor closes it anyway
        except (AttributeError, OSError):
            pass


def deployment(
    server_args: Sequence[str],
    *,
    replicas: int,
    max_ongoing_requests: int = 64,
    num_cpus: float = 0.25,
    log_dir: str | None = None,
    host: str | None = None,
    port: int | None = None,
) -> Any:
    """The Serve application: ``replicas`` of :class:`MuxworkerReplica` behind :class:`SessionAffinityRouter`.
    ``host`` and ``port``: where Serve's proxies listen (``http_options``), the only Host a request
    may name besides ``--allowed-host`` values (without them: the address a connection came in on)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    router: dict[str, Any] = {
        "request_router_class": SessionAffinityRouter,
        "request_routing_stats_period_s": STATS_PERIOD_S,
        "request_routing_stats_timeout_s": 2.0,
    }
    decorate = serve.deployment(
        name="muxworker",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=10.0,
        ray_actor_options={"num_cpus": num_cpus},
        request_router_config=RequestRouterConfig(**router),
    )
    public = (host, port) if host is not None and port is not None else None
    return decorate(MuxworkerReplica).bind(list(server_args), log_dir, public)


def replica_actors(app_name: str = "muxworker") -> dict[str, str]:
    """{replica unique id: actor name} of the running replicas (namespace ``serve``)."""
    import ray

    out = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"] if isinstance(actor, dict) else actor
        if name.startswith(f"SERVE_REPLICA::{app_name}#"):
            out[name.rsplit("#", 1)[1]] = name
    return out


def local_cluster_options(host: str) -> dict[str, Any]:
    """``ray.init``'s options for the local cluster :func:`run` starts, so that Ray's daemons listen
    where the server does (``--host``). Loopback: Ray's single-machine mode, its node address the
    loopback one, so the GCS, the raylet and object manager, the agents, the workers and their
    metrics ports all bind it (Ray turns a loopback ``_node_ip_address`` into the machine's outward
    address otherwise). Another address: Ray's node address (Ray 2.60 still binds its gRPC ports on
    every interface then: docs/SCALE_OUT.md). A wildcard: Ray's defaults."""
    if is_wildcard(host):
        return {}
    if not is_loopback(host):
        return {"_node_ip_address": host.strip("[]")}
    from ray._private import ray_constants

    # The switch Ray keeps for macOS and Windows, where a cluster is one machine: set in this
    # process (read when Ray picks its node address) and for every Ray process started from here.
    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    return {}


def run(
    server_args: Sequence[str],
    *,
    replicas: int,
    host: str,
    port: int,
    num_cpus: int | None = None,
    ready: Callable[[str], None] | None = None,
) -> int:
    """Start a local Ray cluster, deploy, print the ready line, serve until SIGINT or SIGTERM."""
    import ray
    from ray import serve

    ray.init(
        num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False, **local_cluster_options(host)
    )
    stop = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    try:
        serve.start(http_options={"host": host, "port": port})
        app = deployment(server_args, replicas=replicas, host=host, port=port)
        serve.run(app, name="muxworker", route_prefix="/")
        if ready is not None:
            ready(f"http://{host}:{port}")
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        while not stop:
            time.sleep(0.2)
        return 0
    finally:
        try:
            serve.shutdown()  # the replicas stop; their servers see EOF on their lifelines and save
        finally:
            ray.shutdown()
            print("muxworker serve: stopped", file=sys.stderr, flush=True)
