"""python -m muxworker.serve [--model PATH] [--host H] [--port P] [--store DIR] [server flags] [worker flags]

Flags this command does not know are the worker's (``python -m muxworker.worker --help``), passed
to it as given and checked before anything starts. SIGINT or SIGTERM stops accepting requests, lets
the ones in flight finish (``--graceful-timeout``), saves every live session with unsaved turns and
closes the worker.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
from pathlib import Path

import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio import serve

from muxworker.chat import default_store_dir
from muxworker.client import MuxError, StoreBinding, WorkerStartupError, open_store
from muxworker.client.stores import ObjectSessionStore
from muxworker.client.stores.objects import DEFAULT_TIMEOUT
from muxworker.worker.models.loader import BUNDLED_GGUF_NAME, ModelLoadError, resolve_model
from muxworker.worker.options import UsageError
from muxworker.worker.server import EXIT_USAGE
from muxworker.worker.spec import WorkerSpec

from . import defaults
from .app import AppConfig, create_app
from .metrics import ServerMetrics
from .openai_api import ServedModel
from .options import RESERVED_WORKER_FLAGS, check_flags, flag_defaults, http_policy, parser
from .policy import HttpPolicy, startup_problem
from .process import READY_PREFIX
from .service import ModelService, SavePolicy, ServiceConfig

log = logging.getLogger("muxworker.serve")


async def _run(
    args: argparse.Namespace, spec: WorkerSpec, store: StoreBinding, policy: HttpPolicy, served: ServedModel
) -> int:
    metrics = ServerMetrics()
    service = ModelService(
        spec,
        store,
        metrics,
        ServiceConfig(
            save_policy=SavePolicy(args.save),
            max_concurrent_requests=args.max_concurrent_requests,
            max_sessions_per_tenant=args.max_sessions_per_tenant,
            max_store_bytes_per_tenant=args.max_store_bytes_per_tenant,
            collect_interval_s=args.collect_interval,
            max_queued_requests=args.max_queued_requests,
            queue_timeout_s=args.queue_timeout,
            implicit_store_bytes=args.implicit_store_bytes,
            response_ttl_s=args.response_ttl,
            store_timeout_s=_store_timeout(args, store),
        ),
    )
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        try:
            await nursery.start(service.run)
        except WorkerStartupError as exc:
            if exc.returncode == EXIT_USAGE:  # a malformed model file: the worker said why, in one line
                print(f"muxworker serve: {exc.reason}", file=sys.stderr)
                return 2
            log.error("the worker did not start: %s", exc)
            return 1
        app = create_app(service, metrics, AppConfig(served, policy=policy, internal_token=args.internal_token))
        config = _Config()
        config.send_timeout_s = args.send_timeout
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
            print(f"{READY_PREFIX} {served.id} on {' '.join(binds)}", flush=True)
        # serve() has returned: the signal came and its connections have closed (graceful_timeout).
        log.info("shutting down: saving live sessions")
        with trio.CancelScope(shield=True):
            await service.shutdown()
    log.info("stopped")
    return 0


class _Config(Config):
    """hypercorn's config, whose listening sockets give every connection ``send_timeout_s``: the
    kernel cuts a connection whose client has taken none of its bytes for that long (a zero
    window) or acknowledged none (TCP_USER_TIMEOUT, which accepted sockets inherit). hypercorn
    shields its socket writes from cancellation, so the app cannot bound them itself."""

    send_timeout_s: float = 30.0

    def create_sockets(self) -> Sockets:
        sockets = super().create_sockets()
        option = getattr(socket, "TCP_USER_TIMEOUT", None)
        for sock in (*sockets.secure_sockets, *sockets.insecure_sockets):
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if option is None:
                log.warning("--send-timeout is not enforced on this platform (no TCP_USER_TIMEOUT)")
                break
            sock.setsockopt(socket.IPPROTO_TCP, option, int(self.send_timeout_s * 1000))
        return sockets


def _run_ray(args: argparse.Namespace, argv: list[str]) -> int:
    """--ray: every flag but the Ray ones goes to each replica's server as given."""
    try:
        from . import ray as ray_serve
    except ImportError as exc:
        print(f"muxworker serve: --ray needs Ray Serve (pip install 'muxworker[serve]'): {exc}", file=sys.stderr)
        return 2
    server_args = _without(argv, {"--ray": 0, "--replicas": 1, "--ray-num-cpus": 1, "--host": 1, "--port": 1})
    name = _names(args)[0]

    def ready(url: str) -> None:
        print(f"{READY_PREFIX} {name} on {url} ({args.replicas} replicas on Ray)", flush=True)

    return ray_serve.run(
        server_args, replicas=args.replicas, host=args.host, port=args.port, num_cpus=args.ray_num_cpus, ready=ready
    )


def _store_timeout(args: argparse.Namespace, store: StoreBinding) -> float | None:
    """How long a request waits on the store: ``--store-timeout``, else an object store's default
    timeout; a directory store has none unless the flag sets one."""
    if args.store_timeout is not None:
        return args.store_timeout
    return DEFAULT_TIMEOUT if isinstance(store, ObjectSessionStore) else None


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


def _names(args: argparse.Namespace) -> tuple[str, ...]:
    """The model's names: ``--served-model-name``'s (the first is its id), else its file's."""
    return tuple(args.served_model_name or (_default_name(args.model),))


def _request_defaults(args: argparse.Namespace, model_dir: Path) -> defaults.GenerationDefaults:
    """What a request leaves out: the model's defaults (``--generation-config auto``), then the flags'."""
    layers = defaults.model_defaults(model_dir) if args.generation_config == "auto" else []
    return defaults.GenerationDefaults.resolve(*layers, ("flags", flag_defaults(args)))


def _default_name(model: str | None) -> str:
    """The model id clients send by default: the file or directory name the user gave, without
    ``.gguf`` (the worker's own name for a GGUF is its conversion directory's)."""
    path = Path(model) if model is not None else Path(BUNDLED_GGUF_NAME)
    name = path.name if path.name else path.resolve().name
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def main(argv: list[str] | None = None) -> int:
    args, worker_flags = parser().parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for flag in worker_flags:
        if flag.split("=", 1)[0] in RESERVED_WORKER_FLAGS:
            print(f"muxworker serve: {flag} is set by the server itself", file=sys.stderr)
            return 2
    problem = check_flags(args)
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
        # In a process group of its own, so a terminal's Ctrl-C reaches only the server, which saves
        # the sessions before it closes the worker.
        spec = WorkerSpec(model_dir, tuple(worker_flags), own_process_group=True)
    except UsageError as exc:
        print(f"muxworker serve: bad worker flag: {exc}", file=sys.stderr)
        return 2
    try:
        store = trio.run(
            lambda: open_store(
                args.store or default_store_dir(),
                **spec.store_identity(),
                share_blocks_across_namespaces=args.share_prefix_blocks,
                timeout=args.store_timeout,
                # One server per directory store unless --shared-store (client/stores/directory.py).
                hold="shared" if args.shared_store else "exclusive",
                role="muxworker serve" + (" --shared-store" if args.shared_store else ""),
            )
        )
    except (MuxError, OSError, ValueError) as exc:
        print(f"muxworker serve: cannot use the session store: {exc}", file=sys.stderr)
        return 2
    served = ServedModel(_names(args), _request_defaults(args, model_dir))
    log.info("defaults of what a request leaves out: %s", served.defaults.describe())
    try:
        return trio.run(_run, args, spec, store, policy, served)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
