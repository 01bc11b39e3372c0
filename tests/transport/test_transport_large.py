"""One 1 GiB payload streamed through a pipe between two processes, checked by CRC32C.

Both ends are child processes, so each can report its own peak memory: one copy of the payload
per process (the writer never concatenates it into a bytes object, the reader reads it into a
single preallocated buffer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from muxworker.transport import make_pipe

GiB = 1 << 30

WRITER = r"""
import json, resource, sys
import numpy as np
from muxworker.native import crc32c
from muxworker.transport import FdFrameWriter, Frame, FrameLimits, attach_payload
fd = int(sys.argv[1])
data = np.arange((1 << 30) // 8, dtype=np.uint64)
data *= np.uint64(0x9E3779B97F4A7C15)  # every byte position matters
payloads = []
ref = attach_payload(payloads, data)
control = {"kind": "blob", "crc": crc32c(data), "blob": ref}
FdFrameWriter(fd, FrameLimits(max_payload_bytes=1 << 30)).write(Frame(control, payloads))
print(json.dumps({"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""

READER = r"""
import json, resource, sys
from muxworker.native import crc32c
from muxworker.transport import FdFrameReader, FrameLimits, payload_array
reader = FdFrameReader(int(sys.argv[1]), FrameLimits(max_payload_bytes=1 << 30))
frame = reader.read()
blob = payload_array(frame, frame.control["blob"])
print(json.dumps({
    "nbytes": blob.nbytes,
    "shape": list(blob.shape),
    "crc_sent": frame.control["crc"],
    "crc_received": crc32c(blob),
    "then": repr(reader.read()),
    "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
}))
"""


@pytest.mark.slow  # moves a GiB through a pipe; the framing of large payloads is also in test_transport_pipes
def test_one_gib_payload_between_two_processes():
    r, w = make_pipe()
    reader = subprocess.Popen([sys.executable, "-c", READER, str(r)], pass_fds=[r], stdout=subprocess.PIPE)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(w)], pass_fds=[w], stdout=subprocess.PIPE)
    os.close(r)
    os.close(w)
    try:
        wrote_out = writer.communicate()[0]
        read_out = reader.communicate()[0]
    finally:
        for proc in (reader, writer):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert (writer.returncode, reader.returncode) == (0, 0)
    wrote, read = json.loads(wrote_out), json.loads(read_out)
    assert read["nbytes"] == GiB and read["shape"] == [GiB // 8]
    assert read["crc_received"] == read["crc_sent"]
    assert read["then"] == "None"
    # One copy of the payload per process (plus the interpreter, numpy, ...), never two.
    for peak in (wrote["maxrss_kib"], read["maxrss_kib"]):
        assert peak * 1024 < 1.5 * GiB
