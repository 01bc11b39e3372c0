"""The trio client: spawn a worker, multiplex sessions and streams over its pipes, save and resume
sessions.

::

    async with spawn_multiplexed_worker(default_worker_command(model_dir)) as client:
        await client.open_session("chat")
        stream = client.generate("Hello", GenerationParams(session_id="chat", max_new_tokens=32))
        async for text in stream:
            print(text, end="")
        result = await stream.wait()
"""

from __future__ import annotations

from muxworker.transport.checkpoint import (
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
    checkpoint_identity,
    load_checkpoint,
    save_checkpoint,
)
from muxworker.transport.errors import (
    CapacityExhausted,
    CheckpointRejected,
    ClientClosedError,
    ContextOverflow,
    InternalError,
    InvalidArgument,
    MuxError,
    NotReady,
    OperationCancelled,
    ProtocolError,
    SessionBusy,
    SessionExists,
    SessionNotFound,
    SlowConsumer,
    Unsaveable,
    WorkerDiedError,
    WorkerStartupError,
)
from muxworker.transport.prompt import SpecialText

from .client import MultiplexedWorkerClient, default_worker_command, spawn_multiplexed_worker
from .params import ChatPrompt, GenerationParams, GenerationResult, ModelInfo, TokenLogprob, WorkerInfo
from .runtime import EvictionFailed, RuntimeGenerationResult, RuntimeStream, SessionRuntime
from .sessions import SaveResult
from .stores import (
    ConfigurationMismatch,
    ObjectSessionStore,
    SaveConflict,
    SessionInfo,
    SessionStore,
    StoreBinding,
    StoreBusy,
    StorePermissionError,
    StoreUnavailable,
    open_store,
)
from .stream import GenerationStream

__all__ = [
    # client
    "spawn_multiplexed_worker",
    "default_worker_command",
    "MultiplexedWorkerClient",
    "SessionRuntime",
    "RuntimeStream",
    "GenerationStream",
    "GenerationParams",
    "GenerationResult",
    "TokenLogprob",
    "ChatPrompt",
    "SpecialText",
    "WorkerInfo",
    "ModelInfo",
    # errors
    "MuxError",
    "InvalidArgument",
    "NotReady",
    "SessionNotFound",
    "SessionExists",
    "SessionBusy",
    "CapacityExhausted",
    "ContextOverflow",
    "SlowConsumer",
    "InternalError",
    "ProtocolError",
    "Unsaveable",
    "CheckpointRejected",
    "WorkerDiedError",
    "WorkerStartupError",
    "ClientClosedError",
    "OperationCancelled",
    # checkpoints and storage
    "CPUCheckpoint",
    "SessionStore",
    "ObjectSessionStore",
    "StoreBinding",
    "open_store",
    "SessionInfo",
    "SaveResult",
    "EvictionFailed",
    "RuntimeGenerationResult",
    "SaveConflict",
    "StoreBusy",
    "StorePermissionError",
    "StoreUnavailable",
    "checkpoint_identity",
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointError",
    "CheckpointNotFound",
    "CheckpointCorrupt",
    "CheckpointIncompatible",
    "CheckpointRetentionError",
    "CheckpointTooLarge",
    "CheckpointUnsafePath",
    "CheckpointWriteError",
    "CheckpointReadError",
    "ConfigurationMismatch",
]
