"""python -m muxworker.serve [--model PATH] [--host H] [--port P] [--store DIR] [server flags] [worker flags]

Flags this command does not know are the worker's (``python -m muxworker.worker --help``), passed
to it as given and checked before anything starts. SIGINT or SIGTERM stops accepting requests, lets
the ones in flight finish (``--graceful-timeout``), saves every live session with unsaved turns and
closes the worker.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from muxworker.chat import default_store_dir
from muxworker.client import MuxError, StoreBinding, WorkerStartupError, default_worker_command, open_store
from muxworker.worker.models.identity import model_identity_files, worker_configuration
from muxworker.worker.models.loader import BUNDLED_GGUF_NAME, ModelLoadError, resolve_model
from muxworker.worker.options import UsageError, parse_args

from .app import AppConfig, create_app
from .metrics import ServerMetrics
from .policy import DEFAULT_MAX_REQUEST_BYTES, HttpPolicy, startup_problem
from .process import READY_PREFIX
from .service import ModelService, SavePolicy, ServiceConfig

log = logging.getLogger("muxworker.serve")

API_KEY_ENV = "MUXWORKER_API_KEY"
ADMIN_KEY_ENV = "MUXWORKER_ADMIN_KEY"
# Flags the server sets on the worker itself (the pipes), so a user may not.
_RESERVED = ("--control-fd", "--reply-fd", "--files-fd", "--heartbeat_ms", "--heartbeat-ms")


def _parser() -> argparse.ArgumentParser:
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
        help="seconds an object store may fail to answer before a request gets 503 store_unavailable (default: 30)",
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
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
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
        help="generations admitted at once; more get 429 (default: the worker's max_inflight_requests)",
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


async def _run(args: argparse.Namespace, worker_command: list[str], store: StoreBinding, policy: HttpPolicy) -> int:
    metrics = ServerMetrics()
    service = ModelService(
        worker_command,
        store,
        metrics,
        ServiceConfig(
            save_policy=SavePolicy(args.save),
            max_concurrent_requests=args.max_concurrent_requests,
            max_sessions_per_tenant=args.max_sessions_per_tenant,
            max_store_bytes_per_tenant=args.max_store_bytes_per_tenant,
            collect_interval_s=args.collect_interval,
        ),
    )
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        try:
            await nursery.start(service.run)
        except WorkerStartupError as exc:
            log.error("the worker did not start: %s", exc)
            return 1
        name = args.served_model_name or _default_name(args.model)
        app = create_app(
            service,
            metrics,
            AppConfig(name, policy=policy, internal_token=args.internal_token),
        )
        config = Config()
        config.bind = [f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"]
        config.graceful_timeout = args.graceful_timeout
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")
        config.include_server_header = False

        async def watch_signals() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    stop.set()
                    return

        async def watch_lifeline(fd: int) -> None:
            # The process that started this server holds the other end: EOF means it is gone.
            stream = trio.lowlevel.FdStream(fd)
            while await stream.receive_some(4096):
                pass
            log.warning("the process that started this server is gone: stopping")
            stop.set()

        async with trio.open_nursery() as http:
            http.start_soon(watch_signals)
            if args.lifeline_fd is not None:
                http.start_soon(watch_lifeline, args.lifeline_fd)

            async def serve_until_stopped(task_status: trio.TaskStatus[list[str]]) -> None:
                await serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)  # type: ignore[arg-type]
                # Whichever watcher stopped it, the other must not hold the nursery open (a
                # lifeline EOF left the signal watcher waiting: nothing was saved, nothing exited).
                http.cancel_scope.cancel()

            binds = await http.start(serve_until_stopped)
            # One line on stdout, for people and for scripts waiting for the port (tests parse it).
            print(f"{READY_PREFIX} {name} on {' '.join(binds)}", flush=True)
        # serve() has returned: the signal came and its connections have closed (graceful_timeout).
        log.info("shutting down: saving live sessions")
        with trio.CancelScope(shield=True):
            await service.shutdown()
    log.info("stopped")
    return 0


def _check_flags(args: argparse.Namespace) -> str | None:
    """What is wrong with the server's flags, found before the worker starts (which takes a while)."""
    if not 0 <= args.port <= 65535:
        return f"--port must be in 0..65535, got {args.port}"
    if args.max_concurrent_requests is not None and args.max_concurrent_requests < 1:
        return f"--max-concurrent-requests must be at least 1, got {args.max_concurrent_requests}"
    if args.max_request_bytes < 1024:
        return f"--max-request-bytes must be at least 1024, got {args.max_request_bytes}"
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
    if args.port:
        try:
            family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((args.host, args.port))
        except OSError as exc:
            return f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}"
    return None


def _run_ray(args: argparse.Namespace, argv: list[str]) -> int:
    """--ray: every flag but the Ray ones goes to each replica's server as given."""
    try:
        from . import ray as ray_serve
    except ImportError as exc:
        print(f"muxworker serve: --ray needs Ray Serve (pip install 'muxworker[serve]'): {exc}", file=sys.stderr)
        return 2
    server_args = _without(argv, {"--ray": 0, "--replicas": 1, "--ray-num-cpus": 1, "--host": 1, "--port": 1})
    name = args.served_model_name or _default_name(args.model)

    def ready(url: str) -> None:
        print(f"{READY_PREFIX} {name} on {url} ({args.replicas} replicas on Ray)", flush=True)

    return ray_serve.run(
        server_args, replicas=args.replicas, host=args.host, port=args.port, num_cpus=args.ray_num_cpus, ready=ready
    )


def _without(argv: list[str], flags: dict[str, int]) -> list[str]:
    """``argv`` without ``flags`` (name: how many values follow it), in both --flag V and --flag=V forms."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in flags:
            skip = flags[name] if "=" not in arg else 0
            continue
        out.append(arg)
    return out


def _default_name(model: str | None) -> str:
    """The model id clients send by default: the file or directory name the user gave, without
    ``.gguf`` (the worker's own name for a GGUF is its conversion directory's)."""
    path = Path(model) if model is not None else Path(BUNDLED_GGUF_NAME)
    name = path.name if path.name else path.resolve().name
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def main(argv: list[str] | None = None) -> int:
    args, worker_flags = _parser().parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for flag in worker_flags:
        if flag.split("=", 1)[0] in _RESERVED:
            print(f"muxworker serve: {flag} is set by the server itself", file=sys.stderr)
            return 2
    problem = _check_flags(args)
    if problem is not None:
        print(f"muxworker serve: {problem}", file=sys.stderr)
        return 2
    try:
        policy = http_policy(args)
    except ValueError as exc:
        print(f"muxworker serve: {exc}", file=sys.stderr)
        return 2
    problem = startup_problem(args.host, policy)
    if problem is not None:
        print(f"muxworker serve: {problem}", file=sys.stderr)
        return 2
    if args.ray:
        return _run_ray(args, argv if argv is not None else sys.argv[1:])
    if not policy.api_keys and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without --api-key: anyone who can reach it can use it", args.host)
    try:
        model_dir = resolve_model(args.model, progress=sys.stderr)
    except (ModelLoadError, OSError) as exc:
        print(f"muxworker serve: cannot load the model: {exc}", file=sys.stderr)
        return 2
    try:
        options = parse_args(["--model", str(model_dir), *worker_flags])
    except UsageError as exc:
        print(f"muxworker serve: bad worker flag: {exc}", file=sys.stderr)
        return 2
    try:
        store = trio.run(
            lambda: open_store(
                args.store or default_store_dir(),
                model_files=model_identity_files(model_dir),
                configuration=worker_configuration(
                    backend=options.backend,
                    dtype=options.dtype,
                    device=options.device,
                    weights=options.weights,
                    quantize=options.quantize,
                    model_dir=model_dir,
                    draft=options.draft,
                    n_draft=options.config.n_draft,
                ),
                share_blocks_across_namespaces=args.share_prefix_blocks,
                timeout=args.store_timeout,
            )
        )
    except (MuxError, OSError, ValueError) as exc:
        print(f"muxworker serve: cannot use the session store: {exc}", file=sys.stderr)
        return 2
    command = default_worker_command(model_dir) + list(worker_flags)
    # The worker in a process group of its own, so a terminal's Ctrl-C reaches only the server,
    # which saves the sessions before it closes the worker.
    command[command.index("muxworker.worker")] = "muxworker.chat._worker"
    try:
        return trio.run(_run, args, command, store, policy)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
