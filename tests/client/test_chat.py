"""`python -m muxworker.chat` driven through a pseudo-terminal that is its controlling terminal, so
Ctrl-C (b"\\x03") reaches it as SIGINT and Ctrl-D (b"\\x04") as end of input, as on a real terminal.

Those runs start a real worker each (slow tier); the chat's conversation logic (``Conversation``)
also runs here over the in-process fake worker with the tiny model's real tokenizer."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from helpers.fake_worker import fake_worker_client

from muxworker.worker.models.defaults import auto_dtype

CTRL_C = b"\x03"
CTRL_D = b"\x04"


def _controlling_terminal() -> None:
    # In the child, after setsid: make the pty (its stdin) the controlling terminal, so the line
    # discipline turns Ctrl-C into SIGINT for the chat's process group.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    def __init__(self, argv, env=None):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            close_fds=True,
            start_new_session=True,
            preexec_fn=_controlling_terminal,
        )
        os.close(slave)
        self.buf = b""
        self.seen = b""  # everything read, for failure messages and whole-run checks

    def expect(self, pattern: str, timeout: float = 120.0) -> re.Match:
        """Read until ``pattern`` appears (a hang guard, not a timing assertion)."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern.encode())
        while True:
            m = rx.search(self.buf)
            if m:
                self.buf = self.buf[m.end() :]
                return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"{pattern!r} not seen; output so far: {self.seen.decode(errors='replace')[-4000:]}"
                )
            r, _, _ = select.select([self.master], [], [], left)
            if r:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    raise AssertionError(
                        f"terminal closed before {pattern!r}; output: {self.seen.decode(errors='replace')[-4000:]}"
                    )
                self.buf += chunk
                self.seen += chunk

    def send(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def send_raw(self, data: bytes) -> None:
        os.write(self.master, data)

    def close(self) -> int:
        """Wait for the chat to exit (reading its output, so it never blocks on a full pty)."""
        deadline = time.monotonic() + 60
        while self.proc.poll() is None and time.monotonic() < deadline:
            r, _, _ = select.select([self.master], [], [], 0.1)
            if r:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:
                    chunk = b""
                self.buf += chunk
                self.seen += chunk
        try:
            return self.proc.wait(timeout=1)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            try:
                os.close(self.master)
            except OSError:
                pass


@pytest.fixture
def chat(tiny_llama_dir, tmp_path):
    """chat(*flags) -> Terminal running the chat on session 't1' in one store for the whole test."""
    made: list[Terminal] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def start(*flags: str) -> Terminal:
        argv = [
            sys.executable, "-m", "muxworker.chat", "--session", "t1", "--store", str(tmp_path / "store"),
            "--model", str(tiny_llama_dir), "--threads", "1", *flags,
        ]  # fmt: skip
        made.append(Terminal(argv, env))
        return made[-1]

    yield start
    for t in made:
        if t.proc.poll() is None:
            t.proc.kill()
            t.proc.wait()


def _store_files(store: Path) -> dict[str, bytes]:
    """Every checkpoint and transcript in the store, by name."""
    files = list(store.glob("*.mxckpt")) + list((store / "transcripts").glob("*.json"))
    return {f.name: f.read_bytes() for f in files}


def _transcript(store: Path) -> dict:
    (path,) = (store / "transcripts").glob("*.json")
    return json.loads(path.read_text())


STATS = r"(\d+) tokens, prefilled (\d+), reused (\d+)"


@pytest.mark.slow
def test_chat_saves_on_quit_and_resumes(chat):
    term = chat("--max_new_tokens", "12")
    term.expect(r"new session 't1'")
    term.expect(r"you> ")
    term.send("Hello there")
    first = term.expect(STATS)
    assert int(first.group(1)) > 0 and int(first.group(3)) == 0
    term.expect(r"you> ")
    term.send("And again")
    second = term.expect(STATS)
    assert int(second.group(3)) > 0  # the second turn extends the first: only the suffix is prefilled
    term.expect(r"you> ")
    term.send("/quit")
    saved = term.expect(r"saved (\d+) tokens")
    assert term.close() == 0

    term = chat("--max_new_tokens", "12")
    restored = term.expect(r"resumed session 't1': (\d+) tokens restored")
    assert restored.group(1) == saved.group(1)
    term.expect(r"you> ")
    term.send("One more")
    third = term.expect(STATS)
    # Everything saved is reused after the restart; the last sampled token (no KV yet) is prefilled.
    assert int(third.group(3)) == int(saved.group(1)) - 1
    term.expect(r"you> ")
    term.send("/quit")
    term.expect(r"saved")
    assert term.close() == 0


@pytest.mark.slow
def test_ctrl_c_stops_the_reply_and_keeps_the_session(chat, tmp_path):
    # Greedy and long: this model does not stop by itself within 2,000 tokens, so the reply is
    # still streaming when Ctrl-C arrives (the worker needs seconds for it, the signal microseconds).
    term = chat("--max_new_tokens", "2000", "--temperature", "0", "--repetition_penalty", "1")
    term.expect(r"you> ")
    term.send("Hello there")
    term.expect(r"assistant> ")
    term.expect(r"(?s).")  # the reply has started
    term.send_raw(CTRL_C)
    stopped = term.expect(r"reply stopped: kept (\d+) tokens; prefilled (\d+), reused (\d+)")
    kept, prompt1 = int(stopped.group(1)), int(stopped.group(2)) + int(stopped.group(3))
    assert 0 < kept < 2000
    term.expect(r"you> ")
    term.send("And again")
    second = term.expect(STATS)
    # The chat's history is exactly what the worker committed for the stopped turn (prompt plus
    # the kept tokens), so all of it is reused but the last token, which had no KV yet.
    assert int(second.group(3)) == prompt1 + kept - 1
    term.expect(r"you> ")
    term.send_raw(CTRL_D)
    saved = term.expect(r"saved (\d+) tokens")
    assert term.close() == 0
    messages = _transcript(tmp_path / "store")["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2
    assert messages[1]["content"]  # the stopped reply's text stays in the conversation

    term = chat("--max_new_tokens", "8")
    assert term.expect(r"resumed session 't1': (\d+) tokens restored").group(1) == saved.group(1)
    term.expect(r"the last exchange")
    term.expect(r"you: And again")
    term.expect(r"assistant: ")
    term.expect(r"you> ")
    term.send("One more")
    third = term.expect(STATS)
    assert int(third.group(3)) == int(saved.group(1)) - 1  # only the new suffix is prefilled
    term.expect(r"you> ")
    term.send_raw(CTRL_C)  # at the prompt: save and quit
    term.expect(r"saved \d+ tokens")
    assert term.close() == 0
    assert len(_transcript(tmp_path / "store")["messages"]) == 6


@pytest.mark.slow
def test_a_paste_and_a_block_are_one_message_each(chat, tmp_path):
    term = chat("--max_new_tokens", "4")
    term.expect(r"you> ")
    term.send("first line\nsecond line\nthird line")  # one write, as a terminal delivers a paste
    term.expect(STATS)
    term.expect(r"you> ")
    term.send('"""\nalpha\n\nbeta\n"""')
    term.expect(STATS)
    term.expect(r"you> ")
    term.send("/quit")
    term.expect(r"saved")
    assert term.close() == 0
    users = [m["content"] for m in _transcript(tmp_path / "store")["messages"] if m["role"] == "user"]
    assert users == ["first line\nsecond line\nthird line", "alpha\n\nbeta"]


@pytest.mark.slow
def test_a_failed_resume_never_touches_the_saved_files(chat, tmp_path):
    store = tmp_path / "store"
    term = chat("--max_new_tokens", "6")
    term.expect(r"you> ")
    term.send("Hello there")
    term.expect(STATS)
    term.expect(r"you> ")
    term.send("/quit")
    term.expect(r"saved")
    assert term.close() == 0
    saved = _store_files(store)
    assert len(saved) == 2

    # Another dtype: the store is bound to the configuration, so the checkpoint is incompatible.
    other = "float32" if auto_dtype("cpu") == "bfloat16" else "bfloat16"  # not what --dtype auto gave
    term = chat("--max_new_tokens", "6", "--dtype", other)
    term.expect(r"cannot resume session 't1'")
    term.expect(r"another model or configuration")
    term.expect(r"start a new session under 't1-2'\? \[y/N\] ")
    term.send("n")
    term.expect(r"session 't1' is untouched")
    assert term.close() == 1
    assert _store_files(store) == saved

    # A damaged checkpoint: accept a fresh session under the new name; the old files stay as they are.
    (ckpt,) = store.glob("*.mxckpt")
    raw = ckpt.read_bytes()
    ckpt.write_bytes(raw[: len(raw) // 2])  # cut short, as a full disk or a crashed copy leaves it
    damaged = _store_files(store)
    term = chat("--max_new_tokens", "6")
    term.expect(r"cannot resume session 't1'")
    term.expect(r"start a new session under 't1-2'\? \[y/N\] ")
    term.send("y")
    term.expect(r"new session 't1-2'")
    term.expect(r"you> ")
    term.send("Hello again")
    term.expect(STATS)
    term.expect(r"you> ")
    term.send_raw(CTRL_D)
    term.expect(r"saved")
    assert term.close() == 0
    after = _store_files(store)
    assert {k: after[k] for k in damaged} == damaged
    assert len(after) == 4  # t1-2's checkpoint and transcript beside t1's


@pytest.mark.slow
def test_reset_is_persisted(chat, tmp_path):
    store = tmp_path / "store"
    term = chat("--max_new_tokens", "6")
    term.expect(r"you> ")
    term.send("Remember this")
    term.expect(STATS)
    term.expect(r"you> ")
    assert len(_store_files(store)) == 2  # saved after the reply, before any quit
    term.send("/reset")
    term.expect(r"session reset")
    term.expect(r"you> ")
    assert _store_files(store) == {}
    term.send("/quit")
    term.expect(r"nothing to save")
    assert term.close() == 0

    term = chat("--max_new_tokens", "6")
    term.expect(r"new session 't1'")
    term.expect(r"you> ")
    term.send_raw(CTRL_D)
    assert term.close() == 0
    assert "resumed" not in term.seen.decode(errors="replace")


def test_sampling_follows_the_generation_config_then_the_chat_defaults(tmp_path):
    from muxworker.chat import CHAT_SAMPLING_DEFAULTS, chat_sampling

    no_flags = dict.fromkeys(CHAT_SAMPLING_DEFAULTS)
    assert chat_sampling(tmp_path, no_flags)[0] == CHAT_SAMPLING_DEFAULTS  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95}))
    sampling, source = chat_sampling(tmp_path, no_flags)
    assert (sampling["temperature"], sampling["top_p"]) == (0.6, 0.95)
    assert sampling["repetition_penalty"] == CHAT_SAMPLING_DEFAULTS["repetition_penalty"]  # unset there
    assert "generation_config" in source
    assert chat_sampling(tmp_path, {**no_flags, "temperature": 0.2})[0]["temperature"] == 0.2  # a flag wins
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert chat_sampling(tmp_path, no_flags)[0]["temperature"] == 0.0  # the model asks for greedy


async def test_the_next_turn_carries_the_templates_real_markers(tiny_llama_dir):
    """The text the chat template adds after the history is sent as SpecialText, so its role markers
    are the special tokens a full render would give, not their characters."""
    from muxworker.chat import Conversation
    from muxworker.client import GenerationParams
    from muxworker.worker.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    async with fake_worker_client(tokenizer=tokenizer, vocab_size=tokenizer.vocab_size) as client:
        await client.open_session("c")
        conv = Conversation("c")
        await conv.send(client, "hello", GenerationParams("c", max_new_tokens=4, temperature=0.0))
        segments = await conv.prompt_for(client, "and again")
        assert len(segments) == 2 and isinstance(segments[1], str)
        suffix_ids = await client.tokenize(segments[1])
        im_start = (await client.tokenize("<|im_start|>", parse_special=True))[0]
        assert im_start in suffix_ids


async def test_an_interrupted_reply_is_kept_and_the_next_turn_reuses_all_of_it(tiny_llama_dir):
    """Ctrl-C's effect on a conversation (ReplyInterrupt) without a terminal: the worker ends the
    reply "cancelled" with the tokens so far, the history holds exactly what it committed, and the
    next turn reuses all of it but the last token (which had no KV yet)."""
    from muxworker.chat import Conversation, ReplyInterrupt
    from muxworker.client import GenerationParams
    from muxworker.worker.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    async with fake_worker_client(tokenizer=tokenizer, vocab_size=tokenizer.vocab_size) as client:
        await client.open_session("c")
        conv = Conversation("c")
        interrupt = ReplyInterrupt()
        params = GenerationParams("c", max_new_tokens=2000, temperature=0.0, stop_token_ids=[])
        turn = await conv.send(client, "Hello there", params, echo=lambda _: interrupt.request(), interrupt=interrupt)
        kept = turn.result.committed_tokens
        assert turn.interrupted and turn.result.finish_reason == "cancelled" and 0 < kept < 2000
        prompt = turn.result.prompt_tokens
        assert conv.history_ids == client.session_tokens("c") and len(conv.history_ids) == prompt + kept
        assert [m["role"] for m in conv.messages] == ["user", "assistant"]
        assert conv.messages[1]["content"] == await client.detokenize(turn.result.generated_token_ids)
        again = await conv.send(client, "And again", GenerationParams("c", max_new_tokens=4, temperature=0.0))
        assert again.result.reused_prompt_tokens == prompt + kept - 1
