"""Prefix cache: an LRU of idle KV snapshots keyed by their token sequences.

Entries live in extra cache slots preallocated next to the sessions' slots (``slot_ids``). A new or
reset session whose prompt starts with a cached prefix gets the longest usable match copied into
its own slot, so only the rest is prefilled. Entries are copies: writing into a session never
changes an entry. A sliding-window layer only offers what its ring still holds (the same retention
rule as truncating a session).

Entries are scoped by a salt (a request's ``cache_salt``, vLLM's name): an entry made under one salt
is only ever matched by requests with the same salt, and ``None`` (no salt) is a namespace of its
own, so one tenant's prompt is never reused for another tenant's request, nor shows through that
request's ``reused_prompt_tokens``. The same tokens may be held twice, once per salt.

Owner: the engine thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_MATCH = 2


@dataclass
class _Entry:
    slot: int
    tokens: np.ndarray  # int64 [length]
    floor: int = 0  # the first position its ring layers hold (an entry made from a restored session)
    salt: str | None = None  # only requests with this cache_salt see it


class PrefixCache:
    def __init__(self, cache, slot_ids: Sequence[int]) -> None:
        self.cache = cache  # KVCache-like: copy_slot, can_truncate
        self._free = list(slot_ids)[::-1]
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # slot -> entry, LRU first
        self.capacity = len(slot_ids)
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[list[int]]:
        """Token sequences of the entries, least recently used first (for tests and stats)."""
        return [e.tokens.tolist() for e in self._entries.values()]

    def entry_slot(self, tokens: Sequence[int], salt: str | None = None) -> int | None:
        """The cache slot holding exactly ``tokens`` under ``salt``, if an entry does."""
        arr = np.asarray(tokens, dtype=np.int64)
        for slot, e in self._entries.items():
            if e.salt == salt and np.array_equal(e.tokens, arr):
                return slot
        return None

    def insert(self, src_slot: int, tokens: Sequence[int], floor: int = 0, salt: str | None = None) -> None:
        """Snapshot ``tokens`` (whose KV is in rows [0, len) of ``src_slot``, ring layers from
        ``floor`` on) as an entry under ``salt``."""
        if self.capacity == 0 or len(tokens) < MIN_MATCH:
            return
        arr = np.asarray(tokens, dtype=np.int64)
        # Only entries of the same salt cover or are superseded by the new one: another salt's
        # entry of the same tokens is invisible to this salt's requests.
        for slot, e in self._entries.items():
            if e.salt == salt and len(e.tokens) >= len(arr) and np.array_equal(e.tokens[: len(arr)], arr):
                self._entries.move_to_end(slot)  # already covered: just touch it
                return
        # An entry that is a prefix of the new one is superseded by it.
        for slot, e in list(self._entries.items()):
            if e.salt == salt and len(e.tokens) < len(arr) and np.array_equal(arr[: len(e.tokens)], e.tokens):
                del self._entries[slot]
                self._free.append(slot)
        if not self._free:
            slot, _ = self._entries.popitem(last=False)  # evict the least recently used
            self._free.append(slot)
        slot = self._free.pop()
        self.cache.copy_slot(src_slot, slot, len(arr))
        self._entries[slot] = _Entry(slot, arr, floor, salt)

    def match(self, prompt: Sequence[int], limit: int, salt: str | None = None) -> tuple[int, int] | None:
        """The best (entry slot, usable length <= limit) for ``prompt`` among the entries made
        under ``salt`` (None matches only unsalted entries), or None."""
        if not self._entries or limit < MIN_MATCH:
            return None
        p = np.asarray(prompt[:limit], dtype=np.int64)
        best: tuple[int, int] | None = None
        for slot, e in self._entries.items():
            if e.salt != salt:
                continue
            n = min(len(e.tokens), len(p))
            diff = np.flatnonzero(e.tokens[:n] != p[:n])
            m = int(diff[0]) if diff.size else n
            if m >= MIN_MATCH and not self.cache.can_truncate(len(e.tokens), m, e.floor):
                m = 0  # a window layer no longer holds what position m needs
            if m >= MIN_MATCH and (best is None or m > best[1]):
                best = (slot, m)
        return best

    def copy_into(self, entry_slot: int, dst_slot: int, length: int) -> int:
        """Copy an entry's first ``length`` rows into ``dst_slot``; return the copy's floor."""
        e = self._entries[entry_slot]
        self._entries.move_to_end(entry_slot)
        self.cache.copy_slot(entry_slot, dst_slot, length)
        self.hits += 1
        self.reused_tokens += length
        return e.floor
