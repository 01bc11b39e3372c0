"""Prompts too long for the context, refused before the expensive part (issue 40).

A body just under the 4 MiB limit is millions of tokens: tokenizing it whole costs seconds of a core
and hundreds of MB, all to refuse it. Here the cost is bounded by the context, not by the body:

1. A text of B UTF-8 bytes has at least B / ``max_token_bytes`` tokens (the tokenizer's longest
   token, worker/models/tokenizer.py): beyond the room it is refused without tokenizing anything.
   For a chat, the same bound on the strings handed to the template comes before rendering.
2. A text short enough that tokenizing it is cheap anyway (:data:`WHOLE_BYTES_PER_TOKEN` per token
   of room) is tokenized whole.
3. Anything between is counted in chunks cut between words, which stop at the first chunk that
   takes the count past the room (plus :data:`CUT_SLACK_TOKENS` per cut): refused. A text that
   fits is then tokenized whole, as the worker would; the chunks only count, since tokens at a cut
   need not be those of the whole text.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Iterator
from typing import Any

from muxworker.client.client import prompt_too_long

__all__ = [
    "CUT_SLACK_TOKENS",
    "TRIM_AFTER_BYTES",
    "WHOLE_BYTES_PER_TOKEN",
    "check_bytes",
    "chunk_cuts",
    "encode_within",
    "string_bytes",
    "trim_heap",
    "utf8_len",
]

#: A text of at most this many bytes per token of room is tokenized whole at once: text averages
#: 3-4 bytes a token, so such a text may well fit, and its cost is bounded by the room anyway.
WHOLE_BYTES_PER_TOKEN = 4
#: Tokens a cut between two counted chunks may take off the whole text's count (none for a
#: pre-tokenizer that splits before a space, as byte-level BPE's does; a special token cut where a
#: text has no space to cut at is a few more).
CUT_SLACK_TOKENS = 8
_MIN_CHUNK, _MAX_CHUNK = 4096, 65536  # characters per counted chunk, by the room
_CUT_WINDOW = 4096  # how far past a chunk's end a cut between words is looked for
_CUT = re.compile(r"(?<=\S)[ \n](?=\S)")  # a lone space or newline between two words
#: A refused input of this many bytes hands its memory back to the system once its request is done.
TRIM_AFTER_BYTES = 256 << 10


def utf8_len(text: str) -> int:
    """The UTF-8 length of ``text`` (a lone surrogate counted as its three bytes), without a copy
    when it is ASCII."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def string_bytes(value: Any) -> int:
    """The UTF-8 bytes of every string value in ``value`` (dicts, lists and tuples walked; keys
    not counted, templates write few of them): what a chat template is handed, so no more than
    its rendering holds when the template writes what it is given."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += utf8_len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def check_bytes(nbytes: int, room: int | None, max_token_bytes: int | None) -> None:
    """Raise ContextOverflow where ``nbytes`` of text are more tokens than a session of ``room``
    tokens holds (a prompt must leave one for the reply, as the worker's own check)."""
    if room is None or not max_token_bytes:
        return
    at_least = -(-nbytes // max_token_bytes)
    if at_least >= room:
        raise prompt_too_long(at_least, room)


def chunk_cuts(text: str, size: int) -> Iterator[int]:
    """Where ``text`` is cut into chunks of about ``size`` characters: each cut before a lone
    space or newline between two words (found within a window past ``size``), else at ``size``
    itself (a text without such a space: a word as long as the window). The last is len(text)."""
    start = 0
    while len(text) - start > size:
        target = start + size
        match = _CUT.search(text, target, min(len(text), target + _CUT_WINDOW))
        start = match.start() if match is not None else target
        yield start
    yield len(text)


def encode_within(
    encode: Callable[[str], list[int]], text: str, room: int | None, max_token_bytes: int | None
) -> list[int]:
    """``encode(text)``, or ContextOverflow where ``text`` has ``room`` tokens or more (a session
    of ``room`` tokens has none left for the reply), at a cost bounded by ``room`` (the module
    docstring)."""
    if room is None:
        return encode(text)
    nbytes = utf8_len(text)
    check_bytes(nbytes, room, max_token_bytes)
    if nbytes <= WHOLE_BYTES_PER_TOKEN * room:
        return _fitting(encode(text), room)
    size = max(_MIN_CHUNK, min(_MAX_CHUNK, room))
    counted, cuts, start = 0, 0, 0
    for end in chunk_cuts(text, size):
        counted += len(encode(text[start:end]))
        at_least = counted - CUT_SLACK_TOKENS * cuts
        if at_least >= room:
            raise prompt_too_long(at_least, room)
        start, cuts = end, cuts + 1
    return _fitting(encode(text), room)  # it may fit: the whole text's own tokens, not the chunks'


def _fitting(ids: list[int], room: int) -> list[int]:
    if len(ids) >= room:
        raise prompt_too_long(len(ids), room)
    return ids


_libc: Any = None


def trim_heap() -> None:
    """Hand freed heap memory back to the system (glibc keeps freed pages resident: a refused
    4 MB body would leave the server tens of MB larger). Blocking for a few ms, without the GIL:
    call it on a thread."""
    global _libc
    if _libc is False:
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        _libc = False
