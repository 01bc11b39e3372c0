"""The model's tokenizer: tokenizer.json through the `tokenizers` library, the chat template
rendered with jinja2 the way transformers renders it, and streaming detokenization.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
from tokenizers import Tokenizer as BackendTokenizer

from muxworker.worker.models.gguf_tensors import GGUF_LINK
from muxworker.worker.models.loader import ModelFiles, load_model_dir
from muxworker.worker.models.template_sandbox import (  # re-exported: the template's one definition is there
    DEFAULT_LIMITS,
    ChatTemplateError,
    TemplateLimitError,
    check_chat_template,
    compile_chat_template,
)

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer", "compile_chat_template"]

_REPLACEMENT = "\ufffd"

# Names a message's reasoning may come under; templates read the first, gpt-oss ones read "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Special-token variables transformers hands every chat template (its special_tokens_map).
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _message(message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"chat messages must be dicts, got {type(message).__name__}")
    # As transformers does: keys whose value is None are dropped (APIs send content=None), and
    # reasoning given under an older name is also offered under the names templates read.
    out = {key: value for key, value in message.items() if value is not None}
    reasoning = next((out[key] for key in _REASONING_FIELDS if key in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


class Tokenizer:
    """A Hugging Face fast tokenizer plus what tokenizer_config.json and the generation config say
    about special tokens and chat formatting."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        tokenizer_config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        model_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        template_origin: str | None = None,
    ) -> None:
        """``template_origin`` names where the chat template comes from (a file and its field), for
        the errors of :meth:`check_chat_template`."""
        self.backend = backend
        self._encode_lock = threading.Lock()  # the backend's special-token switch is tokenizer-wide
        tokenizer_config = dict(tokenizer_config or {})
        generation_config = dict(generation_config or {})
        model_config = dict(model_config or {})
        self.special_tokens: dict[str, str] = {
            name: text for name in _TEMPLATE_TOKENS if (text := _token_text(tokenizer_config.get(name))) is not None
        }
        if chat_template is None and isinstance(tokenizer_config.get("chat_template"), str):
            chat_template = tokenizer_config["chat_template"]
        self.chat_template = chat_template
        self.template_origin = template_origin or "the model's chat template"
        self._compiled: jinja2.Template | None = None
        self._byte_level: bool | None = None  # whether pieces are GPT-2 byte-level (token_bytes)

        bos = self.special_tokens.get("bos_token")
        bos_id = backend.token_to_id(bos) if bos is not None else None
        if bos_id is None:
            bos_id = next(
                iter(_ids(generation_config.get("bos_token_id")) or _ids(model_config.get("bos_token_id"))), None
            )
        self.bos_token_id: int | None = bos_id

        eos = self.special_tokens.get("eos_token")
        eos_from_text = [i] if eos is not None and (i := backend.token_to_id(eos)) is not None else []
        # generation_config.json is what generate() stops on; config.json and tokenizer_config.json add to it.
        eos_ids = _ids(generation_config.get("eos_token_id")) + _ids(model_config.get("eos_token_id")) + eos_from_text
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_ids))

        self.add_bos_token = bool(tokenizer_config.get("add_bos_token", False))
        # Some tokenizer.json files add BOS in their post-processor (Llama 3); then it must not be added twice.
        probe = backend.encode("", add_special_tokens=True).ids
        self._post_processor_adds_bos = bos_id is not None and probe[:1] == [bos_id]

    @classmethod
    def from_model_files(cls, files: ModelFiles) -> Tokenizer:
        if (files.path / "chat_template.jinja").is_file():  # it wins, as in load_model_dir
            origin = str(files.path / "chat_template.jinja")
        elif files.gguf:  # a converted GGUF: its template came from the file's metadata
            origin = f"{(files.path / GGUF_LINK).resolve()}: tokenizer.chat_template"
        else:
            origin = f"{files.path / 'tokenizer_config.json'}: chat_template"
        return cls(
            BackendTokenizer.from_file(str(files.tokenizer_file)),
            tokenizer_config=files.tokenizer_config,
            generation_config=files.generation_config,
            model_config=files.config,
            chat_template=files.chat_template,
            template_origin=origin,
        )

    def check_chat_template(self) -> None:
        """Compile the chat template and render it once on a one-message chat, under the render
        limits (template_sandbox.py): a template that does not compile, or loops or grows past its
        limits on the simplest chat, fails at start (ChatTemplateError naming its origin), not at
        the first request."""
        if self.chat_template is None:
            return
        try:
            self._compiled = check_chat_template(self.chat_template, DEFAULT_LIMITS, **self.special_tokens)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{self.template_origin}: {e}") from None

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        return cls.from_model_files(load_model_dir(path))

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included. The model's embedding
        may have more rows (padding); use the model config for logits."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of input text one token can stand for, from the vocabulary: a text
        of B bytes has at least B / max_token_bytes tokens, so a prompt too long for a context is
        refused without tokenizing it. None where no such bound holds: a normalizer or
        pre-tokenizer that may drop input (strip, clean-up, whitespace splitting), a model whose
        unknown token covers a whole word or a run of characters (WordPiece, WordLevel, fused
        unknowns), an added token that swallows the whitespace beside it (lstrip/rstrip).
        Computed once (a pass over the vocabulary): touch it where the tokenizer is loaded."""
        backend = self.backend
        factor = _shrink_factor(backend.normalizer, _NORMALIZER_FACTORS)
        if factor is None or _shrink_factor(backend.pre_tokenizer, _PRE_TOKENIZER_FACTORS) is None:
            return None
        model, kind = backend.model, type(backend.model).__name__
        byte_level = backend.pre_tokenizer is not None and b'"ByteLevel"' in backend.pre_tokenizer.__getstate__()
        if kind == "BPE":
            if not (byte_level or model.byte_fallback or (model.unk_token is not None and not model.fuse_unk)):
                return None  # unknown characters dropped, or a run of them as one token
        elif kind != "Unigram" or not json.loads(model.__getstate__()).get("byte_fallback"):
            return None  # WordPiece/WordLevel: one unknown token for a word; Unigram fuses unknowns
        added = backend.get_added_tokens_decoder()
        if any(token.lstrip or token.rstrip for token in added.values()):
            return None
        vocab = backend.get_vocab(with_added_tokens=True).values()
        longest = max((len(self.token_bytes(i)) for i in vocab), default=1)
        added_bytes = (len(token.content.encode("utf-8")) for token in added.values())
        return max(longest, 4, *added_bytes) * factor  # 4: an unknown token stands for one character

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (a piece of a UTF-8 character, possibly), as
        OpenAI's logprobs report them: byte-level BPE pieces mapped back through GPT-2's byte
        alphabet, SentencePiece's ``<0xNN>`` byte tokens as that byte and its U+2581 as a space."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level is None:
            self._byte_level = "ByteLevel" in type(self.backend.decoder).__name__ if self.backend.decoder else False
        if self._byte_level and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    def encode(self, text: str, add_special_tokens: bool = False, *, parse_special: bool = False) -> list[int]:
        """Token ids of `text`. Special-token markers written in the text (<|im_start|>) become
        their ids only with ``parse_special`` (a rendered chat template); otherwise they are
        tokenized as the characters they are, so text cannot forge a role turn. With
        add_special_tokens, BOS is added when the tokenizer is configured to add it."""
        # The backend's switch is tokenizer-wide state: one encode at a time sets and resets it
        # (the HTTP server renders chats and encodes text prompts on several threads at once).
        with self._encode_lock:
            self.backend.encode_special_tokens = not parse_special
            try:
                # encode_batch, not encode: the backend's encode holds the GIL throughout (a 64 KB
                # text: 150 ms in which no other thread of the process runs), encode_batch releases it.
                ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            finally:
                self.backend.encode_special_tokens = False
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and not self._post_processor_adds_bos
        ):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text the model's own chat template makes of `messages`, identical to
        transformers' `apply_chat_template(messages, tokenize=False)`. Extra keyword arguments
        are template variables and override the special-token ones."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
        if not messages:
            raise ChatTemplateError("cannot apply the chat template to an empty conversation")
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._compiled.render(
                messages=[_message(m) for m in messages],
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except TemplateLimitError as e:
            raise ChatTemplateError(f"the chat template was stopped rendering these messages: {e}") from None
        except (jinja2.TemplateError, TypeError) as e:
            raise ChatTemplateError(f"the chat template rejected these messages: {e}") from e


# How many input bytes one byte of each normalizer's output may stand for (max_token_bytes): Unicode
# normalization composes (Hangul L+V+T: 9 bytes -> 3) and maps compatibility characters (U+1D400,
# 4 bytes -> "A"), as lowercasing does (KELVIN SIGN, 3 bytes -> "k"); the others only add. A
# component not named here may drop input (Strip, StripAccents, BertNormalizer, Precompiled): no bound.
_NORMALIZER_FACTORS = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1, "ByteLevel": 1}
# Pre-tokenizers that split without dropping anything (unless their behavior is "Removed").
_PRE_TOKENIZER_FACTORS = dict.fromkeys(
    ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation", "FixedLength"), 1
)


def _component_state(component: Any) -> dict[str, Any] | None:
    """A normalizer's or pre-tokenizer's tokenizer.json entry (None: there is none)."""
    return None if component is None else json.loads(component.__getstate__())


def _shrink_factor(component: Any, factors: Mapping[str, int]) -> int | None:
    """The input bytes one output byte of ``component`` may stand for (see _NORMALIZER_FACTORS);
    None: it may drop input."""

    def factor(state: Mapping[str, Any]) -> int | None:
        kind = state.get("type")
        if kind == "Sequence":
            total = 1
            for part in state.get("normalizers") or state.get("pretokenizers") or ():
                f = factor(part)
                if f is None:
                    return None
                total *= f
            return total
        if state.get("behavior") == "Removed":
            return None
        if kind == "Replace" and factors is _NORMALIZER_FACTORS:
            # A fixed string replaced by one at least as long (SentencePiece's " " -> U+2581) only adds.
            pattern, content = (state.get("pattern") or {}).get("String"), state.get("content")
            if isinstance(pattern, str) and isinstance(content, str):
                return 1 if len(content.encode("utf-8")) >= len(pattern.encode("utf-8")) else None
            return None
        return factors.get(kind) if isinstance(kind, str) else None

    state = _component_state(component)
    return 1 if state is None else factor(state)


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character each byte is written as -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_alphabet()


class IncrementalDetokenizer:
    """Turns a growing stream of token ids into text deltas made of whole characters.

    Bytes of a character split across tokens are held back until the character is complete
    (a delta never ends in U+FFFD from a partial sequence); `flush()` releases what is left.
    The concatenated deltas equal `tokenizer.decode(all_ids)`.

    Each step decodes only a short window, as vLLM's detokenizer does (prefix_offset/read_offset):
    the window starts with the tokens emitted last, as context (sentencepiece decoders drop a
    leading space at the start of a decode), followed by the pending tokens. Text is emitted as
    decode(window) minus decode(context). Older tokens are dropped, so memory stays bounded too.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = False,
        context_tokens: int = 5,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-context_tokens:]) if context_tokens > 0 else []
        # _ids is the window: already-emitted context tokens, then from _read on the pending ones.
        self._read = len(self._ids)
        self._prefix_text: str | None = None  # decode(_ids[:_read]), cached until _read moves

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Add one or more generated token ids; return the text they complete (maybe empty)."""
        if isinstance(token_ids, int):
            self._ids.append(token_ids)
        else:
            self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Release held-back text at the end of the stream (an incomplete character decodes to
        U+FFFD, as in `decode`)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        if not final and (len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT)):
            return ""  # nothing new yet, or a character is still incomplete
        delta = text[len(self._prefix_text) :]
        # The emitted tokens become the context of the next window.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = None
        return delta
