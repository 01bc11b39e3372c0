"""OpenAI's response shapes, sans-I/O: completion bodies with their choices, usage and logprobs,
and the server-sent event chunks of a streamed one (the requests are openai_api.py's)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from muxworker.client.params import GenerationResult, TokenLogprob

from .openai_api import APIError
from .tools import CallDelta, ToolCall

__all__ = [
    "Choice",
    "ChunkWriter",
    "DONE",
    "Logprobs",
    "completion_body",
    "finish_reason",
    "new_id",
    "reasoning_total",
    "usage",
]


def usage(
    results: Sequence[GenerationResult], cached: int | None = None, reasoning: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage object of one request's choices (the prompt counted once); ``cached_tokens``
    are the prompt tokens whose KV was reused (the session's own history, a resumed file, or a
    prefix-cache entry of the same namespace): the first choice's, unless ``cached`` says.
    ``reasoning``: the choices' reasoning tokens, for a model that thinks (None: no details)."""
    prompt = results[0].prompt_tokens
    completion = sum(r.completion_tokens for r in results)
    reused = results[0].reused_prompt_tokens if cached is None else cached
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": reused},
    }
    if reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


def reasoning_total(counts: Sequence[int | None]) -> int | None:
    """The reasoning tokens of a request's choices together (None: a model that does not think)."""
    known = [c for c in counts if c is not None]
    return sum(known) if known else None


def finish_reason(result: GenerationResult, calls: Sequence[ToolCall] = ()) -> str:
    """``length`` for an output cut by max_tokens, its complete calls kept beside it (as OpenAI's
    may): a client streaming the calls knows the last may be cut short; else ``tool_calls`` for a
    reply with calls, ``stop`` for one without."""
    if result.finish_reason == "length":
        return "length"
    return "tool_calls" if calls else "stop"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Logprobs:
    """OpenAI's ``logprobs`` objects of one request's tokens: chat's ``{"content": [...]}`` entries
    (token, logprob, bytes, top_logprobs) or the completions API's parallel lists. ``token_bytes``
    gives a token id's bytes (the server's tokenizer); a token that ends inside a UTF-8 character
    shows U+FFFD in ``token`` and its exact bytes in ``bytes``."""

    def __init__(self, token_bytes: Callable[[int], bytes], chat: bool) -> None:
        self._bytes = token_bytes
        self.chat = chat
        self._offset = 0  # completions: characters of text before the next token

    def _token(self, token_id: int) -> tuple[str, bytes]:
        raw = self._bytes(token_id)
        return raw.decode("utf-8", "replace"), raw

    def of(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            content = []
            for e in entries:
                text, raw = self._token(e.token_id)
                top = []
                for t, lp in e.top:
                    top_text, top_raw = self._token(t)
                    top.append({"token": top_text, "logprob": lp, "bytes": list(top_raw)})
                content.append({"token": text, "logprob": e.logprob, "bytes": list(raw), "top_logprobs": top})
            return {"content": content, "refusal": None}
        tokens, offsets, tops = [], [], []
        for e in entries:
            text = self._token(e.token_id)[0]
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
            tops.append({self._token(t)[0]: lp for t, lp in e.top})
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


@dataclass
class Choice:
    """One choice of a reply: its text (content), tool calls, result and logprobs; and for a model
    that thinks, its reasoning (None: it wrote none) and reasoning tokens (client/serve/reasoning.py)."""

    index: int
    text: str
    result: GenerationResult
    calls: Sequence[ToolCall] = ()
    logprobs: Logprobs | None = None
    reasoning: str | None = None
    reasoning_tokens: int | None = None

    def chat(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.text if self.text or not self.calls else None}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = [c.openai() for c in self.calls]
        return {"index": self.index, "message": message, **self._tail()}

    def completion(self) -> dict[str, Any]:
        return {"index": self.index, "text": self.text, **self._tail()}

    def _tail(self) -> dict[str, Any]:
        lp = self.logprobs.of(self.result.logprobs or ()) if self.logprobs is not None else None
        return {"logprobs": lp, "finish_reason": finish_reason(self.result, self.calls)}


def completion_body(
    chat: bool,
    rid: str,
    model: str,
    choices: Sequence[Choice],
    sid: str | None,
    session: dict | None,
    cached: int | None = None,
) -> dict:
    """A chat completion or a text completion of ``choices``; ``session``: the named session's
    durability (docs/SERVER.md)."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [c.chat() if chat else c.completion() for c in choices],
        "usage": usage([c.result for c in choices], cached, reasoning_total([c.reasoning_tokens for c in choices])),
    }
    if sid is not None:
        body["session_id"] = sid
    if session is not None:
        body["session"] = session
    return body


class ChunkWriter:
    """Server-sent events of one streamed completion, as bytes.

    A chunk for each text delta of choice 0 is the hot path (one per token): the JSON around the
    text is rendered once per request, so a delta costs one ``json.dumps`` of its text.
    """

    def __init__(self, rid: str, model: str, chat: bool, logprobs: Logprobs | None = None) -> None:
        self.chat = chat
        self.logprobs = logprobs
        head = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
        }
        self._head = {**head, "model": model}
        prefix = json.dumps(self._head)[:-1]
        if chat:
            self._open = f'data: {prefix}, "choices": [{{"index": 0, "delta": {{"content": '
            self._close = '}, "logprobs": null, "finish_reason": null}]}\n\n'
        else:
            self._open = f'data: {prefix}, "choices": [{{"index": 0, "text": '
            self._close = ', "logprobs": null, "finish_reason": null}]}\n\n'

    def role(self, index: int = 0) -> bytes:
        """A choice's first chat chunk: the assistant role, no content yet (as OpenAI sends it)."""
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._event({**self._head, "choices": [choice]})

    def delta(self, text: str, logprobs: Sequence[TokenLogprob] = (), index: int = 0, reasoning: str = "") -> bytes:
        """A chunk of ``text``, with the logprobs of the tokens that made it (when asked for);
        ``reasoning``: the reasoning they made (chat, a model that thinks), before the text."""
        if self.logprobs is None and index == 0 and not reasoning:
            return (self._open + json.dumps(text) + self._close).encode()
        lp = self.logprobs.of(logprobs) if self.logprobs is not None else None
        choice: dict[str, Any] = {"index": index, "logprobs": lp, "finish_reason": None}
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if reasoning:  # as vLLM streams it: the reasoning, and content only once there is some
                delta = {"reasoning_content": reasoning, **({"content": text} if text else {})}
            choice["delta"] = delta
        else:
            choice["text"] = text
        return self._event({**self._head, "choices": [choice]})

    def call_deltas(self, deltas: Sequence[CallDelta], index: int = 0) -> bytes:
        """OpenAI's tool-call deltas of choice ``index``: a call's first with its index, id, type
        and name, the next ones with pieces of its arguments."""
        out = []
        for d in deltas:
            part: dict[str, Any] = {"index": d.index, "function": {"arguments": d.arguments}}
            if d.id is not None:
                part = {
                    "index": d.index,
                    "id": d.id,
                    "type": "function",
                    "function": {"name": d.name, "arguments": d.arguments},
                }
            choice = {"index": index, "delta": {"tool_calls": [part]}, "logprobs": None, "finish_reason": None}
            out.append(self._event({**self._head, "choices": [choice]}))
        return b"".join(out)

    def finish(
        self,
        result: GenerationResult,
        session: dict | None = None,
        logprobs: Sequence[TokenLogprob] = (),
        calls: Sequence[ToolCall] = (),
        index: int = 0,
    ) -> bytes:
        """A choice's chunk with its finish reason; ``session``: the named session's durability;
        ``logprobs``: those of tokens no text chunk carried (a stop token, say)."""
        lp = self.logprobs.of(logprobs) if self.logprobs is not None and logprobs else None
        choice: dict[str, Any] = {"index": index, "logprobs": lp, "finish_reason": finish_reason(result, calls)}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        chunk: dict[str, Any] = {**self._head, "choices": [choice]}
        if session is not None:
            chunk["session"] = session
        return self._event(chunk)

    def usage(
        self, results: Sequence[GenerationResult], cached: int | None = None, reasoning: int | None = None
    ) -> bytes:
        return self._event({**self._head, "choices": [], "usage": usage(results, cached, reasoning)})

    @staticmethod
    def error(err: APIError) -> bytes:
        return ChunkWriter._event(err.body())

    @staticmethod
    def _event(obj: Any) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()


DONE = b"data: [DONE]\n\n"
