"""What every session store shares (:class:`StoreBinding`): the binding to one model identity and
configuration, the checks of a worker and of every manifest against it, the plans of a save and a
resume, incremental saves on a base, the cutting of a save into shared blocks and a tail, and the
collector's rule (:class:`ManifestSurvey`). The local directory store (:mod:`.local`) and the
object store (:mod:`.objects`) implement the file I/O beneath it.
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from muxworker.transport.checkpoint import (
    DEFAULT_MAX_BYTES,
    CheckpointCorrupt,
    CheckpointIncompatible,
    CheckpointNotFound,
    CheckpointTooLarge,
    CheckpointWriteError,
    CPUCheckpoint,
    IdentityInputs,
)
from muxworker.transport.checkpoint.blocks import (
    BLOCK_NAME,
    MAX_BLOCKS,
    Piece,
    SegmentMemory,
    split_segment,
)
from muxworker.transport.checkpoint.container import FILE_VERSION, _identity_mismatch
from muxworker.transport.checkpoint.errors import os_failure
from muxworker.transport.checkpoint.file import assemble_checkpoint, write_checkpoint_segment
from muxworker.transport.checkpoint.manifest import SessionManifest, check_chain
from muxworker.transport.checkpoint.segments import SegmentRef, read_payload_into, read_segment_header
from muxworker.transport.errors import (  # noqa: F401  (the store's errors: local.py and objects.py raise them from here)
    ConfigurationMismatch,
    InvalidArgument,
    SaveConflict,
    StoreBusy,
    StorePermissionError,
    StoreUnavailable,
)
from muxworker.transport.messages import SaveBase, SaveFileReply
from muxworker.transport.schema import MAX_SESSION_ID_BYTES

if TYPE_CHECKING:
    from ..params import WorkerInfo


SUFFIX = ".mxckpt"
SEGMENT_SUFFIX = ".mxseg"
#: A record (:meth:`StoreBinding.put_record`) is ``<hash>.mxrec`` (``hash``: :func:`session_hash`
#: of its key); the collector never touches one.
RECORD_SUFFIX = ".mxrec"
#: The most bytes one record may hold (records are small documents: a stored response, say).
MAX_RECORD_BYTES = 8 << 20
#: A session's manifest is ``<hash>.mxckpt`` and its own segments ``<hash>.<random>.mxseg``, on
#: every backend (``hash``: :func:`session_hash` of its id), so a segment's name says whose it is.
MANIFEST_NAME = re.compile(r"[0-9a-f]{64}\.mxckpt")
SEGMENT_NAME = re.compile(r"([0-9a-f]{64})\.[0-9a-f]{16}\.mxseg")
_TEMP_NAME = re.compile(r"\.[0-9a-f]{64}\.[0-9a-f]{16}\.tmp")
# Writers hold a shared lock on WRITERS_LOCK while they save or delete; clean() needs it exclusive.
# COMMIT_LOCK is held exclusive for the few milliseconds a manifest is checked and replaced.
WRITERS_LOCK = ".muxworker-writers.lock"
COMMIT_LOCK = ".muxworker-commit.lock"
# A server holds OWNER_LOCK exclusive for its lifetime (one server per directory store); shared
# writers (--shared-store servers, the chat app, the sessions command) hold it shared.
OWNER_LOCK = ".muxworker-owner.lock"
#: A session saved incrementally is rewritten whole (compacted) once it has this many segments.
DEFAULT_COMPACT_AFTER = 16
#: The local store's blocks by default: none. The worker then writes its rows straight into the
#: store's file and reads them back from one segment per save: measured at 4,096 tokens, 128-token
#: blocks made a save 1.9x and a restore 2.4x slower here (32 files, each fsynced and read on its
#: own). ``block_tokens=DEFAULT_BLOCK_TOKENS`` shares prefixes on disk too. Object stores share by
#: default (transport/checkpoint/blocks.py).
LOCAL_BLOCK_TOKENS = 0


@dataclass(frozen=True)
class SessionInfo:
    """What the store knows of one saved session, from its manifest (no payload is read)."""

    session_id: str
    tokens: int  # the saved position: tokens of history with KV
    nbytes: int  # bytes on disk: segments plus manifest (or the one file)
    segments: int  # files holding its rows
    identity: str | None
    dtype: str
    backend: str
    created: float  # seconds since the epoch
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
    version: Any = None  # the manifest version the commit must still find (None: none may exist)
    staged: bool = False  # fd is a memory file the store cuts into blocks and a tail (block_tokens)
    compact: bool = False  # rewrite the tail run after the base's blocks as one segment
    found: SessionManifest | None = None  # the manifest the save replaces (an object store's e-tag's)
    replace: bool = False  # a host checkpoint's save (save()): replaces whatever begin_save found


@dataclass
class ResumePlan:
    """The open files of a saved session, vetted, for a worker to restore from."""

    session_id: str
    fds: list[int]
    manifest: SessionManifest
    version: Any = None  # the manifest's version (StoreBinding.adopt records it once the worker holds it)

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


def seconds(name: str, value: Any) -> float:
    """``value`` as a number of seconds >= 0, or InvalidArgument naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise InvalidArgument(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


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
        self._init_owned()

    # -- one owner per session's durable state ----------------------------------------------------
    #
    # A save is conditional on the manifest this process last published or resumed into a worker
    # for that session (its *version*: an object store's e-tag, a directory store's manifest tag),
    # never on what the store holds when the save begins: so a save over another writer's (a
    # second server on the store, a replica whose affinity broke) fails with SaveConflict instead
    # of adopting it, and nothing acknowledged is lost silently. A session this process never
    # resumed or saved may be saved only while the store holds nothing for it.

    def _init_owned(self) -> None:
        self._owned: dict[str, Any] = {}  # session id -> the version this process published or resumed
        self._conflicts: dict[str, str] = {}  # session id -> why its last save conflicted, until taken
        self._owned_lock = threading.Lock()

    def owned_version(self, session_id: str) -> Any:
        """The version of ``session_id``'s manifest this process last published or resumed (None: none)."""
        with self._owned_lock:
            return self._owned.get(session_id)

    def adopt(self, session_id: str, version: Any, *, saved: bool = False) -> None:
        """This process now holds ``session_id`` as of the manifest ``version`` (a resume into a
        worker, or ``saved``: a save it published, which also ends a conflict not yet taken)."""
        with self._owned_lock:
            if version is None:
                self._owned.pop(session_id, None)
            else:
                self._owned[session_id] = version
            if saved:
                self._conflicts.pop(session_id, None)

    def forget(self, session_id: str) -> None:
        """Nothing of ``session_id`` is held here any more (deleted, or found absent on a resume)."""
        with self._owned_lock:
            self._owned.pop(session_id, None)
            self._conflicts.pop(session_id, None)

    def take_conflict(self, session_id: str) -> str | None:
        """Why ``session_id``'s last save was refused as a conflict, once (None: no conflict since)."""
        with self._owned_lock:
            return self._conflicts.pop(session_id, None)

    def expected_version(self, session_id: str, current: Any, *, replace: bool = False, found: bool) -> Any:
        """The version a save of ``session_id`` must still find at its commit, given the store's
        ``current`` one (``found``: the store holds a manifest for it, readable or not): the one
        this process owns. Raises SaveConflict (and remembers it for :meth:`take_conflict`) when
        the store holds another; ``replace`` (a host checkpoint's save) takes ``current``."""
        if replace:
            return current
        known = self.owned_version(session_id)
        if known is None and not found:
            return None
        if known is not None and found and known == current:
            return known
        raise self.conflict(session_id, known is None, found)

    def conflict(self, session_id: str, unowned: bool, found: bool) -> SaveConflict:
        """The SaveConflict of a save of ``session_id`` over a manifest this process does not own
        (``unowned``: it never resumed or saved the session; ``found``: the store holds one), kept
        for :meth:`take_conflict`; this process no longer owns the session."""
        if unowned:
            why = "the store holds a save of it that this process did not resume (another writer created it)"
        elif found:
            why = "another writer saved it since this process last saved or resumed it"
        else:
            why = "another writer deleted it since this process last saved or resumed it"
        message = (
            f"session {session_id!r} was not saved: {why}; nothing was published, the store keeps the other "
            "writer's save, and the session continues from it once resumed"
        )
        with self._owned_lock:
            self._owned.pop(session_id, None)
            self._conflicts[session_id] = message
        return SaveConflict(message)

    def check_owned(self, session_id: str) -> None:
        """Raise SaveConflict when the store holds another version of ``session_id`` than the one
        this process owns (what its next save would meet): one small read, before a turn."""
        current, found = self.current_version(session_id)
        self.expected_version(session_id, current, found=found)

    def current_version(self, session_id: str) -> tuple[Any, bool]:
        """(the version of ``session_id``'s manifest in the store, whether there is one)."""
        raise NotImplementedError

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

    def base_of(self, plan: SavePlan) -> SaveBase | None:
        """The ``base`` a worker's save_file appends to (None: write everything). A block store's
        base also says where its last block ends, for saves that complete a block."""
        base = plan.base
        if base is None:
            return None
        run, size = _block_run_end(base), self.block_tokens
        if size and run % size:
            run = 0  # blocks of another size: the next save that crosses a boundary rewrites them
        position = run if plan.compact else base.position
        if size and run < MAX_BLOCKS * size:
            return SaveBase(base.tag, position, run, size)
        return SaveBase(base.tag, position)

    def next_manifest(
        self,
        plan: SavePlan,
        written: SaveFileReply,
        current: SessionManifest | None,
        new_refs: builtins.list[SegmentRef],
    ) -> SessionManifest:
        """The manifest a save publishes over ``current`` (the session's manifest as it stands
        when the save commits): the segments it keeps from ``current`` (those before the new
        rows), then ``new_refs``; a save with nothing new retags ``current``. A save that appended
        to a base ``current`` no longer is raises :class:`SaveConflict` (nothing is published)."""
        start, position, now = written.start, written.position, time.time()
        if start and (plan.base is None or current is None or current.tag != plan.base.tag):
            raise SaveConflict(
                f"session {plan.session_id!r} was saved or deleted by another writer while this save "
                "appended to it; nothing was published, save again"
            )
        if start == position and current is not None:  # nothing new: the base stands, retagged
            return dataclasses.replace(current, tag=plan.tag, saved=now)
        kept = [r for r in current.segments if r.end <= start] if start and current is not None else []
        return SessionManifest(
            plan.session_id,
            self.identity,
            written.format,
            written.geometry,
            position,
            plan.tag,
            current.created if current is not None else now,
            now,
            [*kept, *new_refs],
            self.inputs,
        )

    def _cut(
        self, plan: SavePlan, written: SaveFileReply
    ) -> tuple[builtins.list[SegmentRef], builtins.list[Piece], SegmentMemory]:
        """What a staged save publishes: the base's segments it keeps (those before the new rows),
        and the new rows cut into block pieces and a tail piece (views of the memory file)."""
        start, position = written.start, written.position
        base = plan.base
        kept = [r for r in base.segments if r.end <= start] if start and base is not None else []
        if start and (kept[-1].end if kept else 0) != start:
            raise SaveConflict(
                f"session {plan.session_id!r}: the worker saved from position {start}, which is no segment "
                "boundary of the save it builds on; nothing was published, save again"
            )
        ref = SegmentRef(plan.segment, start, position, written.file_length, written.header_crc)
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
    # move host checkpoints (an application's own, and ``migrate``).

    def begin_save(self, session_id: str, *, replace: bool = False) -> SavePlan:
        """Start a save of ``session_id``, conditional on the version this process owns
        (:meth:`expected_version`; ``replace``: on whatever the store holds now)."""
        raise NotImplementedError

    def commit_save(self, plan: SavePlan, written: SaveFileReply) -> SessionManifest:
        raise NotImplementedError

    def abort_save(self, plan: SavePlan) -> None:
        raise NotImplementedError

    def begin_resume(self, session_id: str) -> ResumePlan:
        raise NotImplementedError

    def save(self, session_id: str, checkpoint: CPUCheckpoint) -> None:
        """Atomically replace ``session_id``'s saved checkpoint with ``checkpoint`` (host memory),
        written whole as one segment, draft-model state included.

        A checkpoint without an identity is stamped with the store's; one with another identity
        raises :class:`CheckpointIncompatible`. Over ``max_bytes`` raises
        :class:`CheckpointTooLarge`; disk full, a read-only file system or denied permission raise
        :class:`CheckpointWriteError` with that ``reason``. On any failure the previous save stays
        loadable."""
        checkpoint = self.checked_for_save(checkpoint)
        plan = self.begin_save(session_id, replace=True)
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
        self.commit_save(plan, written)

    def load(self, session_id: str) -> CPUCheckpoint:
        """The verified checkpoint saved for ``session_id`` (host memory only): every header
        against the manifest, the chain, the size limit, every payload's CRC.

        Raises :class:`CheckpointNotFound`, :class:`CheckpointCorrupt`,
        :class:`CheckpointIncompatible`, :class:`CheckpointTooLarge`, :class:`CheckpointUnsafePath`,
        :class:`CheckpointReadError` or :class:`StoreUnavailable`."""
        plan = self.begin_resume(session_id)
        try:
            return self.assemble(plan.manifest, plan.fds, f"session {session_id!r} in {self.location!r}")
        finally:
            plan.close()

    def info(self, session_id: str) -> SessionInfo:
        raise NotImplementedError

    def list_info(self) -> builtins.list[SessionInfo]:
        raise NotImplementedError

    def saved_tokens(self, session_id: str) -> builtins.list[int]:
        """The token ids of the positions ``session_id``'s save holds (the rows a resume
        restores), read from its segments' token payloads alone, each checked against its CRC
        (an HTTP server matches a new prompt against them after a restart)."""
        plan = self.begin_resume(session_id)
        try:
            tokens: builtins.list[int] = []
            for fd, ref in zip(plan.fds, plan.manifest.segments):
                name = f"segment {ref.name} of session {session_id!r}"
                header = read_segment_header(fd, name, ref)
                ids = np.empty(header.end - header.start, np.int32)
                read_payload_into(fd, header, 0, [memoryview(ids.data).cast("B")], name)
                tokens[header.start :] = ids.tolist()
            return tokens[: plan.manifest.position]
        finally:
            plan.close()

    # -- records: small documents beside the sessions, unbound to the model -----------------------

    def put_record(self, key: str, data: bytes) -> None:
        """Replace the record ``key`` with ``data`` (at most MAX_RECORD_BYTES), atomically."""
        raise NotImplementedError

    def get_record(self, key: str) -> bytes:
        """The record ``key``; CheckpointNotFound when there is none."""
        raise NotImplementedError

    def delete_record(self, key: str) -> bool:
        """Remove the record ``key``; returns whether it existed."""
        raise NotImplementedError

    @staticmethod
    def record_name(key: str) -> str:
        return session_hash(key) + RECORD_SUFFIX

    @staticmethod
    def checked_record(key: str, data: bytes) -> str:
        """The file name of record ``key`` after the checks :meth:`put_record` makes of ``data``."""
        if not isinstance(data, bytes) or len(data) > MAX_RECORD_BYTES:
            raise InvalidArgument(f"a record is at most {MAX_RECORD_BYTES} bytes")
        return StoreBinding.record_name(key)

    def list(self) -> builtins.list[str]:
        """Session ids with a saved manifest, sorted; unreadable ones are skipped."""
        return [i.session_id for i in self.list_info()]

    def delete(self, session_id: str) -> bool:
        raise NotImplementedError

    def prune(self, older_than: float, *, now: float | None = None) -> builtins.list[str]:
        """Delete every session last saved more than ``older_than`` seconds ago; return their ids."""
        cutoff = (time.time() if now is None else now) - seconds("older_than", older_than)
        return [i.session_id for i in self.list_info() if i.saved < cutoff and self.delete(i.session_id)]

    def nbytes(self, session_id: str) -> int:
        """Bytes ``session_id``'s manifest and segments take (its shared blocks not counted)."""
        return self.info(session_id).nbytes

    def clean(self, *, older_than: float) -> CleanResult:
        """Remove what no saved session names (segments killed writers left, blocks no session
        names any more), last modified over ``older_than`` seconds ago. Deletes only what it can
        prove unnamed: see :meth:`survey`."""
        raise NotImplementedError

    @staticmethod
    def survey(manifests: Iterable[str], read: Callable[[str], SessionManifest]) -> ManifestSurvey:
        """Read each manifest of ``manifests`` with ``read`` for a collector (a file of version 1
        or 2, which ``migrate`` converts, is unreadable: it protects its session's files). One gone meanwhile names nothing; one that cannot be
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
        return assemble_checkpoint(list(zip(fds, headers, names)))

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
        FILE_VERSION,
    )
