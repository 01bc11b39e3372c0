"""Reuse without a session id: which of a tenant's sessions a new prompt continues.

Agents resend their whole history every turn and name no session. The server keeps, per tenant,
the token history of every session it may continue (:class:`Entry`): *implicit* sessions that
requests naming nothing opened, *response* sessions holding stored responses (``/v1/responses``),
and the named sessions it has served. For a new prompt :meth:`ReuseIndex.plan` picks the session
sharing the longest prefix with it and says how to use it (:class:`Plan`):

- **in place**: the prompt extends that session's last prompt (the same conversation, one turn
  on; the last reply's tokens may be re-rendered differently, and the engine reuses up to where
  they differ; a template that dropped the reasoning of a model that thinks re-renders the
  ``<think>`` it opened at that prompt's end too). The session is idle and of the kind the
  request may write.
- **fork**: the prompt diverges inside that session's last prompt (another branch of the
  conversation: a regenerated turn, an agent's side request), or the session is busy or of
  another kind. The shared rows are copied into a new session, and the one it came from keeps
  its history: both branches stay reusable.
- **fresh**: nothing shares a token with it.

A request naming a session runs on that session, but where its prompt diverges inside the
session's last prompt, the history it would overwrite is first kept as an implicit branch, and
a branch sharing a longer prefix is copied in (:meth:`ReuseIndex.plan_named`).

Pure bookkeeping (no I/O): the server (service.py) carries a plan out and reports each turn
back (:meth:`ReuseIndex.note_turn`). Owner: the server's trio thread.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .tenants import IMPLICIT, RESPONSE, Tenant, session_kind

__all__ = ["SERVER_SESSION_ID", "Entry", "Plan", "ReuseIndex", "common_prefix"]

#: Entries kept per tenant (matching a prompt compares it with each); the least recently used
#: beyond it are forgotten (their sessions stay, as a cache the store bound removes).
MAX_ENTRIES = 256
#: A session read back from the store (its last prompt's length unknown) is continued in place by a
#: prompt sharing this share of its history; one sharing less is a branch of it.
RESTORED_SHARE = 0.9
#: A branch must share this many more tokens than the named session's own history before it is
#: copied into it (a copy of a few rows is not worth a round trip).
MIN_GAIN = 16
#: The public id of a session the server opened itself (:meth:`ReuseIndex.new_sid`, less the
#: tenant): ``GET /v1/sessions`` lists them, so the session endpoints address them too.
SERVER_SESSION_ID = re.compile(f"(?:{re.escape(IMPLICIT)}|{re.escape(RESPONSE)})[0-9a-f]{{32}}-[0-9a-f]{{32}}")


def salt_tag(salt: str | None) -> str:
    """32 hex digits (128 bits) naming a cache_salt (None: the tenant's default) in a session id:
    the only thing that keeps one salt's histories from another's, so not one a tenant could
    find a collision for."""
    return hashlib.sha256((salt or "").encode()).hexdigest()[:32]


def _tag_of(sid: str) -> str:
    """The salt tag in an implicit or response session's id (``tenant/<kind><tag>-<random>``)."""
    rest = sid.split("/", 1)[1]
    return rest[3:].split("-", 1)[0]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass
class Entry:
    """One session a prompt may continue. ``tokens`` is its committed history, of which the first
    ``rows`` have KV rows (after a turn the last sampled token has none yet); None until read
    from the store (a session saved before a restart). ``prompt_len`` is its last prompt's length
    (less a reasoning block the template opened at its end, which the next turn renders otherwise):
    a prompt extending that continues the conversation in place (unknown: all of ``tokens``)."""

    sid: str
    tokens: np.ndarray | None = None
    rows: int = 0
    prompt_len: int = 0
    used: float = field(default_factory=time.time)
    nbytes: int = 0  # store bytes, as last listed
    busy: bool = False  # a generation runs on it (or a plan is being carried out)

    @property
    def kind(self) -> str:
        return session_kind(self.sid)

    def estimate(self, bytes_per_token: float) -> int:
        """Its store bytes: as listed, or from its rows once it has grown past that."""
        return max(self.nbytes, int(self.rows * bytes_per_token))


@dataclass(frozen=True)
class Plan:
    """How a request uses the index: run on ``target`` (new when ``fresh_target``), after copying
    ``rows`` rows of ``source`` into it (when ``source`` is set); ``branch``: before that, copy
    the target's own history into this new implicit session, which keeps it."""

    target: str
    fresh_target: bool = False
    source: str | None = None
    rows: int = 0
    branch: str | None = None
    reused: int = 0  # the prompt tokens the plan expects to reuse


class ReuseIndex:
    """Per tenant, the sessions a prompt may continue, least recently used first."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._tenants: dict[str, OrderedDict[str, Entry]] = {}
        self.bytes_per_token = 0.0  # store bytes per saved token, learned from listings

    def entries(self, tenant: Tenant) -> OrderedDict[str, Entry]:
        return self._tenants.setdefault(tenant.name, OrderedDict())

    def get(self, sid: str) -> Entry | None:
        return self._tenants.get(sid.split("/", 1)[0], OrderedDict()).get(sid)

    def add(self, sid: str, *, used: float | None = None) -> Entry:
        """The entry of ``sid``, made if new (least recently used ones beyond the bound go)."""
        tenant = self._tenants.setdefault(sid.split("/", 1)[0], OrderedDict())
        entry = tenant.get(sid)
        if entry is None:
            entry = tenant[sid] = Entry(sid, used=time.time() if used is None else used)
            while len(tenant) > self.max_entries:
                oldest = next((e for e in tenant.values() if not e.busy), None)
                if oldest is None:
                    break
                del tenant[oldest.sid]
        return entry

    def forget(self, sid: str) -> None:
        self._tenants.get(sid.split("/", 1)[0], OrderedDict()).pop(sid, None)

    def unloaded(self, tenant: Tenant) -> list[Entry]:
        """Entries whose history is still in the store only, most recently used first."""
        return sorted((e for e in self.entries(tenant).values() if e.tokens is None), key=lambda e: -e.used)

    def _best(
        self, tenant: Tenant, ids: np.ndarray, salt: str | None, exclude: str | None = None
    ) -> tuple[Entry | None, int]:
        tag = salt_tag(salt)
        best, best_common = None, 0
        for entry in self.entries(tenant).values():
            if entry.tokens is None or entry.sid == exclude or entry.kind not in (IMPLICIT, RESPONSE):
                continue
            if _tag_of(entry.sid) != tag:  # another cache_salt's history
                continue
            common = min(common_prefix(entry.tokens, ids), entry.rows)
            if common > best_common or (common == best_common and best is not None and entry.used > best.used):
                best, best_common = entry, common
        return best, best_common

    def plan(self, tenant: Tenant, prompt: list[int], kind: str = IMPLICIT, salt: str | None = None) -> Plan:
        """Where a prompt naming no session runs: in place on the best session of ``kind``, or on
        a new session of ``kind`` forked from the best one, or fresh, among the sessions of the
        request's ``salt`` (its cache_salt: a salt's histories serve only that salt). Marks the
        target busy."""
        ids = np.asarray(prompt, dtype=np.int32)
        best, common = self._best(tenant, ids, salt)
        if best is not None and common > 0:
            if common >= best.prompt_len and not best.busy and best.kind == kind:
                self._claim(best)
                return Plan(best.sid, reused=common)
            target = self.new_sid(tenant, kind, salt)
            self._claim(self.add(target))
            return Plan(target, fresh_target=True, source=best.sid, rows=common, reused=common)
        target = self.new_sid(tenant, kind, salt)
        self._claim(self.add(target))
        return Plan(target, fresh_target=True)

    def plan_named(self, tenant: Tenant, sid: str, prompt: list[int], salt: str | None = None) -> Plan:
        """Where a prompt under the named session ``sid`` runs: on ``sid``, keeping its history
        as a branch first when the prompt diverges inside its last prompt, and copying a branch
        in when one shares a longer prefix."""
        ids = np.asarray(prompt, dtype=np.int32)
        own = self.get(sid)
        own_common, branch = 0, None
        if own is not None and own.tokens is not None:
            own_common = min(common_prefix(own.tokens, ids), own.rows)
            if own_common < own.prompt_len and own.rows > own_common and not own.busy:
                branch = self.new_sid(tenant, IMPLICIT, salt)  # what the turn would overwrite stays reusable
        best, common = self._best(tenant, ids, salt, exclude=sid)
        entry = self.add(sid)
        self._claim(entry)
        if branch is not None:  # claimed until the service has copied the history into it
            new = self.add(branch)
            new.tokens, new.rows, new.prompt_len = own.tokens, own.rows, own.prompt_len  # type: ignore[union-attr]
            new.busy = True
        if best is not None and common >= own_common + MIN_GAIN:
            return Plan(sid, source=best.sid, rows=common, branch=branch, reused=common)
        return Plan(sid, branch=branch, reused=own_common)

    @staticmethod
    def new_sid(tenant: Tenant, kind: str, salt: str | None = None) -> str:
        """``tenant/<kind><salt tag>-<random>``: the id says whose cache_salt its history is."""
        return f"{tenant.prefix}{kind}{salt_tag(salt)}-{uuid.uuid4().hex}"

    def _claim(self, entry: Entry) -> None:
        entry.busy = True
        entry.used = time.time()
        self.entries(Tenant(entry.sid.split("/", 1)[0])).move_to_end(entry.sid)

    def note_turn(
        self, sid: str, prompt: list[int] | None, result: Any, *, ran: bool = True, rerendered: int = 0
    ) -> None:
        """A turn on ``sid`` settled: ``result`` its GenerationResult (None: it failed, and the
        engine emptied the session's history), ``prompt`` its token ids (None: not known here).
        ``ran`` False: it never reached the engine's step (refused at submit, or cancelled while
        queued), so the session's history is as it was. ``rerendered``: the prompt's last tokens
        that the next turn renders otherwise (a reasoning block the template opened, which it
        drops from past turns): a prompt that diverges there still continues the conversation."""
        entry = self.get(sid)
        if entry is None:
            return
        entry.busy = False
        entry.used = time.time()
        if not ran:
            return
        if result is None or prompt is None:  # failed (the engine emptied it), or its prompt is unknown here
            entry.tokens, entry.rows, entry.prompt_len = np.zeros(0, np.int32), 0, 0
            return
        committed = result.generated_token_ids[: result.committed_tokens]
        entry.tokens = np.asarray(list(prompt) + list(committed), dtype=np.int32)
        if result.committed_tokens:
            entry.rows = len(prompt) + result.committed_tokens - 1
        else:  # cancelled during its prefill: the prompt rows computed so far
            entry.rows = min(len(prompt), result.reused_prompt_tokens + result.prefilled_prompt_tokens)
        entry.prompt_len = len(prompt) - rerendered

    def release(self, sid: str) -> None:
        """A plan on ``sid`` was not carried out (its request failed before it ran)."""
        entry = self.get(sid)
        if entry is not None:
            entry.busy = False

    def loaded(self, sid: str, tokens: list[int]) -> None:
        """``sid``'s history as its save holds it (read after a restart). Its last prompt's
        length is not saved: a prompt sharing RESTORED_SHARE of the history continues it (the
        same conversation, its last reply re-rendered), less is another branch."""
        entry = self.get(sid)
        if entry is not None and entry.tokens is None:
            entry.tokens = np.asarray(tokens, dtype=np.int32)
            entry.rows = len(tokens)
            entry.prompt_len = int(len(tokens) * RESTORED_SHARE)

    def over_bound(self, tenant: Tenant, limit: int) -> list[Entry]:
        """The implicit sessions to delete, least recently used first, so that the tenant's
        implicit store bytes (estimated) are within ``limit``; busy ones are kept."""
        implicit = [e for e in self.entries(tenant).values() if e.kind == IMPLICIT]
        total = sum(e.estimate(self.bytes_per_token) for e in implicit)
        out = []
        for entry in sorted(implicit, key=lambda e: e.used):
            if total <= limit:
                break
            if entry.busy:
                continue
            out.append(entry)
            total -= entry.estimate(self.bytes_per_token)
        return out

    def implicit_bytes(self, tenant: Tenant) -> int:
        return sum(e.estimate(self.bytes_per_token) for e in self.entries(tenant).values() if e.kind == IMPLICIT)
