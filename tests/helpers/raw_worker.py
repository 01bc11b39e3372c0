"""A worker subprocess driven frame by frame over its real pipes (and, with :class:`FileWorker`,
its file channel), for the worker's own tests: no client in between."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from muxworker.transport.fdio import FdFrameReader, FdFrameWriter
from muxworker.transport.fdpass import FileChannelPair, send_files
from muxworker.transport.framing import Frame, attach_payload

__all__ = ["WORKER", "HANG_GUARD_S", "RawWorker", "FileWorker", "generate_frame", "worker_args"]

WORKER = [sys.executable, "-m", "muxworker.worker"]
HANG_GUARD_S = 60.0  # generous: the machine is shared; a timeout here means a hang, not slowness


class RawWorker:
    """A worker subprocess with the test holding the other ends of its two protocol pipes."""

    def __init__(
        self,
        args: list[str],
        tmp_path: Path,
        *,
        hello: bool = True,
        command: list[str] = WORKER,
        pass_fds: tuple[int, ...] = (),
    ):
        control_read, self.control_write = os.pipe()
        self.reply_read, reply_write = os.pipe()
        self.stderr_path = tmp_path / f"worker-{id(self)}.stderr"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [*command, *args, "--control-fd", str(control_read), "--reply-fd", str(reply_write)],
                pass_fds=(control_read, reply_write, *pass_fds),
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=err,
            )
        os.close(control_read)
        os.close(reply_write)
        self.reader = FdFrameReader(self.reply_read)
        self.writer = FdFrameWriter(self.control_write)
        self.hello = self.read() if hello else None

    def read(self, timeout: float = HANG_GUARD_S) -> Frame | None:
        """The next frame (None at EOF); fails instead of hanging."""

        def on_alarm(signum: int, frame: object) -> None:
            raise TimeoutError

        # An alarm rather than select(): the reader may already hold the next frames in its buffer.
        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            return self.reader.read()
        except TimeoutError:
            pytest.fail(f"no frame from the worker within {timeout}s; stderr:\n{self.stderr()}")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def send(self, control: dict, payloads: list | None = None) -> None:
        self.writer.write(Frame(control, payloads or []))

    def send_raw(self, data: bytes) -> None:
        os.write(self.control_write, data)

    def close_control(self) -> None:
        self.writer.close()

    def wait(self, timeout: float = HANG_GUARD_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"the worker did not exit within {timeout}s; stderr:\n{self.stderr()}")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def collect(self, *rids: int) -> dict[int, tuple[list[Frame], Frame]]:
        """Read until every request in ``rids`` has its final frame: {rid: (token frames, final frame)}.

        Frames of other requests are kept for a later call, so interleaved outputs can be checked.
        """
        want = set(rids)
        done: dict[int, tuple[list[Frame], Frame]] = {}
        for rid in list(want):
            if rid in self._finals:
                done[rid] = (self._tokens.pop(rid, []), self._finals.pop(rid))
        while want - done.keys():
            frame = self.read()
            assert frame is not None, f"EOF while waiting for {sorted(want - done.keys())}; stderr:\n{self.stderr()}"
            rid = frame.control.get("id")
            if frame.control["kind"] == "token":
                self._tokens.setdefault(rid, []).append(frame)
            elif rid in want:
                done[rid] = (self._tokens.pop(rid, []), frame)
            else:
                self._finals[rid] = frame
        return done

    def final(self, rid: int) -> dict:
        """The control map of request ``rid``'s final frame."""
        return self.collect(rid)[rid][1].control

    def __enter__(self) -> RawWorker:
        self._tokens: dict[int, list[Frame]] = {}
        self._finals: dict[int, Frame] = {}
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.reader.close()
        self.writer.close()


def generate_frame(rid: int, sid: str, ids: list[int], max_new_tokens: int = 8, **extra) -> tuple[dict, list]:
    payloads: list = []
    ref = attach_payload(payloads, np.asarray(ids, dtype=np.int32))
    control = {
        "kind": "generate",
        "id": rid,
        "session_id": sid,
        "prompt": [{"tokens": ref}],
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0,
        "stop_token_ids": [],
        **extra,
    }
    return control, payloads


def worker_args(model: str, *extra: str) -> list[str]:
    return ["--model", model, "--max_session_tokens", "256", *extra]


class FileWorker(RawWorker):
    """A RawWorker with a file channel: checkpoint files are passed as open descriptors."""

    def __init__(self, model: str, tmp_path: Path):
        self.channel = FileChannelPair()
        super().__init__(worker_args(model, *self.channel.worker_args()), tmp_path, pass_fds=self.channel.pass_fds)
        self.channel.close_worker_end()
        assert self.hello is not None and self.hello.control["files"]

    def save_file(self, rid: int, sid: str, fd: int, tag: str | None = "t1", **extra) -> None:
        assert self.channel.client is not None
        send_files(self.channel.client, rid, [fd])
        self.send(
            {
                "kind": "save_file",
                "id": rid,
                "session_id": sid,
                "fds": 1,
                "tag": tag,
                "base": None,
                "identity": "test",
                "max_bytes": 1 << 40,
                **extra,
            }
        )

    def restore_file(self, rid: int, sid: str, path: Path, saved: dict, saved_id: str) -> None:
        assert self.channel.client is not None
        fd = os.open(path, os.O_RDONLY)
        send_files(self.channel.client, rid, [fd])
        os.close(fd)
        ref = {k: saved[k] for k in ("file_length", "header_crc")}
        segment = {"name": path.name, "start": 0, "end": saved["position"], **ref}
        self.send(
            {
                "kind": "restore_file",
                "id": rid,
                "session_id": sid,
                "fds": 1,
                "identity": "test",
                "max_bytes": 1 << 40,
                "tag": "t1",
                "saved_id": saved_id,
                "segments": [segment],
            }
        )

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.channel.close()
