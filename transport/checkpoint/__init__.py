"""Checkpoints, one home for both ends: the data model, its wire codec, the file format, identity.

- :mod:`.state`: :class:`CPUCheckpoint`, :class:`LayerState`, the retention rule
  (:func:`required_rows`), storage dtypes and the layout version. Used by the worker and the client.
- :mod:`.codec`: :func:`checkpoint_to_wire` / :func:`checkpoint_from_wire` (manifest + payloads).
- :mod:`.file`: :func:`save_checkpoint` / :func:`load_checkpoint`, the file layout of
  docs/CHECKPOINT_FORMAT.md (the client's session store writes and reads through it).
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
from .codec import MANIFEST_VERSION, MAX_PAYLOADS, checkpoint_from_wire, checkpoint_to_wire
from .errors import CheckpointMalformed, CheckpointRetentionError
from .file import DEFAULT_MAX_BYTES, load_checkpoint, save_checkpoint
from .identity import IdentityInputs, ModelFileFingerprint, checkpoint_identity, checkpoint_identity_inputs
from .state import LAYOUT_VERSION, CPUCheckpoint, LayerState, numpy_storage_dtype, required_rows, retained_from

__all__ = [
    # data model and codec (as before the package split)
    "CheckpointError",
    "CheckpointMalformed",
    "CheckpointRetentionError",
    "CPUCheckpoint",
    "LayerState",
    "LAYOUT_VERSION",
    "MANIFEST_VERSION",
    "MAX_PAYLOADS",
    "checkpoint_to_wire",
    "checkpoint_from_wire",
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
