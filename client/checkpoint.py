"""Checkpoint files and identity for client code: re-exported from :mod:`muxworker.transport.checkpoint`,
their one home (the data model, wire codec, file format and identity are shared by both ends)."""

from __future__ import annotations

from muxworker.transport.checkpoint import (
    DEFAULT_MAX_BYTES,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointIncompatible,
    CheckpointNotFound,
    CheckpointReadError,
    CheckpointRetentionError,
    CheckpointTooLarge,
    CheckpointUnsafePath,
    CheckpointWriteError,
    CPUCheckpoint,
    IdentityInputs,
    LayerState,
    ModelFileFingerprint,
    checkpoint_identity,
    checkpoint_identity_inputs,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "CPUCheckpoint",
    "LayerState",
    "CheckpointError",
    "CheckpointNotFound",
    "CheckpointCorrupt",
    "CheckpointIncompatible",
    "CheckpointRetentionError",
    "CheckpointTooLarge",
    "CheckpointUnsafePath",
    "CheckpointWriteError",
    "CheckpointReadError",
    "DEFAULT_MAX_BYTES",
    "checkpoint_identity",
    "checkpoint_identity_inputs",
    "IdentityInputs",
    "ModelFileFingerprint",
    "save_checkpoint",
    "load_checkpoint",
]
