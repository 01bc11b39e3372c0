"""The worker's checkpoint files on its I/O thread, over a real file channel: a save in flight holds
up only its own session, and EOF waits for it (tests/helpers/raw_worker.py drives the worker)."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import pytest
from helpers.raw_worker import HANG_GUARD_S, FileWorker, generate_frame

from muxworker.transport.checkpoint.file import assemble_checkpoint
from muxworker.transport.checkpoint.segments import read_segment_header
from muxworker.worker.server import EXIT_OK


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


def _stalled_file() -> tuple[int, int]:
    """A pipe as a segment file: its writer blocks once 4 KiB wait unread (so a save stays in flight
    until the test drains it), and its fsync then fails (EINVAL: a pipe cannot be synced)."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    return read_end, write_end


def _drain(fd: int) -> threading.Thread:
    def drain() -> None:
        while os.read(fd, 1 << 16):
            pass
        os.close(fd)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_a_save_in_flight_holds_up_only_its_own_session(model, tmp_path):
    with FileWorker(model, tmp_path) as w:
        for rid, sid in ((1, "a"), (2, "b")):
            w.send({"kind": "open", "id": rid, "session_id": sid})
        w.send(*generate_frame(3, "a", list(range(3, 120)), max_new_tokens=1))
        assert w.final(3)["kind"] == "done"
        read_end, write_end = _stalled_file()
        w.save_file(4, "a", write_end)
        os.close(write_end)
        w.send(*generate_frame(5, "b", [5, 6, 7], max_new_tokens=20))
        w.send(*generate_frame(6, "a", [5, 6, 7]))
        w.send({"kind": "close", "id": 7, "session_id": "a"})
        # The save's write waits on the full pipe; the other session streams all of its tokens and
        # the saved one refuses what would touch its rows, before the save's reply.
        tokens, done = w.collect(5)[5]
        assert done.control["kind"] == "done" and sum(len(t.control["token_ids"]) for t in tokens) == 20
        assert w.final(6)["code"] == "session_busy"
        assert w.final(7)["code"] == "session_busy"
        assert 4 not in w._finals
        drainer = _drain(read_end)
        failed = w.final(4)  # every byte written, then the fsync failed
        drainer.join(HANG_GUARD_S)
        assert failed["code"] == "checkpoint_write_error" and "cannot save session 'a'" in failed["message"]
        # Idle again: it generates, saves into a real file, and that file restores bit for bit.
        w.send(*generate_frame(8, "a", list(range(3, 120)) + [9, 10], max_new_tokens=2))
        assert w.final(8)["kind"] == "done"
        path = tmp_path / "a.mxseg"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        w.save_file(9, "a", fd)
        os.close(fd)
        saved = w.final(9)["value"]
        assert (saved["start"], saved["position"]) == (0, 117 + 2 + 2 - 1)
        w.restore_file(10, "r", path, saved, "a")
        assert w.final(10)["value"] == {"position": saved["position"]}
        exported = []
        for rid, sid in ((11, "a"), (12, "r")):  # an export: into a memory file, no tag
            fd = os.memfd_create("export")
            w.save_file(rid, sid, fd, tag=None)
            assert w.final(rid)["value"]["position"] == saved["position"]
            ckpt = assemble_checkpoint([(fd, read_segment_header(fd, "export"), "export")])
            os.close(fd)
            exported.append([ckpt.token_ids.tobytes()] + [x.keys.tobytes() + x.values.tobytes() for x in ckpt.layers])
        assert exported[0] == exported[1]
        w.close_control()
        assert w.wait() == EXIT_OK


@pytest.mark.slow
def test_eof_waits_for_a_save_in_flight_and_answers_it(model, tmp_path):
    with FileWorker(model, tmp_path) as w:
        w.send({"kind": "open", "id": 1, "session_id": "a"})
        w.send(*generate_frame(2, "a", list(range(3, 120)), max_new_tokens=1))
        assert w.final(2)["kind"] == "done"
        read_end, write_end = _stalled_file()
        w.save_file(3, "a", write_end)
        os.close(write_end)
        w.close_control()
        time.sleep(0.5)
        assert w.proc.poll() is None  # still writing
        drainer = _drain(read_end)
        assert w.final(3)["code"] == "checkpoint_write_error"
        drainer.join(HANG_GUARD_S)
        assert w.read() is None
        assert w.wait() == EXIT_OK
