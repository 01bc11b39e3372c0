"""Prompt segments: what text in a prompt means.

Plain text (``str``) is tokenized as text: a chat-template marker such as ``<|im_start|>`` written in
it becomes the ordinary tokens of those characters, never the special token, so user text or tool
output cannot forge a role turn. Text that must produce real special tokens (a rendered chat
template, a hand-written control sequence) is opted in by wrapping it in :class:`SpecialText`. On the
wire a text segment carries ``"special": true`` for it.
"""

from __future__ import annotations

__all__ = ["SpecialText"]


class SpecialText(str):
    """Text whose special-token markers are parsed into their token ids (opt-in; see the module)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"SpecialText({str.__repr__(self)})"
