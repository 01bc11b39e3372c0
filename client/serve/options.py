"""The server's command line: its flags (:func:`parser`), their checks (:func:`check_flags`), and
the HTTP refusals they configure (:func:`http_policy`). One definition, read by the server and by
each Ray replica (muxworker.serve.ray), which builds the same policy from the flags it passes on.
"""

from __future__ import annotations

import argparse
import os
import socket
import textwrap
from collections.abc import Mapping

from muxworker.chat import default_store_dir

from . import defaults
from .policy import DEFAULT_MAX_REQUEST_BYTES, HttpPolicy
from .service import SavePolicy, ServiceConfig

__all__ = [
    "ADMIN_KEY_ENV",
    "API_KEY_ENV",
    "RESERVED_WORKER_FLAGS",
    "check_flags",
    "flag_defaults",
    "http_policy",
    "parser",
]

API_KEY_ENV = "MUXWORKER_API_KEY"
ADMIN_KEY_ENV = "MUXWORKER_ADMIN_KEY"
# Flags the server sets on the worker itself (the pipes), so a user may not.
RESERVED_WORKER_FLAGS = ("--control-fd", "--reply-fd", "--files-fd", "--heartbeat_ms", "--heartbeat-ms")


_SERVICE = ServiceConfig()  # the one definition of the service's defaults


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m muxworker.serve",
        description=textwrap.fill(
            "An OpenAI-compatible HTTP server over one muxworker worker. Sessions named by an X-Session-Id "
            "header (or a session_id body field) are kept in the worker, saved to the store after each turn, "
            "and resumed from it after a restart. Unknown flags are the worker's.",
            100,
        ),
        allow_abbrev=False,
    )
    p.add_argument("--model", default=None, help="HF model directory or .gguf (default: the bundled SmolLM2)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one (default: 8000)")
    p.add_argument(
        "--store",
        default=None,
        help=f"session store: a directory, or s3://bucket/prefix (also gs://, az://; credentials from the "
        f"environment) (default: {default_store_dir()})",
    )
    p.add_argument(
        "--store-timeout",
        type=float,
        default=None,
        help="seconds the store may fail to answer before a request gets 503 store_unavailable, also while it "
        "waits for an eviction save, and past which /health says degraded (default: 30 for an object store, "
        "none for a directory)",
    )
    p.add_argument(
        "--shared-store",
        action="store_true",
        help="share a directory --store with other --shared-store servers (Ray replicas pass it), the chat app "
        "and the sessions command; by default a server holds its directory store alone and a second one exits "
        "naming the first. Either way a save over another writer's fails with 409 save_conflict",
    )
    p.add_argument(
        "--share-prefix-blocks",
        action="store_true",
        help="let the store keep one copy of a prompt prefix for every tenant (API key) that sends it; by "
        "default each tenant's blocks are its own, so a save's timing never tells one tenant what another sent",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help=f"require Authorization: Bearer KEY on every endpoint but /health; repeat for several tenants "
        f"(each its own sessions and prefix-cache namespace). Also read from ${API_KEY_ENV}",
    )
    p.add_argument(
        "--admin-key",
        action="append",
        default=[],
        help=f"with --api-key: a key that may read /metrics (server-wide figures no tenant's key reads). "
        f"Also read from ${ADMIN_KEY_ENV}",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        help="a Host value to serve besides the bound address (NAME for any port, or NAME:PORT); repeatable. "
        "Other Host values get 421, so a web page cannot reach the server through DNS rebinding. "
        "Needed (or --api-key) to bind a non-loopback address",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        help="a web origin (https://app.example, or *) whose pages may call the server; repeatable. "
        "Other origins get 403",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model id clients send (default: the model's name); more names are aliases, also accepted "
        "(/v1/models lists the first)",
    )
    p.add_argument(
        "--generation-config",
        choices=["auto", "none"],
        default="auto",
        help="auto: the model's generation_config.json (or a GGUF's general.sampling.* metadata) sets the "
        "defaults of what a request leaves out, before the --default-* flags; none: only the flags (default: auto)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=defaults.DEFAULT_MAX_TOKENS,
        help="max_tokens of a request that sets none, cut to the room its prompt leaves in the context "
        "(0: to the end of the context) (default: %(default)s)",
    )
    for name, kind in defaults.FIELDS.items():
        if name != "max_tokens":
            p.add_argument(
                f"--default-{name.replace('_', '-')}",
                type=kind,
                default=None,
                help=f"{name} of a request that sets none, where the model says nothing"
                + (" (default: OpenAI's 1)" if name == "temperature" else ""),
            )
    p.add_argument(
        "--save",
        choices=[p.value for p in SavePolicy],
        default=SavePolicy.TURN.value,
        help="turn: save a session in the background after each turn (default); sync: save each turn before "
        "answering it; evict: only on eviction and shutdown",
    )
    p.add_argument(
        "--max-sessions-per-tenant",
        type=int,
        default=None,
        help="named sessions (live or stored) one API key may have; more get 429 (default: no limit)",
    )
    p.add_argument(
        "--max-store-bytes-per-tenant",
        type=int,
        default=None,
        help="store bytes one API key's sessions may take; turns beyond it get 507 (default: no limit)",
    )
    p.add_argument(
        "--collect-interval",
        type=float,
        default=3600.0,
        help="seconds between collections of store files no session names, e.g. left by a killed save "
        "(0: never; default: %(default)s)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body accepted (default: %(default)s)",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="generations run at once; more wait in the queue, and a slot that comes free goes to the waiting "
        "tenant running the fewest (default: the worker's max_sessions or max_inflight_requests, whichever is lower)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=_SERVICE.max_queued_requests,
        help="generations that may wait for a slot, served tenant by tenant in turn (without API keys: client "
        "address by address); when it is full, a tenant holding more places than another gives one up to it; "
        "more get 429 (default: %(default)s)",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=_SERVICE.queue_timeout_s,
        help="seconds a generation may wait for a slot before a 429 (default: %(default)s)",
    )
    p.add_argument(
        "--implicit-store-bytes",
        type=int,
        default=_SERVICE.implicit_store_bytes,
        help="store bytes each tenant's implicit sessions (reuse for requests that name no session) may take; "
        "the least recently used are deleted beyond it, and before the tenant's --max-store-bytes-per-tenant "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--response-ttl",
        type=float,
        default=_SERVICE.response_ttl_s,
        help="seconds a stored response (/v1/responses) and its session are kept after their last use "
        "(default: %(default)s, 30 days)",
    )
    p.add_argument(
        "--send-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take none of a response's bytes before its connection is cut (Linux: "
        "TCP_USER_TIMEOUT); its generation never waits for it (default: %(default)s)",
    )
    p.add_argument(
        "--graceful-timeout", type=float, default=30.0, help="seconds in-flight requests get at shutdown (default: 30)"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--ray",
        action="store_true",
        help="serve on a local Ray cluster: --replicas servers, each with its own worker, behind a "
        "session-affinity router (pip install 'muxworker[serve]'; docs/SCALE_OUT.md)",
    )
    p.add_argument("--replicas", type=int, default=2, help="with --ray: servers, each with its own worker (default: 2)")
    p.add_argument("--ray-num-cpus", type=int, default=None, help="with --ray: CPUs of the local Ray cluster")
    # Set by a Ray replica on the server it runs (muxworker.serve.ray), not by people.
    p.add_argument("--internal-token", default=None, help=argparse.SUPPRESS)
    p.add_argument("--lifeline-fd", type=int, default=None, help=argparse.SUPPRESS)
    return p


def http_policy(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> HttpPolicy:
    """The refusals of a server started with ``args`` (keys from the flags and the environment);
    a Ray replica builds the same from the server flags it passes on. ValueError names a bad flag."""
    keys = tuple(args.api_key) + ((environ[API_KEY_ENV],) if environ.get(API_KEY_ENV) else ())
    admin = tuple(args.admin_key) + ((environ[ADMIN_KEY_ENV],) if environ.get(ADMIN_KEY_ENV) else ())
    if any(not k.strip() or k != k.strip() for k in keys + admin):
        raise ValueError("an API key must be non-empty, without surrounding spaces")
    if admin and not keys:
        raise ValueError("--admin-key needs --api-key: without tenant keys every caller reads /metrics")
    return HttpPolicy(
        api_keys=keys,
        admin_keys=admin,
        max_request_bytes=args.max_request_bytes,
        allowed_hosts=tuple(args.allowed_host),
        cors_origins=tuple(args.cors_origin),
    )


def flag_defaults(args: argparse.Namespace) -> dict[str, int | float | None]:
    """The request defaults the ``--default-*`` flags set (None: unset), by field name."""
    out = {name: getattr(args, f"default_{name}") for name in defaults.FIELDS}
    if out["max_tokens"] == 0:
        out["max_tokens"] = None  # to the end of the context
    return out


def check_flags(args: argparse.Namespace) -> str | None:
    """What is wrong with the server's flags, found before the worker starts (which takes a while)."""
    if not 0 <= args.port <= 65535:
        return f"--port must be in 0..65535, got {args.port}"
    if args.max_concurrent_requests is not None and args.max_concurrent_requests < 1:
        return f"--max-concurrent-requests must be at least 1, got {args.max_concurrent_requests}"
    if args.max_queued_requests < 0 or not args.queue_timeout >= 0:
        return "--max-queued-requests and --queue-timeout must be at least 0"
    if args.implicit_store_bytes < 0 or not args.response_ttl > 0:
        return "--implicit-store-bytes must be at least 0 and --response-ttl above 0"
    if args.max_request_bytes < 1024:
        return f"--max-request-bytes must be at least 1024, got {args.max_request_bytes}"
    if not 1 <= args.send_timeout <= 3600:
        return f"--send-timeout must be in [1, 3600] seconds, got {args.send_timeout}"
    if not args.graceful_timeout >= 0:
        return f"--graceful-timeout must be >= 0, got {args.graceful_timeout}"
    if not 1 <= args.replicas <= 1024:
        return f"--replicas must be in 1..1024, got {args.replicas}"
    for name in ("max_sessions_per_tenant", "max_store_bytes_per_tenant"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {value}"
    if args.store_timeout is not None and not 0 < args.store_timeout <= 3600:
        return f"--store-timeout must be in (0, 3600] seconds, got {args.store_timeout}"
    if not args.collect_interval >= 0:
        return f"--collect-interval must be >= 0, got {args.collect_interval}"
    if args.ray_num_cpus is not None and args.ray_num_cpus < 1:
        return f"--ray-num-cpus must be at least 1, got {args.ray_num_cpus}"
    if args.served_model_name is not None and not all(n.strip() for n in args.served_model_name):
        return "--served-model-name: a name must not be empty"
    for name, value in flag_defaults(args).items():
        try:
            if value is not None:
                defaults.check_value(name, value)
        except ValueError as exc:
            return f"--default-{name.replace('_', '-')}: {exc}"
    if args.port:
        try:
            family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((args.host, args.port))
        except OSError as exc:
            return f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}"
    return None
