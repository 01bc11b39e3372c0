"""``python -m muxworker.chat._worker ARGS``: the worker, in a process group of its own.

A terminal sends Ctrl-C's SIGINT to its whole foreground process group, and the worker shuts down
on SIGINT. The chat handles Ctrl-C itself (stop the reply, or save and quit), so its worker must not
receive it: this moves the process out of the terminal's group before the worker starts. The
worker still exits when the chat goes away, because its control pipe reaches EOF.
"""

from __future__ import annotations

import os
import runpy

if __name__ == "__main__":
    os.setpgid(0, 0)
    # sys.argv[1:] are the worker's flags, exactly as `python -m muxworker.worker` would see them.
    runpy.run_module("muxworker.worker", run_name="__main__", alter_sys=True)
