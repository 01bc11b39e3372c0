"""Reading the user's messages from the terminal: line editing, history and multi-line input.

A message is one of:

- one line (readline editing and history when stdin is a terminal);
- a paste: on a terminal with bracketed paste, readline returns the whole paste as one line with its
  newlines; otherwise the lines already waiting when one is read (a paste arrives all at once,
  typing does not) are joined to it, within ``PASTE_WINDOW_S``;
- a ``\"\"\"`` block: a line starting with three double quotes opens it, a line ending with them
  closes it, and everything between is one message (for typing several lines by hand).

Owner: the blocking reads run in one worker thread at a time (``trio.to_thread``); a read the chat
stops waiting for (Ctrl-C at the prompt) is abandoned, so :meth:`LineReader.restore` puts the
terminal back as it was, whatever readline left it in.
"""

from __future__ import annotations

import os
import select
import sys
from typing import TextIO

__all__ = ["LineReader", "BLOCK_DELIMITER", "PASTE_WINDOW_S"]

BLOCK_DELIMITER = '"""'
# Lines of a paste arrive within microseconds of each other, keystrokes hundreds of milliseconds
# apart; terminals write large pastes in chunks, so allow a short gap between them.
PASTE_WINDOW_S = 0.03


class LineReader:
    """Blocking reads of whole messages; call :meth:`read_message` from a worker thread."""

    def __init__(self) -> None:
        # input() reads sys.stdin and writes sys.stdout; these are the streams it uses.
        self.stdin: TextIO = sys.stdin
        self.stdout: TextIO = sys.stdout
        try:
            self._fd: int | None = self.stdin.fileno()
        except (AttributeError, OSError, ValueError):
            self._fd = None
        self.interactive = self._fd is not None and os.isatty(self._fd) and self.stdout.isatty()
        self._saved_tty = None
        self.uses_readline = False
        if self.interactive:
            import termios

            assert self._fd is not None  # interactive implies a terminal fd
            try:
                self._saved_tty = termios.tcgetattr(self._fd)
            except termios.error:
                self._saved_tty = None
            try:
                import readline  # input() then edits lines and keeps a history
            except ImportError:
                pass
            else:
                self.uses_readline = True
                # CPython turns bracketed paste off; on, a paste comes back from input() as one
                # string with its newlines, however slowly the terminal delivers it.
                readline.parse_and_bind("set enable-bracketed-paste on")

    def read_message(self, prompt: str) -> str | None:
        """The next message, or None at end of input (Ctrl-D on an empty line)."""
        line = self._read_line(prompt)
        if line is None:
            return None
        if line.lstrip().startswith(BLOCK_DELIMITER):
            return self._read_block(line.lstrip()[len(BLOCK_DELIMITER) :])
        lines = [line]
        while self._more_waiting():
            more = self._read_line("")
            if more is None:
                break
            lines.append(more)
        return "\n".join(lines)

    def ask(self, question: str) -> str | None:
        """One line of answer to ``question`` (None at end of input); never joined or blocked."""
        return self._read_line(question)

    def _read_block(self, first: str) -> str | None:
        lines: list[str] = []
        rest: str | None = first
        while rest is not None:
            if rest.rstrip().endswith(BLOCK_DELIMITER):
                lines.append(rest.rstrip()[: -len(BLOCK_DELIMITER)])
                break
            lines.append(rest)
            rest = self._read_line("... ")  # None at end of input inside a block: send what was typed
        text = "\n".join(lines).strip("\n")
        return text

    def _read_line(self, prompt: str) -> str | None:
        try:
            line = input(prompt)
        except EOFError:
            return None
        # Bracketed pastes and raw terminals may carry carriage returns as line ends.
        return line.replace("\r\n", "\n").replace("\r", "\n")

    def _more_waiting(self) -> bool:
        # Only readline leaves the unread rest of a paste in the terminal (it reads byte by byte);
        # a buffered reader would already hold it, and piped input is one message per line.
        if not self.uses_readline or self._fd is None:
            return False
        try:
            ready, _, _ = select.select([self._fd], [], [], PASTE_WINDOW_S)
        except (OSError, ValueError):
            return False
        return bool(ready)

    def restore(self) -> None:
        """Put the terminal back as it was at start (an abandoned readline leaves it raw)."""
        if self._saved_tty is None or self._fd is None:
            return
        import termios

        try:
            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved_tty)
            if self.uses_readline:
                self.stdout.write("\x1b[?2004l")  # bracketed paste off, as readline does when it returns
                self.stdout.flush()
        except (termios.error, OSError, ValueError):
            pass
