"""The typed contracts of the wire, defined once for both ends.

:mod:`.schema` checks the *shape* of every control map (types, ranges, unknown keys); the
dataclasses here say what the main messages *mean* to a program, and tests/transport checks that
each one names exactly the fields its schema entry has:

- :class:`GenerateRequest`: the ``generate`` request. Its sampling fields are
  :class:`~.sampling.SamplingFields` (names, defaults and ranges defined there, once); the worker's
  ``SamplingParams`` is that class and the client's ``GenerationParams`` takes its defaults from it.
  Its ``cache_salt`` is not a sampling field: it scopes the worker's prefix cache.
- :class:`GenerationResult`: the ``result`` map of a ``done`` reply; :data:`RESULT_FIELDS` lists
  every field the worker's engine sends (a worker test checks the engine against it).
- :class:`WorkerInfo` and :class:`ModelInfo`: the worker's ``hello`` (its protocol version, model,
  backend, device, dtype, engine limits and readiness).
- One class for every other request kind (:data:`REQUESTS`): the client builds the control map
  with :meth:`fields`, the worker reads it back with ``from_control`` after the schema checked its
  shape, so neither end indexes a raw map. :class:`SaveFileRequest` and :class:`RestoreFileRequest`
  carry checkpoint files (their ``fds`` count is derived), :class:`SaveFileReply` is what a save
  wrote.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .checkpoint.segments import SaveFileReply, SegmentRef
from .errors import ProtocolError
from .sampling import SAMPLING_FIELD_NAMES, SamplingFields

__all__ = [
    "GenerateRequest",
    "GenerationResult",
    "RESULT_FIELDS",
    "TokenLogprob",
    "ModelInfo",
    "WorkerInfo",
    "SamplingFields",
    "OpenSession",
    "CloseSession",
    "ResetSession",
    "ForkSession",
    "CancelRequest",
    "TokenizeRequest",
    "DetokenizeRequest",
    "ChatTemplateRequest",
    "InfoRequest",
    "SaveBase",
    "SaveFileRequest",
    "SaveFileReply",
    "RestoreFileRequest",
    "REQUESTS",
]


class _Request:
    """A request kind's typed fields: ``fields()`` is the control map without ``kind`` and ``id``
    (None-valued optional fields left out), ``from_control`` its inverse on a schema-checked map."""

    KIND: ClassVar[str]

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}  # type: ignore[arg-type]

    @classmethod
    def from_control(cls, control: Mapping[str, Any]) -> Any:
        return cls(**{f.name: control[f.name] for f in dataclasses.fields(cls) if f.name in control})  # type: ignore[arg-type]


@dataclass(frozen=True)
class _SessionRequest(_Request):
    session_id: str


class OpenSession(_SessionRequest):
    KIND: ClassVar[str] = "open"


class CloseSession(_SessionRequest):
    KIND: ClassVar[str] = "close"


class ResetSession(_SessionRequest):
    KIND: ClassVar[str] = "reset"


@dataclass(frozen=True)
class ForkSession(_SessionRequest):
    """Make open session ``target_id``'s history the first ``rows`` tokens of ``session_id``'s,
    their KV rows copied slot to slot (``Engine.fork_session``)."""

    KIND: ClassVar[str] = "fork"
    target_id: str
    rows: int


@dataclass(frozen=True)
class CancelRequest(_Request):
    """Cancel the request whose id this message carries (no fields of its own)."""

    KIND: ClassVar[str] = "cancel"


@dataclass(frozen=True)
class InfoRequest(_Request):
    KIND: ClassVar[str] = "info"


@dataclass(frozen=True)
class TokenizeRequest(_Request):
    KIND: ClassVar[str] = "tokenize"
    text: str
    add_special_tokens: bool = False
    parse_special: bool = False


@dataclass(frozen=True)
class DetokenizeRequest(_Request):
    KIND: ClassVar[str] = "detokenize"
    tokens: Mapping[str, Any]  # a payload reference (framing.attach_payload)


@dataclass(frozen=True)
class ChatTemplateRequest(_Request):
    KIND: ClassVar[str] = "chat_template"
    messages: Sequence[Mapping[str, Any]]
    add_generation_prompt: bool = True


@dataclass(frozen=True)
class SaveBase:
    """What a save may build on: rows ``[0, position)`` of the slot are in the store's save ``tag``.
    A store saving blocks of ``block_tokens`` positions (0: none) has its last block end at
    ``block_start``; a save that crosses a block boundary is written from there."""

    tag: str
    position: int
    block_start: int | None = None
    block_tokens: int = 0

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"tag": self.tag, "position": self.position}
        if self.block_tokens:
            wire.update(block_start=self.block_start, block_tokens=self.block_tokens)
        return wire


@dataclass(frozen=True)
class SaveFileRequest(_Request):
    """Write a session into the one file passed with the request: a store's save (``tag``, and a
    ``base`` to append to) or an export into a memory file (no tag, no base, maybe a ``position``)."""

    KIND: ClassVar[str] = "save_file"
    session_id: str
    identity: str  # "" for an export without one
    max_bytes: int
    tag: str | None = None
    base: SaveBase | None = None
    position: int | None = None

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "session_id": self.session_id,
            "fds": 1,
            "tag": self.tag,
            "base": None if self.base is None else self.base.to_wire(),
            "identity": self.identity,
            "max_bytes": self.max_bytes,
        }
        if self.position is not None:
            out["position"] = self.position
        return out

    @classmethod
    def from_control(cls, control: Mapping[str, Any]) -> SaveFileRequest:
        base = control["base"]
        return cls(
            control["session_id"],
            control["identity"],
            control["max_bytes"],
            control["tag"],
            None if base is None else SaveBase(**base),
            control.get("position"),
        )


@dataclass(frozen=True)
class RestoreFileRequest(_Request):
    """Restore session ``session_id`` from the segment files passed with the request, one per
    entry of ``segments``: a saved session's (``tag`` its save, ``saved_id`` the session they
    hold when another) or one host checkpoint in a memory file (no tag)."""

    KIND: ClassVar[str] = "restore_file"
    session_id: str
    identity: str
    max_bytes: int
    segments: tuple[SegmentRef, ...]
    tag: str | None = None
    saved_id: str | None = None

    def fields(self) -> dict[str, Any]:
        out = super().fields()
        out["fds"] = len(self.segments)
        out["segments"] = [ref.to_wire() for ref in self.segments]
        return out

    @classmethod
    def from_control(cls, control: Mapping[str, Any]) -> RestoreFileRequest:
        refs = tuple(SegmentRef.from_wire(r, f"segments[{i}]") for i, r in enumerate(control["segments"]))
        return cls(
            control["session_id"],
            control["identity"],
            control["max_bytes"],
            refs,
            control.get("tag"),
            control.get("saved_id"),
        )


@dataclass(frozen=True)
class GenerateRequest:
    """A ``generate`` request: the prompt segments that are the session's whole next context, and the
    sampling fields the caller set. Fields left out take :class:`SamplingFields`' defaults in the
    worker, which validates their ranges (:meth:`SamplingFields.validate`)."""

    session_id: str
    prompt: Sequence[Mapping[str, Any]]  # segments: {"text": str, "special"?: bool} or {"tokens": ref}
    sampling: Mapping[str, Any] = field(default_factory=dict)  # a subset of SamplingFields' fields
    # The prefix-cache namespace: only requests with the same salt reuse each other's prompts
    # (None: the shared, unsalted namespace). Sent only when set.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        unknown = set(self.sampling) - set(SAMPLING_FIELD_NAMES)
        if unknown:
            raise ValueError(f"not sampling fields: {sorted(unknown)}; expected some of {list(SAMPLING_FIELD_NAMES)}")

    def fields(self) -> dict[str, Any]:
        """The request's fields of the control map (``kind`` and ``id`` are the connection's)."""
        fields = {"session_id": self.session_id, "prompt": list(self.prompt), **self.sampling}
        if self.cache_salt is not None:
            fields["cache_salt"] = self.cache_salt
        return fields

    def sampling_fields(self) -> SamplingFields:
        """The sampling parameters as the worker will apply them (defaults filled in, validated)."""
        return SamplingFields.from_wire(dict(self.sampling))


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and its most likely alternatives (``top``: (id,
    logprob) pairs, most likely first), from the model's own distribution (transport/sampling.py)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @staticmethod
    def to_wire(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The ``token`` frame's fields for ``entries`` (one per token id of the frame)."""
        return {
            "logprobs": [e.logprob for e in entries],
            "top_ids": [[t for t, _ in e.top] for e in entries],
            "top_logprobs": [[lp for _, lp in e.top] for e in entries],
        }

    @staticmethod
    def from_wire(control: Mapping[str, Any]) -> list[TokenLogprob]:
        """The entries of a ``token`` frame (none when it carries no logprobs)."""
        lps = control.get("logprobs")
        if lps is None:
            return []
        ids, top_ids, top_lps = control["token_ids"], control["top_ids"], control["top_logprobs"]
        if not len(ids) == len(lps) == len(top_ids) == len(top_lps):
            raise ValueError("a token frame's logprobs do not match its token ids")
        return [
            TokenLogprob(t, float(lp), tuple(zip(ti, map(float, tl))))
            for t, lp, ti, tl in zip(ids, lps, top_ids, top_lps)
        ]


@dataclass(frozen=True)
class GenerationResult:
    """How a generation ended, as the engine reports it."""

    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    reused_prompt_tokens: int  # prompt tokens whose KV the session already held
    prefilled_prompt_tokens: int  # prompt tokens computed for this request
    completion_tokens: int
    generated_token_ids: list[int]
    prefill_time_s: float
    decode_time_s: float
    # Generated tokens the session's history kept: all of them, except after a stop-string cut
    # (only those whose text is visible) or a cancel during prefill (none).
    committed_tokens: int = 0
    draft_proposed_tokens: int = 0  # speculative decoding: tokens the draft proposed
    draft_accepted_tokens: int = 0  # of those, tokens the target accepted
    # Not a field of the done map: the client gathers them from the token frames (when asked for).
    logprobs: tuple[TokenLogprob, ...] | None = None

    @classmethod
    def cancelled_locally(cls) -> GenerationResult:
        """The result of a request cancelled before it was sent: the worker never saw it."""
        return cls("cancelled", 0, 0, 0, 0, [], 0.0, 0.0)

    @classmethod
    def from_wire(cls, result: dict, generated_token_ids: list[int]) -> GenerationResult:
        """From a ``done`` frame's result map: every field the worker sends (RESULT_FIELDS)."""
        missing = [name for name in RESULT_FIELDS if name not in result]
        if missing:
            raise ValueError(f"the result lacks {', '.join(missing)}")
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in RESULT_FIELDS and f.name != "generated_token_ids":
                kw[f.name] = _COERCE[str(f.type)](result[f.name])
        return cls(generated_token_ids=generated_token_ids, **kw)


_COERCE = {"str": str, "int": int, "float": float}

#: Every field of a ``done`` result, in GenerationResult's order; the engine builds exactly these
#: (a test checks both ends against this list).
RESULT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GenerationResult) if f.name != "logprobs")


@dataclass(frozen=True)
class ModelInfo:
    """The ``model`` map of the hello (the worker may send more keys; these are the ones read)."""

    name: str
    architecture: str
    vocab_size: int
    context_length: int
    has_chat_template: bool
    path: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # How the weights are held, by type: {"type", "held", "runs", "tensors", "nbytes"} each.
    weight_groups: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class WorkerInfo:
    """The worker's hello: protocol version, model, backend, device, dtype and engine limits."""

    protocol: tuple[int, int]
    model: ModelInfo
    backend: str
    device: str
    dtype: str
    limits: dict[str, Any] = field(default_factory=dict)
    readiness: str = "ready"  # at the hello; a 1.0 worker does not say, and sends its hello when ready
    weights: str = "float"  # "quantized", "int4", "int8" or "float"; a worker before 0.2 does not say
    # Whether the worker reads and writes checkpoint files passed over its file channel
    # (transport/fdpass.py); without it the client refuses checkpoint calls.
    files: bool = False

    @classmethod
    def from_hello(cls, hello: dict[str, Any]) -> WorkerInfo:
        m = hello["model"]
        try:
            model = ModelInfo(
                name=str(m["name"]),
                architecture=str(m["architecture"]),
                vocab_size=int(m["vocab_size"]),
                context_length=int(m["context_length"]),
                has_chat_template=bool(m["has_chat_template"]),
                path=m.get("path"),
                bos_token_id=m.get("bos_token_id"),
                eos_token_ids=tuple(m.get("eos_token_ids") or ()),
                weight_groups=tuple(dict(g) for g in m.get("weight_groups") or () if isinstance(g, dict)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"hello.model is malformed: {exc!r}") from None
        return cls(
            protocol=(hello["protocol"][0], hello["protocol"][1]),
            model=model,
            backend=hello["backend"],
            device=hello["device"],
            dtype=hello["dtype"],
            limits=dict(hello["limits"]),
            readiness=hello.get("readiness", "ready"),
            weights=hello.get("weights", "float"),
            files=bool(hello.get("files", False)),
        )


#: The typed class of every request kind but ``generate`` (GenerateRequest), by kind.
REQUESTS: dict[str, type[_Request]] = {
    cls.KIND: cls
    for cls in (
        OpenSession,
        CloseSession,
        ResetSession,
        ForkSession,
        CancelRequest,
        InfoRequest,
        TokenizeRequest,
        DetokenizeRequest,
        ChatTemplateRequest,
        SaveFileRequest,
        RestoreFileRequest,
    )
}
