"""What a generation asks for (``GenerationParams``) and what it returns (``GenerationResult``)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

from muxworker.transport.errors import InvalidArgument

__all__ = ["GenerationParams", "GenerationResult", "ChatPrompt", "WorkerInfo", "ModelInfo"]


@dataclass
class GenerationParams:
    """Sampling parameters of one generation. Any object with these attributes works as well
    (``types.SimpleNamespace(session_id=..., max_new_tokens=...)``); missing ones take these defaults,
    which are the worker's own."""

    session_id: str
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] | None = None  # None: the model's EOS tokens


_INT_FIELDS = ("max_new_tokens", "top_k")
_FLOAT_FIELDS = ("temperature", "top_p")


def params_to_wire(params: Any) -> tuple[str, dict[str, Any]]:
    """``(session_id, generate fields)`` of a params object. Only attributes present are sent, so
    the worker's defaults apply to the rest; types are normalized (numpy scalars, tuples), values
    are checked by the worker."""
    try:
        session_id = params.session_id
    except AttributeError:
        raise InvalidArgument(f"generation params need a session_id attribute ({type(params).__name__} has none)") from None
    fields: dict[str, Any] = {}
    for name in _INT_FIELDS:
        value = getattr(params, name, None)
        if value is not None:
            fields[name] = int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value
    for name in _FLOAT_FIELDS:
        value = getattr(params, name, None)
        if value is not None:
            fields[name] = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else value
    seed = getattr(params, "seed", None)
    if seed is not None:
        fields["seed"] = int(seed) if isinstance(seed, numbers.Integral) and not isinstance(seed, bool) else seed
    stop = getattr(params, "stop", None)
    if stop is not None:
        fields["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if hasattr(params, "stop_token_ids"):
        ids = params.stop_token_ids
        fields["stop_token_ids"] = None if ids is None else [
            int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in ids
        ]
    return session_id, fields


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

    @classmethod
    def cancelled_locally(cls) -> GenerationResult:
        """The result of a request cancelled before it was sent: the worker never saw it."""
        return cls("cancelled", 0, 0, 0, 0, [], 0.0, 0.0)


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
        )
