"""``python -m muxworker.chat``: a terminal chat whose sessions survive a restart.

The application (this module) keeps the messages and the exact token history of the conversation;
the worker keeps the model state, which ``/save`` (and quitting) writes to a SessionStore. On start
the session is resumed from the store when it has one, so only the new suffix is prefilled.

Each turn's prompt is the previous token history followed by the text the chat template adds for
the new message, so it extends the saved tokens exactly (re-tokenizing the whole rendered history
could pick different ids and force a longer prefill).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from muxworker.client import GenerationParams, GenerationResult, MultiplexedWorkerClient

__all__ = ["Conversation", "Turn", "default_store_dir"]


def default_store_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "muxworker" / "sessions"


@dataclass
class Turn:
    text: str
    result: GenerationResult
    first_token_s: float  # client-observed time to the first streamed text
    total_s: float


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
            suffix = rendered.text[len(prev_text) :]
            return [list(self.history_ids), suffix] if suffix else [list(self.history_ids)]
        # The template rewrote earlier text (e.g. it drops old reasoning): fall back to a full
        # render; the worker reuses the longest common prefix it still holds.
        return [list(rendered.token_ids)]

    async def send(
        self, client: MultiplexedWorkerClient, user_text: str, params: GenerationParams, *, echo=None
    ) -> Turn:
        """Run one turn; ``echo(text)`` is called with each streamed delta."""
        segments = await self.prompt_for(client, user_text)
        t0 = time.perf_counter()
        first = None
        parts: list[str] = []
        stream = client.generate(segments, params)
        async for delta in stream:
            if first is None:
                first = time.perf_counter() - t0
            parts.append(delta)
            if echo is not None:
                echo(delta)
        result = await stream.wait()
        total = time.perf_counter() - t0
        text = "".join(parts)
        prompt_ids = await _flatten(client, segments)
        self.history_ids = prompt_ids + list(result.generated_token_ids)
        self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": text}]
        return Turn(text, result, first if first is not None else total, total)

    def save(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"session_id": self.session_id, "messages": self.messages, "history_ids": self.history_ids}))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "Conversation":
        data = json.loads(path.read_text())
        return cls(data["session_id"], data["messages"], data["history_ids"])


async def _flatten(client: MultiplexedWorkerClient, segments: list[Any]) -> list[int]:
    ids: list[int] = []
    for seg in segments:
        ids.extend(await client.tokenize(seg) if isinstance(seg, str) else seg)
    return ids


async def iter_lines(prompt: str) -> AsyncIterator[str]:  # pragma: no cover - thin stdin wrapper
    import sys

    import trio

    while True:
        sys.stdout.write(prompt)
        sys.stdout.flush()
        line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
        if not line:
            return
        yield line.rstrip("\n")
