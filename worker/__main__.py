"""``python -m muxworker.worker``: the worker process (see server.py and ``--help``)."""

from __future__ import annotations

import os
import sys


def _stdout_to_stderr() -> None:
    """Point fd 1 at stderr before anything else is imported.

    The protocol runs on two dedicated pipes, so stdout carries nothing of ours; sending it to
    stderr keeps a stray print from any library (torch, tokenizers, ...) visible in the client's
    stderr capture instead of filling a pipe nobody reads.
    """
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os.dup2(2, 1)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]


if __name__ == "__main__":
    from muxworker.worker import passive_openmp

    passive_openmp()
    if "--own-process-group" in sys.argv[1:]:  # before anything else, so no signal finds it in the old one
        os.setpgid(0, 0)
    if not {"-h", "--help"} & set(sys.argv[1:]):  # --help is for a person: keep it on stdout
        _stdout_to_stderr()
    from muxworker.worker.startup import main

    code = main()
    # Everything is settled and sent: skip interpreter teardown (torch's can take a second), so the
    # client sees the exit status promptly.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
