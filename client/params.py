"""What a generation asks for (``GenerationParams``) and the client's view of the replies.

``GenerationResult``, ``RESULT_FIELDS``, ``WorkerInfo`` and ``ModelInfo`` are defined once in
:mod:`muxworker.transport.messages`, the contract both ends share, and re-exported here.
``RuntimeGenerationResult`` is a ``GenerationResult`` with what only the client side knows (whether
a :class:`~.runtime.SessionRuntime` resumed the session from its store first)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from muxworker.transport.errors import InvalidArgument
from muxworker.transport.messages import RESULT_FIELDS, GenerationResult, ModelInfo, TokenLogprob, WorkerInfo
from muxworker.transport.sampling import SamplingFields, check_constraint

_D = SamplingFields()  # the one definition of every sampling default (transport/sampling.py)

__all__ = [
    "GenerationParams",
    "CheckedParams",
    "check_params",
    "GenerationResult",
    "RuntimeGenerationResult",
    "RESULT_FIELDS",
    "TokenLogprob",
    "ChatPrompt",
    "WorkerInfo",
    "ModelInfo",
]


@dataclass
class GenerationParams:
    """Sampling parameters of one generation, and its prefix-cache salt. Any object with these
    attributes works as well (``types.SimpleNamespace(session_id=..., max_new_tokens=...)``); missing
    ones take these defaults, which are the worker's own (the sampling ones come from
    transport/sampling.py, where the ranges and the meaning of each field are documented)."""

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
    # None: free text; else one of {"json_schema": {...}}, {"json_object": True}, {"regex": "..."},
    # {"lark": "..."}, {"gbnf": "..."}: every token is one the grammar allows (transport/sampling.py).
    constraint: Mapping[str, Any] | None = _D.constraint
    # None: none; k in 0..20: each token's logprob and the k most likely tokens' (GenerationResult.logprobs)
    logprobs: int | None = _D.logprobs
    # Not a sampling field: scopes prefix-cache reuse to requests with the same salt (a tenant's
    # name); None is the shared namespace.
    cache_salt: str | None = None


@dataclass(frozen=True, eq=False)
class RuntimeGenerationResult(GenerationResult):
    """A :class:`GenerationResult` as :class:`~.runtime.SessionRuntime` returns it.

    ``resumed_from_store``: the runtime had evicted the session to the client's store (its
    ``evict_idle_to_store`` policy) and resumed it from its file before this generation ran; the
    tokens the file gave back are in ``reused_prompt_tokens``, as for any reuse. False otherwise,
    including when an evicted session had nothing to save and was reopened empty.

    Not a wire field (the worker never sends it, so it is not in ``RESULT_FIELDS``). A result that
    is not resumed equals the plain ``GenerationResult`` with the same fields, so comparing with
    ``GenerationResult.cancelled_locally()`` works as before.
    """

    resumed_from_store: bool = False

    @classmethod
    def of(cls, result: GenerationResult, *, resumed_from_store: bool = False) -> RuntimeGenerationResult:
        """``result`` with ``resumed_from_store`` set."""
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(GenerationResult)}
        return cls(**fields, resumed_from_store=resumed_from_store)

    @classmethod
    def from_wire(cls, result: dict, generated_token_ids: list[int]) -> RuntimeGenerationResult:
        return cls.of(GenerationResult.from_wire(result, generated_token_ids))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GenerationResult):
            return NotImplemented
        return _compared(self) == _compared(other)

    # Equal results have equal base fields, so the base hash stays consistent with __eq__.
    __hash__ = GenerationResult.__hash__


def _compared(result: GenerationResult) -> tuple[Any, ...]:
    base = tuple(getattr(result, f.name) for f in dataclasses.fields(GenerationResult))
    return (*base, getattr(result, "resumed_from_store", False))


_INT_FIELDS = ("max_new_tokens", "top_k", "logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class CheckedParams:
    """Generation parameters checked once, where they entered (:func:`check_params`): the
    session id and the ``generate`` fields to send (sampling fields and ``cache_salt``). Every
    later layer (the runtime, the client) passes it on as it is; the worker checks the ranges of
    what arrives on its wire (transport/sampling.py), as it must for any peer."""

    session_id: str
    fields: Mapping[str, Any]

    def for_session(self, session_id: str, cache_salt: str | None = None) -> CheckedParams:
        """The same parameters for ``session_id`` (and, when given, that prefix-cache salt)."""
        fields = dict(self.fields)
        if cache_salt is not None:
            fields["cache_salt"] = cache_salt
        return CheckedParams(session_id, fields)


def check_params(params: Any) -> CheckedParams:
    """A params object (:class:`GenerationParams` or any object with its attributes), checked:
    only attributes present are sent, so the worker's defaults apply to the rest; types are
    normalized (numpy scalars, tuples) and checked, raising :class:`InvalidArgument` naming the
    field. A :class:`CheckedParams` is returned as it is."""
    if isinstance(params, CheckedParams):
        return params
    try:
        session_id = params.session_id
    except AttributeError:
        raise InvalidArgument(
            f"generation params need a session_id attribute ({type(params).__name__} has none)"
        ) from None
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
    constraint = getattr(params, "constraint", None)
    if constraint is not None:
        constraint = dict(constraint) if isinstance(constraint, Mapping) else constraint
        check_constraint(constraint)
        fields["constraint"] = constraint
    salt = getattr(params, "cache_salt", None)
    if salt is not None:
        if not isinstance(salt, str):
            raise InvalidArgument(f"cache_salt must be a str or None, got {salt!r:.200}")
        fields["cache_salt"] = salt
    return CheckedParams(session_id, fields)


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
