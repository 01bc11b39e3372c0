"""Constrained decoding: a request's ``constraint`` (transport/sampling.py) compiled into a grammar
matcher over the model's own tokenizer, and the per-step token masks it allows.

The grammar engine is llguidance (the one llama.cpp, vLLM and SGLang use): a JSON schema, any JSON
object, a regular expression, a Lark grammar or a llama.cpp GBNF grammar becomes an Earley parser
whose lexer runs over the tokenizer's token trie, so a mask over the whole vocabulary costs tens of
microseconds for typical schemas.

Who calls what, and on which thread:

- :meth:`GrammarCompiler.compile` builds a :class:`Guide` for one request. It is bounded in size
  (``MAX_CONSTRAINT_BYTES``, checked by the sampling contract) and in work (:data:`LIMITS`: lexer
  fuel, Earley items per step, grammar symbols), and releases the GIL while it runs. The worker calls
  it on its reader thread, never on the engine thread; an in-process engine compiles in ``submit``.
  Compiled grammars are cached by their constraint's text (a hash of it; least recently used out),
  so a tool set an agent resends every turn is compiled once: the next requests copy the matcher.
- :func:`fill_masks` computes the next mask of every guided request of a batch at once (llguidance's
  executor, several threads, the GIL released). The engine starts it on a helper thread before the
  forward pass and waits for it after, so the masks are off the critical path.
- :meth:`Guide.allowed` turns a mask into a bool tensor [V] on the logits' device for ``sample``;
  :meth:`Guide.consume` advances the parser by the sampled token. A token the mask allowed is always
  accepted; when the grammar is complete (:attr:`Guide.done`), the request ends with ``stop``.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from copy import copy
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from muxworker.transport.errors import InvalidArgument
from muxworker.transport.sampling import JSON_LAYOUT, bounded_schema

if TYPE_CHECKING:
    import llguidance
    import torch
    from llguidance._lib import JsonCompileOptions

    from muxworker.worker.models.tokenizer import Tokenizer

__all__ = ["GrammarCompiler", "Guide", "fill_masks"]


def _limits() -> llguidance.LLParserLimits:
    import llguidance

    # llguidance's defaults, with the per-step work capped lower: a mask step stays within a few
    # milliseconds whatever the grammar (its docs: ~14k fuel/ms, ~20k items/ms), and building the
    # lexer within about 100 ms.
    return llguidance.LLParserLimits(
        initial_lexer_fuel=5_000_000,
        step_lexer_fuel=100_000,
        step_max_items=40_000,
        max_grammar_size=200_000,
        verbose_errors=False,
    )


class GrammarCompiler:
    """Compiles constraints against one model's tokenizer (thread-safe; the tokenizer is converted
    once, on first use, which takes about a second)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._lltok: llguidance.LLTokenizer | None = None
        self._limits: llguidance.LLParserLimits | None = None
        # Compiled grammars by the hash of their constraint's text: agents resend the same tool
        # schemas (often tens of KB) every turn, and a compile costs tens of milliseconds where a
        # copy of the compiled matcher costs a fraction of one. A pristine matcher (never advanced)
        # or the error its constraint got; least recently used first.
        self._cache: OrderedDict[bytes, tuple[llguidance.LLMatcher | str, int]] = OrderedDict()
        self._cache_bytes = 0
        self._cache_lock = threading.Lock()

    def _ll(self) -> tuple[llguidance.LLTokenizer, llguidance.LLParserLimits]:
        with self._lock:
            if self._lltok is None:
                import llguidance

                backend = copy(self._tokenizer.backend)
                backend.no_padding()
                backend.no_truncation()
                self._lltok = llguidance.LLTokenizer(
                    backend.to_str(), n_vocab=self._vocab_size, eos_token=self._eos or None
                )
                self._limits = _limits()
            assert self._limits is not None
            return self._lltok, self._limits

    def compile(self, constraint: dict[str, Any]) -> Guide:
        """A :class:`Guide` for ``constraint`` (already checked by ``SamplingFields.validate``);
        raises :class:`InvalidArgument` naming what is wrong with a schema, pattern or grammar.
        A constraint compiled before (the same text: key order counts, as it orders a schema's
        properties) is a copy of its cached matcher."""
        # ASCII escapes: a lone surrogate in a string cannot be encoded otherwise.
        text = json.dumps(constraint, separators=(",", ":")).encode()
        key = hashlib.sha256(text).digest()
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            try:
                compiled: llguidance.LLMatcher | str = self._compile(constraint)
            except InvalidArgument as exc:
                compiled = exc.message
            hit = (compiled, len(text))
            self._remember(key, hit)
        compiled = hit[0]
        if isinstance(compiled, str):
            raise InvalidArgument(compiled)
        return Guide(compiled.deep_copy(), self._vocab_size)

    def _remember(self, key: bytes, entry: tuple[llguidance.LLMatcher | str, int]) -> None:
        with self._cache_lock:
            if key in self._cache:
                return
            self._cache[key] = entry
            self._cache_bytes += entry[1]
            while len(self._cache) > 1 and (
                len(self._cache) > GRAMMAR_CACHE_ENTRIES or self._cache_bytes > GRAMMAR_CACHE_BYTES
            ):
                _, (_, size) = self._cache.popitem(last=False)
                self._cache_bytes -= size

    @property
    def cached(self) -> int:
        """How many constraints have a compiled grammar (or their error) cached."""
        return len(self._cache)

    def _compile(self, constraint: dict[str, Any]) -> llguidance.LLMatcher:
        """A fresh matcher for ``constraint`` (see :meth:`compile`)."""
        import llguidance

        lltok, limits = self._ll()
        (kind, value), *_ = constraint.items()
        try:
            if kind in ("json_schema", "json_object"):
                schema = bounded_schema(value) if kind == "json_schema" else {"type": "object"}
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema, defaults=cast("JsonCompileOptions", JSON_LAYOUT)
                )
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(value)
            elif kind == "lark":
                grammar = llguidance.LLMatcher.grammar_from_lark(value)
            else:  # gbnf
                from llguidance.gbnf_to_lark import gbnf_to_lark

                grammar = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(value))
        except (ValueError, TypeError) as exc:
            raise InvalidArgument(f"constraint.{kind} is not valid: {_first_line(exc)}") from None
        except Exception as exc:  # the GBNF converter raises its own errors
            raise InvalidArgument(f"constraint.{kind} is not valid: {type(exc).__name__}: {_first_line(exc)}") from None
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise InvalidArgument(f"constraint.{kind} is not valid: {_first_line(matcher.get_error())}")
        return matcher

    def check(self, constraint: dict[str, Any]) -> None:
        """Raise :class:`InvalidArgument` unless ``constraint`` compiles and its grammar can start:
        what the HTTP server runs before it admits a request (off its event loop; the GIL is
        released), so a schema the engine could not follow is a 400, not an error mid-stream.
        Beyond :meth:`compile`: the first mask (a schema that only refers to itself allows no
        value) and the bytes forced before the model chooses any (a required property or item
        that refers back to its own schema forces ``{"a": {"a": ...`` without end). Bytes, not
        tokens: llguidance finds them with the mask (tens of milliseconds where tokenizing them
        takes most of a second)."""
        guide = self.compile(constraint)
        kind = next(iter(constraint))
        guide.fill()
        if guide.error is None:
            forced = guide.matcher.compute_ff_bytes()
            if guide.error is None and len(forced) >= MAX_FORCED_BYTES:
                raise InvalidArgument(
                    f"constraint.{kind} forces {len(forced)} or more bytes before the model may choose any: "
                    "it has no finite value (does a required property or item refer back to its own schema?)"
                )
        if guide.error is not None:
            raise InvalidArgument(
                f"constraint.{kind} cannot be followed: {guide.error} (a schema that only refers to itself "
                "allows no value)"
            )


#: The grammar cache of one compiler: at most this many constraints, and this many bytes of their
#: text together (a compiled matcher takes several times its text; one larger than the bound is
#: still kept, alone, until the next).
GRAMMAR_CACHE_ENTRIES = 64
GRAMMAR_CACHE_BYTES = 16 * 2**20

#: More bytes than any real schema forces at its start (a long ``const`` included): a grammar that
#: forces as many has no end (llguidance stops looking past some 60 KB), and its parser gives up
#: on it mid-generation.
MAX_FORCED_BYTES = 16 * 1024


def _first_line(message: object) -> str:
    """The start of an error message (at most three lines, 500 characters)."""
    lines = [line.strip() for line in str(message).strip().splitlines() if line.strip() not in ("", "<non-verbose/>")]
    return " / ".join(lines[:3])[:500] or "(no detail)"


class Guide:
    """One request's grammar state: the matcher and the mask of the next token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.mask = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)
        self.fresh = False  # whether ``mask`` is the mask of the next token

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (only the end of the output)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return _first_line(self.matcher.get_error()) if self.matcher.is_error() else None

    def fill(self) -> None:
        """Compute the next mask on this thread (the GIL is released meanwhile)."""
        self.matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        self.fresh = True

    def allowed(self, device: torch.device) -> torch.Tensor:
        """The next token's mask as bool [V] on ``device``."""
        import torch  # here: the HTTP server checks constraints with this module and has no torch

        if not self.fresh:
            self.fill()
        bits = np.unpackbits(self.mask.view(np.uint8), bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits.view(np.bool_)).to(device)

    def consume(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar refuses it (the matcher is then in error)."""
        self.fresh = False
        return bool(self.matcher.consume_token(token))


def fill_masks(guides: list[Guide]) -> None:
    """Compute the next mask of every guide whose mask is stale, in parallel on llguidance's
    threads (the GIL released meanwhile)."""
    stale = [g for g in guides if not g.fresh]
    if len(stale) == 1:
        stale[0].fill()
    elif stale:
        import llguidance

        global _EXECUTOR
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        masks = np.empty((len(stale), stale[0].mask.shape[1]), dtype=np.int32)
        _EXECUTOR.unsafe_compute_mask_ptr(
            [(g.matcher, i) for i, g in enumerate(stale)], masks.ctypes.data, masks.strides[0], len(stale)
        )
        for i, g in enumerate(stale):
            g.mask[0] = masks[i]
            g.fresh = True


_EXECUTOR: llguidance.LLExecutor | None = None
