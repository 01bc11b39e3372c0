"""SessionStore: one directory of saved session checkpoints bound to one model/configuration.

Configure it once at start-up with the worker's artifacts and settings; after that every call needs
only a session id::

    store = await SessionStore.create("./saved-sessions", model_files=[...], configuration={...})
    await trio.to_thread.run_sync(store.save, "chat-42", checkpoint)
    checkpoint = await trio.to_thread.run_sync(store.load, "chat-42")

The methods are blocking and thread-safe (each opens, checks and closes what it uses), so callers run
them in worker threads. Nothing is evicted or swept implicitly: a writer killed mid-save can leave a
``.<session-hash>.<random>.tmp`` file, which :meth:`list` ignores and which may be removed once no
writer is running.
"""

from __future__ import annotations

import builtins
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from muxworker.transport.checkpoint import (
    DEFAULT_MAX_BYTES,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointIncompatible,
    CheckpointNotFound,
    CheckpointReadError,
    CheckpointTooLarge,
    CheckpointWriteError,
    CPUCheckpoint,
    IdentityInputs,
    checkpoint_identity_inputs,
)
from muxworker.transport.checkpoint.blocks import (
    BLOCK_NAME,
    DEFAULT_BLOCK_TOKENS,
    MAX_BLOCKS,
    Piece,
    SegmentMemory,
    split_segment,
)
from muxworker.transport.checkpoint.errors import os_failure
from muxworker.transport.checkpoint.file import (
    _identity_mismatch,
    _open_regular,
    _write_all,
    read_checkpoint_file,
    replace_file,
    write_checkpoint_file,
)
from muxworker.transport.checkpoint.segments import (
    SEGMENTED_VERSION,
    SegmentRef,
    SessionManifest,
    assemble_checkpoint,
    check_chain,
    encode_session_manifest,
    file_version,
    read_payload_into,
    read_segment_header,
    read_session_manifest,
    write_checkpoint_segment,
)
from muxworker.transport.errors import InvalidArgument
from muxworker.transport.schema import MAX_SESSION_ID_BYTES

if TYPE_CHECKING:
    from .params import WorkerInfo

__all__ = [
    "SessionStore",
    "StoreBinding",
    "open_store",
    "StorePermissionError",
    "ConfigurationMismatch",
    "StoreBusy",
    "SaveConflict",
    "StoreUnavailable",
    "SessionInfo",
    "CleanResult",
    "DEFAULT_COMPACT_AFTER",
]

SUFFIX = ".mxckpt"
SEGMENT_SUFFIX = ".mxseg"
#: A session's manifest is ``<hash>.mxckpt`` and its own segments ``<hash>.<random>.mxseg``, on
#: every backend (``hash``: :func:`session_hash` of its id), so a segment's name says whose it is.
MANIFEST_NAME = re.compile(r"[0-9a-f]{64}\.mxckpt")
SEGMENT_NAME = re.compile(r"([0-9a-f]{64})\.[0-9a-f]{16}\.mxseg")
_TEMP_NAME = re.compile(r"\.[0-9a-f]{64}\.[0-9a-f]{16}\.tmp")
# Writers hold a shared lock on WRITERS_LOCK while they save or delete; clean() needs it exclusive.
# COMMIT_LOCK is held exclusive for the few milliseconds a manifest is checked and replaced.
WRITERS_LOCK = ".muxworker-writers.lock"
COMMIT_LOCK = ".muxworker-commit.lock"
#: A session saved incrementally is rewritten whole (compacted) once it has this many segments.
DEFAULT_COMPACT_AFTER = 16
#: The local store's blocks by default: none. The worker then writes its rows straight into the
#: store's file and reads them back from one segment per save: measured at 4,096 tokens, 128-token
#: blocks made a save 1.9x and a restore 2.4x slower here (32 files, each fsynced and read on its
#: own). ``block_tokens=DEFAULT_BLOCK_TOKENS`` shares prefixes on disk too. Object stores share by
#: default (transport/checkpoint/blocks.py).
LOCAL_BLOCK_TOKENS = 0


class StorePermissionError(CheckpointError):
    """The store directory is missing, a symlink, not a directory, not owned by this user, or
    writable by group or others."""


class ConfigurationMismatch(CheckpointIncompatible):
    """The worker (or a checkpoint) does not run the configuration the store was created with."""


class StoreBusy(CheckpointError):
    """A writer holds the store, so an operation that needs it alone (``clean``) did not run."""


class SaveConflict(CheckpointError):
    """Another writer saved or deleted the session while this incremental save ran; save again."""


class StoreUnavailable(CheckpointError):
    """The store could not be reached or answered with a server/network error; the session's data is not known to be damaged."""

    code = "store_unavailable"  # never on the wire: only the client's stores raise it


@dataclass(frozen=True)
class SessionInfo:
    """What the store knows of one saved session, from its manifest (no payload is read)."""

    session_id: str
    tokens: int  # the saved position: tokens of history with KV
    nbytes: int  # bytes on disk: segments plus manifest (or the one file)
    segments: int  # files holding its rows (1 for a file version 1 or 2 session)
    identity: str | None
    dtype: str
    backend: str
    created: float  # seconds since the epoch (a version 1/2 file: its modification time)
    saved: float
    file_version: int


class CleanResult(tuple[list[str], int]):
    """What :meth:`StoreBinding.clean` did. It unpacks as ``(removed, nbytes)``: the names it
    removed and their bytes. ``kept`` are the segments and blocks it left only because a manifest
    it could not read may name them, and ``unreadable`` those manifests, as (name, why)."""

    kept: list[str]
    unreadable: list[tuple[str, str]]

    def __new__(
        cls,
        removed: list[str],
        nbytes: int,
        *,
        kept: Iterable[str] = (),
        unreadable: Iterable[tuple[str, str]] = (),
    ) -> CleanResult:
        result = super().__new__(cls, (removed, nbytes))
        result.kept = sorted(kept)
        result.unreadable = sorted(unreadable)
        return result

    @property
    def removed(self) -> list[str]:
        return self[0]

    @property
    def nbytes(self) -> int:
        return self[1]


@dataclass
class ManifestSurvey:
    """What a collector learned from reading every manifest: the segments and blocks they name,
    and the manifests it could not read, as (name, why).

    A manifest that cannot be read, for any reason (an I/O or permission error, a network error,
    a newer version, damage), may name anything: the segments of its own session (named after it,
    ``<hash>.<random>.mxseg``) stay, and while any manifest is unreadable no block is collected,
    since which blocks it names is unknown."""

    named: set[str] = field(default_factory=set)
    unreadable: list[tuple[str, str]] = field(default_factory=list)

    def partition(self, names: Iterable[str]) -> tuple[list[str], list[str]]:
        """The segments and blocks among ``names`` that no manifest names: (those no manifest
        can name, those only an unreadable manifest may name)."""
        guarded = {name[:64] for name, _ in self.unreadable}  # the session hashes they are named by
        stray: list[str] = []
        kept: list[str] = []
        for name in names:
            segment = SEGMENT_NAME.fullmatch(name)
            if not (segment or BLOCK_NAME.fullmatch(name)) or name in self.named:
                continue
            if segment:
                protected = segment.group(1) in guarded
            else:  # a block: any manifest may name it
                protected = bool(self.unreadable)
            (kept if protected else stray).append(name)
        return stray, kept


@dataclass
class SavePlan:
    """A save in progress (begin_save .. commit_save / abort_save); holds the writers' lock."""

    session_id: str
    digest: str
    segment: str  # the new segment's file name
    fd: int  # the new segment file, open for writing, passed to the worker
    tag: str
    base: SessionManifest | None  # the saved manifest the save may append to
    lock_fd: int  # the local store's writers' lock (-1: none)
    version: Any = None  # an object store's e-tag of the manifest found (the conditional write's)
    staged: bool = False  # fd is a memory file the store cuts into blocks and a tail (block_tokens)
    compact: bool = False  # rewrite the tail run after the base's blocks as one segment
    found: SessionManifest | None = None  # the manifest the save replaces (an object store's e-tag's)


@dataclass
class ResumePlan:
    """The open files of a saved session, vetted, for a worker to restore from."""

    session_id: str
    fds: list[int]
    manifest: SessionManifest | None  # None: a version 1 or 2 file (``fds`` holds it alone)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


# Configuration keys the worker's hello reports, and where. Keys it does not report (rope, ...)
# are bound by the identity alone; the engine limits (info.limits) are matched by their own names.
_WORKER_FACTS = {
    "backend": lambda info: info.backend,
    "dtype": lambda info: info.dtype,
    "weights": lambda info: info.weights,
    "device": lambda info: info.device,
    "architecture": lambda info: info.model.architecture,
    "vocab_size": lambda info: info.model.vocab_size,
    "context_length": lambda info: info.model.context_length,
}


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def session_hash(session_id: str) -> str:
    """The hex name of ``session_id``'s files (any id is safe as a name); checks the id."""
    if not isinstance(session_id, str) or not session_id:
        raise InvalidArgument(f"session id must be a nonempty string, got {session_id!r}")
    try:
        raw = session_id.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"session id {session_id!r} is not valid Unicode text") from None
    # The wire's limit, so that every id the worker accepts can be saved and no saved id is one
    # the worker would refuse to resume.
    if len(raw) > MAX_SESSION_ID_BYTES:
        raise InvalidArgument(f"session id is longer than {MAX_SESSION_ID_BYTES} UTF-8 bytes")
    return hashlib.sha256(raw).hexdigest()


class StoreBinding:
    """What every session store shares, whatever holds its files: the checkpoint identity it is
    bound to, the declared configuration a worker is checked against, and the size limit.
    ``location`` names the store in messages (a directory, or an object-storage URL)."""

    location: str

    def __init__(
        self,
        *,
        identity: str,
        max_bytes: int = DEFAULT_MAX_BYTES,
        inputs: IdentityInputs | None = None,
        compact_after: int = DEFAULT_COMPACT_AFTER,
        block_tokens: int,
        share_blocks_across_namespaces: bool = False,
    ) -> None:
        if not isinstance(share_blocks_across_namespaces, bool):
            raise InvalidArgument(
                f"share_blocks_across_namespaces must be True or False, got {share_blocks_across_namespaces!r}"
            )
        #: Whether sessions of different namespaces (the part of an id before its first "/", e.g.
        #: the HTTP server's tenant) share blocks. Off: a namespace cannot learn, from a save's
        #: time or the store's objects, whether another already stored a prefix.
        self.share_blocks_across_namespaces = share_blocks_across_namespaces
        if isinstance(compact_after, bool) or not isinstance(compact_after, int) or not 1 <= compact_after <= 128:
            raise InvalidArgument(f"compact_after must be an integer in [1, 128], got {compact_after!r}")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or not 0 <= block_tokens <= 1 << 20:
            raise InvalidArgument(
                f"block_tokens must be 0 (no shared blocks) or a positive integer, got {block_tokens!r}"
            )
        self.block_tokens = block_tokens
        if not isinstance(identity, str) or not identity:
            raise InvalidArgument("identity must be a nonempty string")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise InvalidArgument(f"max_bytes must be a positive integer, got {max_bytes!r}")
        if inputs is not None and not isinstance(inputs, IdentityInputs):
            raise InvalidArgument(f"inputs must be IdentityInputs or None, got {type(inputs).__name__}")
        self.compact_after = compact_after
        self.identity = identity
        self.max_bytes = max_bytes
        self.inputs = inputs
        self.inspecting = False

    def _check_bound(self, what: str) -> None:
        if self.inspecting:
            raise InvalidArgument(
                f"this store was opened for inspection, bound to no model: it cannot {what}; "
                "open it with SessionStore.create(path, model_files=..., configuration=...)"
            )

    @property
    def configuration(self) -> dict[str, Any] | None:
        """The configuration the store was created with (canonical JSON data), if known."""
        return None if self.inputs is None else self.inputs.configuration

    def check_worker(self, info: WorkerInfo) -> None:
        """Refuse a worker that does not run what this store's configuration declares.

        Compares each declared key that the worker's hello reports: ``backend``, ``dtype``,
        ``device`` (``cuda`` matches ``cuda:0``), the model's ``architecture``, ``vocab_size`` and
        ``context_length``, every engine limit by name (``max_session_tokens``, ``n_draft``, ...),
        and ``draft`` as present or absent. Undeclared keys, and keys the hello does not report,
        are not compared (the model files' bytes are bound by the identity). A store made without
        ``inputs`` declares nothing. Raises :class:`ConfigurationMismatch` naming every differing
        field, e.g. ``dtype: store float32, worker bfloat16``.
        """
        config = self.configuration
        if not config:
            return
        differences = []
        for key, declared in sorted(config.items()):
            if key in _WORKER_FACTS:
                actual = _WORKER_FACTS[key](info)
                if key == "device" and isinstance(actual, str) and actual.startswith(f"{declared}:"):
                    continue
            elif key == "draft" and "n_draft" in info.limits:
                # The hello reports the draft through its n_draft (0: none; with --speculative
                # ngram, no draft model); the draft's name is bound by its files in the identity.
                has_draft = bool(info.limits["n_draft"]) and info.limits.get("speculative") != "ngram"
                if has_draft != (declared is not None):
                    differences.append(
                        f"draft: store {_show(declared)}, worker "
                        + (f"a draft model (n_draft {info.limits['n_draft']})" if has_draft else "none")
                    )
                continue
            elif key == "n_draft" and info.limits.get("speculative") == "ngram" and not declared:
                continue  # n-gram drafting holds no state: its sessions are a plain worker's
            elif key in info.limits:
                actual = info.limits[key]
            else:
                continue
            if actual != declared:
                differences.append(f"{key}: store {_show(declared)}, worker {_show(actual)}")
        if differences:
            raise ConfigurationMismatch(
                f"the worker does not run what the session store {self.location!r} declares: " + "; ".join(differences)
            )

    def _check_format(self, checkpoint: CPUCheckpoint) -> None:
        """A checkpoint's own dtype and backend must be the declared ones (it was made by the worker)."""
        self._check_declared(checkpoint.format, "checkpoint")

    def _check_declared(self, fmt: dict, what: str) -> None:
        """A checkpoint's (or saved session's) dtype and backend must be the declared ones."""
        config = self.configuration or {}
        differences = [
            f"{key}: store {_show(config[key])}, {what} {_show(fmt.get(key))}"
            for key in ("dtype", "backend")
            if key in config and fmt.get(key) != config[key]
        ]
        if differences:
            raise ConfigurationMismatch(
                f"the {what} was not made by the configuration the session store {self.location!r} declares: "
                + "; ".join(differences)
            )

    def check_manifest(self, m: SessionManifest, session_id: str, name: str) -> None:
        """A manifest read under ``name`` must be ``session_id``'s, of this store's identity, and
        made by the declared configuration."""
        if m.session_id != session_id:
            raise CheckpointCorrupt(
                f"{name} holds session {m.session_id!r}, not {session_id!r}; the file was renamed or copied"
            )
        if m.identity != self.identity and not self.inspecting:
            raise CheckpointIncompatible(
                _identity_mismatch(name, m.identity, self.identity, m.identity_inputs, self.inputs, "store")
            )
        self._check_declared(m.format, "checkpoint")

    # -- content-addressed blocks (transport/checkpoint/blocks.py), for every backend ------------

    def block_namespace(self, session_id: str) -> str:
        """The namespace whose blocks ``session_id``'s saves name: the part of the id before its
        first "/" ("" without one), or "" for all when the store shares blocks across namespaces."""
        if self.share_blocks_across_namespaces or "/" not in session_id:
            return ""
        return session_id.split("/", 1)[0]

    def _base_plan(self, base: SessionManifest | None) -> tuple[SessionManifest | None, bool]:
        """(the manifest a save builds on, whether it compacts the tail run): a session with
        ``compact_after`` tail segments gets its tail rewritten as one (whole when it has no blocks)."""
        if base is None:
            return None, False
        tails = sum(not r.shared for r in base.segments)
        if tails < self.compact_after:
            return base, False
        if self.block_tokens and _block_run_end(base) % self.block_tokens == 0 and _block_run_end(base):
            return base, True
        return None, False

    def base_of(self, plan: SavePlan) -> dict[str, Any] | None:
        """The ``base`` a worker's save_file appends to (None: write everything). A block store's
        base also says where its last block ends, for saves that complete a block."""
        base = plan.base
        if base is None:
            return None
        run, size = _block_run_end(base), self.block_tokens
        if size and run % size:
            run = 0  # blocks of another size: the next save that crosses a boundary rewrites them
        out: dict[str, Any] = {"tag": base.tag, "position": run if plan.compact else base.position}
        if size and run < MAX_BLOCKS * size:
            out["block_start"] = run
            out["block_tokens"] = size
        return out

    def _cut(
        self, plan: SavePlan, written: dict[str, Any]
    ) -> tuple[builtins.list[SegmentRef], builtins.list[Piece], SegmentMemory]:
        """What a staged save publishes: the base's segments it keeps (those before the new rows),
        and the new rows cut into block pieces and a tail piece (views of the memory file)."""
        start, position = int(written["start"]), int(written["position"])
        base = plan.base
        kept = [r for r in base.segments if r.end <= start] if start and base is not None else []
        if start and (kept[-1].end if kept else 0) != start:
            raise SaveConflict(
                f"session {plan.session_id!r}: the worker saved from position {start}, which is no segment "
                "boundary of the save it builds on; nothing was published, save again"
            )
        ref = SegmentRef(plan.segment, start, position, written["file_length"], written["header_crc"])
        header = read_segment_header(plan.fd, f"the new segment of session {plan.session_id!r}", ref)
        if header.session_id != plan.session_id or header.identity != self.identity:
            raise CheckpointCorrupt(
                f"the worker wrote a segment of another session or identity for {plan.session_id!r}"
            )
        size, parent = self.block_tokens, None
        if start:
            match = BLOCK_NAME.fullmatch(kept[-1].name) if kept[-1].shared else None
            if match is None:
                size = 0  # blocks continue only a run of blocks
            else:
                parent = match.group(1)
        memory = SegmentMemory(plan.fd)
        try:
            pieces = split_segment(
                memory,
                header,
                session_id=plan.session_id,
                block_tokens=size,
                parent_key=parent,
                namespace=self.block_namespace(plan.session_id),
            )
        except BaseException:
            memory.close()
            raise
        return kept, pieces, memory

    # -- what every backend implements (SessionStore: a directory; ObjectSessionStore: a bucket) --
    # Blocking and thread-safe, for trio.to_thread. The client's save and resume use the begin /
    # commit pairs (the worker writes and reads the open descriptors they hold); save and load
    # move host checkpoints (the pipe path).

    def begin_save(self, session_id: str) -> SavePlan:
        raise NotImplementedError

    def commit_save(self, plan: SavePlan, written: dict[str, Any], format: dict, geometry: dict) -> SessionManifest:
        raise NotImplementedError

    def abort_save(self, plan: SavePlan) -> None:
        raise NotImplementedError

    def begin_resume(self, session_id: str) -> ResumePlan:
        raise NotImplementedError

    def save(self, session_id: str, checkpoint: CPUCheckpoint) -> None:
        raise NotImplementedError

    def load(self, session_id: str) -> CPUCheckpoint:
        raise NotImplementedError

    def info(self, session_id: str) -> SessionInfo:
        raise NotImplementedError

    def list_info(self) -> builtins.list[SessionInfo]:
        raise NotImplementedError

    def list(self) -> builtins.list[str]:
        raise NotImplementedError

    def delete(self, session_id: str) -> bool:
        raise NotImplementedError

    def clean(self, *, older_than: float) -> CleanResult:
        """Remove what no saved session names (segments killed writers left, blocks no session
        names any more), last modified over ``older_than`` seconds ago. Deletes only what it can
        prove unnamed: see :meth:`survey`."""
        raise NotImplementedError

    @staticmethod
    def survey(manifests: Iterable[str], read: Callable[[str], SessionManifest | None]) -> ManifestSurvey:
        """Read each manifest of ``manifests`` with ``read`` (None: a version 1 or 2 file, which
        names no segment) for a collector. One gone meanwhile names nothing; one that cannot be
        read for any other reason is unreadable, and protects what it may name
        (:class:`ManifestSurvey`)."""
        survey = ManifestSurvey()
        for name in manifests:
            try:
                m = read(name)
            except CheckpointNotFound:
                continue
            except Exception as exc:  # any reason at all: what it names is unknown
                survey.unreadable.append((name, str(exc) or type(exc).__name__))
                continue
            if m is not None:
                survey.named.update(r.name for r in m.segments)
        return survey

    def assemble(self, m: SessionManifest, fds: builtins.list[int], where: str) -> CPUCheckpoint:
        """The host checkpoint of the manifest ``m`` from its open segments ``fds`` (every header
        against the manifest, the chain, the size limit, every payload's CRC)."""
        names = [f"segment {r.name} of session {m.session_id!r}" for r in m.segments]
        headers = [read_segment_header(fd, n, r) for fd, n, r in zip(fds, names, m.segments)]
        check_chain(m, headers, where)
        total = sum(length for h in headers for _, length, _ in h.payloads)
        if total > self.max_bytes:
            raise CheckpointTooLarge(
                f"session {m.session_id!r} holds {total} payload bytes, over the limit of {self.max_bytes}"
            )
        return assemble_checkpoint(m, list(zip(fds, headers, names)))

    def open_all(self, m: SessionManifest, open_one: Callable[[SegmentRef], int]) -> builtins.list[int]:
        """``open_one(ref)`` for every segment of ``m``, each checked to be the size its manifest
        records; on any failure the ones opened are closed. The session's own segments are
        opened first: a concurrent save may replace them, while shared blocks stay until clean()."""
        fds: builtins.list[int] = []
        order = sorted(range(len(m.segments)), key=lambda i: m.segments[i].shared)
        try:
            for i in order:
                ref = m.segments[i]
                fd = open_one(ref)
                fds.append(fd)
                size = os.fstat(fd).st_size
                if size != ref.file_length:
                    raise CheckpointCorrupt(
                        f"segment {ref.name} of session {m.session_id!r} is {size} bytes, "
                        f"not the {ref.file_length} its manifest records"
                    )
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        in_order = [0] * len(fds)
        for i, fd in zip(order, fds):
            in_order[i] = fd
        return in_order

    def checked_for_save(self, checkpoint: CPUCheckpoint) -> CPUCheckpoint:
        """``checkpoint`` stamped with this store's identity, after the checks every save makes."""
        if not isinstance(checkpoint, CPUCheckpoint):
            raise InvalidArgument(f"expected a CPUCheckpoint, got {type(checkpoint).__name__}")
        self._check_format(checkpoint)  # first: it can name what differs, two digests cannot
        if checkpoint.identity is None:
            checkpoint = dataclasses.replace(checkpoint, identity=self.identity)
        elif checkpoint.identity != self.identity:
            raise CheckpointIncompatible(
                f"checkpoint identity {checkpoint.identity!r} is not this store's {self.identity!r}"
            )
        checkpoint.validate()
        if checkpoint.nbytes > self.max_bytes:
            raise CheckpointTooLarge(
                f"checkpoint holds {checkpoint.nbytes} payload bytes, over the limit of {self.max_bytes}"
            )
        return checkpoint


class SessionStore(StoreBinding):
    """Saved checkpoints of named sessions in one directory, bound to one checkpoint identity.

    ``identity`` is :func:`checkpoint_identity` of the worker's model files and configuration; a
    file saved under another identity raises :class:`CheckpointIncompatible` on load. ``max_bytes``
    bounds a checkpoint's payload bytes on save (the previous file stays) and on load.
    ``inputs`` (what :meth:`create` passes) are what the identity was computed from: saved files
    record them, so a mismatch names the differing file or setting, and :meth:`check_worker`
    compares the declared configuration with what a worker reports.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        identity: str,
        max_bytes: int = DEFAULT_MAX_BYTES,
        inputs: IdentityInputs | None = None,
        compact_after: int = DEFAULT_COMPACT_AFTER,
        block_tokens: int = LOCAL_BLOCK_TOKENS,
        share_blocks_across_namespaces: bool = False,
    ) -> None:
        super().__init__(
            identity=identity,
            max_bytes=max_bytes,
            inputs=inputs,
            compact_after=compact_after,
            block_tokens=block_tokens,
            share_blocks_across_namespaces=share_blocks_across_namespaces,
        )
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.location = str(self.path)
        self._prepare_directory()

    @classmethod
    def inspect(cls, path: str | os.PathLike) -> SessionStore:
        """An existing store opened for maintenance, bound to no model (``python -m
        muxworker.sessions``): :meth:`list_info`, :meth:`info`, :meth:`verify` (every checksum),
        :meth:`delete`, :meth:`prune` and :meth:`clean` work; saving, loading and resuming need the
        model's identity (:meth:`create`). The directory must exist and pass the usual checks."""
        store = cls.__new__(cls)
        store.path = Path(os.path.abspath(os.fspath(path)))
        store.location = str(store.path)
        store.identity = ""
        store.max_bytes = sys.maxsize
        store.inputs = None
        store.compact_after = DEFAULT_COMPACT_AFTER
        store.block_tokens = LOCAL_BLOCK_TOKENS
        store.share_blocks_across_namespaces = False
        store.inspecting = True
        try:
            os.close(store._open_dir())
        except StorePermissionError:
            if not os.path.lexists(store.path):
                raise CheckpointNotFound(f"no session store at {str(store.path)!r}") from None
            raise
        return store

    @classmethod
    async def create(
        cls,
        path: str | os.PathLike,
        *,
        model_files: Iterable[str | os.PathLike],
        configuration: dict,
        max_bytes: int = DEFAULT_MAX_BYTES,
        compact_after: int = DEFAULT_COMPACT_AFTER,
        block_tokens: int = LOCAL_BLOCK_TOKENS,
        share_blocks_across_namespaces: bool = False,
    ) -> SessionStore:
        """Hash ``model_files`` and ``configuration`` off the event loop and open the directory.

        The directory is created with mode 0700 when missing. An existing one must be owned by
        this user and not writable by group or others (an owned 0755 directory is fine).
        ``block_tokens``: the size of the content-addressed blocks sessions share (0: none; each
        session's rows in its own segments, written by the worker straight into the file).
        Blocks are shared only within a namespace (the part of a session id before its first
        "/"), unless ``share_blocks_across_namespaces`` (for namespaces that trust each other).
        """

        def build() -> SessionStore:
            identity, inputs = checkpoint_identity_inputs(model_files, configuration)
            return cls(
                path,
                identity=identity,
                max_bytes=max_bytes,
                inputs=inputs,
                compact_after=compact_after,
                block_tokens=block_tokens,
                share_blocks_across_namespaces=share_blocks_across_namespaces,
            )

        return await trio.to_thread.run_sync(build)

    def __repr__(self) -> str:
        return f"SessionStore({str(self.path)!r}, identity={self.identity[:12]}...)"

    # -- directory ------------------------------------------------------------------------------

    def _prepare_directory(self) -> None:
        try:
            os.makedirs(self.path.parent, exist_ok=True)
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise os_failure(CheckpointWriteError, e, f"cannot create the store directory {str(self.path)!r}") from None
        else:
            # mkdir's mode is masked by the umask; make it exactly 0700.
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
        os.close(self._open_dir())

    def _open_dir(self) -> int:
        """An fd of the store directory after checking it is safe; every operation goes through it."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise StorePermissionError(f"store path {str(self.path)!r} is a symlink or not a directory") from None
            raise StorePermissionError(f"store directory {str(self.path)!r} is unusable: {e}") from None
        try:
            st = os.fstat(fd)
            if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
                raise StorePermissionError(
                    f"store directory {str(self.path)!r} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
                )
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise StorePermissionError(
                    f"store directory {str(self.path)!r} has mode {stat.filemode(st.st_mode)}: "
                    "it must not be writable by group or others (use chmod 0700)"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- what the worker runs -------------------------------------------------------------------

    # -- locks ---------------------------------------------------------------------------------

    @contextmanager
    def _locked(self, dir_fd: int, name: str, mode: int) -> Iterator[int]:
        fd = self._flock(dir_fd, name, mode)
        try:
            yield fd
        finally:
            os.close(fd)

    def _flock(self, dir_fd: int, name: str, mode: int) -> int:
        """An fd of lock file ``name`` holding ``flock(mode)`` (closing the fd releases it)."""
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            try:
                fd = os.open(name, flags, dir_fd=dir_fd)
            except FileNotFoundError:
                fd = os.open(name, flags | os.O_CREAT, 0o600, dir_fd=dir_fd)
        except OSError as e:
            raise os_failure(CheckpointWriteError, e, f"cannot open the store's lock file {name!r}") from None
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            os.close(fd)
            raise StoreBusy(f"another process is writing to the session store {str(self.path)!r}") from None
        except OSError as e:
            os.close(fd)
            raise os_failure(CheckpointWriteError, e, f"cannot lock the store's lock file {name!r}") from None
        return fd

    # -- reading what is saved --------------------------------------------------------------------

    def path_for(self, session_id: str) -> Path:
        """The manifest file of ``session_id`` (named by a hash, so any id is safe); its rows are in
        segment files beside it (:meth:`files_of`)."""
        return self.path / (session_hash(session_id) + SUFFIX)

    def _not_found(self, session_id: str) -> CheckpointNotFound:
        return CheckpointNotFound(f"no saved checkpoint for session {session_id!r}")

    def _read_saved(self, dir_fd: int, session_id: str | None, name: str) -> tuple[int, SessionManifest | None, Any]:
        """(file version, manifest of a version 3 session or None, (session id, checkpoint manifest
        only) of a version 1/2 file) for the manifest file ``name``; checks the identity, nothing else."""
        with _reading_manifest(name):
            fd, _ = _open_regular(name, dir_fd)
            try:
                version = file_version(fd, name)
                if version == SEGMENTED_VERSION:
                    return version, read_session_manifest(fd, name), None
                found, _ = read_checkpoint_file(name, fd=fd, max_bytes=sys.maxsize, manifest_only=True)
                return version, None, found
            finally:
                os.close(fd)

    def _manifest(self, dir_fd: int, session_id: str) -> SessionManifest | None:
        """The verified version 3 manifest of ``session_id``, None for a version 1/2 file; raises
        CheckpointNotFound, CheckpointCorrupt (another session's file), CheckpointIncompatible
        or StoreUnavailable (the system failed the read)."""
        name = session_hash(session_id) + SUFFIX
        with _reading_manifest(name):
            try:
                fd, _ = _open_regular(name, dir_fd)
            except CheckpointNotFound:
                raise self._not_found(session_id) from None
            try:
                if file_version(fd, name) != SEGMENTED_VERSION:
                    return None
                m = read_session_manifest(fd, name)
            finally:
                os.close(fd)
        self.check_manifest(m, session_id, name)
        return m

    def _open_segments(self, dir_fd: int, m: SessionManifest) -> list[int]:
        """Open every segment of ``m`` (regular files, no symlinks, the recorded sizes)."""
        return self.open_all(m, lambda ref: _open_regular(ref.name, dir_fd)[0])

    def _with_segments(self, session_id: str, body: Any) -> Any:
        """Run ``body(dir_fd, manifest | None, fds)`` on the vetted open files of ``session_id``.
        A manifest replaced meanwhile (a concurrent compaction deleted a segment) is read again."""
        try:
            dir_fd = self._open_dir()
        except StorePermissionError:
            if not os.path.lexists(self.path):
                raise self._not_found(session_id) from None
            raise
        try:
            for attempt in range(3):
                m = self._manifest(dir_fd, session_id)
                if m is None:
                    name = session_hash(session_id) + SUFFIX
                    try:
                        fd, _ = _open_regular(name, dir_fd)
                    except CheckpointNotFound:
                        raise self._not_found(session_id) from None
                    return body(dir_fd, None, [fd])
                try:
                    fds = self._open_segments(dir_fd, m)
                except CheckpointNotFound:
                    if attempt == 2:
                        raise CheckpointCorrupt(
                            f"a segment of session {session_id!r} is missing (deleted by hand, or by a "
                            "concurrent save three times in a row)"
                        ) from None
                    continue
                return body(dir_fd, m, fds)
        finally:
            os.close(dir_fd)
        raise AssertionError("unreachable")

    def load(self, session_id: str) -> CPUCheckpoint:
        """The verified checkpoint saved for ``session_id`` (host memory only).

        Raises :class:`CheckpointNotFound`, :class:`CheckpointCorrupt`,
        :class:`CheckpointIncompatible`, :class:`CheckpointTooLarge`, :class:`CheckpointUnsafePath`
        or :class:`CheckpointReadError` (the system refused or failed the read).
        """

        self._check_bound("load a session")

        def body(dir_fd: int, m: SessionManifest | None, fds: list[int]) -> CPUCheckpoint:
            try:
                if m is None:
                    return self._load_legacy(session_id, fds[0])
                return self.assemble(m, fds, str(self.path_for(session_id)))
            finally:
                for fd in fds:
                    os.close(fd)

        return self._with_segments(session_id, body)

    def _load_legacy(self, session_id: str, fd: int) -> CPUCheckpoint:
        name = session_hash(session_id) + SUFFIX
        found, checkpoint = read_checkpoint_file(
            name,
            fd=fd,
            expected_identity=self.identity or None,  # inspecting: any identity
            max_bytes=self.max_bytes,
            expected_inputs=self.inputs,
            expected_label="store",
        )
        if found != session_id:
            raise CheckpointCorrupt(
                f"{name} holds session {found!r}, not {session_id!r}; the file was renamed or copied"
            )
        assert checkpoint is not None  # not manifest_only, so the payloads were read
        self._check_format(checkpoint)  # files saved before save() checked it
        return checkpoint

    def begin_resume(self, session_id: str) -> ResumePlan:
        """Open and vet the files of ``session_id`` for a worker to restore from (the caller closes
        them with :meth:`ResumePlan.close`): the manifest is verified and bound to this store's
        identity, and every segment it names is opened (no symlink, a regular file, the recorded
        size). The worker checks each segment's header against the manifest and every payload's
        CRC before it publishes the session."""
        self._check_bound("resume a session")
        return self._with_segments(session_id, lambda dir_fd, m, fds: ResumePlan(session_id, fds, m))

    def verify(self, session_id: str) -> SessionInfo:
        """Read every byte of ``session_id``'s files and check every checksum; raise as :meth:`load`."""
        info = self.info(session_id)

        def body(dir_fd: int, m: SessionManifest | None, fds: list[int]) -> None:
            try:
                if m is None:
                    self._load_legacy(session_id, fds[0])
                    return
                for fd, ref in zip(fds, m.segments):
                    name = f"segment {ref.name} of session {session_id!r}"
                    header = read_segment_header(fd, name, ref)
                    for i, (_, length, _) in enumerate(header.payloads):
                        read_payload_into(fd, header, i, [memoryview(bytearray(length))], name)
            finally:
                for fd in fds:
                    os.close(fd)

        self._with_segments(session_id, body)
        return info

    def info(self, session_id: str) -> SessionInfo:
        """What is saved for ``session_id`` (from its manifest; no payload is read)."""
        dir_fd = self._open_dir()
        try:
            name = session_hash(session_id) + SUFFIX
            try:
                with _reading_manifest(name):
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise self._not_found(session_id) from None
            version, m, _ = self._read_saved(dir_fd, session_id, name)
            if m is not None:
                if m.session_id != session_id:
                    raise CheckpointCorrupt(f"{name} holds session {m.session_id!r}, not {session_id!r}")
                return manifest_info(m, st.st_size)
            return self._legacy_info(dir_fd, name, session_id, st, version)
        finally:
            os.close(dir_fd)

    def _legacy_info(self, dir_fd: int, name: str, session_id: str, st: os.stat_result, version: int) -> SessionInfo:
        with _reading_manifest(name):
            fd, _ = _open_regular(name, dir_fd)
            try:
                found, _ = read_checkpoint_file(name, fd=fd, max_bytes=sys.maxsize, manifest_only=True)
                manifest = _legacy_wire(fd, name)
            finally:
                os.close(fd)
        if found != session_id:
            raise CheckpointCorrupt(f"{name} holds session {found!r}, not {session_id!r}")
        fmt = manifest.get("format", {})
        return SessionInfo(
            session_id,
            int(manifest.get("position", 0)),
            st.st_size,
            1,
            manifest.get("identity"),
            str(fmt.get("dtype")),
            str(fmt.get("backend")),
            st.st_mtime,
            st.st_mtime,
            version,
        )

    def list(self) -> builtins.list[str]:
        """Session ids with a saved file, sorted; temp files and unreadable files are skipped."""
        return [i.session_id for i in self.list_info()]

    def list_info(self) -> builtins.list[SessionInfo]:
        """:class:`SessionInfo` of every saved session, sorted by id; unreadable ones are skipped
        (:meth:`load` and :meth:`verify` report them precisely)."""
        dir_fd = self._open_dir()
        try:
            try:
                names = os.listdir(dir_fd)
            except OSError as e:
                raise os_failure(CheckpointReadError, e, f"cannot list {str(self.path)!r}") from None
            out = []
            for name in names:
                if not MANIFEST_NAME.fullmatch(name):
                    continue
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    version, m, found = self._read_saved(dir_fd, None, name)
                    if m is not None:
                        if session_hash(m.session_id) + SUFFIX == name:
                            out.append(manifest_info(m, st.st_size))
                    elif found is not None and session_hash(found) + SUFFIX == name:
                        out.append(self._legacy_info(dir_fd, name, found, st, version))
                except (CheckpointError, OSError):
                    continue  # damaged, foreign or vanished meanwhile
            return sorted(out, key=lambda i: i.session_id)
        finally:
            os.close(dir_fd)

    def unreadable(self) -> builtins.list[tuple[str, str]]:
        """(file name, why) of every manifest file in the store that :meth:`list_info` skips."""
        dir_fd = self._open_dir()
        try:
            out = []
            for name in sorted(os.listdir(dir_fd)):
                if not MANIFEST_NAME.fullmatch(name):
                    continue
                try:
                    _, m, found = self._read_saved(dir_fd, None, name)
                    sid = m.session_id if m is not None else found
                    if sid is None or session_hash(sid) + SUFFIX != name:
                        out.append((name, f"holds session {sid!r}, whose file has another name (renamed or copied)"))
                except (CheckpointError, OSError) as e:
                    out.append((name, str(e)))
            return out
        finally:
            os.close(dir_fd)

    # -- saving ---------------------------------------------------------------------------------

    def begin_save(self, session_id: str) -> SavePlan:
        """Start a save of ``session_id``: take the writers' lock, read the manifest the save may
        append to, and create the new segment file (``<hash>.<random>.mxseg``, O_EXCL, 0600) for the
        worker to write. Finish with :meth:`commit_save` or :meth:`abort_save`."""
        self._check_bound("save a session")
        digest = session_hash(session_id)
        dir_fd = self._open_dir()
        try:
            lock_fd = self._flock(dir_fd, WRITERS_LOCK, fcntl.LOCK_SH)
            try:
                found: SessionManifest | None
                try:
                    found = self._manifest(dir_fd, session_id)
                except StoreUnavailable:
                    raise
                except CheckpointError:
                    found = None  # none, damaged or foreign: this save writes everything
                base, compact = self._base_plan(found)
                segment = f"{digest}.{secrets.token_hex(8)}{SEGMENT_SUFFIX}"
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                try:
                    if self.block_tokens:  # staged in memory, cut into blocks and a tail at commit
                        fd = os.memfd_create(segment, os.MFD_CLOEXEC)
                    else:
                        fd = os.open(segment, flags, 0o600, dir_fd=dir_fd)
                except OSError as e:
                    raise os_failure(
                        CheckpointWriteError,
                        e,
                        f"cannot save session {session_id!r} (creating its segment file)",
                        after="; the previous file, if any, is unchanged",
                    ) from None
            except BaseException:
                os.close(lock_fd)
                raise
        finally:
            os.close(dir_fd)
        plan = SavePlan(session_id, digest, segment, fd, secrets.token_hex(16), base, lock_fd)
        plan.staged, plan.compact = bool(self.block_tokens), compact
        return plan

    def commit_save(self, plan: SavePlan, written: dict[str, Any], format: dict, geometry: dict) -> SessionManifest:
        """Publish what the worker wrote into ``plan``'s segment (its save_file reply ``written``):
        replace the manifest atomically (temp file, fsync, rename, directory fsync) and delete the
        segments it no longer names. The previous save stays loadable until the rename.

        Raises :class:`SaveConflict` when the save appended to a manifest another writer replaced
        meanwhile (nothing is published; save again)."""
        try:
            start, position = int(written["start"]), int(written["position"])
            dir_fd = self._open_dir()
            try:
                new_refs: builtins.list[SegmentRef] | None = None
                if plan.staged and not (start == position and plan.base is not None):
                    new_refs = self._store_pieces(dir_fd, plan, written)  # before the lock: the big writes
                os.close(plan.fd)
                plan.fd = -1
                with self._locked(dir_fd, COMMIT_LOCK, fcntl.LOCK_EX):
                    try:
                        current = self._manifest(dir_fd, plan.session_id)
                    except CheckpointError:
                        current = None
                    now = time.time()
                    if start == position and plan.base is not None:  # nothing new: the base stands
                        self._unlink(dir_fd, plan.segment)
                        if current is None or current.tag != plan.base.tag:
                            raise SaveConflict(
                                f"session {plan.session_id!r} was saved or deleted by another writer meanwhile"
                            )
                        m = dataclasses.replace(current, tag=plan.tag, saved=now)
                    else:
                        if new_refs is None:
                            ref = SegmentRef(
                                plan.segment, start, position, written["file_length"], written["header_crc"]
                            )
                            new_refs = [ref]
                        if start:
                            if plan.base is None or current is None or current.tag != plan.base.tag:
                                raise SaveConflict(
                                    f"session {plan.session_id!r} was saved or deleted by another writer while this "
                                    "save appended to it; nothing was published, save again"
                                )
                            # The base is current (same tag); keep its segments before the new rows.
                            segments = [*(r for r in current.segments if r.end <= start), *new_refs]
                        else:
                            segments = new_refs
                        created = current.created if current is not None else now
                        m = SessionManifest(
                            plan.session_id,
                            self.identity,
                            format,
                            geometry,
                            position,
                            plan.tag,
                            created,
                            now,
                            segments,
                            self.inputs,
                        )
                    name = plan.digest + SUFFIX
                    replace_file(
                        dir_fd,
                        name,
                        [encode_session_manifest(m)],
                        temp_prefix=plan.digest,
                        display=f"session {plan.session_id!r} ({self.path / name})",
                    )
                    keep = {r.name for r in m.segments}
                    for ref in current.segments if current is not None else []:
                        if ref.name not in keep and not ref.shared:  # blocks go with clean()
                            self._unlink(dir_fd, ref.name)
                    return m
            finally:
                os.close(dir_fd)
        except BaseException:
            self.abort_save(plan)
            raise
        finally:
            self._release(plan)

    def _store_pieces(self, dir_fd: int, plan: SavePlan, written: dict[str, Any]) -> builtins.list[SegmentRef]:
        """Write a staged save's pieces: each block not yet in the store (linked in under its key,
        so concurrent writers of one block both succeed) and the tail as the plan's segment file.
        Returns the refs that follow the base's kept segments."""
        _, pieces, memory = self._cut(plan, written)
        try:
            refs, linked = [], False
            for piece in pieces:
                what = f"session {plan.session_id!r} ({self.path / (piece.name or plan.segment)})"
                try:
                    if piece.key is None:
                        self._write_new(dir_fd, plan.segment, piece.plan.buffers)
                    else:
                        linked |= self._put_block(dir_fd, piece)
                except OSError as e:
                    raise os_failure(
                        CheckpointWriteError,
                        e,
                        f"cannot save {what}",
                        after="; the previous file, if any, is unchanged",
                    ) from None
                name = plan.segment if piece.key is None else piece.name
                assert name is not None
                refs.append(
                    SegmentRef(
                        name,
                        piece.start,
                        piece.end,
                        piece.plan.file_length,
                        piece.plan.header_crc,
                        piece.key is not None,
                    )
                )
            if linked:
                os.fsync(dir_fd)  # the blocks' names are durable before a manifest names them
            return refs
        finally:
            del pieces
            memory.close()

    @staticmethod
    def _write_new(dir_fd: int, name: str, buffers: builtins.list[Any]) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            _write_all(fd, buffers)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _put_block(self, dir_fd: int, piece: Piece) -> bool:
        """Store block ``piece`` unless a file of its name with its header is there; returns
        whether it wrote one. A damaged block of that name is replaced."""
        name = piece.name
        assert name is not None
        try:
            fd, _ = _open_regular(name, dir_fd)
        except CheckpointNotFound:
            present = None
        else:
            try:
                present = read_segment_header(fd, name).header_crc == piece.plan.header_crc
            except CheckpointError:
                present = False
            finally:
                os.close(fd)
        if present:
            return False
        temp = f".{piece.key}.{secrets.token_hex(8)}.tmp"
        try:
            self._write_new(dir_fd, temp, piece.plan.buffers)
            if present is None:
                try:
                    os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                except FileExistsError:
                    pass  # another writer stored the same block meanwhile
            else:
                os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            self._unlink(dir_fd, temp)
        return True

    def abort_save(self, plan: SavePlan) -> None:
        """Undo :meth:`begin_save`: remove the new segment (when not published) and release the lock."""
        if plan.fd >= 0:
            os.close(plan.fd)
            plan.fd = -1
        if plan.lock_fd >= 0:
            try:
                dir_fd = self._open_dir()
            except CheckpointError:
                pass
            else:
                try:
                    if not self._names_segment(dir_fd, plan):
                        self._unlink(dir_fd, plan.segment)
                finally:
                    os.close(dir_fd)
        self._release(plan)

    def _names_segment(self, dir_fd: int, plan: SavePlan) -> bool:
        """Whether the session's manifest may name the plan's segment (a failed commit may have
        published it): a manifest the system failed to read keeps the segment."""
        try:
            m = self._manifest(dir_fd, plan.session_id)
        except StoreUnavailable:
            return True  # cannot tell: clean() decides, knowing which manifests it could not read
        except CheckpointError:
            return False  # none, or one this save did not write (it writes a readable one)
        return m is not None and any(r.name == plan.segment for r in m.segments)

    @staticmethod
    def _release(plan: SavePlan) -> None:
        if plan.lock_fd >= 0:
            os.close(plan.lock_fd)
            plan.lock_fd = -1

    @staticmethod
    def _unlink(dir_fd: int, name: str) -> None:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError:
            pass  # a stray segment is what clean() removes; the published state is what counts

    def save(self, session_id: str, checkpoint: CPUCheckpoint) -> None:
        """Atomically replace ``session_id``'s saved checkpoint with ``checkpoint`` (host memory).

        A checkpoint without an identity is stamped with the store's; one with another identity
        raises :class:`CheckpointIncompatible`. Over ``max_bytes`` raises
        :class:`CheckpointTooLarge`; disk full, a read-only file system or denied permission raise
        :class:`CheckpointWriteError` with that ``reason``. On any failure the previous save stays
        loadable. A checkpoint with draft-model state is written as one version 2 file.
        """
        digest = session_hash(session_id)
        checkpoint = self.checked_for_save(checkpoint)
        if checkpoint.draft is not None:
            self._save_legacy(session_id, digest, checkpoint)
            return
        plan = self.begin_save(session_id)
        plan.base = None  # a host checkpoint is written whole
        try:
            try:
                written = write_checkpoint_segment(plan.fd, session_id, self.identity, checkpoint)
            except OSError as e:
                raise os_failure(
                    CheckpointWriteError,
                    e,
                    f"cannot save session {session_id!r} (writing its segment)",
                    after="; the previous file, if any, is unchanged",
                ) from None
        except BaseException:
            self.abort_save(plan)
            raise
        self.commit_save(plan, written, checkpoint.format, checkpoint.geometry)

    def _save_legacy(self, session_id: str, digest: str, checkpoint: CPUCheckpoint) -> None:
        dir_fd = self._open_dir()
        try:
            with self._locked(dir_fd, WRITERS_LOCK, fcntl.LOCK_SH), self._locked(dir_fd, COMMIT_LOCK, fcntl.LOCK_EX):
                try:
                    old = self._manifest(dir_fd, session_id)
                except CheckpointError:
                    old = None
                write_checkpoint_file(
                    checkpoint,
                    dir_fd,
                    digest + SUFFIX,
                    temp_prefix=digest,
                    session_id=session_id,
                    max_bytes=self.max_bytes,
                    display=f"session {session_id!r} ({self.path / (digest + SUFFIX)})",
                    identity_inputs=self.inputs,
                )
                for ref in old.segments if old is not None else []:
                    if not ref.shared:
                        self._unlink(dir_fd, ref.name)
        finally:
            os.close(dir_fd)

    # -- removing -------------------------------------------------------------------------------

    def delete(self, session_id: str) -> bool:
        """Remove ``session_id``'s saved files; return whether one existed. Live sessions are untouched.

        Whatever sits at the manifest's path goes: a symlink or FIFO is unlinked (never followed
        or opened) and a directory removed with its contents, so an unusable id becomes usable
        again. The segments of a manifest that cannot be read stay until :meth:`clean`."""
        digest = session_hash(session_id)
        name = digest + SUFFIX
        dir_fd = self._open_dir()
        try:
            with self._locked(dir_fd, WRITERS_LOCK, fcntl.LOCK_SH), self._locked(dir_fd, COMMIT_LOCK, fcntl.LOCK_EX):
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    return False
                m = None
                if stat.S_ISREG(st.st_mode):
                    try:
                        m = self._manifest(dir_fd, session_id)
                    except CheckpointError:
                        pass  # damaged, foreign or unreadable: what it names goes with clean()
                try:
                    if stat.S_ISDIR(st.st_mode):
                        _remove_tree(dir_fd, name)
                    else:
                        os.unlink(name, dir_fd=dir_fd)
                except FileNotFoundError:
                    return False  # a concurrent delete won
                for ref in m.segments if m is not None else []:
                    if not ref.shared:  # blocks other sessions may name go with clean()
                        self._unlink(dir_fd, ref.name)
                os.fsync(dir_fd)
                return True
        except OSError as e:
            raise os_failure(
                CheckpointWriteError, e, f"cannot delete session {session_id!r} ({self.path / name})"
            ) from None
        finally:
            os.close(dir_fd)

    def prune(self, older_than: float, *, now: float | None = None) -> builtins.list[str]:
        """Delete every session last saved more than ``older_than`` seconds ago; return their ids."""
        if isinstance(older_than, bool) or not isinstance(older_than, (int, float)) or not older_than >= 0:
            raise InvalidArgument(f"older_than must be a number of seconds >= 0, got {older_than!r}")
        cutoff = (time.time() if now is None else now) - older_than
        gone = []
        for info in self.list_info():
            if info.saved < cutoff and self.delete(info.session_id):
                gone.append(info.session_id)
        return gone

    def clean(self, *, older_than: float = 0.0) -> CleanResult:
        """Remove what killed writers left behind, temporary files and segments no manifest
        names, and the shared blocks no manifest names any more (their sessions were deleted or
        moved on), of those last modified more than ``older_than`` seconds ago.

        Runs only when no writer holds the store (raises :class:`StoreBusy` otherwise), so nothing
        it removes is a save in progress, and no block it removes is about to be named. A manifest
        it cannot read protects what it may name (:meth:`survey`): its session's segments, and
        every block. Returns (the names removed, their bytes), and what was kept for manifests it
        could not read (:class:`CleanResult`)."""
        if isinstance(older_than, bool) or not isinstance(older_than, (int, float)) or not older_than >= 0:
            raise InvalidArgument(f"older_than must be a number of seconds >= 0, got {older_than!r}")
        cutoff = time.time() - older_than
        dir_fd = self._open_dir()
        try:
            with self._locked(dir_fd, WRITERS_LOCK, fcntl.LOCK_EX | fcntl.LOCK_NB):
                names = sorted(os.listdir(dir_fd))
                survey = self.survey(
                    (n for n in names if MANIFEST_NAME.fullmatch(n)), lambda n: self._read_saved(dir_fd, None, n)[1]
                )
                stray, kept = survey.partition(names)
                removed, nbytes = [], 0
                for name in [*(n for n in names if _TEMP_NAME.fullmatch(n)), *stray]:
                    try:
                        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode) and st.st_mtime <= cutoff:
                            os.unlink(name, dir_fd=dir_fd)
                            removed.append(name)
                            nbytes += st.st_size
                    except FileNotFoundError:
                        continue
                if removed:
                    os.fsync(dir_fd)
                return CleanResult(sorted(removed), nbytes, kept=kept, unreadable=survey.unreadable)
        except OSError as e:
            raise os_failure(CheckpointWriteError, e, f"cannot clean the session store {str(self.path)!r}") from None
        finally:
            os.close(dir_fd)

    def files_of(self, session_id: str) -> builtins.list[Path]:
        """The files holding ``session_id`` now: its manifest, then its segments in order."""
        dir_fd = self._open_dir()
        try:
            m = self._manifest(dir_fd, session_id)
        finally:
            os.close(dir_fd)
        return [self.path_for(session_id), *(self.path / r.name for r in (m.segments if m is not None else []))]

    def nbytes(self, session_id: str) -> int:
        """Bytes ``session_id`` takes on disk (manifest and segments)."""
        return self.info(session_id).nbytes


def _remove_tree(parent_fd: int, name: str) -> None:
    """Remove the directory ``name`` in ``parent_fd`` and everything in it, following no symlink."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    try:
        for entry in os.listdir(fd):
            if stat.S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
                _remove_tree(fd, entry)
            else:
                os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


@contextmanager
def _reading_manifest(name: str) -> Iterator[None]:
    """The system failing a manifest's read (an I/O or permission error) raises StoreUnavailable:
    the session is not known to be damaged, and a later read may succeed. A file that does not
    exist is let through (FileNotFoundError, CheckpointNotFound), as is every other error."""
    try:
        yield
    except CheckpointReadError as e:
        raise StoreUnavailable(f"{e}; the saved session is not known to be damaged") from None
    except FileNotFoundError:
        raise
    except OSError as e:
        failure = os_failure(CheckpointReadError, e, f"cannot read {name!r}")
        raise StoreUnavailable(f"{failure}; the saved session is not known to be damaged") from None


def _block_run_end(m: SessionManifest) -> int:
    """Where the run of shared blocks at the start of ``m`` ends (0: it has none)."""
    end = 0
    for ref in m.segments:
        if not ref.shared:
            break
        end = ref.end
    return end


def manifest_info(m: SessionManifest, manifest_bytes: int) -> SessionInfo:
    """The :class:`SessionInfo` of a version 3 session from its manifest."""
    return SessionInfo(
        m.session_id,
        m.position,
        m.nbytes + manifest_bytes,
        len(m.segments),
        m.identity,
        str(m.format.get("dtype")),
        str(m.format.get("backend")),
        m.created,
        m.saved,
        SEGMENTED_VERSION,
    )


def _legacy_wire(fd: int, name: str) -> dict[str, Any]:
    """The wire manifest of a version 1/2 file (already verified by read_checkpoint_file)."""
    from muxworker.transport.checkpoint.file import _FILE_KEYS, _read_manifest, fstat_regular

    manifest, _, _ = _read_manifest(fd, fstat_regular(fd, name), name, _FILE_KEYS)
    wire = manifest["checkpoint"]
    return wire if isinstance(wire, dict) else {}


async def open_store(
    location: str | os.PathLike,
    *,
    model_files: Iterable[str | os.PathLike],
    configuration: dict,
    max_bytes: int = DEFAULT_MAX_BYTES,
    compact_after: int = DEFAULT_COMPACT_AFTER,
    block_tokens: int | None = None,
    share_blocks_across_namespaces: bool = False,
    timeout: float | None = None,
    **options: Any,
) -> StoreBinding:
    """The session store at ``location``, bound to the model files and configuration.

    A path or ``file://`` URL is a local :class:`SessionStore` (``options`` must be empty).
    ``block_tokens`` (None: the backend's default, :data:`LOCAL_BLOCK_TOKENS` or
    :data:`~muxworker.transport.checkpoint.blocks.DEFAULT_BLOCK_TOKENS`) sizes the shared blocks,
    which sessions share only within their namespace (the part of the id before its first "/")
    unless ``share_blocks_across_namespaces``.
    ``s3://bucket/prefix``, ``gs://``, ``az://`` and ``memory:///`` are an
    :class:`~.object_store.ObjectSessionStore`. It takes credentials, region and endpoint from the
    environment as every tool for that cloud does (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_REGION``, ``AWS_ENDPOINT_URL``, ...), and ``options`` are obstore's store options.
    ``timeout`` (seconds; None: :data:`~.object_store.DEFAULT_TIMEOUT`) bounds how long a request
    to an object store may fail before :class:`StoreUnavailable`; a local store has none.
    """
    text = os.fspath(location)
    scheme = text.split("://", 1)[0] if "://" in text else ""
    if scheme in ("", "file"):
        if options:
            raise InvalidArgument(f"a local store takes no store options, got {sorted(options)}")
        path = text[len("file://") :] if scheme == "file" else text
        return await SessionStore.create(
            path,
            model_files=model_files,
            configuration=configuration,
            max_bytes=max_bytes,
            compact_after=compact_after,
            block_tokens=LOCAL_BLOCK_TOKENS if block_tokens is None else block_tokens,
            share_blocks_across_namespaces=share_blocks_across_namespaces,
        )
    from .object_store import DEFAULT_TIMEOUT, OBJECT_SCHEMES, ObjectSessionStore

    if scheme not in OBJECT_SCHEMES:
        raise InvalidArgument(
            f"no session store for {text!r}: expected a path, file://, or one of "
            + ", ".join(f"{s}://" for s in OBJECT_SCHEMES)
        )
    return await ObjectSessionStore.create(
        text,
        model_files=model_files,
        configuration=configuration,
        max_bytes=max_bytes,
        compact_after=compact_after,
        block_tokens=DEFAULT_BLOCK_TOKENS if block_tokens is None else block_tokens,
        share_blocks_across_namespaces=share_blocks_across_namespaces,
        timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
        **options,
    )
