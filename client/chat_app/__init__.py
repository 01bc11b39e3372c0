"""``python -m muxworker.chat``: a terminal chat whose sessions survive a restart.

The application (this package) keeps the messages and the exact token history of the conversation
(the *transcript*); the worker keeps the model state, which is saved to a SessionStore as a KV
checkpoint. On start the session is resumed from both, so only the new suffix is prefilled.

Each turn's prompt is the previous token history followed by the text the chat template adds for
the new message, so it extends the saved tokens exactly (re-tokenizing the whole rendered history
could pick different ids and force a longer prefill).

Rules that keep a conversation from being lost:

- The transcript is the conversation; the checkpoint is a cache of its KV. After every turn the
  transcript is written first (atomically), then the checkpoint. Whatever a crash leaves, the next
  start is correct: the worker reuses the longest prefix the checkpoint holds and prefills the rest.
- A turn stopped by Ctrl-C keeps the prompt and the tokens generated so far, as the worker commits
  them; a turn stopped before any token was generated is dropped from the transcript.
- Nothing a resume could not read is ever overwritten (see ``__main__``).

Owner: the chat's main task owns a :class:`Conversation`; :class:`ReplyInterrupt` is the one object
the Ctrl-C task touches while a reply streams.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from muxworker.client import GenerationParams, GenerationResult, GenerationStream, MultiplexedWorkerClient, SpecialText
from muxworker.transport.sampling import SamplingFields

__all__ = [
    "Conversation",
    "Turn",
    "ReplyInterrupt",
    "TranscriptError",
    "default_store_dir",
    "CHAT_SAMPLING_DEFAULTS",
    "chat_sampling",
    "check_sampling",
    "generation_params",
    "describe_sampling",
    "recap",
]

TRANSCRIPT_VERSION = 1


def default_store_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "muxworker" / "sessions"


class TranscriptError(ValueError):
    """A saved transcript is unreadable or not a transcript."""


@dataclass
class Turn:
    text: str
    result: GenerationResult
    first_token_s: float  # client-observed time to the first streamed text
    total_s: float
    interrupted: bool = False  # stopped by Ctrl-C (finish_reason "cancelled")
    kept: bool = True  # whether the turn is now part of the conversation


class ReplyInterrupt:
    """Ctrl-C for one reply: cancels the stream now, or as soon as it exists (a Ctrl-C can land
    while the prompt is still being rendered, before there is a stream to cancel)."""

    def __init__(self) -> None:
        self.requested = False
        self._stream: GenerationStream | None = None

    def attach(self, stream: GenerationStream) -> None:
        self._stream = stream
        if self.requested:
            stream.cancel()

    def request(self) -> None:
        self.requested = True
        if self._stream is not None:
            self._stream.cancel()


@dataclass
class Conversation:
    """Messages plus the committed token history of one session."""

    session_id: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    history_ids: list[int] = field(default_factory=list)

    async def prompt_for(self, client: MultiplexedWorkerClient, user_text: str) -> list[Any]:
        """Prompt segments for the next turn: the exact history, then the template's new text."""
        messages = self.messages + [{"role": "user", "content": user_text}]
        rendered = await client.apply_chat_template(messages, add_generation_prompt=True)
        if not self.history_ids:
            return [list(rendered.token_ids)]
        prev_text = await client.detokenize(self.history_ids)
        if rendered.text.startswith(prev_text):
            # The template's own text: its markers must be the real special tokens.
            suffix = SpecialText(rendered.text[len(prev_text) :])
            return [list(self.history_ids), suffix] if suffix else [list(self.history_ids)]
        # The template rewrote earlier text (e.g. it drops old reasoning): fall back to a full
        # render; the worker reuses the longest common prefix it still holds.
        return [list(rendered.token_ids)]

    async def send(
        self,
        client: MultiplexedWorkerClient,
        user_text: str,
        params: GenerationParams,
        *,
        echo: Callable[[str], object] | None = None,
        interrupt: ReplyInterrupt | None = None,
    ) -> Turn:
        """Run one turn; ``echo(text)`` is called with each streamed delta.

        ``interrupt.request()`` stops the reply: the worker ends it "cancelled" with the tokens so
        far, which are kept. A request error (e.g. ContextOverflow) leaves the conversation as it was.
        """
        segments = await self.prompt_for(client, user_text)
        t0 = time.perf_counter()
        first = None
        parts: list[str] = []
        stream = client.generate(segments, params)
        if interrupt is not None:
            interrupt.attach(stream)
        try:
            async for delta in stream:
                if first is None:
                    first = time.perf_counter() - t0
                parts.append(delta)
                if echo is not None:
                    echo(delta)
            result = await stream.wait()
        except BaseException:
            stream.cancel()  # never leave a generation running in the worker behind an error
            raise
        total = time.perf_counter() - t0
        text = "".join(parts)
        generated = _committed_generated(result)
        interrupted = result.finish_reason == "cancelled"
        if interrupted and not generated:
            # Stopped before its first token: no reply to keep. The worker may hold part of the
            # prompt; the next prompt shares its prefix, so the worker reuses what it can.
            return Turn(text, result, total, total, interrupted=True, kept=False)
        prompt_ids = await _flatten(client, segments)
        self.history_ids = prompt_ids + generated
        if interrupted:
            # The committed tokens, not the streamed text (which may still hold back a partial
            # character), so the next render extends the history exactly.
            text = await client.detokenize(generated)
        self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": text}]
        return Turn(text, result, first if first is not None else total, total, interrupted=interrupted)

    # -- the transcript ------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Atomically replace the transcript at ``path`` (durable once this returns)."""
        data = json.dumps(
            {
                "version": TRANSCRIPT_VERSION,
                "session_id": self.session_id,
                "messages": self.messages,
                "history_ids": self.history_ids,
            }
        ).encode()
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power loss
        finally:
            os.close(dir_fd)

    @classmethod
    def load(cls, path: Path) -> Conversation:
        """The transcript at ``path``; :class:`TranscriptError` naming what is wrong with it."""
        try:
            data = json.loads(path.read_bytes())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TranscriptError(f"transcript {path} is unreadable: {exc}") from None
        try:
            conv = cls(data["session_id"], data["messages"], data["history_ids"])
        except (KeyError, TypeError):
            raise TranscriptError(f"transcript {path} lacks session_id, messages or history_ids") from None
        if not (
            isinstance(conv.session_id, str)
            and isinstance(conv.messages, list)
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in conv.messages
            )
            and isinstance(conv.history_ids, list)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in conv.history_ids)
        ):
            raise TranscriptError(f"transcript {path} is malformed (messages or history_ids of the wrong type)")
        return conv


def _committed_generated(result: GenerationResult) -> list[int]:
    """The generated tokens the worker committed to the session's history: ``committed_tokens`` of
    them (a turn cut by a stop string keeps only those whose text was shown)."""
    return list(result.generated_token_ids[: result.committed_tokens])


async def _flatten(client: MultiplexedWorkerClient, segments: list[Any]) -> list[int]:
    ids: list[int] = []
    for seg in segments:
        ids.extend(await client.tokenize(seg) if isinstance(seg, str) else seg)
    return ids


# ----------------------------------------------------------------------------------------------
# Sampling

# Greedy decoding loops on small chat models (SmolLM2-135M repeats itself within a few lines), so
# the chat samples by default. These apply where the model's generation_config.json is silent.
CHAT_SAMPLING_DEFAULTS: dict[str, float] = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.0,
}
_NEUTRAL = SamplingFields()  # the value of each field that leaves sampling unchanged
_GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def chat_sampling(model_dir: Path, overrides: dict[str, float | None]) -> tuple[dict[str, float], str]:
    """``(sampling fields, where they came from)`` for a chat on ``model_dir``.

    Precedence: an explicit flag (a non-None value in ``overrides``), then the model's
    generation_config.json, then :data:`CHAT_SAMPLING_DEFAULTS`. A generation_config that says
    ``do_sample: false`` means greedy (temperature 0), as transformers reads it.
    """
    sampling = dict(CHAT_SAMPLING_DEFAULTS)
    source = "chat defaults"
    path = Path(model_dir) / "generation_config.json"
    try:
        gen = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        gen = {}  # the worker reports a broken model directory itself
    if isinstance(gen, dict):
        taken = {
            k: gen[k]
            for k in _GENERATION_CONFIG_FIELDS
            if isinstance(gen.get(k), (int, float)) and not isinstance(gen.get(k), bool)
        }
        if gen.get("do_sample") is False:
            taken["temperature"] = 0.0
        if taken:
            sampling.update(taken)
            source = "the model's generation_config.json"
    given = {k: v for k, v in overrides.items() if v is not None}
    if given:
        sampling.update(given)
        source += ", with " + ", ".join(f"--{k}" for k in given)
    return sampling, source


def check_sampling(sampling: dict[str, Any], max_new_tokens: int) -> None:
    """Raise InvalidArgument naming a field out of range, by the worker's own rules, so a bad flag
    stops the chat at start rather than failing every turn."""
    SamplingFields(max_new_tokens=max_new_tokens, **sampling).validate()


def generation_params(session_id: str, max_new_tokens: int, sampling: dict[str, Any]) -> GenerationParams:
    return GenerationParams(session_id=session_id, max_new_tokens=max_new_tokens, **sampling)


def describe_sampling(sampling: dict[str, float]) -> str:
    shown = [f"{k} {v:g}" for k, v in sampling.items() if k == "temperature" or v != getattr(_NEUTRAL, k)]
    return ", ".join(shown) + (" (greedy)" if sampling.get("temperature", 0) == 0 else "")


def recap(conv: Conversation, width: int = 200) -> list[str]:
    """Lines recalling the last exchange: the last user message and the start of the reply."""
    last_user = next((m["content"] for m in reversed(conv.messages) if m["role"] == "user"), None)
    if last_user is None:
        return []
    last_reply = conv.messages[-1]["content"] if conv.messages[-1]["role"] == "assistant" else ""
    # "you:", not the prompt's "you> ", so the recap never reads as a prompt waiting for input.
    return [f"you: {_clip(last_user, width)}", f"assistant: {_clip(last_reply, width)}"]


def _clip(text: str, width: int) -> str:
    one_line = " ".join(text.split())
    return one_line if len(one_line) <= width else one_line[: width - 1] + "\u2026"
