"""One worker as an application starts it: :class:`WorkerSpec`.

The chat, the HTTP server (and so each Ray replica) and the demo each need two things that must
agree: the worker's command line, and the identity a session store binds checkpoints to (the
model's files and the settings that change activations). A spec parses and checks the worker's
flags once (:func:`~.options.parse_args`, torch-free) and derives both from them, so no caller
builds a command string or a configuration dict by hand.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from muxworker.transport.fdio import flags_of
from muxworker.worker.models.identity import model_identity_files, worker_configuration
from muxworker.worker.options import WorkerOptions, parse_args

__all__ = ["WorkerSpec", "flags_of"]


@dataclass(frozen=True)
class WorkerSpec:
    """A worker: its model directory and its flags (as a command line gives them, without
    ``--model``), parsed and checked at construction (:class:`~.options.UsageError` names a bad
    flag). ``own_process_group``: the worker leaves its parent's process group, so a terminal's
    Ctrl-C reaches only the application, which saves its sessions before it closes the worker."""

    model_dir: Path
    flags: tuple[str, ...] = ()
    own_process_group: bool = False
    options: WorkerOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        object.__setattr__(self, "flags", tuple(self.flags))
        object.__setattr__(self, "options", parse_args(["--model", os.fspath(self.model_dir), *self.flags]))

    @classmethod
    def of(cls, model_dir: str | os.PathLike[str], *, own_process_group: bool = False, **flags: Any) -> WorkerSpec:
        """A spec from keyword flags (``dtype="float32", max_sessions=2``; see :func:`flags_of`)."""
        return cls(Path(model_dir), tuple(flags_of(**flags)), own_process_group)

    def command(self) -> list[str]:
        """The worker's command line (the protocol's fd flags are added by the spawn)."""
        group = ["--own-process-group"] if self.own_process_group else []
        return [sys.executable, "-m", "muxworker.worker", "--model", os.fspath(self.model_dir), *group, *self.flags]

    def store_identity(self) -> dict[str, Any]:
        """``model_files`` and ``configuration`` for ``open_store`` / ``SessionStore.create``: what
        this worker's checkpoints are bound to."""
        o = self.options
        return {
            "model_files": model_identity_files(self.model_dir),
            "configuration": worker_configuration(
                backend=o.backend,
                dtype=o.dtype,
                device=o.device,
                weights=o.weights,
                quantize=o.quantize,
                model_dir=self.model_dir,
                draft=o.draft,
                n_draft=o.config.n_draft,
            ),
        }
