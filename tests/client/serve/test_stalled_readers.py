"""Clients that stop reading, against a real server (``python -m muxworker.serve``, a real worker,
the tiny random llama) over real sockets: four streams opened with a 2 KiB receive buffer and never
read hold no generation slot (a bystander on the four slots they took is answered while they are
still connected), their turns are saved as generated, and the kernel cuts their connections after
``--send-timeout`` (docs/SERVER.md, "Admission")."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from muxworker.serve.process import ServerProcess

pytestmark = pytest.mark.slow

SEND_TIMEOUT = 4
MAX_TOKENS = 128  # with logprobs, some 100 KB of events: more than the socket buffers hold


def _count(server: ServerProcess, status: str) -> float:
    name = f'muxworker_http_requests_total{{endpoint="completions",status="{status}"}}'
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _stalled_stream(server: ServerProcess, session: str) -> socket.socket:
    """A streamed completion whose client never reads a byte of the answer."""
    url = urlsplit(server.url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connect: the window it offers
    sock.connect((url.hostname, url.port))
    body = json.dumps(
        {
            "prompt": "Once upon a time",
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "logprobs": 5,
            "stream": True,
            "temperature": 0,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"X-Session-Id: {session}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(30)
    parts = []
    try:
        while chunk := sock.recv(65536):
            parts.append(chunk)
    except ConnectionResetError:  # the kernel's cut, after what the buffers held
        pass
    return b"".join(parts)


def test_clients_that_stop_reading_hold_no_slot_and_are_cut(tiny_llama_dir, tmp_path):
    args = ["--model", str(tiny_llama_dir), "--store", str(tmp_path / "store"), "--dtype", "float32"]
    args += ["--max-concurrent-requests", "4", "--send-timeout", str(SEND_TIMEOUT)]
    with ServerProcess(args, log_path=tmp_path / "serve.log") as server:
        stalled = [_stalled_stream(server, f"stalled-{i}") for i in range(4)]
        try:
            # The four took every slot; their generations run to the end without their clients, and
            # each gives its slot back as it settles: the bystander is answered, not refused.
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=120)
            assert r.status_code == 200, r.text
            # ... while the four are still connected, unread: their slots were not waiting for them.
            assert _count(server, "200") == 1
            # The kernel cuts each once it has taken nothing for --send-timeout; then it is counted.
            deadline = time.monotonic() + 60
            while _count(server, "200") < 5 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _count(server, "200") == 5
            for sock in stalled:
                got = _read_all(sock)
                assert got.startswith(b"HTTP/1.1 200")
                assert b"data: [DONE]" not in got  # cut before the end: no client read it
        finally:
            for sock in stalled:
                sock.close()
        # Each turn was saved as it was generated: the prompt and every token of the reply.
        for i in range(4):
            session = httpx.get(server.url + f"/v1/sessions/stalled-{i}").json()
            assert session["durable_tokens"] == session["live_tokens"] >= MAX_TOKENS, session
