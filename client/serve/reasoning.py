"""Models that think: the reasoning a model writes between ``<think>`` and ``</think>`` before its
answer, split from the answer as vLLM's reasoning parsers (qwen3, deepseek_r1) split it.

A model thinks when both tags are single tokens of its vocabulary (:meth:`Thinking.of`, as vLLM's
qwen3 parser requires); for any other model nothing here runs. Where a reply starts is read from
the end of its rendered prompt (:meth:`Thinking.start`):

- ``OPEN``: the chat template opened ``<think>`` in the generation prompt (Qwen3-2507 thinking,
  QwQ, DeepSeek-R1 templates): the reply starts inside the reasoning, and a reply that never
  writes ``</think>`` is all reasoning.
- ``CLOSED``: the template wrote a whole block (``<think>\\n\\n</think>``, thinking switched off):
  the reply is all content.
- ``FREE``: the model may open a block itself, as the first thing it writes (Qwen3's first
  template); a reply that does not start with ``<think>`` is all content.

:class:`ReasoningParser` splits the streamed text (a tag may arrive split across deltas) and hands
only the content, leading newlines dropped as Qwen3's template drops them, to the tool-call parser
(tools.py), so a call is found in the answer and never in the reasoning. :meth:`Thinking.constrain`
lets a grammar (tool calls, ``response_format``) hold from the end of the reasoning on, as vLLM
applies structured output only once the reasoning has ended.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from muxworker.transport.sampling import JSON_LAYOUT, bounded_schema

from .tools import CallDelta, OutputParser, ToolCall

__all__ = ["CLOSED", "FREE", "OPEN", "ReasoningParser", "Thinking"]

START = "<think>"
END = "</think>"
OPEN, CLOSED, FREE = "open", "closed", "free"  # where a reply starts (the module docstring)
_TAIL = 8  # whitespace tokens after a tag that still count as the prompt's end


@dataclass(frozen=True)
class Thinking:
    """A model that thinks: the ids of its ``<think>`` and ``</think>`` tokens, and how its tokens
    read (``decode``: token ids to text), to tell whitespace at a prompt's end."""

    start_id: int
    end_id: int
    decode: Callable[[Sequence[int]], str] = field(compare=False, repr=False)
    eos_ids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, tokenizer: Any) -> Thinking | None:
        """The model's tags when both are single tokens of its vocabulary (a ``Tokenizer`` of
        worker/models/tokenizer.py); None: the model does not think."""
        start, end = tokenizer.token_to_id(START), tokenizer.token_to_id(END)
        if start is None or end is None:
            return None
        return cls(start, end, tokenizer.decode, frozenset(tokenizer.eos_token_ids))

    def _tag_before(self, prompt: Sequence[int], end: int, tags: tuple[int, ...]) -> int:
        """The index of the last of ``tags`` before ``end`` with only whitespace tokens between
        (at most _TAIL tokens back); -1 when there is none."""
        for i in range(end - 1, max(-1, end - 1 - _TAIL), -1):
            if prompt[i] in tags:
                return i
            if self.decode([prompt[i]]).strip():
                return -1
        return -1

    def _block(self, prompt: Sequence[int]) -> tuple[str, int]:
        """Where a reply to ``prompt`` starts, and the tokens of the block the template put at the
        prompt's end (from its ``<think>`` on; 0 for FREE)."""
        i = self._tag_before(prompt, len(prompt), (self.start_id, self.end_id))
        if i < 0:
            return FREE, 0
        if prompt[i] == self.start_id:
            return OPEN, len(prompt) - i
        j = self._tag_before(prompt, i, (self.start_id,))  # a closed block: back to its <think>
        return CLOSED, len(prompt) - (j if j >= 0 else i)

    def start(self, prompt: Sequence[int]) -> str:
        """OPEN, CLOSED or FREE: where the reply to ``prompt`` starts (the module docstring)."""
        return self._block(prompt)[0]

    def rerendered(self, prompt: Sequence[int]) -> int:
        """The prompt's last tokens that the next turn's render may not repeat: a block the
        template put in the generation prompt, which templates like Qwen3's drop from past
        assistant turns. The next turn's prompt diverges there (client/serve/reuse.py)."""
        return self._block(prompt)[1]

    def parser(self, start: str, inner: OutputParser | None = None) -> ReasoningParser:
        """The output parser of a reply starting at ``start``; ``inner`` parses its content."""
        return ReasoningParser(self, start, inner if inner is not None else OutputParser())

    def constrain(self, constraint: dict[str, Any] | None, start: str) -> dict[str, Any] | None:
        """``constraint`` (a grammar for the answer: tool calls, ``response_format``) held only
        after the reasoning: the reply may think first (must, when the template opened the block),
        then writes ``</think>``, newlines, and what the grammar allows. Only the kinds the server
        builds are wrapped (JSON schemas and its Lark tool grammars); None stays free text."""
        if constraint is None or start == CLOSED:
            return constraint
        (kind, value), *_ = constraint.items()
        if kind == "json_schema":
            reply = "reply: %json " + json.dumps({**bounded_schema(value), "x-guidance": JSON_LAYOUT})
        elif kind == "json_object":
            reply = "reply: %json " + json.dumps({"type": "object", "x-guidance": JSON_LAYOUT})
        elif kind == "lark" and isinstance(value, str) and value.startswith("start:"):
            reply = "reply:" + value[len("start:") :]
        else:
            return constraint
        # The tags by token id: llguidance keeps added tokens apart from the text they spell.
        block = f"THOUGHT? <[{self.end_id}]> GAP?"
        head = f"start: {block} reply" if start == OPEN else f"start: (<[{self.start_id}]> {block})? reply"
        rules = [head, r"THOUGHT: /(.|\n)+/ & ~/(.|\n)*<\/think>(.|\n)*/", r"GAP: /\n+/", reply]
        return {"lark": "\n".join(rules)}


_BEFORE, _REASONING, _CONTENT = range(3)  # a parser's state: before a block may open, in it, after it


class ReasoningParser(OutputParser):
    """A thinking model's reply as reasoning and content, streamed: the reasoning as it comes
    (:meth:`pop_reasoning`), the content through ``inner`` (the tool-call parser), a possible tag
    held back until the next delta decides it."""

    def __init__(self, thinking: Thinking, start: str, inner: OutputParser) -> None:
        self.thinking = thinking
        self.start = start
        self.inner = inner
        self._state = {OPEN: _REASONING, CLOSED: _CONTENT, FREE: _BEFORE}[start]
        self._held = ""  # text that may be the start of a tag
        self._lead = False  # the content after a block has not begun: its leading newlines go
        self._opened = start == OPEN  # a block has opened: the reply has reasoning
        self._parts: list[str] = []  # the reasoning, as it came
        self._popped = 0  # parts given out by pop_reasoning

    @property
    def reasoning(self) -> str | None:
        """The reasoning so far; None while no block has opened (then the reply has none)."""
        return "".join(self._parts) if self._opened else None

    def fresh(self) -> OutputParser:
        return ReasoningParser(self.thinking, self.start, self.inner.fresh())

    def feed(self, text: str) -> str:
        text = self._held + text
        self._held = ""
        if self._state == _BEFORE:
            lead = text.lstrip()
            if lead.startswith(START):
                self._state, self._opened = _REASONING, True
                text = lead[len(START) :]
            elif START.startswith(lead):  # still whitespace, or a part of the tag
                self._held = text
                return ""
            else:
                self._state = _CONTENT  # no block: the reply is content, as it came
        if self._state == _REASONING:
            at = text.find(END)
            if at == -1:
                keep = next((k for k in range(min(len(END) - 1, len(text)), 0, -1) if text.endswith(END[:k])), 0)
                self._think(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                return ""
            self._think(text[:at])
            self._state, self._lead = _CONTENT, True
            text = text[at + len(END) :]
        if self._lead:
            text = text.lstrip("\n")
            if not text:
                return ""
            self._lead = False
        return self.inner.feed(text) if text else ""

    def _think(self, text: str) -> None:
        if text:
            self._parts.append(text)

    def pop_reasoning(self) -> str:
        out = "".join(self._parts[self._popped :])
        self._popped = len(self._parts)
        return out

    def pop_deltas(self) -> list[CallDelta]:
        return self.inner.pop_deltas()

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        content = ""
        if self._state == _REASONING:
            self._think(held)  # a tag cut short is reasoning text
        elif held:
            content = self.inner.feed(held)  # whitespace, or a part of "<think>": content as it came
        rest, calls = self.inner.finish()
        return content + rest, calls

    def reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """The tokens of the reasoning among the reply's ``token_ids``, as vLLM counts them: those
        between the tags (to the end, less a stop token, when the block never closed)."""
        if not self._opened:
            return 0
        ids = list(token_ids)
        begin = 0
        if self.start != OPEN:
            if self.thinking.start_id not in ids:
                return 0
            begin = ids.index(self.thinking.start_id) + 1
        try:
            end = ids.index(self.thinking.end_id, begin)
        except ValueError:
            end = len(ids) - (1 if ids and ids[-1] in self.thinking.eos_ids else 0)
        return max(0, end - begin)
