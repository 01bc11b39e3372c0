"""What a generation asks for (``GenerationParams``) and what it returns (``GenerationResult``)."""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from muxworker.transport.errors import InvalidArgument
from muxworker.transport.sampling import SamplingFields

_D = SamplingFields()  # the one definition of every sampling default (transport/sampling.py)

__all__ = ["GenerationParams", "GenerationResult", "ChatPrompt", "WorkerInfo", "ModelInfo"]


@dataclass
class GenerationParams:
    """Sampling parameters of one generation. Any object with these attributes works as well
    (``types.SimpleNamespace(session_id=..., max_new_tokens=...)``); missing ones take these defaults,
    which are the worker's own (both come from transport/sampling.py, where the ranges and the
    meaning of each field are documented)."""

    session_id: str
    max_new_tokens: int = _D.max_new_tokens
    temperature: float = _D.temperature  # below TEMPERATURE_FLOOR (1e-5): greedy
    top_p: float = _D.top_p
    top_k: int = _D.top_k  # 0: no top-k filter
    min_p: float = _D.min_p  # 0: no min-p filter
    repetition_penalty: float = _D.repetition_penalty  # 1: off
    presence_penalty: float = _D.presence_penalty  # 0: off
    frequency_penalty: float = _D.frequency_penalty  # 0: off
    seed: int | None = _D.seed
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] | None = _D.stop_token_ids  # None: the model's EOS tokens


_INT_FIELDS = ("max_new_tokens", "top_k")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def params_to_wire(params: Any) -> tuple[str, dict[str, Any]]:
    """``(session_id, generate fields)`` of a params object. Only attributes present are sent, so
    the worker's defaults apply to the rest; types are normalized (numpy scalars, tuples) and
    checked here, raising :class:`InvalidArgument` naming the field; value ranges are the worker's."""
    try:
        session_id = params.session_id
    except AttributeError:
        raise InvalidArgument(f"generation params need a session_id attribute ({type(params).__name__} has none)") from None
    fields: dict[str, Any] = {}
    for name in _INT_FIELDS:
        value = getattr(params, name, None)
        if value is not None:
            fields[name] = _int(name, value)
    for name in _FLOAT_FIELDS:
        value = getattr(params, name, None)
        if value is not None:
            fields[name] = _float(name, value)
    seed = getattr(params, "seed", None)
    if seed is not None:
        fields["seed"] = _int("seed", seed)
    stop = getattr(params, "stop", None)
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise InvalidArgument(f"stop must be a str or a list of str, got {stop!r:.200}")
        fields["stop"] = [str(s) for s in stop]
    if hasattr(params, "stop_token_ids"):
        ids = params.stop_token_ids
        if ids is not None:
            if isinstance(ids, np.ndarray):
                ids = ids.tolist() if ids.ndim == 1 else ids
            if not isinstance(ids, (list, tuple)):
                raise InvalidArgument(f"stop_token_ids must be a list of int or None, got {ids!r:.200}")
            ids = [_int("stop_token_ids", t) for t in ids]
        fields["stop_token_ids"] = ids
    return session_id, fields


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgument(f"{name} must be an int, got {value!r:.200}")
    return int(value)


def _float(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{name} must be a number, got {value!r:.200}")
    try:
        number = float(value)
    except (OverflowError, ValueError):  # an int too large for a float, an odd Real subclass
        raise InvalidArgument(f"{name} must be a finite number, got {value!r:.200}") from None
    if not math.isfinite(number):
        raise InvalidArgument(f"{name} must be a finite number, got {value!r:.200}")
    return number


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
            if f.name != "generated_token_ids":
                kw[f.name] = _COERCE[str(f.type)](result[f.name])
        return cls(generated_token_ids=generated_token_ids, **kw)


_COERCE = {"str": str, "int": int, "float": float}

# Every field of a ``done`` result, in GenerationResult's order; the engine builds exactly these
# (a test checks both ends against this list).
RESULT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GenerationResult))


class ChatPrompt(tuple):
    """``(text, token_ids)`` of a rendered chat template; unpacks like a pair."""

    __slots__ = ()

    def __new__(cls, text: str, token_ids: list[int]) -> ChatPrompt:
        return super().__new__(cls, (text, token_ids))

    @property
    def text(self) -> str:
        return self[0]

    @property
    def token_ids(self) -> list[int]:
        return self[1]


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    vocab_size: int
    context_length: int
    has_chat_template: bool
    path: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()


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
            )
        except (KeyError, TypeError, ValueError) as exc:
            from muxworker.transport.errors import ProtocolError

            raise ProtocolError(f"hello.model is malformed: {exc!r}") from None
        return cls(
            protocol=(hello["protocol"][0], hello["protocol"][1]),
            model=model,
            backend=hello["backend"],
            device=hello["device"],
            dtype=hello["dtype"],
            limits=dict(hello["limits"]),
            readiness=hello.get("readiness", "ready"),
        )
