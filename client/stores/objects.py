"""ObjectSessionStore: saved sessions on object storage (S3, GCS, Azure, or in memory), via obstore.

It holds the same files as :class:`~.store.SessionStore` (docs/CHECKPOINT_FORMAT.md, file version 3),
as objects under the URL's prefix: a small manifest ``<hash>.mxckpt`` per session, naming immutable
segments ``<hash>.<random>.mxseg``. So a session saved by one machine resumes on any other that
reaches the bucket, and a save after a turn uploads only that turn's rows.

- **The data path.** The worker reads and writes segments through open descriptors (the file
  channel), never a path, so each segment is staged in an anonymous memory file (``memfd``). A save
  is written there by the worker, then uploaded. A resume downloads the segments into memfds and
  passes them to the worker, which checks every CRC before it publishes the session. Host
  checkpoints (``save`` / ``load``) go through the same memfds.
- **Atomic saves.** Segments are uploaded create-only, before the manifest that names them. The
  manifest is replaced with a conditional write: create-only when the save found none, and
  ``If-Match`` the version it found otherwise. So a reader sees the old session or the new one,
  never a mix, and of two writers of one session the later fails with :class:`SaveConflict`,
  leaving the winner's save whole. The loser's segment is deleted. A writer killed between its
  upload and its manifest leaves an unreferenced segment, which :meth:`clean` removes.
- **Binding.** Identity, configuration checks and size limits are :class:`~.store.SessionStore`'s
  own (the shared base, :class:`~.store.StoreBinding`).

Owner: none; every method opens, checks and closes what it uses. Like SessionStore, the methods
block and are meant for ``trio.to_thread``.
"""

from __future__ import annotations

import builtins
import datetime
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import trio

from muxworker.transport.checkpoint import (
    DEFAULT_MAX_BYTES,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    CheckpointReadError,
    CheckpointTooLarge,
    CheckpointWriteError,
    IdentityInputs,
    checkpoint_identity_inputs,
)
from muxworker.transport.checkpoint.blocks import BLOCK_NAME, BLOCK_SUFFIX, DEFAULT_BLOCK_TOKENS, Piece
from muxworker.transport.checkpoint.container import memory_file
from muxworker.transport.checkpoint.manifest import SessionManifest, encode_session_manifest, read_session_manifest
from muxworker.transport.checkpoint.segments import SegmentRef
from muxworker.transport.errors import InvalidArgument
from muxworker.transport.messages import SaveFileReply

from .binding import (
    DEFAULT_COMPACT_AFTER,
    MANIFEST_NAME,
    MAX_RECORD_BYTES,
    SEGMENT_SUFFIX,
    SUFFIX,
    CleanResult,
    ResumePlan,
    SaveConflict,
    SavePlan,
    SessionInfo,
    StoreBinding,
    StorePermissionError,
    StoreUnavailable,
    manifest_info,
    seconds,
    session_hash,
)

if TYPE_CHECKING:
    from obstore.store import ObjectStore

__all__ = ["ObjectSessionStore", "OBJECT_SCHEMES", "DEFAULT_TIMEOUT"]

#: URL schemes served by this backend (obstore's); a path or ``file://`` is the local SessionStore.
OBJECT_SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss", "azure", "memory")
#: Seconds a stored block may be named by a new save without being written again (clean()).
DEFAULT_BLOCK_REFRESH = 1800.0
#: Seconds within which a request to the object store fails, retries included, when the store
#: does not answer or answers with server errors (:func:`connect`): then StoreUnavailable.
DEFAULT_TIMEOUT = 30.0
#: The HTTP status in an obstore error's message ("... status code: 503 Service Unavailable").
_HTTP_STATUS = re.compile(r"status code: (\d{3})")


def _errors():
    from obstore import exceptions

    return exceptions


class ObjectSessionStore(StoreBinding):
    """Saved sessions under one object-storage URL, bound to one model identity (module docstring).

    Make it with :meth:`create` (or :func:`muxworker.client.open_store`). ``store`` is an obstore
    store already rooted at the prefix.
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        url: str,
        identity: str,
        max_bytes: int = DEFAULT_MAX_BYTES,
        inputs: IdentityInputs | None = None,
        compact_after: int = DEFAULT_COMPACT_AFTER,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        block_refresh: float = DEFAULT_BLOCK_REFRESH,
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
        if isinstance(block_refresh, bool) or not isinstance(block_refresh, (int, float)) or not block_refresh > 0:
            raise InvalidArgument(f"block_refresh must be a positive number of seconds, got {block_refresh!r}")
        self.block_refresh = float(block_refresh)
        #: Bytes this object has uploaded (segments, blocks and manifests), for metrics and benchmarks.
        self.uploaded_bytes = 0
        self.store = store
        self.url = url
        self.location = url

    @classmethod
    async def create(
        cls,
        url: str,
        *,
        model_files: Any,
        configuration: dict,
        max_bytes: int = DEFAULT_MAX_BYTES,
        compact_after: int = DEFAULT_COMPACT_AFTER,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        block_refresh: float = DEFAULT_BLOCK_REFRESH,
        share_blocks_across_namespaces: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        **options: Any,
    ) -> ObjectSessionStore:
        """Hash the model files off the event loop, connect to ``url`` and check it answers.

        Credentials, region and endpoint come from the environment as every S3 tool reads them
        (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``, ...;
        GCS and Azure likewise); ``options`` are obstore's store options and override them.
        ``timeout``: seconds within which a request fails with :class:`StoreUnavailable` while the
        store does not answer (:func:`connect`)."""

        def build() -> ObjectSessionStore:
            identity, inputs = checkpoint_identity_inputs(model_files, configuration)
            store = cls(
                connect(url, timeout=timeout, **options),
                url=url,
                identity=identity,
                max_bytes=max_bytes,
                inputs=inputs,
                compact_after=compact_after,
                block_tokens=block_tokens,
                block_refresh=block_refresh,
                share_blocks_across_namespaces=share_blocks_across_namespaces,
            )
            store._probe()
            return store

        return await trio.to_thread.run_sync(build)

    def __repr__(self) -> str:
        return f"ObjectSessionStore({self.url!r}, identity={self.identity[:12]}...)"

    # -- objects ----------------------------------------------------------------------------------

    def _failure(
        self, exc: BaseException, what: str, kind: type[CheckpointError] = StoreUnavailable
    ) -> CheckpointError:
        """A CheckpointError for an obstore failure, naming what was being done and why.

        ``kind`` is what the operation raises for a failure the store did not explain. A read
        (``kind`` StoreUnavailable) that fails for any reason but a missing object raises
        StoreUnavailable: what it reads is not known to be damaged, and a refused credential may
        be a policy or token being rotated. A write, or the start-up probe, raises
        StorePermissionError for refused credentials and StoreUnavailable for a network failure,
        a timeout or a server error."""
        e = _errors()
        if isinstance(exc, (e.NotFoundError, FileNotFoundError)):  # obstore raises the builtin too
            return CheckpointNotFound(f"{what}: not found in {self.url}")
        if "NoSuchBucket" in str(exc):
            return CheckpointNotFound(f"{what}: the bucket of {self.url} does not exist (NoSuchBucket)")
        reason = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
        if isinstance(exc, (e.PermissionDeniedError, e.UnauthenticatedError)):
            kind = StoreUnavailable if kind is StoreUnavailable else StorePermissionError
            message = (
                f"{what}: the object store refused the credentials ({type(exc).__name__}); check "
                f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the provider's variables) and the bucket policy "
                f"for {self.url}: {reason}"
            )
        else:
            kind = StoreUnavailable if _unavailable(exc) else kind
            message = f"{what} in {self.url} failed: {reason}"
        if kind is StoreUnavailable:
            message += "; the saved sessions are not known to be damaged"
        return kind(message)

    def _probe(self) -> None:
        """Fail at start-up, not at the first save, when the bucket or the credentials are wrong."""
        import obstore

        try:
            obstore.list_with_delimiter(self.store)
        except Exception as exc:
            raise self._failure(exc, "listing the session store", CheckpointReadError) from None

    def _get_into_memfd(self, name: str, what: str, limit: int) -> tuple[int, Any]:
        """Download object ``name`` into a new memfd; returns (fd, the object's e-tag)."""
        import obstore

        try:
            result = obstore.get(self.store, name)
            size, etag = result.meta["size"], result.meta["e_tag"]
            if size > limit:
                raise CheckpointTooLarge(f"{what} is {size} bytes, over the limit of {limit}")
            fd = memory_file(name)
            try:
                view = result.bytes()  # obstore's buffer: written out without a copy in Python
                written = os.write(fd, memoryview(view)) if size else 0
                while written < size:
                    written += os.write(fd, memoryview(view)[written:])
                os.lseek(fd, 0, os.SEEK_SET)
            except BaseException:
                os.close(fd)
                raise
        except CheckpointError:
            raise
        except Exception as exc:
            raise self._failure(exc, f"reading {what}") from None
        return fd, etag

    def _put(self, name: str, data: Any, what: str, mode: Any) -> Any:
        """Write object ``name``; a failed condition of ``mode`` (create-only, If-Match) is a
        :class:`SaveConflict`."""
        import obstore

        e = _errors()
        try:
            # One PUT, never a multipart upload: a failed condition or a killed writer leaves no
            # hidden parts behind (S3 takes up to 5 GiB in one PUT; a block is a few MiB).
            result = obstore.put(self.store, name, data, mode=mode, use_multipart=False)
            self.uploaded_bytes += len(data)
            return result
        except (e.PreconditionError, e.AlreadyExistsError):
            raise SaveConflict(
                f"{what} was saved or deleted by another writer meanwhile; nothing was published, save again"
            ) from None
        except Exception as exc:
            raise self._failure(exc, f"writing {what}", CheckpointWriteError) from None

    def _delete(self, name: str) -> None:
        import obstore

        try:
            obstore.delete(self.store, name)
        except Exception:
            pass  # an unreferenced segment is what clean() removes; the published state is what counts

    def _manifest(self, session_id: str) -> tuple[SessionManifest, Any]:
        """The verified manifest of ``session_id`` and its e-tag (CheckpointNotFound when none)."""
        name = session_hash(session_id) + SUFFIX
        what = f"the manifest of session {session_id!r}"
        try:
            fd, etag = self._get_into_memfd(name, what, 1 << 26)
        except CheckpointNotFound:
            raise CheckpointNotFound(f"no saved checkpoint for session {session_id!r}") from None
        try:
            m = read_session_manifest(fd, name)  # damage is CheckpointCorrupt, a newer version Incompatible
        finally:
            os.close(fd)
        self.check_manifest(m, session_id, name)
        return m, etag

    def _open_segments(self, m: SessionManifest) -> builtins.list[int]:
        """Download every segment of ``m`` into a memory file (the recorded sizes), several at once."""

        def get(ref: SegmentRef) -> int:
            what = f"segment {ref.name} of session {m.session_id!r}"
            return self._get_into_memfd(ref.name, what, self.max_bytes + ref.file_length)[0]

        fetched = _each(get, m.segments)
        try:
            return self.open_all(m, lambda ref: fetched.pop(ref.name))
        finally:
            for fd in fetched.values():
                os.close(fd)

    def _with_segments(self, session_id: str) -> tuple[SessionManifest, builtins.list[int], Any]:
        """The manifest, its downloaded segments and its e-tag; a manifest replaced meanwhile (a
        concurrent save deleted a segment it named) is read again."""
        for _ in range(3):
            m, etag = self._manifest(session_id)
            try:
                return m, self._open_segments(m), etag
            except CheckpointNotFound:
                continue
        raise CheckpointCorrupt(
            f"a segment of session {session_id!r} is missing (deleted by hand, or by a concurrent save "
            "three times in a row)"
        )

    # -- resume and load --------------------------------------------------------------------------

    def begin_resume(self, session_id: str) -> ResumePlan:
        """Download and vet ``session_id``'s objects into memory files for a worker to restore from
        (the caller closes them with :meth:`ResumePlan.close`)."""
        self._check_bound("resume a session")
        m, fds, etag = self._with_segments(session_id)
        return ResumePlan(session_id, fds, m, etag)

    # -- save -------------------------------------------------------------------------------------

    def begin_save(self, session_id: str, *, replace: bool = False) -> SavePlan:
        """Start a save: read the manifest it may append to and check its version (e-tag) is the
        one this process owns (:meth:`~.StoreBinding.expected_version`: else SaveConflict), then
        make the memory file the worker writes the new segment into. The commit's conditional
        write publishes only over that version (create-only when none)."""
        self._check_bound("save a session")
        digest = session_hash(session_id)
        base: SessionManifest | None
        present = True
        try:
            base, etag = self._manifest(session_id)
        except CheckpointNotFound:
            base, etag, present = None, None, False
        except StoreUnavailable:
            raise
        except CheckpointError:
            # Damaged or foreign: this save writes everything, and replaces it only if it is
            # still the object found here.
            base = None
            etag, present = self._etag(digest + SUFFIX)
        etag = self.expected_version(session_id, etag, replace=replace, found=present)
        found = base
        base, compact = self._base_plan(base)
        segment = f"{digest}.{secrets.token_hex(8)}{SEGMENT_SUFFIX}"
        fd = memory_file(segment)
        plan = SavePlan(session_id, digest, segment, fd, secrets.token_hex(16), base, -1, etag)
        plan.staged, plan.compact, plan.found, plan.replace = bool(self.block_tokens), compact, found, replace
        return plan

    def current_version(self, session_id: str) -> tuple[Any, bool]:
        return self._etag(session_hash(session_id) + SUFFIX)

    def _etag(self, name: str) -> tuple[Any, bool]:
        """(the e-tag of object ``name``, whether it exists); StoreUnavailable when the store
        does not answer."""
        import obstore

        try:
            return obstore.head(self.store, name)["e_tag"], True
        except Exception as exc:
            failure = self._failure(exc, f"reading {name}")
            if isinstance(failure, CheckpointNotFound):
                return None, False
            raise failure from None

    def commit_save(self, plan: SavePlan, written: SaveFileReply) -> SessionManifest:
        """Upload the segment the worker wrote, then publish the manifest with a conditional write.

        Raises :class:`SaveConflict` when another writer saved or deleted the session since
        :meth:`begin_save` (nothing is published; save again)."""
        try:
            start, position = written.start, written.position
            version = plan.version
            new_refs: builtins.list[SegmentRef] = []
            if start == position and plan.base is not None:
                pass  # nothing new: the base stands, retagged
            elif plan.staged:
                new_refs = self._store_pieces(plan, written)
            else:
                # One read of the memory file (the worker fsynced it; one copy, then one PUT).
                self._put(plan.segment, _read_all(plan.fd), f"segment {plan.segment}", "create")
                new_refs = [SegmentRef(plan.segment, start, position, written.file_length, written.header_crc)]
            # The conditional write below publishes only over the manifest begin_save found.
            m = self.next_manifest(plan, written, plan.found, new_refs)
            mode: Any = "create" if version is None else {"e_tag": version}
            try:
                put = self._put(plan.digest + SUFFIX, encode_session_manifest(m), f"session {plan.session_id!r}", mode)
            except SaveConflict:
                if plan.replace:
                    raise
                # Another writer published between begin_save and here: not this process's any more.
                raise self.conflict(plan.session_id, version is None, True) from None
            etag = put.get("e_tag") if put else None
            self.adopt(plan.session_id, etag if etag is not None else self._etag(plan.digest + SUFFIX)[0], saved=True)
            # The conditional write replaced exactly the manifest found: its segments are ours to drop.
            keep = {r.name for r in m.segments}
            for ref in plan.found.segments if plan.found is not None else []:
                if ref.name not in keep and not ref.shared:  # blocks go with clean()
                    self._delete(ref.name)
            return m
        except BaseException:
            if not self._published(plan):
                self._delete(plan.segment)
            raise
        finally:
            self.abort_save(plan)

    def _store_pieces(self, plan: SavePlan, written: SaveFileReply) -> builtins.list[SegmentRef]:
        """Upload a staged save's pieces (blocks without a young enough copy, and the tail as the
        plan's segment); returns their refs (which follow the base's kept segments)."""
        _, pieces, memory = self._cut(plan, written)
        try:
            attempt = 0

            def store(piece: Piece) -> str:
                if piece.key is not None:
                    return self._put_block(piece)
                mode = "overwrite" if attempt else "create"  # again: renews its age
                self._put(plan.segment, b"".join(piece.plan.buffers), f"segment {plan.segment}", mode)
                return plan.segment

            while True:
                checked = time.time()
                names = _each(store, pieces, key=lambda piece: piece.start)
                refs = [
                    SegmentRef(names[p.start], p.start, p.end, p.plan.file_length, p.plan.header_crc, p.key is not None)
                    for p in pieces
                ]
                # A collector deletes an unnamed block only once it is 2 x block_refresh old, and
                # this save's blocks were at most block_refresh old when checked: it must publish
                # within half of block_refresh of the check (clean()'s docstring has the argument).
                if time.time() - checked < self.block_refresh / 2:
                    return refs
                attempt += 1
        finally:
            del pieces
            memory.close()

    def _put_block(self, piece: Any) -> str:
        """The name of a stored copy of block ``piece`` at most ``block_refresh`` old: one found,
        or one written now. Copies are named ``<key>.<epoch>.mxblk`` (``epoch``: the time in
        units of block_refresh) and never overwritten, so the age a collector reads is the age a
        writer checked."""
        import obstore

        epoch = int(time.time() // self.block_refresh)
        for e in (epoch, epoch - 1):
            name = f"{piece.key}.{e:x}{BLOCK_SUFFIX}"
            try:
                meta = obstore.head(self.store, name)
            except Exception:
                continue
            if (
                meta["size"] == piece.plan.file_length
                and meta["last_modified"].timestamp() >= time.time() - self.block_refresh
            ):
                return name
        name = f"{piece.key}.{epoch:x}{BLOCK_SUFFIX}"
        try:
            self._put(name, b"".join(piece.plan.buffers), f"block {name}", "create")
        except SaveConflict:
            pass  # another writer stored it this epoch: the same bytes, as young
        return name

    def _published(self, plan: SavePlan) -> bool:
        """Whether the session's manifest may name the plan's segment (a manifest write that timed
        out may have landed): a manifest the store failed to return keeps the segment."""
        try:
            m, _ = self._manifest(plan.session_id)
        except StoreUnavailable:
            return True  # cannot tell: clean() decides, knowing which manifests it could not read
        except CheckpointError:
            return False  # none, or one this save did not write (it writes a readable one)
        return any(r.name == plan.segment for r in m.segments)

    def abort_save(self, plan: SavePlan) -> None:
        """Drop a save begun with :meth:`begin_save` (nothing was uploaded that a manifest names)."""
        if plan.fd >= 0:
            os.close(plan.fd)
            plan.fd = -1

    # -- listing and removing ---------------------------------------------------------------------

    def _names(self) -> builtins.list[tuple[str, int]]:
        import obstore

        try:
            out: builtins.list[tuple[str, int]] = []
            for batch in obstore.list(self.store):
                out.extend((meta["path"], meta["size"]) for meta in batch)
            return out
        except Exception as exc:
            raise self._failure(exc, "listing the session store") from None

    def info(self, session_id: str) -> SessionInfo:
        m, _ = self._manifest(session_id)
        manifest_bytes = len(encode_session_manifest(m))
        return manifest_info(m, manifest_bytes)

    def _read_listed(self, name: str) -> SessionManifest:
        """The manifest object ``name`` found by a listing (not checked against a session id)."""
        fd, _ = self._get_into_memfd(name, name, 1 << 26)
        try:
            return read_session_manifest(fd, name)
        finally:
            os.close(fd)

    def list_info(self) -> builtins.list[SessionInfo]:
        """:class:`SessionInfo` of every readable saved session, sorted by id."""
        out = []
        for name, size in self._names():
            if not MANIFEST_NAME.fullmatch(name):
                continue
            try:
                m = self._read_listed(name)
            except CheckpointError:
                continue
            out.append(manifest_info(m, size))
        return sorted(out, key=lambda i: i.session_id)

    def put_record(self, key: str, data: bytes) -> None:
        self._put(self.checked_record(key, data), data, f"record {key!r}", "overwrite")

    def get_record(self, key: str) -> bytes:
        name = self.record_name(key)
        try:
            fd, _ = self._get_into_memfd(name, f"record {key!r}", MAX_RECORD_BYTES)
        except CheckpointNotFound:
            raise CheckpointNotFound(f"no record {key!r}") from None
        try:
            return _read_all(fd)
        finally:
            os.close(fd)

    def delete_record(self, key: str) -> bool:
        import obstore

        name = self.record_name(key)
        try:
            obstore.head(self.store, name)
        except Exception:
            return False
        try:
            obstore.delete(self.store, name)
        except Exception as exc:
            raise self._failure(exc, f"deleting record {key!r}", CheckpointWriteError) from None
        return True

    def delete(self, session_id: str) -> bool:
        """Remove ``session_id``'s manifest, then its segments; return whether one existed."""
        try:
            m, _ = self._manifest(session_id)
        except CheckpointNotFound:
            self.forget(session_id)
            return False
        except CheckpointError:
            m = None
        import obstore

        try:
            obstore.delete(self.store, session_hash(session_id) + SUFFIX)
        except Exception as exc:
            raise self._failure(exc, f"deleting session {session_id!r}", CheckpointWriteError) from None
        self.forget(session_id)
        for ref in m.segments if m is not None else []:
            if not ref.shared:  # blocks other sessions may name go with clean()
                self._delete(ref.name)
        return True

    def clean(self, *, older_than: float = 3600.0) -> CleanResult:
        """Remove segments no manifest names that are older than ``older_than`` seconds (what
        killed or conflicting writers left; younger ones may belong to a save in progress, and
        below ``2 * block_refresh`` it is safe only while no writer runs), and blocks no manifest
        names that are older than ``max(older_than, 2 * block_refresh)``. Returns (the names
        removed, their bytes).

        It runs beside writers, with no lock. A writer names a stored copy of a block only if it
        is at most ``block_refresh`` (r) old when checked (else it writes a new copy; copies are
        never overwritten), and publishes its manifest within r/2 of that check (else it checks
        again). This
        collector reads the manifests, then deletes only blocks older than G = ``max(older_than,
        2r)``, and stops deleting G/4 after it began. A block that a writer names after the
        collector read the manifests was checked at most r/2 before, so it is younger than
        r + r/2 + G/4 < G at any deletion: it stays (given clocks within a few minutes of the
        store's, at the default r of 30 minutes)."""
        block_age = max(seconds("older_than", older_than), 2 * self.block_refresh)
        began = time.time()
        sizes = dict(self._names())
        survey = self.survey(sorted(n for n in sizes if MANIFEST_NAME.fullmatch(n)), self._read_listed)
        stray, kept = survey.partition(sorted(sizes))
        import obstore

        removed, nbytes = [], 0
        for name in stray:
            age = block_age if BLOCK_NAME.fullmatch(name) else older_than
            if time.time() - began > age / 4:
                continue  # past the collector's window: this waits for the next run
            try:
                meta = obstore.head(self.store, name)
            except Exception:
                continue
            # + 1 s: S3 reports Last-Modified in whole seconds, rounded down.
            if meta["last_modified"].timestamp() + 1.0 < began - age:
                self._delete(name)
                removed.append(name)
                nbytes += sizes[name]
        return CleanResult(sorted(removed), nbytes, kept=kept, unreadable=survey.unreadable)


#: Objects uploaded or downloaded at once by one save or resume (obstore releases the GIL).
IO_THREADS = 8


def _each(call: Callable[[Any], Any], items: Iterable[Any], key: Callable[[Any], Any] = lambda item: item.name) -> dict:
    """``{key(item): call(item)}``, the calls run on up to IO_THREADS threads. If any fails, the
    first failure is raised once all have ended, and results that are memory files are closed."""
    items = builtins.list(items)
    if len(items) <= 1:
        return {key(item): call(item) for item in items}
    with ThreadPoolExecutor(min(IO_THREADS, len(items))) as pool:
        futures = [(key(item), pool.submit(call, item)) for item in items]
    done, failure = {}, None
    for k, future in futures:
        try:
            done[k] = future.result()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the others are closed
            failure = failure or e
    if failure is not None:
        for value in done.values():
            if isinstance(value, int):
                os.close(value)
        raise failure
    return done


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    data = os.pread(fd, size, 0)
    while len(data) < size:  # pread returns at most 2 GiB at a time
        data += os.pread(fd, size - len(data), len(data))
    return data


def _unavailable(exc: BaseException) -> bool:
    """Whether an obstore failure is the store not answering: a network failure or a timeout (no
    HTTP status), or a server error (5xx, 429), after obstore's retries."""
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if not isinstance(exc, _errors().GenericError):
        return False
    status = _HTTP_STATUS.search(str(exc))
    return status is None or int(status.group(1)) >= 500 or int(status.group(1)) == 429


def connect(url: str, *, timeout: float = DEFAULT_TIMEOUT, **options: Any) -> ObjectStore:
    """An obstore store for ``url``. For S3: conditional writes by e-tag, and plain HTTP allowed
    when the endpoint (``AWS_ENDPOINT_URL`` or ``endpoint=``) is an ``http://`` URL (a local S3
    such as moto or MinIO).

    A request fails within ``timeout`` seconds, retries included, when the store does not answer
    or answers with server errors: obstore retries a failed try only during the first quarter of
    it, waits at most an eighth between tries, and one try may take half of it (connecting at
    most 5 s of that). A try includes its transfer: raise ``timeout`` for segments of several GB
    on a slow link. ``client_options`` and ``retry_config`` in ``options`` override these."""
    from obstore.store import from_url

    scheme = urlparse(url).scheme
    if scheme not in OBJECT_SCHEMES:
        raise InvalidArgument(f"not an object-storage URL: {url!r} (expected one of {', '.join(OBJECT_SCHEMES)}://)")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e6:
        raise InvalidArgument(f"timeout must be a positive number of seconds, got {timeout!r}")
    if scheme != "memory":  # in-process: nothing to wait for

        def share(fraction: float, at_most: float = timeout) -> datetime.timedelta:
            return datetime.timedelta(seconds=min(timeout * fraction, at_most))

        client = dict(options.pop("client_options", None) or {})
        client.setdefault("timeout", share(1 / 2))
        client.setdefault("connect_timeout", share(1 / 4, 5.0))
        retry = dict(options.pop("retry_config", None) or {})
        retry.setdefault("retry_timeout", share(1 / 4))
        retry.setdefault("backoff", {"init_backoff": share(1 / 40, 0.1), "max_backoff": share(1 / 8)})
        options["client_options"], options["retry_config"] = client, retry
    if scheme in ("s3", "s3a"):
        options.setdefault("conditional_put", "etag")
        endpoint = (
            options.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        )
        if endpoint and endpoint.startswith("http://"):
            client = dict(options.pop("client_options", None) or {})
            client.setdefault("allow_http", True)
            options["client_options"] = client
    try:
        return from_url(url, **options)
    except Exception as exc:
        raise InvalidArgument(f"cannot use the object store {url!r}: {type(exc).__name__}: {exc}") from None
