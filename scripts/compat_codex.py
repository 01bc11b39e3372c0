"""OpenAI's Codex CLI, unmodified, against muxworker's ``/v1/responses``: ``make compat`` (not
part of ``make test``; it installs ``@openai/codex`` into build/compat/ first).

Starts a server on 127.0.0.1 (the bundled SmolLM2-135M; ``--max_session_tokens 8192``, as Codex's
system prompt and tools take ~6,000 tokens; ``--default-max-tokens 256``, as Codex sends no
``max_output_tokens``), writes a Codex config into a fresh ``CODEX_HOME`` (a custom model provider
whose ``base_url`` is the server; update checks, analytics, feedback and telemetry off; no login;
approvals never, a read-only sandbox) and runs one conversation of ``--turns`` turns in an empty
folder: ``codex exec "<task>"``, then ``codex exec resume <thread> "<follow-up>"``, each within
``--timeout``. ``HOME`` and ``CODEX_HOME`` are fresh folders under ``--state`` (with the server's
store and log) and every proxy variable points at a closed port, so nothing of this machine's user
config is read or written and nothing leaves the machine.

Codex talks to a recording pass-through in this process, which forwards to the server and notes
what each request carried (``store``, ``previous_response_id``, ``prompt_cache_key``, its input
items and tool types) and which events came back. Prints two markdown tables: per
``POST /v1/responses``, the server's access-log line (prompt, cached and completion tokens, ms),
what Codex sent and what it got; per turn, Codex's exit status, the usage it reported and its
final message. Then the request fields the server ignored (its debug log's "ignoring unknown
fields") and what Codex reported. Exits 1 when a codex run failed. The model is tiny: that it
answers well is not the point; that every request is accepted, streamed back, parsed by Codex
and reused is.

    python scripts/compat_codex.py                        # build/compat/node_modules/.bin/codex
    python scripts/compat_codex.py --turns 2 --keep       # keep the work folder too
    python scripts/compat_codex.py --multi-agent --state build/compat/run-multi-agent
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from muxworker.client.serve.process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
TASKS = [
    "Answer in one short sentence, without running any command: what is 2 + 3?",
    "Now multiply that result by 4. Answer in one short sentence.",
    "Summarize this conversation in one sentence.",
    "Add 1 to the last result. One short sentence.",
]
KEY_ENV = "MUXWORKER_COMPAT_KEY"  # the provider's env_key: Codex sends its value as the bearer token
CLOSED = "http://127.0.0.1:9"  # every proxy variable: nothing but 127.0.0.1 is reachable
ACCESS = re.compile(
    r"muxworker\.serve\.access.*?(GET|POST|DELETE) (\S+) (\d{3})"
    r"(?: prompt=(\d+) cached=(\d+) completion=(\d+))? (\d+) ms"
)
IGNORED = re.compile(r"ignoring unknown fields (.*)$")

CONFIG = """\
# Written by scripts/compat_codex.py for one run (docs/SERVER.md, "Codex CLI").
model = "{model}"
model_provider = "muxworker"
model_context_window = {context}
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false
web_search = "disabled"
cli_auth_credentials_store = "file"

[model_providers.muxworker]
name = "muxworker"
base_url = "{url}/v1"
env_key = "{key_env}"
wire_api = "responses"
# No retries: a request the server refuses shows as it is, once.
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = {idle_ms}

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
trace_exporter = "none"
metrics_exporter = "none"

[history]
persistence = "none"

[agents]
# Sub-agent tools come as one `namespace` tool of 2,700 tokens, more than SmolLM2's 8k context
# leaves (--multi-agent keeps them).
enabled = {multi_agent}

[projects."{work}"]
trust_level = "trusted"
"""


class Recorder:
    """A pass-through HTTP server: forwards every request to ``upstream`` and notes what Codex
    sent and which server-sent events came back."""

    def __init__(self, upstream: str, timeout: float) -> None:
        self.upstream = urlsplit(upstream)
        self.timeout = timeout
        self.records: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                recorder.forward(self)

            do_POST = do_DELETE = do_GET

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def forward(self, h: BaseHTTPRequestHandler) -> None:
        body = h.rfile.read(int(h.headers.get("content-length") or 0))
        rec: dict[str, Any] = {
            "method": h.command,
            "path": h.path,
            "events": [],
            "encoding": h.headers.get("content-encoding"),
        }
        try:
            rec["body"] = json.loads(body) if body else None
        except ValueError:
            rec["body"] = None
        with self.lock:
            self.records.append(rec)
        skip = {"host", "connection", "accept-encoding", "content-length"}
        headers = {k: v for k, v in h.headers.items() if k.lower() not in skip}
        conn = http.client.HTTPConnection(self.upstream.netloc, timeout=self.timeout)
        try:
            conn.request(h.command, h.path, body, headers)
            resp = conn.getresponse()
            rec["status"] = resp.status
            h.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "content-length", "connection", "date", "server"):
                    h.send_header(k, v)
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            seen = b""
            while chunk := resp.read1(65536):
                seen += chunk
                h.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                h.wfile.flush()
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
            rec.update(_events(seen))
        except OSError as exc:
            rec["error"] = repr(exc)
            h.close_connection = True
        finally:
            conn.close()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _events(raw: bytes) -> dict[str, Any]:
    """The event types of a server-sent event stream, and its final response's usage (or a
    JSON body's error)."""
    events, usage, error = [], None, None
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line.startswith("data:"):
            continue
        try:
            data = json.loads(line[5:])
        except ValueError:
            continue
        events.append(data.get("type", "?"))
        response = data.get("response") if isinstance(data.get("response"), dict) else {}
        usage = response.get("usage") or usage
        error = response.get("error") or (data if data.get("type") == "error" else error)
    if not events:
        try:
            error = json.loads(raw).get("error")
        except (ValueError, AttributeError):
            pass
    return {"events": events, "usage": usage, "error": error}


def _codex_env(state: Path) -> dict[str, str]:
    home = state / "home"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CODEX_HOME": str(state / "codex_home"),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_DATA_HOME": str(home / ".local/share"),
        "XDG_STATE_HOME": str(home / ".local/state"),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        KEY_ENV: "compat-dummy-key",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = CLOSED
    return env


def _run_codex(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> dict[str, Any]:
    t0 = time.monotonic()
    rc: int | str
    try:
        proc = subprocess.run(
            argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = "timeout"
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
    turn: dict[str, Any] = {"rc": rc, "s": time.monotonic() - t0, "stderr": err, "thread": None, "usage": None}
    messages, errors, items = [], [], []
    for line in out.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        kind = ev.get("type")
        if kind == "thread.started":
            turn["thread"] = ev.get("thread_id")
        elif kind == "turn.completed":
            turn["usage"] = ev.get("usage")
        elif kind in ("error", "turn.failed"):
            errors.append((ev.get("error") or {}).get("message") or ev.get("message"))
        elif kind == "item.completed":
            item = ev.get("item") or {}
            items.append(item.get("type", "?"))
            if item.get("type") == "agent_message":
                messages.append(item.get("text", ""))
            elif item.get("type") == "error":
                errors.append(item.get("message"))
    turn["message"] = messages[-1] if messages else ""
    turn["items"] = [i for i in items if i != "error"]
    turn["errors"] = [e for e in errors if e]
    return turn


def _access_lines(log: Path, start: int) -> tuple[list[tuple], int]:
    lines = log.read_text(errors="replace").splitlines()
    out = [m.groups() for line in lines[start:] if (m := ACCESS.search(line))]
    return out, len(lines)


def _short(text: str, n: int = 90) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= n else text[: n - 3] + "..."


def _sent(body: dict[str, Any] | None) -> str:
    if not isinstance(body, dict):
        return "(not JSON)"
    tools = [t.get("type") for t in body.get("tools") or []]
    kinds = [i.get("type", "message") for i in body.get("input") or [] if isinstance(i, dict)]
    pck = body.get("prompt_cache_key")
    return (
        f"store={json.dumps(body.get('store'))} prev={'yes' if body.get('previous_response_id') else 'no'} "
        f"pck={pck[:8] + '..' if isinstance(pck, str) else pck} input={len(kinds)} items "
        f"({', '.join(sorted(set(kinds)))}) tools={len(tools)} ({', '.join(sorted(set(tools)))})"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codex", default=str(ROOT / "build/compat/node_modules/.bin/codex"), help="the codex command")
    ap.add_argument("--state", default=str(ROOT / "build/compat/run"), help="HOME, CODEX_HOME, store and logs (wiped)")
    ap.add_argument("--turns", type=int, default=3, choices=range(1, len(TASKS) + 1))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds each codex run may take")
    ap.add_argument("--context", type=int, default=8192, help="the server's --max_session_tokens")
    ap.add_argument("--max-tokens", type=int, default=256, help="the server's --default-max-tokens (Codex sends none)")
    ap.add_argument(
        "--multi-agent", action="store_true", help="keep Codex's sub-agent tools: one namespace tool, 2,700 tokens more"
    )
    ap.add_argument("--model", help="the server's --model (default: the bundled SmolLM2)")
    ap.add_argument("--keep", action="store_true", help="keep the state folder and the work folder")
    args = ap.parse_args()

    codex = str(Path(shutil.which(args.codex) or args.codex).absolute())  # codex runs in another folder
    if not Path(codex).exists():
        print(f"no codex at {codex}: run `make compat`, which installs it", file=sys.stderr)
        return 2
    version = subprocess.run([codex, "--version"], capture_output=True, text=True).stdout.strip()
    state = Path(args.state).resolve()
    shutil.rmtree(state, ignore_errors=True)
    (state / "home").mkdir(parents=True)
    (state / "codex_home").mkdir()
    # Outside any git repository, so Codex reads no AGENTS.md or project config of this one.
    work = Path(tempfile.mkdtemp(prefix="muxworker-compat-"))
    log = state / "server.log"
    flags = ["--store", str(state / "store"), "--max_session_tokens", str(args.context)]
    flags += ["--default-max-tokens", str(args.max_tokens), "--log-level", "debug"]
    flags += ["--model", args.model] if args.model else []
    print(f"{version}; muxworker serve {' '.join(flags)}; state in {state}", flush=True)

    turns: list[dict[str, Any]] = []
    server = ServerProcess(flags, log_path=log, startup_timeout=600)
    recorder = None
    try:
        server.start()
        recorder = Recorder(server.url, args.timeout)
        env = _codex_env(state)
        (state / "codex_home/config.toml").write_text(
            CONFIG.format(
                model=server.model,
                url=recorder.url,
                key_env=KEY_ENV,
                context=args.context,
                idle_ms=int(args.timeout * 1000),
                multi_agent=str(args.multi_agent).lower(),
                work=work,
            )
        )
        common = ["--json", "--skip-git-repo-check", "--strict-config"]
        log_at, rec_at, thread = 0, 0, None
        for i in range(args.turns):
            if i == 0:
                argv = [codex, "exec", *common, TASKS[0]]
            else:
                argv = [codex, "exec", "resume", *common, *([thread] if thread else ["--last"]), TASKS[i]]
            print(f"turn {i + 1}: {' '.join(argv[1:-1])} {TASKS[i]!r}", flush=True)
            turn = _run_codex(argv, env, work, args.timeout)
            time.sleep(0.5)  # the access line is written once the response is done
            turn["access"], log_at = _access_lines(log, log_at)
            with recorder.lock:
                turn["requests"], rec_at = recorder.records[rec_at:], len(recorder.records)
            thread = thread or turn["thread"]
            turns.append(turn)
    finally:
        if recorder is not None:
            recorder.close()
        server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    ignored = sorted(
        {
            f
            for line in log.read_text(errors="replace").splitlines()
            if (m := IGNORED.search(line))
            for f in re.findall(r"'([^']+)'", m.group(1))
        }
    )
    _report(turns, ignored, log)
    if args.keep:
        print(f"kept: {work}; Codex's own record of the conversation is under {state / 'codex_home/sessions'}")
    ok = all(t["rc"] == 0 for t in turns)
    return 0 if ok else 1


def _report(turns: list[dict[str, Any]], ignored: list[str], log: Path) -> None:
    print("\n| turn | request | status | prompt | cached | completion | ms | what Codex sent | events back |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, turn in enumerate(turns, 1):
        posts = [r for r in turn["requests"] if r["path"].rstrip("/").endswith("/responses") and r["method"] == "POST"]
        lines = [a for a in turn["access"] if a[0] == "POST" and a[1].rstrip("/").endswith("/responses")]
        others = [f"{a[0]} {a[1]} {a[2]}" for a in turn["access"] if a not in lines]
        for k in range(max(len(posts), len(lines))):
            rec = posts[k] if k < len(posts) else {}
            acc = lines[k] if k < len(lines) else (None,) * 7
            events = rec.get("events") or []
            err = rec.get("error") or ""
            err = f"{err.get('code')}: {err.get('message')}" if isinstance(err, dict) else err
            shown = f"{len(events)}: {events[0]} .. {events[-1]}" if events else _short(err, 90)
            row = [n, k + 1, acc[2] or rec.get("status"), acc[3], acc[4], acc[5], acc[6], _sent(rec.get("body")), shown]
            print("| " + " | ".join("-" if v is None else str(v) for v in row) + " |")
        for other in others:
            print(f"| {n} | | {other} | | | | | | |")
    print(
        "\n| turn | codex exit | s | items | Codex's usage, summed over the thread (input / cached / output) | final message |"
    )
    print("|---|---|---|---|---|---|")
    for n, turn in enumerate(turns, 1):
        u = turn["usage"] or {}
        usage = f"{u.get('input_tokens')} / {u.get('cached_input_tokens')} / {u.get('output_tokens')}" if u else "-"
        last = turn["message"] or (turn["errors"] or turn["stderr"].strip().splitlines() or [""])[-1]
        items = ", ".join(turn["items"]) or "-"
        print(f"| {n} | {turn['rc']} | {turn['s']:.0f} | {items} | {usage} | {_short(last, 120)} |")
    print(f"\nRequest fields the server ignored (its debug log): {', '.join(ignored) or 'none'}")
    first = next((r["body"] for t in turns for r in t["requests"] if isinstance(r.get("body"), dict)), None)
    if first is not None:
        print(f"Fields of Codex's first request: {', '.join(first)}")
    reported: dict[str, list[int]] = {}
    for n, turn in enumerate(turns, 1):
        for err in turn["errors"]:
            if n not in reported.setdefault(err, []):
                reported[err].append(n)
    for err, where in reported.items():
        print(f"Codex reported (turns {', '.join(map(str, where))}): {_short(err, 400)}")
    for n, turn in enumerate(turns, 1):
        if turn["rc"] != 0:
            print(f"turn {n}, codex stderr tail: {_short(' '.join(turn['stderr'].splitlines()[-5:]), 600)}")
    print(f"(server log: {log})")


if __name__ == "__main__":
    sys.exit(main())
