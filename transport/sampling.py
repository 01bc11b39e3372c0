"""The sampling fields of a ``generate`` request: names, defaults and valid ranges, defined once.

Both ends use this one definition: the worker's ``SamplingParams`` is this dataclass, the client's
``GenerationParams`` takes its defaults from it, and the schema's ``generate`` entry lists exactly
these fields (a test checks all three agree). Adding a sampling knob means one field here, its check
in :meth:`SamplingFields.validate`, the engine's use of it, and a line in docs/PROTOCOL.md.

Rules a caller can rely on:

- ``temperature`` below :data:`TEMPERATURE_FLOOR` (including 0) is greedy: dividing logits by a tiny
  positive temperature overflows to inf and NaN, so such values are treated as the limit they
  approach (the argmax), as vLLM does.
- Penalties follow the conventions clients already use: ``repetition_penalty`` (Hugging Face/vLLM,
  > 0, 1 = off) divides positive and multiplies negative logits of every token seen in the prompt or
  the output; ``presence_penalty`` and ``frequency_penalty`` (OpenAI, in [-2, 2], 0 = off) subtract
  from the logits of tokens already generated, once and per occurrence.
- ``min_p`` (in [0, 1], 0 = off) drops tokens whose probability is below ``min_p`` times the most
  likely token's, after temperature.
- ``constraint`` (None = free text) restricts every generated token to those a grammar allows, and
  ends the output (``finish_reason`` "stop") once the grammar is complete. A map with exactly one of
  :data:`CONSTRAINT_KINDS`: ``{"json_schema": {...}}`` (a JSON Schema), ``{"json_object": true}``
  (any JSON object), ``{"regex": "..."}``, ``{"lark": "..."}`` (llguidance's Lark dialect) or
  ``{"gbnf": "..."}`` (llama.cpp's GBNF). At most :data:`MAX_CONSTRAINT_BYTES` as JSON; the worker
  compiles it against its tokenizer before any work and refuses a schema or grammar it cannot
  compile (``invalid_argument``). The mask applies after penalties and before temperature, top-k,
  top-p and min-p, to greedy and sampled requests alike (worker/engine/constraints.py).
- ``logprobs`` (None = none; k in 0..:data:`MAX_LOGPROBS`) returns with every generated token its
  log-probability and the k most likely tokens with theirs, from the model's own distribution:
  ``log_softmax`` of the raw logits, before penalties, the constraint's mask, temperature and the
  filters (vLLM's default), so they do not depend on how the token was picked.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import InvalidArgument

__all__ = [
    "SamplingFields",
    "TEMPERATURE_FLOOR",
    "MAX_STOP_STRINGS",
    "MAX_STOP_TOKEN_IDS",
    "SAMPLING_FIELD_NAMES",
    "CONSTRAINT_KINDS",
    "MAX_CONSTRAINT_BYTES",
    "check_constraint",
    "MAX_LOGPROBS",
    "MAX_NEW_TOKENS",
    "MAX_TOP_K",
    "MAX_SEED",
    "MAX_TOKEN_ID",
    "SamplingFieldError",
    "JSON_LAYOUT",
    "bounded_schema",
    "rebased_schema",
    "ref_cycle",
]

TEMPERATURE_FLOOR = 1e-5  # below this a temperature is greedy
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty, as OpenAI's API bounds them
MAX_REPETITION_PENALTY = 100.0  # beyond this every seen token is effectively banned; refuse absurd values
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs allows
# Integers go to the worker as msgpack and to the engine as 32-bit or 64-bit values: bounded here,
# so a huge one is a clear error naming its field rather than an encoding error.
MAX_NEW_TOKENS = 2**31 - 1
MAX_TOP_K = 2**31 - 1  # any value at or past the vocabulary's size filters nothing
MAX_SEED = 2**63  # exclusive: a seed is an int64 to the engine's generator
MAX_TOKEN_ID = 2**31 - 1  # a prompt's or a stop token's id, before the worker checks its vocabulary
#: How constrained JSON is laid out (llguidance's options): on one line, ``{"a": 1, "b": [true]}``.
#: Flexible whitespace is an ignored lexeme that may repeat without bound, and a small model then
#: loops on blank lines until max_tokens. The one layout, so what a grammar made a model write is
#: what ``json.dumps`` writes back (the server's tool calls rely on that).
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: An integer a schema leaves unbounded is held to JavaScript's safe range (16 digits), as
#: llama.cpp's JSON grammars bound them: a small model otherwise writes ``1111...`` until
#: max_tokens. What is produced still validates against the schema as given.
SAFE_INTEGER = 2**53 - 1
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "unevaluatedProperties")


def bounded_schema(schema: Any) -> Any:
    """``schema`` with every unbounded integer held to +-:data:`SAFE_INTEGER` (a copy)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    kind = out.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_schema(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_schema(sub) for sub in out[key]]
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = bounded_schema(out[key])
    return out


def rebased_schema(schema: Any, base: str) -> Any:
    """``schema`` (a copy) moved to the JSON pointer ``base`` of a larger schema (``#/$defs/t0``):
    its local references (``#``, ``#/$defs/x``) rewritten to point where it now lies. Only schema
    positions are walked, so a ``const``, ``enum`` or ``default`` value is left as written."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: rebased_schema(sub, base) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [rebased_schema(sub, base) for sub in out[key]]
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = rebased_schema(out[key], base)
    return out


def _pointed(root: Any, ref: str) -> Any:
    """What the local reference ``ref`` (``#``, ``#/$defs/a``) points at in ``root``; None: nothing."""
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def ref_cycle(schema: Any) -> str | None:
    """A local reference of ``schema`` that leads only to references and back to itself
    (``{"$ref": "#"}``, or ``a`` -> ``b`` -> ``a`` in ``$defs``): a schema that allows no value,
    which a grammar compiler may take for any value. None when there is none."""
    stack, seen_nodes = [schema], 0
    while stack and seen_nodes < 100_000:
        node = stack.pop()
        seen_nodes += 1
        if not isinstance(node, dict):
            continue
        ref, hops, chain = node.get("$ref"), node, []
        while isinstance(ref, str) and ref.startswith("#") and set(hops) == {"$ref"}:
            if ref in chain:
                return ref
            chain.append(ref)
            hops = _pointed(schema, ref)
            ref = hops.get("$ref") if isinstance(hops, dict) else None
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        stack.extend(node[key] for key in _SUBSCHEMAS if key in node)
    return None


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")
MAX_CONSTRAINT_BYTES = 256 * 1024  # a large tool set's schemas fit; a grammar's size bounds its compile


class SamplingFieldError(InvalidArgument):
    """A sampling field out of range; ``field`` names it (the HTTP server's ``param``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past a float's range
        return False


def _shown(value: object, limit: int = 60) -> str:
    """``value`` in a message, bounded (str() of a 5,000-digit integer raises; say its size)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**limit:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class SamplingFields:
    """What a generation asks for. Validated by :meth:`validate` before any work."""

    max_new_tokens: int = 256  # -1: the rest of the session's context
    temperature: float = 0.0  # below TEMPERATURE_FLOOR: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    min_p: float = 0.0  # 0: no min-p filter
    repetition_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0  # 0: off
    frequency_penalty: float = 0.0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] | None = None  # None: the model's EOS tokens
    constraint: dict[str, Any] | None = None  # None: free text; else one of CONSTRAINT_KINDS
    logprobs: int | None = None  # None: none; k: each token's logprob and the k most likely tokens'

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (they then depend on the tokens before each position)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def from_wire(cls, control: dict[str, Any]) -> SamplingFields:
        kw = {k: control[k] for k in SAMPLING_FIELD_NAMES if k in control}
        if kw.get("stop") is None:
            kw.pop("stop", None)
        params = cls(**kw)
        params.validate()
        return params

    def validate(self, vocab_size: int | None = None, *, constraint: bool = True) -> None:
        """Raise :class:`InvalidArgument` naming the first field that is out of range.
        ``constraint=False``: the constraint was checked already (its size check encodes it)."""
        bad = SamplingFieldError
        if not _is_int(self.max_new_tokens) or not (
            1 <= self.max_new_tokens <= MAX_NEW_TOKENS or self.max_new_tokens == -1
        ):
            raise bad(
                "max_new_tokens",
                f"max_new_tokens must be an integer in [1, {MAX_NEW_TOKENS}] or -1, got {_shown(self.max_new_tokens)}",
            )
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"temperature must be a finite number >= 0, got {_shown(self.temperature)}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"top_p must be in (0, 1], got {_shown(self.top_p)}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise bad("top_k", f"top_k must be an integer in [0, {MAX_TOP_K}] (0 = off), got {_shown(self.top_k)}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"min_p must be in [0, 1], got {_shown(self.min_p)}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise bad(
                "repetition_penalty",
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), "
                f"got {_shown(self.repetition_penalty)}",
            )
        lo, hi = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not lo <= value <= hi:
                raise bad(name, f"{name} must be in [{lo:g}, {hi:g}] (0 = off), got {_shown(value)}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise bad("seed", f"seed must be an integer in [0, 2**63) or None, got {_shown(self.seed)}")
        if (
            not isinstance(self.stop, (list, tuple))
            or len(self.stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop)
        ):
            raise bad(
                "stop",
                f"stop must be a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
                f"{MAX_STOP_STRING_CHARS} characters, got {self.stop!r:.200}",
            )
        if self.stop_token_ids is not None:
            if (
                not isinstance(self.stop_token_ids, (list, tuple))
                or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
                or not all(_is_int(t) for t in self.stop_token_ids)
            ):
                raise bad(
                    "stop_token_ids",
                    f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} integers, "
                    f"got {self.stop_token_ids!r:.200}",
                )
            limit = MAX_TOKEN_ID + 1 if vocab_size is None else vocab_size
            if any(not 0 <= t < limit for t in self.stop_token_ids):
                raise bad("stop_token_ids", f"stop_token_ids must lie in [0, {limit})")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad(
                "logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {_shown(self.logprobs)}"
            )
        if constraint and self.constraint is not None:
            check_constraint(self.constraint)


def check_constraint(constraint: object) -> None:
    """Raise :class:`InvalidArgument` unless ``constraint`` has the shape the module docstring gives
    (what its schema or grammar says is checked by the compiler)."""
    if not isinstance(constraint, dict) or len(constraint) != 1 or next(iter(constraint)) not in CONSTRAINT_KINDS:
        raise SamplingFieldError(
            "constraint",
            f"constraint must be a map with exactly one of {', '.join(CONSTRAINT_KINDS)}, got {constraint!r:.200}",
        )
    (kind, value), *_ = constraint.items()
    if kind == "json_schema" and not isinstance(value, dict):
        raise SamplingFieldError(
            "constraint", f"constraint.json_schema must be a JSON Schema object, got {value!r:.200}"
        )
    if kind == "json_object" and value is not True:
        raise SamplingFieldError("constraint", f"constraint.json_object must be true, got {value!r:.200}")
    if kind in ("regex", "lark", "gbnf") and (not isinstance(value, str) or not value):
        raise SamplingFieldError("constraint", f"constraint.{kind} must be a non-empty string, got {value!r:.200}")
    try:
        size = len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise SamplingFieldError("constraint", f"constraint.{kind} is not JSON: {type(exc).__name__}: {exc}") from None
    if size > MAX_CONSTRAINT_BYTES:
        raise SamplingFieldError(
            "constraint", f"constraint.{kind} is {size} bytes as JSON; at most {MAX_CONSTRAINT_BYTES} are allowed"
        )


SAMPLING_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(SamplingFields))
