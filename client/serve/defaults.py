"""What a request leaves out: the model's own generation defaults, then the server's flags, then
OpenAI's (temperature 1, no length limit but the context).

The model speaks first, as vLLM's ``--generation-config auto``: an HF directory's
``generation_config.json`` (``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, ``max_new_tokens``) and, for a converted GGUF, the source file's
``general.sampling.*`` metadata. The flags (``--default-max-tokens``, ``--default-temperature``, ...)
fill what the model does not say; ``--generation-config none`` leaves the model out.

A default ``max_tokens`` is a ceiling, never a reason to refuse: a request that sets ``max_tokens``
beyond the room its prompt leaves is refused (context_length_exceeded, as OpenAI's API does), but
one that leaves it out gets the default cut to that room (:func:`clamp`, once the prompt is
rendered). Sans-I/O but for :func:`model_defaults`, which reads the model's files once at start.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from muxworker.client.params import CheckedParams
from muxworker.transport.errors import InvalidArgument
from muxworker.transport.sampling import SamplingFields
from muxworker.worker.models.gguf_tensors import GGUF_LINK

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "FIELDS",
    "GenerationDefaults",
    "check_value",
    "clamp",
    "model_defaults",
]

log = logging.getLogger("muxworker.serve")

#: ``--default-max-tokens``: a request without ``max_tokens`` stops here (or at the context's end).
#: aider sends none, and with ``temperature: 0`` a small model loops until the context is full.
DEFAULT_MAX_TOKENS = 4096
#: The defaults a model or a flag may set: {field: its type}. The sampling ones keep their names
#: (transport/sampling.py); ``max_tokens`` is OpenAI's name for ``max_new_tokens``.
FIELDS: dict[str, type] = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
}
_SAMPLING = tuple(name for name in FIELDS if name != "max_tokens")
#: generation_config.json's names, as vLLM reads them (do_sample is not one: vLLM ignores it too).
_HF_KEYS = {"max_new_tokens": "max_tokens", **{name: name for name in _SAMPLING}}
#: A GGUF's general.sampling.* keys (llama.cpp's names).
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


@dataclass(frozen=True)
class GenerationDefaults:
    """The value of each field a request leaves out; None: nobody said (OpenAI's default then).
    ``origins`` says where each set one came from, for the startup log line."""

    max_tokens: int | None = None  # None: to the end of the session's context
    temperature: float | None = None  # None: OpenAI's 1
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    origins: Mapping[str, str] = field(default_factory=dict, compare=False)

    @classmethod
    def resolve(cls, *layers: tuple[str, Mapping[str, Any]]) -> GenerationDefaults:
        """The first layer (``(origin, {field: value})``, e.g. the model's, then the flags') that
        sets a field gives its value; None values say nothing. Raises ValueError for a bad value."""
        values: dict[str, Any] = {}
        origins: dict[str, str] = {}
        for origin, layer in layers:
            for name, value in layer.items():
                if name not in FIELDS:
                    raise ValueError(f"{name} is not a generation default (one of {', '.join(FIELDS)})")
                if value is None or name in values:
                    continue
                values[name] = check_value(name, value)
                origins[name] = origin
        return cls(**values, origins=origins)

    def fill(self, sampling: dict[str, Any]) -> dict[str, Any]:
        """``sampling`` (the fields a request gave) with the defaults of those it left out, and
        OpenAI's temperature 1 where nobody said (muxworker's own default is greedy)."""
        for name in _SAMPLING:
            value = getattr(self, name)
            if name not in sampling and value is not None:
                sampling[name] = value
        sampling.setdefault("temperature", 1.0)
        return sampling

    def describe(self) -> str:
        """One line for the log: each default and where it came from."""
        said = [f"{n} {getattr(self, n)} ({self.origins.get(n, '?')})" for n in FIELDS if getattr(self, n) is not None]
        return ", ".join(said) or "OpenAI's"


def check_value(name: str, value: Any) -> int | float:
    """``value`` as the field ``name`` takes it (an integral float for an int field is accepted, as
    JSON writers give them); ValueError naming the range otherwise."""
    kind = FIELDS[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if kind is int:
        if value != int(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        value = int(value)
    else:
        value = float(value)
    if name == "max_tokens":
        if value < 1:
            raise ValueError(f"max_tokens must be at least 1, got {value}")
        return value
    try:
        SamplingFields(**{name: value}).validate()  # the one definition of the ranges
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None
    return value


def model_defaults(model_dir: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """The model's own defaults, as layers for :meth:`GenerationDefaults.resolve`: its
    generation_config.json, then (a converted GGUF) the source file's ``general.sampling.*``.
    A value out of range is left out with a warning: a model file does not stop the server."""
    model_dir = Path(model_dir)
    layers: list[tuple[str, dict[str, Any]]] = []
    config_file = model_dir / "generation_config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            log.warning("ignoring %s: %s", config_file, exc)
            config = None
        if isinstance(config, dict):
            layers.append(("generation_config.json", _checked(config, _HF_KEYS, config_file.name)))
    gguf_file = model_dir / GGUF_LINK
    if gguf_file.is_file():
        layers.append(("the GGUF's general.sampling", _checked(_gguf_sampling(gguf_file), _GGUF_KEYS, "the GGUF")))
    return layers


def _checked(source: Mapping[str, Any], keys: Mapping[str, str], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, name in keys.items():
        if source.get(key) is None:
            continue
        try:
            out[name] = check_value(name, source[key])
        except ValueError as exc:
            log.warning("ignoring %s's %s: %s", where, key, exc)
    return out


def _gguf_sampling(path: Path) -> dict[str, Any]:
    """The ``general.sampling.*`` fields of a GGUF file (float32 there: 0.7 reads 0.699999988,
    so floats are rounded to float32's 7 significant digits).

    Read by walking the header's key-value pairs and skipping every other value by its size:
    ``gguf.GGUFReader`` builds a numpy view of every field, which takes 1.5 s for a 49k-token
    vocabulary, at every server start."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            with memoryview(buf) as view:
                return _scan_gguf_kv(view, set(_GGUF_KEYS))
    except (OSError, ValueError, struct.error) as exc:
        log.warning("reading %s's sampling metadata: %s", path, exc)
        return {}


#: GGUF value types (gguf's GGUFValueType) of a fixed size: struct format.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _scan_gguf_kv(buf: memoryview, wanted: set[str]) -> dict[str, Any]:
    """The values of the ``wanted`` keys among a little-endian GGUF file's metadata."""
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("not a GGUF file")
    (n_kv,) = struct.unpack_from("<Q", buf, 16)
    pos, out = 24, {}

    def string(pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", "replace"), pos + 8 + n

    def skip(kind: int, pos: int, count: int = 1) -> int:
        if kind in _GGUF_SCALARS:
            return pos + count * struct.calcsize(_GGUF_SCALARS[kind])
        if kind == _GGUF_STRING:
            for _ in range(count):
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            return pos
        if kind == _GGUF_ARRAY:
            for _ in range(count):
                inner, n = struct.unpack_from("<IQ", buf, pos)
                pos = skip(inner, pos + 12, n)
            return pos
        raise ValueError(f"unknown GGUF value type {kind}")

    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key in wanted and kind in _GGUF_SCALARS:
            (value,) = struct.unpack_from("<" + _GGUF_SCALARS[kind], buf, pos)
            out[key] = float(f"{value:.7g}") if isinstance(value, float) else value
        pos = skip(kind, pos)
    return out


def clamp(params: CheckedParams, prompt_tokens: int | None, max_session_tokens: int | None) -> CheckedParams:
    """``params`` of a request whose ``max_tokens`` is a default, cut to the room its prompt of
    ``prompt_tokens`` leaves in a session of ``max_session_tokens`` (the engine refuses a prompt
    plus max_new_tokens beyond it). An unknown size, or a prompt that fills the session (which the
    worker refuses with its own error), leaves it to the end of the context (-1)."""
    wanted = params.fields.get("max_new_tokens", -1)
    if max_session_tokens is None or wanted == -1:
        return params
    room = max_session_tokens - prompt_tokens if prompt_tokens is not None else 0
    if room >= wanted:
        return params
    return CheckedParams(params.session_id, {**params.fields, "max_new_tokens": room if room >= 1 else -1})
