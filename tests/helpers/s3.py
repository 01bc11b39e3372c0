"""A real S3 API for tests: moto's server on 127.0.0.1, and a TCP proxy in front of it that a test
can cut (every connection hangs, as in a network outage) and restore."""

from __future__ import annotations

import contextlib
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx

BUCKET = "muxworker-test"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server() -> Iterator[tuple[str, subprocess.Popen]]:
    """A real S3 API on 127.0.0.1 (moto's server mode) with one bucket: (its endpoint, process)."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(endpoint + "/moto-api/", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.1)
        assert httpx.put(f"{endpoint}/{BUCKET}").status_code == 200  # CreateBucket
        yield endpoint, process
    finally:
        process.terminate()
        process.wait(timeout=30)


class CuttableProxy:
    """Forwards 127.0.0.1:<port> to ``target`` until :meth:`cut`; then every connection, open or
    new, is held without an answer (a black-holed network), until :meth:`restore`."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit("//", 1)[-1].rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.up = threading.Event()
        self.up.set()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self.up.clear()

    def restore(self) -> None:
        self.up.set()

    def close(self) -> None:
        self.closed = True
        self.up.set()
        self.listener.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        with client:
            self.up.wait()
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                return
            with upstream:
                while not self.closed:
                    ready, _, _ = select.select([client, upstream], [], [], 0.1)
                    if not self.up.is_set():
                        self.up.wait()  # black hole: read nothing, answer nothing
                        return  # and the connection is gone when the network comes back
                    for sock in ready:
                        data = sock.recv(65536)
                        if not data:
                            return
                        (upstream if sock is client else client).sendall(data)
