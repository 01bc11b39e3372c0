"""Start ``python -m muxworker.serve`` as a child process and wait until it listens.

For scripts, benchmarks and tests that need a real server: ``with ServerProcess(["--store", d]) as
server: httpx.get(server.url + "/health")``. The server prints one line when it listens
(:data:`READY_PREFIX`, then the model id and its URLs); everything else it writes goes to a log file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "READY_PREFIX",
    "ProcStat",
    "ServerProcess",
    "ServerStartError",
    "descendants",
    "process_table",
    "tree_rss",
]

#: The line the server prints on stdout once it accepts connections: ``<prefix> <model> on <url> ...``.
READY_PREFIX = "muxworker serve:"


class ServerStartError(RuntimeError):
    """The server exited or stayed silent before it listened; the message carries its log's tail."""


class ServerProcess:
    """One server child process (see the module docstring). ``url`` is its first bound URL."""

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        startup_timeout: float = 180.0,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.args = ["--port", "0", *args] if "--port" not in args else list(args)
        self.startup_timeout = startup_timeout
        self.env = env
        self.log_path = Path(log_path) if log_path is not None else Path(tempfile.mkstemp(suffix=".log")[1])
        self.pass_fds = tuple(pass_fds)
        self.process: subprocess.Popen[str] | None = None
        self.url = ""
        self.model = ""

    def start(self) -> ServerProcess:
        log = open(self.log_path, "a")  # noqa: SIM115 - owned by the process, closed in stop()
        self._log = log
        self.process = subprocess.Popen(
            [sys.executable, "-m", "muxworker.serve", *self.args],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, **(self.env or {})},
            pass_fds=self.pass_fds,
        )
        ready = threading.Event()
        line_box: list[str] = []

        def read() -> None:
            assert self.process is not None and self.process.stdout is not None
            for line in self.process.stdout:
                if line.startswith(READY_PREFIX) and not ready.is_set():
                    line_box.append(line)
                    ready.set()
                log.write(line)
                log.flush()
            ready.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        if not ready.wait(self.startup_timeout) or not line_box:
            self.stop()
            raise ServerStartError(f"the server did not start: {self.log_tail()}")
        words = line_box[0][len(READY_PREFIX) :].split()
        self.model = words[0]
        self.url = words[words.index("on") + 1]
        return self

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90.0) -> int | None:
        """Ask it to stop (it saves its sessions first), then kill it after ``timeout`` seconds."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(sig)
            deadline = time.monotonic() + timeout
            while process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if process.poll() is None:
                process.kill()
                process.wait()
        self._reader.join(timeout=5)  # it reads until EOF, which the exit brought
        if process.stdout is not None:
            process.stdout.close()
        self._log.close()
        return process.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@dataclass(frozen=True)
class ProcStat:
    """One process as ``/proc/<pid>/stat`` shows it (Linux)."""

    ppid: int
    state: str  # "R", "S", ..., "Z" for a zombie (exited, not reaped)
    start_ticks: int  # clock ticks after boot: with the pid, names a process for good
    rss_bytes: int

    def argv(self, pid: int) -> list[str]:
        """The command line of ``pid`` ([] once it is gone or for a kernel thread)."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            return []


def process_table() -> dict[int, ProcStat]:
    """Every process on the machine, from /proc (Linux): for tests and scripts that count a server's
    processes or add up their memory."""
    page = os.sysconf("SC_PAGE_SIZE")
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        out[int(entry)] = ProcStat(int(fields[1]), fields[0], int(fields[19]), int(fields[21]) * page)
    return out


def descendants(root: int, table: dict[int, ProcStat] | None = None) -> list[int]:
    """The pids of ``root``'s children, theirs, and so on (``table``: :func:`process_table`)."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, stat in table.items():
        children.setdefault(stat.ppid, []).append(pid)
    out, stack = [], [root]
    while stack:
        kids = children.get(stack.pop(), [])
        out.extend(kids)
        stack.extend(kids)
    return out


def tree_rss(root: int) -> int:
    """Bytes of RSS of process ``root`` and all its descendants, from /proc (Linux): what a server
    and its workers (or a local Ray cluster, from its driver) hold. Pages shared between processes
    count once per process."""
    table = process_table()
    return sum(table[pid].rss_bytes for pid in [root, *descendants(root, table)] if pid in table)
