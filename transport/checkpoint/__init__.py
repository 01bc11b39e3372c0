"""Checkpoints, one home for both ends: the data model, the file format, identity.

- :mod:`.state`: :class:`CPUCheckpoint`, :class:`LayerState`, the retention rule
  (:func:`required_rows`), storage dtypes and the layout version. Used by the worker and the client.
- :mod:`.container`: the checkpoint file container (header, manifest, CRC32C-checked payloads,
  trailer; docs/CHECKPOINT_FORMAT.md) and memory files.
- :mod:`.segments`: segments, the one file kind that holds KV rows (and a draft model's state);
  :mod:`.manifest`: session manifests naming them; :mod:`.blocks`: content-addressed blocks.
- :mod:`.file`: host checkpoints as segments, :func:`save_checkpoint` / :func:`load_checkpoint`.
- :mod:`.identity`: :func:`checkpoint_identity` and the inputs it was computed from.
- :mod:`.errors`: :class:`CheckpointMalformed` and :class:`CheckpointRetentionError` are the
  worker's wire error ``CheckpointRejected``; the file layer's errors derive from
  :class:`CheckpointError`, which is not (defined, with their codes, in transport/errors.py).
"""

from __future__ import annotations

from ..errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointIncompatible,
    CheckpointNotFound,
    CheckpointReadError,
    CheckpointTooLarge,
    CheckpointUnsafePath,
    CheckpointWriteError,
)
from .container import DEFAULT_MAX_BYTES
from .errors import CheckpointMalformed, CheckpointRetentionError
from .file import load_checkpoint, save_checkpoint
from .identity import IdentityInputs, ModelFileFingerprint, checkpoint_identity, checkpoint_identity_inputs
from .state import LAYOUT_VERSION, CPUCheckpoint, LayerState, numpy_storage_dtype, required_rows, retained_from

__all__ = [
    # data model
    "CheckpointError",
    "CheckpointMalformed",
    "CheckpointRetentionError",
    "CPUCheckpoint",
    "LayerState",
    "LAYOUT_VERSION",
    "numpy_storage_dtype",
    "required_rows",
    "retained_from",
    # file format
    "DEFAULT_MAX_BYTES",
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointNotFound",
    "CheckpointCorrupt",
    "CheckpointIncompatible",
    "CheckpointTooLarge",
    "CheckpointUnsafePath",
    "CheckpointWriteError",
    "CheckpointReadError",
    # identity
    "checkpoint_identity",
    "checkpoint_identity_inputs",
    "IdentityInputs",
    "ModelFileFingerprint",
]
