"""Where sessions are kept: :func:`open_store` picks the store for a path or URL.

- :mod:`.binding`: :class:`StoreBinding`, what every store shares, and the store errors;
- :mod:`.local`: :class:`SessionStore`, one directory on a local file system;
- :mod:`.objects`: :class:`ObjectSessionStore`, the same files on S3, GCS or Azure (obstore).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from muxworker.transport.checkpoint import DEFAULT_MAX_BYTES
from muxworker.transport.checkpoint.blocks import DEFAULT_BLOCK_TOKENS
from muxworker.transport.errors import InvalidArgument

from .binding import (
    DEFAULT_COMPACT_AFTER,
    LOCAL_BLOCK_TOKENS,
    CleanResult,
    ConfigurationMismatch,
    SaveConflict,
    SessionInfo,
    StoreBinding,
    StoreBusy,
    StorePermissionError,
    StoreUnavailable,
    session_hash,
)
from .local import SessionStore
from .objects import DEFAULT_TIMEOUT, OBJECT_SCHEMES, ObjectSessionStore

__all__ = [
    "CleanResult",
    "ConfigurationMismatch",
    "DEFAULT_COMPACT_AFTER",
    "ObjectSessionStore",
    "SaveConflict",
    "SessionInfo",
    "SessionStore",
    "StoreBinding",
    "StoreBusy",
    "StorePermissionError",
    "StoreUnavailable",
    "open_store",
    "session_hash",
]


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
    hold: str | None = None,
    role: str = "muxworker",
    **options: Any,
) -> StoreBinding:
    """The session store at ``location``, bound to the model files and configuration.

    A path or ``file://`` URL is a local :class:`SessionStore` (``options`` must be empty).
    ``block_tokens`` (None: the backend's default, :data:`LOCAL_BLOCK_TOKENS` or
    :data:`~muxworker.transport.checkpoint.blocks.DEFAULT_BLOCK_TOKENS`) sizes the shared blocks,
    which sessions share only within their namespace (the part of the id before its first "/")
    unless ``share_blocks_across_namespaces``.
    ``s3://bucket/prefix``, ``gs://``, ``az://`` and ``memory:///`` are an
    :class:`~.objects.ObjectSessionStore`. It takes credentials, region and endpoint from the
    environment as every tool for that cloud does (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_REGION``, ``AWS_ENDPOINT_URL``, ...), and ``options`` are obstore's store options.
    ``timeout`` (seconds; None: :data:`~.objects.DEFAULT_TIMEOUT`) bounds how long a request
    to an object store may fail before :class:`StoreUnavailable`; a local store has none.
    ``hold`` (a local store only): take its owner lock, ``"exclusive"`` (a server that owns the
    directory alone) or ``"shared"`` (writers beside each other), named ``role`` in the lock
    file; StoreBusy naming the holder when it is taken (:meth:`SessionStore.hold`). An object
    store has no lock: its conditional writes alone keep one owner per session.
    """
    text = os.fspath(location)
    common: dict[str, Any] = dict(
        model_files=model_files,
        configuration=configuration,
        max_bytes=max_bytes,
        compact_after=compact_after,
        share_blocks_across_namespaces=share_blocks_across_namespaces,
    )
    scheme = text.split("://", 1)[0] if "://" in text else ""
    if scheme in ("", "file"):
        if options:
            raise InvalidArgument(f"a local store takes no store options, got {sorted(options)}")
        path = text[len("file://") :] if scheme == "file" else text
        return await SessionStore.create(
            path,
            **common,
            block_tokens=LOCAL_BLOCK_TOKENS if block_tokens is None else block_tokens,
            hold=hold,
            role=role,
        )
    if scheme not in OBJECT_SCHEMES:
        raise InvalidArgument(
            f"no session store for {text!r}: expected a path, file://, or one of "
            + ", ".join(f"{s}://" for s in OBJECT_SCHEMES)
        )
    return await ObjectSessionStore.create(
        text,
        **common,
        block_tokens=DEFAULT_BLOCK_TOKENS if block_tokens is None else block_tokens,
        timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
        **options,
    )
