"""A scripted stand-in for the HTTP server's ModelService, to drive the real ASGI app in-process
(httpx's ASGI transport) or behind a real hypercorn socket, with no worker: every generation
streams two words (or the service's ``words``, one delta each). What the app sends the service is recorded (``params``), so a test can check
what a request turned into."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio

from muxworker.client.params import CheckedParams, GenerationResult
from muxworker.serve.reasoning import Thinking
from muxworker.serve.service import ServiceConfig
from muxworker.serve.tools import GENERIC, ToolFormat

WORDS = ["Hello", " there"]


class ScriptedStream:
    def __init__(self, prompt_tokens: int, words: list[str] = WORDS, token_ids: list[int] | None = None) -> None:
        self.finished = False
        self.prompt_tokens = prompt_tokens
        self._left = list(words)
        self._ids = list(token_ids) if token_ids is not None else [5, 6]

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> str:
        if not self._left:
            self.finished = True
            raise StopAsyncIteration
        await trio.sleep(0)
        return self._left.pop(0)

    async def wait(self) -> GenerationResult:
        n, ids = self.prompt_tokens, self._ids
        return GenerationResult("stop", n, 1, n - 1, len(ids), ids, 0.0, 0.0, committed_tokens=len(ids))

    def cancel(self) -> None:
        pass

    def logprobs_from(self, start: int) -> list:
        return []


@dataclass
class _Plan:
    target: str


class _Grant:
    def release(self) -> None:
        pass


@dataclass
class ScriptedService:
    """The service's surface the endpoints use."""

    max_session_tokens: int | None = 100
    prompt: list[int] = field(default_factory=lambda: [1, 2, 3])  # what every chat renders to
    generated: int = 0
    params: list[CheckedParams] = field(default_factory=list)  # of every generation, in order
    ready: bool = True
    last_error: str | None = None
    config: ServiceConfig = field(default_factory=ServiceConfig)
    words: list[str] = field(default_factory=lambda: list(WORDS))  # the deltas every generation streams
    token_ids: list[int] | None = None  # the generated ids its result reports (None: [5, 6])
    thinking_tags: Thinking | None = None  # the model thinks (client/serve/reasoning.py)

    def max_messages(self) -> int:
        return 100

    def max_model_len(self) -> int | None:
        return self.max_session_tokens

    def weight_groups(self) -> list[dict]:
        return [{"type": "Q8_0", "held": "mapped", "runs": "decode", "tensors": 1, "nbytes": 34}]

    def store_health(self) -> dict:
        return {"status": "ok"}

    def record(self, sid: str) -> None:
        return None

    def token_bytes(self, token_id: int) -> bytes:
        return b"x"

    async def render_chat(self, messages: list, tools: object = None) -> list[int]:
        return list(self.prompt)

    async def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def tool_format(self) -> ToolFormat:
        return GENERIC

    def thinking(self) -> Thinking | None:
        return self.thinking_tags

    async def check_constraint(self, constraint: object) -> None:
        pass  # no grammar compiler here: the real server's check is tests/client/serve/test_fuzz.py's

    async def check_store_quota(self, tenant: object) -> None:
        pass

    async def ensure_session(self, sid: str, tenant: object = None) -> bool:
        return False

    async def open_ephemeral(self, tenant: object) -> tuple[str, None]:
        return "local/~x", None

    def release_ephemeral(self, *args: object) -> None:
        pass

    async def admit(self, party: str, units: int) -> _Grant:
        return _Grant()

    async def place(self, tenant: object, prompt: list[int], named: str | None = None, *args: Any, **kw: Any) -> _Plan:
        return _Plan(named or "local/~x")

    def unplace(self, plan: object) -> None:
        pass

    def after_stream(self, *args: object, **kw: object) -> None:
        pass

    def after_turn(self, *args: object, **kw: object) -> None:
        pass

    def generate(self, sid: str, prompt: Any, params: CheckedParams, salt: str) -> tuple[ScriptedStream, None]:
        self.generated += 1
        self.params.append(params)
        return ScriptedStream(len(prompt), self.words, self.token_ids), None
