"""The worker process (`python -m muxworker.worker`) over real pipes, driven frame by frame.

These tests speak the wire protocol directly with the transport's blocking reader and writer, so
they cover what the trio client never sends: malformed frames, bad flags, signals.

A worker that loads a model takes seconds to start, so those tests are in the slow tier, but for
one smoke test of the protocol (requests answered, outputs in order); the engine behind it is
tested in-process in tests/worker/engine. Start-up failures that come before the model loads stay
in the fast tier.
"""

from __future__ import annotations

import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from helpers.raw_worker import HANG_GUARD_S, WORKER, RawWorker, generate_frame, worker_args

from muxworker.transport.framing import (
    HEADER_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    Frame,
    attach_payload,
    encode_frame,
    payload_array,
)
from muxworker.worker.models.defaults import auto_dtype
from muxworker.worker.server import EXIT_INTERNAL, EXIT_OK, EXIT_PROTOCOL, EXIT_STARTUP, EXIT_USAGE


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


# ----------------------------------------------------------------------------------------------
# start-up


@pytest.mark.slow
def test_hello_describes_model_backend_and_limits(model, tmp_path):
    with RawWorker(worker_args(model, "--max_sessions", "3", "--seed", "7"), tmp_path) as w:
        hello = w.hello.control
        assert hello["kind"] == "hello"
        assert hello["protocol"] == list(PROTOCOL_VERSION)
        assert hello["model"]["architecture"] == "LlamaForCausalLM"
        assert hello["model"]["vocab_size"] == 384
        assert hello["model"]["context_length"] == 4096
        assert hello["model"]["has_chat_template"] is True
        # --dtype auto: bfloat16 on a CPU with native bfloat16, else float32.
        assert (hello["backend"], hello["device"], hello["dtype"]) == ("torch", "cpu", auto_dtype("cpu"))
        assert hello["weights"] == "float"  # an HF directory
        assert hello["limits"]["max_sessions"] == 3
        assert hello["limits"]["max_session_tokens"] == 256
        assert hello["limits"]["seed"] == 7
        w.close_control()
        assert w.wait() == EXIT_OK


def test_help_explains_every_flag():
    out = subprocess.run([*WORKER, "--help"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0
    for flag in (
        "--model",
        "--backend",
        "--device",
        "--dtype",
        "--max_sessions",
        "--max_session_tokens",
        "--max_decode_sequences",
        "--max_inflight_requests",
        "--prefill_chunk_tokens",
        "--prefix_cache_entries",
        "--threads",
        "--draft",
        "--n_draft",
        "--seed",
        "--control-fd",
        "--reply-fd",
    ):
        assert flag in out.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--backend", "tensorflow"], "--backend must be one of torch, mlx"),
        (["--draft", "/some/draft"], "--draft needs --n_draft"),
        (["--n_draft", "4"], "--n_draft needs --draft"),
        (["--prefix_cache_entries", "-1"], "prefix_cache_entries"),
        (["--threads", "0"], "expected a positive integer"),
        (["--dtype", "float16"], "float16 is not supported on --device cpu"),
        (["--dtype", "int8"], "invalid choice"),
        (["--max_sessions", "0"], "expected a positive integer"),
        (["--device", "tpu"], "must be cpu, cuda or cuda:N"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_invalid_flags_fail_at_start_with_a_message(model, tmp_path, flags, message):
    with RawWorker(worker_args(model, *flags), tmp_path, hello=False) as w:
        frame = w.read()
        assert frame is not None and frame.control["kind"] == "error"
        assert frame.control["id"] == 0 and frame.control["code"] == "invalid_argument"
        assert message in frame.control["message"]
        assert w.wait() == EXIT_USAGE
        assert message in w.stderr()


def test_missing_protocol_fds_fail_with_the_expected_form(model):
    out = subprocess.run([*WORKER, "--model", model], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == EXIT_USAGE
    assert "--control-fd N --reply-fd M" in out.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(
            ["--max_session_tokens", "8192"], "exceeds the model's context length (4096)", marks=pytest.mark.slow
        ),
        (["--model", "/no/such/model"], "does not exist"),
    ],
)
def test_load_failure_sends_an_error_frame_and_exits_nonzero(model, tmp_path, flags, message):
    with RawWorker(["--model", model, *flags], tmp_path, hello=False) as w:
        frame = w.read()
        assert frame is not None and frame.control["kind"] == "error", frame
        assert frame.control["id"] == 0 and message in frame.control["message"]
        assert w.read() is None  # then EOF
        assert w.wait() == EXIT_STARTUP
        assert message in w.stderr()


# ----------------------------------------------------------------------------------------------
# requests


def test_requests_are_answered_and_outputs_stay_in_order(model, tmp_path):
    with RawWorker(worker_args(model), tmp_path) as w:
        w.send({"kind": "open", "id": 1, "session_id": "a"})
        w.send({"kind": "open", "id": 2, "session_id": "b"})
        assert w.final(1) == {"kind": "ok", "id": 1}
        assert w.final(2) == {"kind": "ok", "id": 2}
        w.send(*generate_frame(3, "a", [5, 6, 7], max_new_tokens=12))
        w.send(*generate_frame(4, "b", [8, 9], max_new_tokens=6))
        out = w.collect(3, 4)
        for rid, n in ((3, 12), (4, 6)):
            tokens, done = out[rid]
            assert done.control["kind"] == "done"
            result = done.control["result"]
            ids = payload_array(done, result["generated_token_ids"])
            assert ids.dtype == np.int32 and len(ids) == n == result["completion_tokens"]
            assert [t for f in tokens for t in f.control["token_ids"]] == ids.tolist()
            assert result["finish_reason"] == "length"
            assert result["prompt_tokens"] == result["prefilled_prompt_tokens"] == (3 if rid == 3 else 2)
        w.close_control()
        assert w.wait() == EXIT_OK


@pytest.mark.slow
def test_a_bad_request_gets_an_error_for_its_id_and_the_worker_carries_on(model, tmp_path):
    with RawWorker(worker_args(model), tmp_path) as w:
        w.send({"kind": "open", "id": 1, "session_id": 42})  # wrong type
        error = w.final(1)
        assert error["kind"] == "error" and error["code"] == "invalid_argument"
        assert "session_id" in error["message"]
        w.send({"kind": "open", "id": 2, "session_id": "a", "colour": "blue"})  # unknown field
        assert "colour" in w.final(2)["message"]
        w.send({"kind": "frobnicate", "id": 3})  # unknown kind
        assert w.final(3)["code"] == "invalid_argument"
        w.send({"kind": "generate", "id": 4, "session_id": "nope", "prompt": [{"text": "hi"}]})
        assert w.final(4)["code"] == "session_not_found"
        w.send({"kind": "open", "id": 5, "session_id": "a"})
        assert w.final(5)["kind"] == "ok"
        w.send(*generate_frame(6, "a", [1, 2], max_new_tokens=0))
        assert w.final(6)["code"] == "invalid_argument"
        w.send(*generate_frame(7, "a", [1, 10_000]))
        assert "outside the vocabulary" in w.final(7)["message"]
        w.send(
            {"kind": "detokenize", "id": 8, "tokens": {"payload": 0, "dtype": "int32", "shape": [1]}},
            [np.asarray([10_000], dtype=np.int32)],
        )
        assert w.final(8)["code"] == "invalid_argument"
        w.send({"kind": "tokenize", "id": 9, "text": "x"}, [b"stray payload"])
        assert w.final(9)["kind"] == "tokens"  # payloads nobody names are ignored
        w.send({"kind": "chat_template", "id": 10, "messages": []})
        assert w.final(10)["code"] == "invalid_argument"
        w.send({"kind": "open", "id": 11, "session_id": "b"})
        assert w.final(11)["kind"] == "ok"
        w.close_control()
        assert w.wait() == EXIT_OK


@pytest.mark.slow
def test_cancel_arriving_during_generation_ends_only_its_target(model, tmp_path):
    with RawWorker(worker_args(model), tmp_path) as w:
        for rid, sid in ((1, "a"), (2, "b")):
            w.send({"kind": "open", "id": rid, "session_id": sid})
            w.final(rid)
        w.send(*generate_frame(3, "a", [5, 6], max_new_tokens=200))
        w.send(*generate_frame(4, "b", [7, 8], max_new_tokens=40))
        frame = w.read()  # a first token: the generations are running
        w._tokens.setdefault(frame.control["id"], []).append(frame)
        w.send({"kind": "cancel", "id": 3})
        out = w.collect(3, 4)
        result3 = out[3][1].control["result"]
        assert result3["finish_reason"] == "cancelled" and result3["completion_tokens"] < 200
        result4 = out[4][1].control["result"]
        assert result4["finish_reason"] == "length" and result4["completion_tokens"] == 40
        w.send({"kind": "cancel", "id": 3})  # already finished: a no-op
        w.send({"kind": "cancel", "id": 99})  # never existed: a no-op
        w.send({"kind": "open", "id": 5, "session_id": "c"})
        assert w.final(5)["kind"] == "ok"
        w.close_control()
        assert w.wait() == EXIT_OK


@pytest.mark.slow
def test_close_settles_the_session_request_before_its_ok(model, tmp_path):
    with RawWorker(worker_args(model), tmp_path) as w:
        w.send({"kind": "open", "id": 1, "session_id": "a"})
        w.collect(1)
        w.send(*generate_frame(2, "a", [5, 6], max_new_tokens=200))
        w.read()  # generation is running
        w.send({"kind": "close", "id": 3, "session_id": "a"})
        order = []
        while len(order) < 2:
            frame = w.read()
            if frame.control["kind"] != "token":
                order.append((frame.control["kind"], frame.control["id"]))
        assert order == [("done", 2), ("ok", 3)]
        w.close_control()
        assert w.wait() == EXIT_OK


@pytest.mark.slow
def test_tokenize_detokenize_chat_template_info(model, tmp_path):
    with RawWorker(worker_args(model), tmp_path) as w:
        w.send({"kind": "tokenize", "id": 1, "text": "Hello world"})
        reply = w.collect(1)[1][1]
        ids = payload_array(reply, reply.control["tokens"]).tolist()
        assert ids and all(isinstance(i, int) for i in ids)
        payloads: list = []
        ref = attach_payload(payloads, np.asarray(ids, dtype=np.int32))
        w.send({"kind": "detokenize", "id": 2, "tokens": ref}, payloads)
        assert w.final(2) == {"kind": "text", "id": 2, "text": "Hello world"}
        w.send({"kind": "chat_template", "id": 3, "messages": [{"role": "user", "content": "hi"}]})
        reply = w.collect(3)[3][1]
        assert reply.control["kind"] == "tokens"
        assert reply.control["text"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert payload_array(reply, reply.control["tokens"])[0] == 1  # <|im_start|> as one special token
        w.send({"kind": "info", "id": 4})
        info = w.final(4)
        assert info["kind"] == "ok" and info["value"]["model"] == w.hello.control["model"]
        assert info["value"]["stats"]["steps"] == 0
        w.close_control()
        assert w.wait() == EXIT_OK


@pytest.mark.slow
def test_a_worker_without_a_file_channel_refuses_checkpoint_files(model, tmp_path):
    """Checkpoints travel only as files: with no channel, save_file is a clear error and the
    worker goes on."""
    with RawWorker(worker_args(model), tmp_path) as w:
        assert not w.hello.control.get("files")
        w.send({"kind": "open", "id": 1, "session_id": "a"})
        w.send(*generate_frame(2, "a", list(range(3, 40)), max_new_tokens=4))
        w.collect(2)
        export = {"kind": "save_file", "id": 3, "session_id": "a", "fds": 1, "tag": None, "base": None}
        w.send({**export, "identity": "", "max_bytes": 1 << 40})
        reply = w.final(3)
        assert (reply["code"], "no file channel" in reply["message"]) == ("invalid_argument", True)
        w.send({"kind": "export", "id": 4, "session_id": "a"})  # the pipe path is gone
        assert w.final(4)["code"] == "invalid_argument"
        w.send(*generate_frame(5, "a", list(range(3, 44)), max_new_tokens=1))
        assert w.final(5)["kind"] == "done"
        w.close_control()
        assert w.wait() == EXIT_OK


# ----------------------------------------------------------------------------------------------
# shutdown


@pytest.mark.slow
def test_eof_settles_every_request_and_exits_zero(model, tmp_path):
    with RawWorker(worker_args(model), tmp_path) as w:
        w.send({"kind": "open", "id": 1, "session_id": "a"})
        w.send(*generate_frame(2, "a", [5, 6], max_new_tokens=250))
        w.collect(1)
        w.read()  # running
        w.close_control()
        done = w.collect(2)[2][1]
        assert done.control["result"]["finish_reason"] == "cancelled"
        assert w.read() is None
        assert w.wait() == EXIT_OK


@pytest.mark.slow
def test_sigterm_settles_every_request_and_exits_zero(model, tmp_path):
    with RawWorker(worker_args(model), tmp_path) as w:
        w.send({"kind": "open", "id": 1, "session_id": "a"})
        w.send(*generate_frame(2, "a", [5, 6], max_new_tokens=250))
        w.collect(1)
        w.read()
        w.proc.send_signal(signal.SIGTERM)
        done = w.collect(2)[2][1]
        assert done.control["result"]["finish_reason"] == "cancelled"
        assert w.read() is None
        assert w.wait() == EXIT_OK
        assert "SIGTERM" in w.stderr()


@pytest.mark.slow
def test_sigterm_while_idle_exits_zero(model, tmp_path):
    with RawWorker(worker_args(model), tmp_path) as w:
        w.proc.send_signal(signal.SIGTERM)
        assert w.read() is None
        assert w.wait() == EXIT_OK


# ----------------------------------------------------------------------------------------------
# a broken frame stream: an exit with a message, never a hang


def _header(control_len: int, payload_lengths: tuple[int, ...] = (), magic: bytes = MAGIC) -> bytes:
    major, minor = PROTOCOL_VERSION
    return struct.pack("<4sBBHII", magic, major, minor, 0, control_len, len(payload_lengths)) + struct.pack(
        f"<{len(payload_lengths)}Q", *payload_lengths
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(_header(100)[: HEADER_SIZE - 3], "truncated frame", id="truncated-header"),
        pytest.param(_header(100) + b"\x81", "truncated frame", id="truncated-control"),
        pytest.param(_header(1 << 30), "exceeds max_control_bytes", id="oversized-control"),
        pytest.param(_header(10, (1 << 40,)), "payload bytes", id="oversized-payload"),
        pytest.param(b"GET / HTTP/1.1\r\n\r\n", "bad magic", id="bad-magic"),
        pytest.param(_header(3) + b"\xc1\xc1\xc1", "not valid msgpack", id="bad-msgpack"),
        pytest.param(_header(1) + msgpack.packb(7), "must be a msgpack map", id="control-not-a-map"),
        pytest.param(
            _header(len(msgpack.packb({"kind": "open"}))) + msgpack.packb({"kind": "open"}),
            "missing required field",
            id="no-request-id",
        ),
        pytest.param(
            _header(len(msgpack.packb({"kind": "open", "id": -1, "session_id": "a"})))
            + msgpack.packb({"kind": "open", "id": -1, "session_id": "a"}),
            "field id",
            id="negative-request-id",
        ),
    ],
)
def test_malformed_frames_exit_with_a_message(model, tmp_path, data, message):
    with RawWorker(worker_args(model), tmp_path) as w:
        w.send({"kind": "open", "id": 1, "session_id": "a"})
        w.send(*generate_frame(2, "a", [5, 6], max_new_tokens=250))
        w.collect(1)
        w.send_raw(data)
        w.close_control()  # a truncated frame is only known as such at EOF
        frames = []
        while (frame := w.read()) is not None:
            frames.append(frame)
        # The connection dies with the worker: a generation still running gets no reply at all
        # (the client reports it as WorkerDiedError), never an ordinary "cancelled" finish.
        done = [f for f in frames if f.control["kind"] == "done"]
        assert all(f.control["result"]["finish_reason"] == "length" for f in done)
        last = frames[-1].control
        assert last["kind"] == "error" and last["id"] == 0 and last["code"] == "protocol"
        assert message in last["message"]
        assert w.wait() == EXIT_PROTOCOL
        assert message in w.stderr()


# ----------------------------------------------------------------------------------------------
# the same worker over interchangeable engines


def _has_mlx() -> bool:
    try:
        import mlx.core  # noqa: F401
    except ImportError:
        return False
    return True


def _greedy_run(args: list[str], tmp_path: Path) -> tuple[dict, list[int]]:
    with RawWorker(args, tmp_path) as w:
        w.send({"kind": "open", "id": 1, "session_id": "a"})
        w.send(*generate_frame(2, "a", [5, 6, 7, 8], max_new_tokens=24))
        w.final(1)
        done = w.collect(2)[2][1]
        w.close_control()
        assert w.wait() == EXIT_OK
        return w.hello.control, payload_array(done, done.control["result"]["generated_token_ids"]).tolist()


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(
            ["--backend", "mlx"],
            id="mlx",
            marks=pytest.mark.skipif(not _has_mlx(), reason="the mlx package is not installed"),
        ),
        pytest.param(["--n_draft", "3"], id="draft"),
    ],
)
def test_backends_and_speculative_decoding_serve_the_same_greedy_tokens(model, tmp_path, extra):
    _, reference = _greedy_run(worker_args(model), tmp_path)
    if "--n_draft" in extra:
        extra = [*extra, "--draft", model]  # the model drafting for itself: every draft is accepted
    hello, ids = _greedy_run(worker_args(model, *extra), tmp_path)
    if "--backend" in extra:
        assert hello["backend"] == "mlx"
    else:
        assert hello["limits"]["n_draft"] == 3 and hello["model"]["draft"]["n_draft"] == 3
    assert ids == reference


# ----------------------------------------------------------------------------------------------
# liveness and readiness (protocol 1.1, asked for with --heartbeat_ms)

# A worker whose every forward pass takes SLOW_STEP_S: time.sleep releases the GIL like a real
# long pass in torch does, so only a heartbeat from another thread can fill the gaps.
SLOW_STEPS = [
    sys.executable,
    "-c",
    (
        "import runpy, time\n"
        "import muxworker.worker.engine as e\n"
        "step = e.Engine.step\n"
        "def slow(self):\n"
        "    time.sleep(0.3)\n"
        "    return step(self)\n"
        "e.Engine.step = slow\n"
        "runpy.run_module('muxworker.worker', run_name='__main__', alter_sys=True)\n"
    ),
]


# A worker whose engine loop fails in the first step after a generation on session "boom" is
# accepted; the step says so on stderr and waits until QUEUED more frames are in the inbox, so those
# are queued at the failure, never seen by the engine.
def _failing_engine(queued: int) -> list[str]:
    return [
        sys.executable,
        "-c",
        (
            "import runpy, sys, time\n"
            "import muxworker.worker.engine as e, muxworker.worker.server as srv\n"
            "servers = []\n"
            "init = srv.WorkerServer.__init__\n"
            "def keep(self, *a, **k):\n"
            "    init(self, *a, **k)\n"
            "    servers.append(self)\n"
            "srv.WorkerServer.__init__ = keep\n"
            "submit, step = e.Engine.submit, e.Engine.step\n"
            "armed = []\n"
            "def arm(self, rid, sid, *a, **k):\n"
            "    submit(self, rid, sid, *a, **k)\n"
            "    if sid == 'boom':\n"
            "        armed.append(rid)\n"
            "def failing(self):\n"
            "    if armed:\n"
            "        print('failing step: waiting for queued frames', file=sys.stderr, flush=True)\n"
            "        deadline = time.monotonic() + 60\n"
            f"        while servers[0]._inbox._frames < {queued} and time.monotonic() < deadline:\n"
            "            time.sleep(0.01)\n"
            "        raise RuntimeError('injected engine failure')\n"
            "    return step(self)\n"
            "e.Engine.submit, e.Engine.step = arm, failing\n"
            "runpy.run_module('muxworker.worker', run_name='__main__', alter_sys=True)\n"
        ),
    ]


def _wait_for_stderr(w: RawWorker, text: str) -> None:
    for _ in range(int(HANG_GUARD_S / 0.01)):
        if text in w.stderr():
            return
        time.sleep(0.01)
    pytest.fail(f"the worker never logged {text!r}; stderr:\n{w.stderr()}")


@pytest.mark.slow
def test_readiness_is_in_the_hello_and_info_only_for_a_1_1_client(model, tmp_path):
    with RawWorker(worker_args(model, "--heartbeat_ms", "0"), tmp_path) as w:
        assert w.hello.control["readiness"] == "ready"
        w.send({"kind": "info", "id": 1})
        assert w.final(1)["value"]["readiness"] == "ready"
    with RawWorker(worker_args(model), tmp_path) as w:  # a 1.0 client: its schema has no such field
        assert "readiness" not in w.hello.control
        w.send({"kind": "info", "id": 1})
        assert w.final(1)["value"]["readiness"] == "ready"  # a new entry of a map: allowed in 1.x


@pytest.mark.slow
def test_heartbeats_fill_a_long_forward_pass_and_only_when_asked(model, tmp_path):
    for ask, expect in ((["--heartbeat_ms", "50"], True), ([], False)):
        with RawWorker(worker_args(model, *ask), tmp_path, command=SLOW_STEPS) as w:
            w.send({"kind": "open", "id": 1, "session_id": "a"})
            w.send(*generate_frame(2, "a", [5, 6], max_new_tokens=4))
            kinds = []
            while True:
                frame = w.read()
                assert frame is not None, w.stderr()
                kinds.append(frame.control["kind"])
                if frame.control.get("id") == 2 and frame.control["kind"] != "token":
                    break
            assert kinds[-1] == "done"
            between = kinds[kinds.index("token") :]  # 0.3 s passes each: room for several beats
            assert ("heartbeat" in between) is expect, kinds
            w.close_control()
            assert w.wait() == EXIT_OK


@pytest.mark.slow
def test_an_engine_loop_failure_settles_nothing_as_finished_and_refuses_queued_requests(tmp_path, model):
    with RawWorker(worker_args(model, "--heartbeat_ms", "0"), tmp_path, command=_failing_engine(queued=2)) as w:
        w.send({"kind": "open", "id": 1, "session_id": "a"})
        w.send({"kind": "open", "id": 2, "session_id": "boom"})
        w.send(*generate_frame(3, "a", [5, 6], max_new_tokens=250))
        w.collect(1, 2)
        w.read()  # "a" is streaming
        w.send(*generate_frame(4, "boom", [5, 6], max_new_tokens=4))
        _wait_for_stderr(w, "failing step")
        w.send({"kind": "open", "id": 5, "session_id": "late"})  # queued when the loop fails
        w.send({"kind": "info", "id": 6})
        frames = []
        while (frame := w.read()) is not None:
            frames.append(frame.control)
        finals = {c["id"]: c for c in frames if c["kind"] != "token"}
        # Nothing that was running ends as an ordinary finish: the client reports those as the
        # worker's death. What was still queued is refused, and info says why.
        assert 3 not in finals and 4 not in finals
        assert finals[5]["kind"] == "error" and finals[5]["code"] == "not_ready"
        assert "failed" in finals[5]["message"]
        assert finals[6]["kind"] == "ok" and finals[6]["value"]["readiness"] == "failed"
        last = frames[-1]
        assert last["kind"] == "error" and last["id"] == 0 and last["code"] == "internal"
        assert "engine loop failed" in last["message"]
        assert w.wait() == EXIT_INTERNAL
        assert "injected engine failure" in w.stderr()


# ----------------------------------------------------------------------------------------------
# a misbehaving client: bounded memory, oversized prompts


def _vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_a_client_that_never_reads_replies_cannot_grow_the_worker_without_bound(model, tmp_path):
    ids = np.full(256 * 1024, 5, dtype=np.int32)  # 1 MiB of token ids; each reply is ~256 KB of text

    def detokenize(rid: int) -> bytes:
        payloads: list = []
        ref = attach_payload(payloads, ids)
        return b"".join(
            bytes(memoryview(b))
            for b in encode_frame(Frame({"kind": "detokenize", "id": rid, "tokens": ref}, payloads))
        )

    with RawWorker(worker_args(model), tmp_path) as w:
        w.send_raw(detokenize(1))
        assert w.final(1)["kind"] == "text"  # warm: one such request and its reply at the peak
        before = _vm_kib(w.proc.pid, "VmHWM")
        n = 50
        data = b"".join(detokenize(2 + i) for i in range(n))  # 50 MiB of requests, replies unread
        os.set_blocking(w.control_write, False)
        sent = 0
        poller = select.poll()
        poller.register(w.control_write, select.POLLOUT)
        while sent < len(data):
            try:
                sent += os.write(w.control_write, data[sent : sent + (1 << 20)])
            except BlockingIOError:
                if not poller.poll(3000):  # the worker stopped taking requests: backpressure
                    break
        peak = _vm_kib(w.proc.pid, "VmHWM")
        growth_mib = (peak - before) / 1024
        print(
            f"sent {sent / 2**20:.1f} of {len(data) / 2**20:.0f} MiB unread-reply requests; worker peak RSS grew {growth_mib:.1f} MiB"
        )
        assert sent < len(data)  # the client was made to wait
        assert growth_mib < 40  # the bound (8 MiB queued + one request + the one being answered)
        # Reading the replies lets everything through: every request is answered, in order.
        os.set_blocking(w.control_write, True)
        writer = threading.Thread(target=_write_all, args=(w.control_write, [memoryview(data)[sent:]]))
        writer.start()
        for i in range(n):
            assert w.final(2 + i)["kind"] == "text"
        writer.join()
        w.send({"kind": "info", "id": 100})
        assert w.final(100)["kind"] == "ok"


def _write_all(fd: int, buffers: list) -> None:
    for buf in buffers:
        view = memoryview(buf).cast("B")
        while view:
            view = view[os.write(fd, view) :]


@pytest.mark.slow
def test_an_oversized_prompt_is_refused_from_its_header_while_other_streams_go_on(model, tmp_path):
    with RawWorker(["--model", model, "--max_session_tokens", "4096"], tmp_path) as w:
        w.send({"kind": "open", "id": 1, "session_id": "a"})
        w.send({"kind": "open", "id": 2, "session_id": "b"})
        w.send(*generate_frame(3, "a", [5, 6], max_new_tokens=4000))
        w.collect(1, 2)
        first = w.read()  # the stream is decoding: the engine's own warm-up is behind the baseline
        assert first is not None and first.control["kind"] == "token", first
        before = _vm_kib(w.proc.pid, "VmHWM")
        control, payloads = generate_frame(4, "b", np.zeros(16 * 2**20, dtype=np.int32), max_new_tokens=1)
        head, *body = encode_frame(Frame(control, payloads))
        w.send_raw(bytes(head))  # the header and control map only: 64 MiB of token ids still to come
        seen: list[str] = []
        while not ("refused" in seen and seen[-3:] == ["token"] * 3):
            frame = w.read()
            assert frame is not None
            c = frame.control
            if c.get("id") == 4:
                assert c["kind"] == "error" and c["code"] == "context_overflow", c
                assert "16777216 tokens" in c["message"]
                seen.append("refused")
            elif c.get("id") == 3:
                assert c["kind"] == "token", "the other stream ended before the oversized prompt was refused"
                seen.append("token")
        # Refused before its body was sent, and the other stream kept receiving tokens after that.
        # The body is still read (and dropped), so the stream stays in step for the next request.
        _write_all(w.control_write, body)
        w.send({"kind": "cancel", "id": 3})
        assert w.collect(3)[3][1].control["result"]["finish_reason"] == "cancelled"
        w.send({"kind": "info", "id": 5})
        assert w.final(5)["kind"] == "ok"
        growth_mib = (_vm_kib(w.proc.pid, "VmHWM") - before) / 1024
        assert growth_mib < 32, f"the worker's peak RSS grew {growth_mib:.0f} MiB: it held the 64 MiB body"


@pytest.mark.slow
def test_constraints_compile_off_the_engine_thread_and_bad_ones_are_refused(model, tmp_path):
    """A constrained generate is compiled on the reader thread and then runs like any other; a
    schema that does not compile gets invalid_argument while another session keeps streaming."""
    with RawWorker(["--model", model], tmp_path) as w:
        for rid, sid in ((1, "a"), (2, "b")):
            w.send({"kind": "open", "id": rid, "session_id": sid})
        w.collect(1, 2)
        w.send(*generate_frame(3, "a", [5, 6], max_new_tokens=400))
        w.send(*generate_frame(4, "b", [7, 8], constraint={"json_schema": {"type": "nonsense"}}))
        bad = w.final(4)
        assert bad["kind"] == "error" and bad["code"] == "invalid_argument" and "json_schema" in bad["message"]
        w.send(*generate_frame(5, "b", [7, 8], max_new_tokens=40, constraint={"regex": "[0-9]{4}"}))
        tokens, done = w.collect(5)[5]
        assert done.control["result"]["finish_reason"] == "stop"
        text = "".join(f.control.get("text", "") for f in tokens)
        assert len(text) == 4 and text.isdigit(), text
        w.send({"kind": "cancel", "id": 3})
        assert w.final(3)["result"]["finish_reason"] in ("cancelled", "length")
