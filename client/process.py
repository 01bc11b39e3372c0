"""The worker process seen from the client: spawn it, read its hello, pump its stderr, reap it.

Owner: :class:`WorkerProcess` owns the child process, the client's ends of its two pipes until
the connection takes them, and the tail of its stderr. The connection (``connection.py``) never
touches the process; it asks this object to reap the worker and for its exit status and stderr tail
when the connection is lost, through the small :class:`~.connection.Peer` interface.

The child process is always reaped (terminate, then kill after a grace period) in a shielded scope,
also when the caller is cancelled.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import trio

from muxworker.transport.errors import ProtocolError, WorkerStartupError
from muxworker.transport.fdio import WorkerPipes, flags_of
from muxworker.transport.fdpass import FileChannelPair
from muxworker.transport.messages import WorkerInfo
from muxworker.transport.schema import check_hello
from muxworker.transport.trio_stream import TrioFrameReader

__all__ = ["WorkerProcess", "default_worker_command", "WORKER_LOG", "KILL_GRACE", "STDERR_TAIL_LINES"]

WORKER_LOG = logging.getLogger("muxworker.worker")

KILL_GRACE = 5.0  # between SIGTERM and SIGKILL
STDERR_TAIL_LINES = 50
_STDERR_MAX_LINE = 64 * 1024


def default_worker_command(model: str | os.PathLike[str] | None = None, **flags: Any) -> list[str]:
    """``[sys.executable, "-m", "muxworker.worker", "--model", model, "--flag", value, ...]``.

    Flag names are used as given (``max_sessions=32`` becomes ``--max_sessions 32``); None values are
    left out, True adds the bare flag. The protocol fd flags are added by the spawn.
    """
    command = [sys.executable, "-m", "muxworker.worker"]
    if model is not None:
        command += ["--model", os.fspath(model)]
    return command + flags_of(**flags)


def heartbeat_args(liveness_timeout: float | None) -> list[str]:
    """Announce protocol 1.1 and ask for heartbeats: several per liveness_timeout, so that one
    late beat is not a death (0: none, with the watchdog off)."""
    if liveness_timeout is None:
        return ["--heartbeat_ms", "0"]
    interval_ms = min(1000, max(10, int(liveness_timeout * 1000 / 5)))
    return ["--heartbeat_ms", str(interval_ms)]


class WorkerProcess:
    """One worker child process: :meth:`spawn`, :meth:`pump_stderr` (a task), :meth:`handshake`,
    :meth:`reap`. Implements the connection's :class:`~.connection.Peer`."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        self.command = [os.fspath(a) for a in command]
        self._env = dict(env) if env is not None else None
        self._cwd = cwd
        self.process: trio.Process | None = None
        self._stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self.stderr_done = trio.Event()
        self.hung = False  # declared dead for silence: reaped with SIGKILL at once
        # The client's end of the file channel (transport/fdpass.py), once spawned; the connection
        # sends checkpoint files through it when the worker's hello says it takes them.
        self.files: socket.socket | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def returncode(self) -> int | None:
        """The exit status once the worker has exited and been reaped, else None."""
        return self.process.returncode if self.process is not None else None

    @property
    def stderr_tail(self) -> list[str]:
        """The last lines the worker wrote to stderr (or stdout)."""
        return list(self._stderr_tail)

    async def spawn(self, extra_args: Sequence[str] = ()) -> tuple[trio.lowlevel.FdStream, trio.lowlevel.FdStream]:
        """Start the worker; return the client's ends ``(reply stream, control stream)``.

        Raises :class:`WorkerStartupError` when the command cannot be started. Whatever happens,
        this process keeps no fd of the worker's ends (so the worker's exit reads as EOF here), and
        on failure none of the client's ends either.
        """
        try:
            pipes = WorkerPipes.open()
        except OSError as exc:
            raise WorkerStartupError(f"cannot create the worker's pipes: {exc}") from exc
        try:
            files = FileChannelPair()
        except OSError as exc:
            pipes.close()
            raise WorkerStartupError(f"cannot create the worker's file channel: {exc}") from exc
        try:
            try:
                self.process = await trio.lowlevel.open_process(
                    [*self.command, *pipes.worker_args(), *files.worker_args(), *extra_args],
                    stdin=subprocess.DEVNULL,
                    # stdout and stderr share one pipe: the worker points its fd 1 at stderr anyway, and
                    # a print before that (a wrapper script, a site hook) is captured the same way.
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    pass_fds=(*pipes.pass_fds, *files.pass_fds),
                    env=self._env,
                    cwd=self._cwd,
                )
            finally:
                # Only the child may hold its ends, so that its exit is seen as EOF here.
                pipes.close_worker_ends()
                files.close_worker_end()
            reply = trio.lowlevel.FdStream(pipes.reply_read)
            pipes.reply_read = -1  # the stream owns it now
            control = trio.lowlevel.FdStream(pipes.control_write)
            pipes.control_write = -1
            self.files, files.client = files.client, None
        except BaseException as exc:
            pipes.close()
            files.close()
            if isinstance(exc, OSError):
                raise WorkerStartupError(f"cannot start {self.command[0]!r}: {exc}") from exc
            raise
        return reply, control

    async def handshake(self, reader: TrioFrameReader, startup_timeout: float, settle_s: float) -> WorkerInfo:
        """Read the hello; on anything else stop the worker and raise :class:`WorkerStartupError`."""
        reason: str | None = None
        info: WorkerInfo | None = None
        with trio.move_on_after(startup_timeout) as timeout:
            try:
                frame = await reader.receive()
            except ProtocolError as exc:
                reason = f"its first frame is broken: {exc}"
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                reason = f"its reply pipe failed: {exc}"
            else:
                if frame is None:
                    reason = "it exited before sending its hello"
                elif frame.control.get("kind") == "error":
                    reason = str(frame.control.get("message", "no message"))
                else:
                    try:
                        check_hello(frame.control)
                        info = WorkerInfo.from_hello(frame.control)
                    except ProtocolError as exc:
                        reason = f"bad hello: {exc}"
        if timeout.cancelled_caught:
            reason = f"no hello within startup_timeout={startup_timeout}s"
        if reason is None:
            assert info is not None
            return info
        with trio.CancelScope(shield=True):
            await self.reap(wait_first=settle_s)
            with trio.move_on_after(settle_s):
                await self.stderr_done.wait()
        raise WorkerStartupError(reason, self.returncode, self._stderr_tail)

    async def wait(self) -> None:
        """Until the worker has exited."""
        assert self.process is not None
        await self.process.wait()

    async def reap(self, wait_first: float = 0.0) -> None:
        """Make sure the worker has exited and been waited for: terminate, then kill. Shield it."""
        process = self.process
        if process is None:
            return
        if wait_first and process.returncode is None and not self.hung:
            with trio.move_on_after(wait_first):
                await process.wait()
        if process.returncode is None and not self.hung:
            process.terminate()
            with trio.move_on_after(KILL_GRACE):
                await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()
        if self.files is not None:
            self.files.close()
            self.files = None

    def mark_hung(self) -> None:
        """The worker went silent: the next reap kills it at once (a stopped process ignores SIGTERM)."""
        self.hung = True

    async def pump_stderr(self) -> None:
        """Task: log each line the worker writes (logger ``"muxworker.worker"``) and keep the tail."""
        assert self.process is not None and self.process.stdout is not None
        stream = self.process.stdout
        pending = bytearray()
        try:
            while chunk := await stream.receive_some(65536):
                pending += chunk
                *lines, rest = pending.split(b"\n")
                for line in lines:
                    self._stderr_line(line)
                pending = bytearray(rest)
                if len(pending) > _STDERR_MAX_LINE:
                    self._stderr_line(pending)
                    pending.clear()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            if pending:
                self._stderr_line(pending)
            self.stderr_done.set()

    def _stderr_line(self, raw: bytes | bytearray) -> None:
        line = bytes(raw).decode("utf-8", "replace").rstrip("\r")
        self._stderr_tail.append(line)
        WORKER_LOG.info("%s", line)
