"""Shared helpers for the transport tests: child processes on real pipes, frame comparison."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from hypothesis import strategies as st

from muxworker.transport import Frame, WorkerPipes

# Echoes every frame back until EOF. It finds its fds the way the worker does (worker_fds), and
# reports a ProtocolError on stderr with exit status 3.
ECHO_CHILD = r"""
import sys
from muxworker.transport import FdFrameReader, FdFrameWriter, FrameLimits, ProtocolError, worker_fds
limits = FrameLimits(max_payloads=int(sys.argv[1]))
control_fd, reply_fd = worker_fds(sys.argv[2:])
reader, writer = FdFrameReader(control_fd, limits), FdFrameWriter(reply_fd, limits)
try:
    for frame in reader:
        writer.write(frame)
except ProtocolError as exc:
    print(f"ProtocolError: {exc}", file=sys.stderr)
    sys.exit(3)
"""


class EchoChild:
    """A child process that echoes frames; ``control_fd`` to write to it, ``reply_fd`` to read."""

    def __init__(self, *, max_payloads: int = 1024, use_env: bool = False):
        self.pipes = WorkerPipes.open()
        args = [] if use_env else self.pipes.worker_args()
        env = {**os.environ, **self.pipes.worker_env()} if use_env else None
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ECHO_CHILD, str(max_payloads), *args],
            pass_fds=self.pipes.pass_fds,
            env=env,
            stderr=subprocess.PIPE,
        )
        self.pipes.close_worker_ends()
        self.control_fd = self.pipes.control_write
        self.reply_fd = self.pipes.reply_read

    def finish(self) -> tuple[int, str]:
        """Close our write end, wait for the child, return (exit status, stderr)."""
        if self.pipes.control_write >= 0:
            os.close(self.pipes.control_write)
            self.pipes.control_write = -1
        _, err = self.proc.communicate()
        return self.proc.returncode, err.decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        self.pipes.close()


@contextmanager
def echo_child(**kwargs: object) -> Iterator[EchoChild]:
    child = EchoChild(**kwargs)  # type: ignore[arg-type]
    try:
        yield child
    finally:
        child.close()


def payload_bytes(frame: Frame) -> list[bytes]:
    return [memoryview(p).tobytes() for p in frame.payloads]


def assert_same_frame(got: Frame | None, sent: Frame) -> None:
    assert got is not None
    assert got.control == _as_received(sent.control)
    assert payload_bytes(got) == payload_bytes(sent)


def _as_received(value: object) -> object:
    """What msgpack gives back for a value we sent (tuples come back as lists)."""
    if isinstance(value, dict):
        return {k: _as_received(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_received(v) for v in value]
    return value


# ----------------------------------------------------------------------------------------------
# Hypothesis strategies


def depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, (list, tuple)):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
_values = st.recursive(
    _leaves,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=16,
)
controls = st.dictionaries(st.text(max_size=10), _values, max_size=6).filter(lambda c: depth(c) <= 32)


def _random_bytes(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


# Mostly small payloads, sometimes past the decoder's 64 KiB staging buffer and the pipe size.
payload_sets = st.lists(
    st.one_of(
        st.binary(max_size=64),
        st.builds(_random_bytes, st.integers(0, 300_000), st.integers(0, 2**32 - 1)),
    ),
    max_size=6,
)
frames = st.builds(Frame, controls, payload_sets)
