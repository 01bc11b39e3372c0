"""Content-addressed blocks: the rows of fixed token ranges, stored once for every session that has them.

A store that saves in blocks (``block_tokens`` B, 128 by default) keeps a session as a run of
**blocks** ``[0, B), [B, 2B), ...`` followed by a **tail** run of ordinary segments up to the
session's position (file version 3 segments both; docs/CHECKPOINT_FORMAT.md). A block is named by
its **key**::

    key_0 = sha256("muxworker-block-1" | identity | format | geometry [| namespace])   (the seed)
    key_k = sha256(key_{k-1} | start, end, layer layout, payload CRC32Cs | token ids of the block)

so a key covers the model identity, the whole token prefix up to the block's end (through the
chain), which rows of each layer the block holds (a sliding-window layer may hold fewer), and the
CRC32C of every payload. The **namespace** (the store passes the part of the session id before its
first "/", e.g. the HTTP server's tenant; "" adds nothing to the seed) keeps the chains of two
namespaces apart, so a namespace cannot learn whether another stored a prefix (a save that finds
its blocks stored is faster, and the store lists them). Two sessions name the same block only when
they share a namespace and their rows are bit-identical:
rows computed for the same tokens in different batches can differ in the last bits, and such
sessions simply keep their own blocks. So a session resumed from shared blocks holds exactly the
rows it saved, and stays exact; the sharing comes from the prefix cache, which hands the same rows
to every session that starts with the same prompt.

The worker writes one segment per save (the rows since its base); :func:`split_segment` cuts it
at the block boundaries into block pieces and one tail piece, as views of the segment's own
memory (no copy until a piece is written). Only numpy, the file container and segments here; the
stores (client/stores/) decide which blocks are already stored.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
from dataclasses import dataclass

import msgpack
import numpy as np

from muxworker.native import crc32c

from .segments import DraftRows, LayerRows, SegmentHeader, SegmentPlan, plan_segment
from .state import numpy_storage_dtype

__all__ = [
    "BLOCK_SUFFIX",
    "BLOCK_NAME",
    "BLOCK_SESSION",
    "DEFAULT_BLOCK_TOKENS",
    "MAX_BLOCKS",
    "Piece",
    "SegmentMemory",
    "chain_seed",
    "split_segment",
]

#: A block's file name is ``<key>.mxblk`` (64 hex digits); on object storage, where copies are
#: dated for the collector, ``<key>.<epoch>.mxblk``.
BLOCK_SUFFIX = ".mxblk"
BLOCK_NAME = re.compile(r"([0-9a-f]{64})(?:\.[0-9a-f]{1,16})?\.mxblk")
#: The session id in a block's header: a block belongs to no session (its refs are ``shared``).
BLOCK_SESSION = "(shared block)"
DEFAULT_BLOCK_TOKENS = 128
#: Blocks per session at most; positions past ``MAX_BLOCKS * block_tokens`` stay in the tail run.
#: With the tail's compaction this keeps a session's files under the file channel's 240 descriptors.
MAX_BLOCKS = 200


@dataclass
class Piece:
    """One segment to store, cut from a worker's segment: a block (``key`` set) or the tail."""

    start: int
    end: int
    key: str | None
    plan: SegmentPlan

    @property
    def name(self) -> str | None:
        return None if self.key is None else self.key + BLOCK_SUFFIX


class SegmentMemory:
    """A segment file mapped read-only, for views of its payloads (close after the pieces are stored)."""

    def __init__(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        self.map = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        self.view = memoryview(self.map) if self.map is not None else memoryview(b"")

    def close(self) -> None:
        self.view.release()
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:
                pass  # a view is still exported; the map goes with the last one

    def __enter__(self) -> SegmentMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chain_seed(identity: str, format: dict, geometry: dict, namespace: str = "") -> str:
    """The key a session's first block chains from. The empty namespace's seed is the one stores
    used before namespaces; another appends NUL and the namespace (JSON has no raw NUL, so no two
    namespaces give the same bytes)."""
    shape = json.dumps([format, geometry], sort_keys=True, separators=(",", ":"))
    seed = b"muxworker-block-1\0" + identity.encode() + b"\0" + shape.encode()
    if namespace:
        seed += b"\0" + namespace.encode()
    return hashlib.sha256(seed).hexdigest()


def split_segment(
    memory: SegmentMemory,
    header: SegmentHeader,
    *,
    session_id: str,
    block_tokens: int,
    parent_key: str | None,
    namespace: str = "",
) -> list[Piece]:
    """Cut the verified segment ``header`` (mapped as ``memory``) into pieces: blocks of
    ``block_tokens`` positions where the segment starts on a block boundary (``parent_key``: the
    key of the block before it, None at position 0, where the chain starts from ``namespace``'s
    seed), up to :data:`MAX_BLOCKS`, then one tail piece for the rest (``session_id``'s own
    segment). A segment that starts inside a block, or carries a draft model's state (the whole
    draft, which belongs to no range of positions), is one tail piece. Every piece's payloads are
    views of ``memory``."""
    start, end = header.start, header.end
    if header.draft is not None:
        block_tokens = 0
    cuts = [start]
    limit = MAX_BLOCKS * block_tokens if block_tokens else 0
    if block_tokens and start % block_tokens == 0 and start < limit:
        a = start
        while a + block_tokens <= min(end, limit):
            a += block_tokens
            cuts.append(a)
    if cuts[-1] != end:
        cuts.append(end)
    key = parent_key
    if key is None:
        key = chain_seed(header.identity, header.format, header.geometry, namespace)
    pieces = []
    for a, b in zip(cuts, cuts[1:]):
        is_block = bool(block_tokens) and b - a == block_tokens and a % block_tokens == 0 and b <= limit
        tokens, layers, crcs = _rows(memory, header, a, b)
        if is_block:
            layout = [layer.lo - a for layer in layers]
            h = hashlib.sha256(bytes.fromhex(key))
            h.update(msgpack.packb([a, b, layout, crcs]))
            h.update(tokens.tobytes())
            key = h.hexdigest()
        plan = plan_segment(
            session_id=BLOCK_SESSION if is_block else session_id,
            identity=header.identity,
            format=header.format,
            geometry=header.geometry,
            start=a,
            token_ids=tokens,
            layers=layers,
            draft=_draft_rows(memory, header) if b == end and header.draft is not None else None,
            crcs=crcs + _draft_crcs(header) if b == end else crcs,
        )
        pieces.append(Piece(a, b, key if is_block else None, plan))
    return pieces


def _rows(
    memory: SegmentMemory, header: SegmentHeader, a: int, b: int
) -> tuple[np.ndarray, list[LayerRows], list[int]]:
    """Positions [a, b) of the segment: token ids, each layer's rows (views) and every payload's CRC."""
    view = memory.view
    kv, d = header.geometry["num_kv_heads"], header.geometry["head_dim"]
    row_bytes = d * numpy_storage_dtype(header.format["dtype"]).itemsize
    offset = header.payloads[0][0] + 4 * (a - header.start)
    token_bytes = view[offset : offset + 4 * (b - a)]
    tokens = np.frombuffer(token_bytes, dtype=np.int32)
    crcs = [crc32c(token_bytes)]
    layers = []
    for i, (seg_lo, rows) in enumerate(header.layers):
        lo = max(seg_lo, a) if seg_lo < b else b
        n = b - lo
        parts = []
        for part in (0, 1):
            base = header.payloads[header.payload_index(i, part)][0]
            runs = []
            for head in range(kv):
                first = base + (head * rows + (lo - seg_lo)) * row_bytes
                runs.append(view[first : first + n * row_bytes])
            crc = 0
            for run in runs:
                crc = crc32c(run, crc)
            crcs.append(crc)
            parts.append(runs)
        layers.append(LayerRows(lo, n, parts[0], parts[1]))
    return tokens, layers, crcs


def _draft_rows(memory: SegmentMemory, header: SegmentHeader) -> DraftRows:
    """The segment's draft-model state, as views of ``memory``."""
    draft = header.draft
    assert draft is not None
    layers = []
    for i, (lo, rows) in enumerate(draft.layers):
        parts = []
        for part in (0, 1):
            offset, length, _ = header.payloads[header.draft_payload_index(i, part)]
            parts.append([memory.view[offset : offset + length]])
        layers.append(LayerRows(lo, rows, parts[0], parts[1]))
    return DraftRows(draft.geometry, draft.position, layers)


def _draft_crcs(header: SegmentHeader) -> list[int]:
    """The CRC32Cs of the segment's draft payloads (none without a draft)."""
    if header.draft is None:
        return []
    first = header.draft_payload_index(0, 0)
    return [crc for _, _, crc in header.payloads[first:]]
