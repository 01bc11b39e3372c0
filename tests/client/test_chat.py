"""`python -m muxworker.chat` driven through a pseudo-terminal: chat, quit (saves), restart (resumes)."""
from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest


class Terminal:
    def __init__(self, argv, env=None):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
        os.close(slave)
        self.buf = b""

    def expect(self, pattern: str, timeout: float = 120.0) -> re.Match:
        """Read until ``pattern`` appears (a hang guard, not a timing assertion)."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern.encode())
        while True:
            m = rx.search(self.buf)
            if m:
                self.buf = self.buf[m.end() :]
                return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{pattern!r} not seen; output so far: {self.buf.decode(errors='replace')}")
            r, _, _ = select.select([self.master], [], [], left)
            if r:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"terminal closed before {pattern!r}; output: {self.buf.decode(errors='replace')}")
                self.buf += chunk

    def send(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            try:
                os.close(self.master)
            except OSError:
                pass


@pytest.fixture
def terminals():
    made = []
    yield lambda argv, env: made.append(Terminal(argv, env)) or made[-1]
    for t in made:
        if t.proc.poll() is None:
            t.proc.kill()
            t.proc.wait()


def test_chat_saves_on_quit_and_resumes(tiny_llama_dir, tmp_path, terminals):
    store = tmp_path / "store"
    argv = [sys.executable, "-m", "muxworker.chat", "--session", "t1", "--store", str(store), "--model", str(tiny_llama_dir), "--max_new_tokens", "12"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    term = terminals(argv, env)
    term.expect(r"new session 't1'")
    term.expect(r"you> ")
    term.send("Hello there")
    first = term.expect(r"(\d+) tokens, prefilled (\d+), reused (\d+)")
    assert int(first.group(1)) > 0 and int(first.group(3)) == 0
    term.expect(r"you> ")
    term.send("And again")
    second = term.expect(r"(\d+) tokens, prefilled (\d+), reused (\d+)")
    assert int(second.group(3)) > 0  # the second turn extends the first: only the suffix is prefilled
    term.expect(r"you> ")
    term.send("/quit")
    saved = term.expect(r"saved (\d+) tokens")
    assert term.close() == 0

    term = terminals(argv, env)
    restored = term.expect(r"resumed session 't1': (\d+) tokens restored")
    assert restored.group(1) == saved.group(1)
    term.expect(r"you> ")
    term.send("One more")
    third = term.expect(r"(\d+) tokens, prefilled (\d+), reused (\d+)")
    # Everything saved is reused after the restart; the last sampled token (no KV yet) is prefilled.
    assert int(third.group(3)) == int(saved.group(1)) - 1
    term.expect(r"you> ")
    term.send("/quit")
    term.expect(r"saved")
    assert term.close() == 0
