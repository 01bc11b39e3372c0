"""The processes a test started, from /proc (muxworker.serve.process reads the table)."""

from __future__ import annotations

import os

from muxworker.serve.process import process_table


def child_pids() -> set[int]:
    """Live (or zombie) children of this process."""
    me = os.getpid()
    return {pid for pid, stat in process_table().items() if stat.ppid == me}
