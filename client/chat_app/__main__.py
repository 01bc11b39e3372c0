"""python -m muxworker.chat [--session NAME] [--store DIR|URL] [--model PATH] [sampling flags]

The terminal chat. How it keeps a conversation (see also the package docstring):

- Ctrl-C is an event, not a crash: during a reply it stops that reply (the text so far stays in
  the conversation) and returns to the prompt; at the prompt it saves and quits, like Ctrl-D.
- After every reply the session is saved (transcript, then KV checkpoint), so a crash or a kill
  loses at most the reply in progress.
- A session that cannot be resumed (a damaged file, another model or dtype) is never written to:
  the chat says why and offers a new session under a free name, or exits leaving it as it was.
- ``/reset`` deletes the session's saved files, so the next start does not bring it back.
"""

from __future__ import annotations

import argparse
import signal
import sys
import textwrap
import time
from pathlib import Path

import trio

from muxworker.client import (
    CheckpointIncompatible,
    CheckpointNotFound,
    ContextOverflow,
    MultiplexedWorkerClient,
    MuxError,
    SessionStore,
    StoreBinding,
    WorkerDiedError,
    WorkerStartupError,
    open_store,
    spawn_multiplexed_worker,
)
from muxworker.client.stores import session_hash
from muxworker.worker.models.defaults import DTYPE_CHOICES, WEIGHTS_CHOICES
from muxworker.worker.models.loader import ModelLoadError, resolve_model
from muxworker.worker.options import UsageError
from muxworker.worker.spec import WorkerSpec

from . import (
    CHAT_SAMPLING_DEFAULTS,
    Conversation,
    ReplyInterrupt,
    TranscriptError,
    chat_sampling,
    check_sampling,
    default_store_dir,
    describe_sampling,
    generation_params,
    recap,
)
from ._terminal import BLOCK_DELIMITER, LineReader

KEYS_HELP = f"""\
keys and commands:
  Enter         send the message; a paste of several lines is sent as one message
  {BLOCK_DELIMITER}           on a line of its own: start a block of lines, sent as one message
                when a line ends with {BLOCK_DELIMITER}
  Ctrl-C        during a reply: stop it (the text so far stays in the conversation);
                at the prompt: save and quit
  Ctrl-D        save and quit
  /save         save now (the chat also saves after every reply)
  /reset        forget the conversation, here and in the store
  /quit         save and quit
  /help         this list"""

SAMPLING_HELP = (
    "Sampling: flags win; then the model's generation_config.json (do_sample, temperature, top_p, "
    "top_k, min_p, repetition_penalty); else the chat defaults "
    + ", ".join(
        f"{k} {v:g}" for k, v in CHAT_SAMPLING_DEFAULTS.items() if k in ("temperature", "top_p", "repetition_penalty")
    )
    + " (greedy decoding loops on small models). --temperature 0 is greedy."
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m muxworker.chat",
        description=textwrap.fill("Terminal chat with resumable sessions. " + SAMPLING_HELP, 100),
        epilog=KEYS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--session", default="default", help="session name; resumed from the store if saved (default: default)"
    )
    p.add_argument(
        "--store",
        default=None,
        help=f"session store: a directory, or s3://bucket/prefix (gs://, az://) with credentials from the "
        f"environment (default: {default_store_dir()})",
    )
    p.add_argument(
        "--transcripts",
        type=Path,
        default=None,
        help="directory of the conversations' transcripts (default: the store directory's transcripts/, or "
        f"{default_store_dir() / 'transcripts'} for a store on object storage)",
    )
    p.add_argument(
        "--model", default=None, help="HF model directory or .gguf (default: the bundled SmolLM2-135M-Instruct)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="activation and KV dtype (default: auto, the worker's --dtype auto); a session resumes only with "
        "the dtype and weights it was saved with",
    )
    p.add_argument(
        "--weights",
        default=None,
        choices=WEIGHTS_CHOICES,
        help="the worker's --weights (default: quantized for a GGUF, float otherwise)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads for the worker (default: one per physical core)"
    )
    p.add_argument(
        "--max_new_tokens", type=int, default=256, help="reply length limit; -1: the rest of the context (default: 256)"
    )
    p.add_argument("--max_session_tokens", type=int, default=4096, help="tokens one conversation holds (default: 4096)")
    s = p.add_argument_group("sampling (default: the model's generation_config.json, else the chat defaults)")
    d = CHAT_SAMPLING_DEFAULTS
    s.add_argument("--temperature", type=float, default=None, help=f"0: greedy (chat default {d['temperature']:g})")
    s.add_argument("--top_p", type=float, default=None, help=f"nucleus sampling mass (chat default {d['top_p']:g})")
    s.add_argument("--top_k", type=int, default=None, help="keep the k most likely tokens; 0: off (chat default 0)")
    s.add_argument(
        "--min_p",
        type=float,
        default=None,
        help="drop tokens below min_p x the top probability; 0: off (chat default 0)",
    )
    s.add_argument(
        "--repetition_penalty",
        type=float,
        default=None,
        help=f"> 1 discourages repeats; 1: off (chat default {d['repetition_penalty']:g})",
    )
    s.add_argument(
        "--presence_penalty", type=float, default=None, help="-2..2, > 0 favours new tokens; 0: off (chat default 0)"
    )
    return p


def _info(msg: str) -> None:
    print(f"[{msg}]", file=sys.stderr, flush=True)


def _echo(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


class _Chat:
    """One run of the chat. Owner: the main task; the signal task only reads ``state`` and calls
    the cancel/interrupt handles set beside it."""

    def __init__(
        self,
        args: argparse.Namespace,
        model_dir: Path,
        reader: LineReader,
        sampling: dict[str, float],
        sampling_source: str,
    ) -> None:
        self.args = args
        self.model_dir = model_dir
        self.reader = reader
        self.sampling, self.sampling_source = sampling, sampling_source
        # "starting" (nothing to save yet) | "prompt" | "reply" | "busy" (a command or a save)
        self.state = "starting"
        self.quit = False  # save and exit once the current step ends
        self.top = trio.CancelScope()  # cancelled to give up at once (start-up, or a repeated Ctrl-C)
        self.prompt_scope: trio.CancelScope | None = None
        self.interrupt: ReplyInterrupt | None = None
        self.store: StoreBinding | None = None
        self.transcripts: Path | None = None
        self.name = args.session
        self.conv = Conversation(self.name)
        self.transcript_dirty = False
        self.checkpoint_dirty = False

    # -- signals ----------------------------------------------------------------------------------

    async def run(self) -> int:
        rc = 130
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_signals, signals)
                with self.top:
                    rc = await self._main(nursery)
                if self.top.cancelled_caught and self.state == "starting":
                    _info("stopped before the session started; nothing was changed")
                nursery.cancel_scope.cancel()
        return rc

    async def _watch_signals(self, signals) -> None:
        async for signum in signals:
            if self.state == "starting":
                self.top.cancel()  # nothing has changed yet, so nothing needs saving
            elif self.state == "reply" and self.interrupt is not None and not self.interrupt.requested:
                self.interrupt.request()
                if signum != signal.SIGINT:
                    self.quit = True
            elif self.state == "prompt" and self.prompt_scope is not None:
                self.quit = True
                self.prompt_scope.cancel()
            elif self.quit:
                # Asked twice while a step (a save, a stopping reply) would not end: stop waiting.
                # Every file is replaced atomically, so the last completed save stays intact.
                _info("giving up; the last saved state is kept")
                self.top.cancel()
            else:
                self.quit = True

    # -- start-up ---------------------------------------------------------------------------------

    async def _main(self, nursery: trio.Nursery) -> int:
        args = self.args
        store_dir = args.store or str(default_store_dir())
        try:
            # Out of the terminal's process group: Ctrl-C is the chat's to handle.
            spec = WorkerSpec.of(
                self.model_dir,
                own_process_group=True,
                dtype=args.dtype,
                weights=args.weights,
                device=args.device,
                threads=args.threads,
                max_sessions=1,
                max_session_tokens=args.max_session_tokens,
            )
        except UsageError as exc:
            _info(f"bad worker setting: {exc}")
            return 2
        try:
            # The shared writers' lock of a directory store: beside other chats, the sessions
            # command and --shared-store servers, never beside a server that holds it alone.
            self.store = await open_store(
                store_dir, **spec.store_identity(), hold="shared", role="python -m muxworker.chat"
            )
            session_hash(self.name)  # checks the session name
            if args.transcripts is not None:
                self.transcripts = args.transcripts
            elif isinstance(self.store, SessionStore):
                self.transcripts = self.store.path / "transcripts"
            else:
                self.transcripts = default_store_dir() / "transcripts"
            self.transcripts.mkdir(mode=0o700, parents=True, exist_ok=True)
        except (MuxError, OSError) as exc:
            _info(f"cannot use the session store {store_dir}: {exc}")
            return 1
        command = spec.command()
        progress = _Progress("loading model: starting the worker")
        nursery.start_soon(progress.run)
        t0 = time.perf_counter()
        try:
            async with spawn_multiplexed_worker(command, session_store=self.store) as client:
                progress.stop()
                info = client.info
                if info is not None:
                    _info(
                        f"model ready: {info.model.name} ({info.dtype}, {info.device}) in {time.perf_counter() - t0:.1f} s"
                    )
                return await self._session(client)
        except WorkerStartupError as exc:
            progress.stop()
            _info(f"the worker did not start: {exc}")
            return 1
        except WorkerDiedError as exc:
            _info(str(exc))
            if self.conv.messages:
                _info(f"the conversation up to the last reply is saved in {self._transcript_path(self.name)}")
            return 1
        finally:
            progress.stop()

    def _transcript_path(self, name: str) -> Path:
        assert self.transcripts is not None
        return self.transcripts / f"{session_hash(name)}.json"

    def _where(self, name: str) -> str:
        """Where ``name``'s checkpoint is saved (for messages)."""
        assert self.store is not None
        if isinstance(self.store, SessionStore):
            return str(self.store.path_for(name))
        return f"{self.store.location}/{session_hash(name)}.mxckpt"

    def _saved(self, name: str) -> bool:
        """Whether the store holds something under ``name`` (blocking: a file or an object store)."""
        assert self.store is not None
        if isinstance(self.store, SessionStore):
            return self.store.path_for(name).exists()
        try:
            self.store.info(name)
        except CheckpointNotFound:
            return False
        except MuxError:
            return True  # there, but unreadable: the resume says why
        return True

    async def _open(self, client: MultiplexedWorkerClient) -> bool:
        """Resume ``self.name`` or start it fresh; on a failed resume offer a new name. Returns
        whether there is a session to chat in."""
        assert self.store is not None
        name = self.name
        transcript, checkpoint = self._transcript_path(name), self._where(name)
        if not transcript.exists() and not await trio.to_thread.run_sync(self._saved, name):
            await client.open_session(name)
            _info(f"new session {name!r}; Ctrl-C stops a reply, Ctrl-D saves and quits, /help lists the commands")
            return True
        try:
            if not transcript.exists():
                raise TranscriptError(
                    f"its checkpoint {checkpoint} has no transcript ({transcript}), so its messages are unknown"
                )
            conv = await trio.to_thread.run_sync(Conversation.load, transcript)
            if conv.session_id != name:
                raise TranscriptError(f"transcript {transcript} belongs to session {conv.session_id!r}")
            if not conv.messages:
                # An emptied transcript is a /reset that stopped before it deleted the checkpoint:
                # deleted now (a new session's save finds nothing in its place).
                await trio.to_thread.run_sync(self.store.delete, name)
                await client.open_session(name)
                _info(f"new session {name!r} (it was reset); /help lists the commands")
                return True
            try:
                await client.resume_session(name)
            except CheckpointNotFound:
                await client.open_session(name)
                self.conv = conv
                self.checkpoint_dirty = True
                _info(
                    f"resumed session {name!r} from its transcript: {len(conv.messages)} messages; "
                    f"no KV checkpoint was saved, so the next turn prefills {len(conv.history_ids)} tokens"
                )
            else:
                self.conv = conv
                _info(
                    f"resumed session {name!r}: {len(conv.history_ids)} tokens restored, {len(conv.messages)} messages"
                )
        except WorkerDiedError:
            raise
        except (TranscriptError, MuxError) as exc:
            return await self._offer_new_name(client, exc)
        lines = recap(self.conv)
        if lines:
            _info("the last exchange")
            for line in lines:
                print(f"  {line}", file=sys.stderr, flush=True)
        return True

    async def _offer_new_name(self, client: MultiplexedWorkerClient, exc: BaseException) -> bool:
        assert self.store is not None
        name = self.name
        _info(f"cannot resume session {name!r}: {exc}")
        if isinstance(exc, CheckpointIncompatible):
            _info("it was saved with another model or configuration (--model, --dtype); start with those to resume it")
        _info(f"its files are left as they are: {self._where(name)}, {self._transcript_path(name)}")
        fresh = await trio.to_thread.run_sync(self._free_name, name)
        answer = await trio.to_thread.run_sync(
            self.reader.ask, f"start a new session under {fresh!r}? [y/N] ", abandon_on_cancel=True
        )
        if answer is None or answer.strip().lower() not in ("y", "yes"):
            _info(f"exiting; session {name!r} is untouched")
            return False
        self.name = fresh
        self.conv = Conversation(fresh)
        await client.open_session(fresh)
        _info(f"new session {fresh!r}; /help lists the commands")
        return True

    def _free_name(self, name: str) -> str:
        assert self.store is not None
        n = 2
        while True:
            candidate = f"{name}-{n}"
            if not self._transcript_path(candidate).exists() and not self._saved(candidate):
                return candidate
            n += 1

    # -- the conversation -------------------------------------------------------------------------

    async def _session(self, client: MultiplexedWorkerClient) -> int:
        """Raises WorkerDiedError once the conversation's transcript is saved as far as it got."""
        if not await self._open(client):
            return 1
        self.params = generation_params(self.name, self.args.max_new_tokens, self.sampling)
        _info(f"sampling: {describe_sampling(self.sampling)} (from {self.sampling_source})")
        try:
            await self._loop(client)
            self.state = "busy"
            await self._save(client, announce=True)
        except BaseException:
            # A crash here: keep the conversation even if the worker is unusable. Every completed
            # turn was saved already; this covers one that ended without its save.
            with trio.CancelScope(shield=True):
                await self._save_transcript()
            raise
        return 0

    async def _loop(self, client: MultiplexedWorkerClient) -> None:
        while not self.quit:
            self.state = "prompt"
            with trio.CancelScope() as self.prompt_scope:
                text = await trio.to_thread.run_sync(self.reader.read_message, "you> ", abandon_on_cancel=True)
            cut = self.prompt_scope.cancelled_caught
            self.prompt_scope = None
            self.state = "busy"
            if cut or text is None:  # Ctrl-C at the prompt, or Ctrl-D
                if cut or not self.reader.uses_readline:  # readline ends the line itself at EOF
                    print(file=sys.stdout, flush=True)
                return
            message = text.strip()
            if not message:
                continue
            if "\n" not in message and message.startswith("/"):
                if message in ("/quit", "/exit", "/bye"):
                    return
                if message == "/save":
                    await self._save(client, announce=True)
                elif message == "/reset":
                    await self._reset(client)
                elif message in ("/help", "/?"):
                    print(KEYS_HELP, file=sys.stderr, flush=True)
                else:
                    _info(f"unknown command {message}; /help lists the commands")
                continue
            await self._turn(client, message)

    async def _turn(self, client: MultiplexedWorkerClient, message: str) -> None:
        self.interrupt = ReplyInterrupt()
        self.state = "reply"
        _echo("assistant> ")
        try:
            turn = await self.conv.send(client, message, self.params, echo=_echo, interrupt=self.interrupt)
        except WorkerDiedError:
            _echo("\n")
            raise
        except MuxError as exc:
            # A request error ends this request only; the conversation is as it was before it.
            _echo("\n")
            _info(f"error: {exc}")
            if isinstance(exc, ContextOverflow):
                _info("the conversation is full: /reset starts over, or restart with a larger --max_session_tokens")
            return
        finally:
            self.state = "busy"
            self.interrupt = None
        _echo("\n")
        r = turn.result
        if not turn.interrupted:
            _info(
                f"{r.completion_tokens} tokens, prefilled {r.prefilled_prompt_tokens}, reused {r.reused_prompt_tokens}, "
                f"first token {turn.first_token_s * 1000:.0f} ms"
            )
        elif turn.kept:
            _info(
                f"reply stopped: kept {len(self.conv.history_ids) - r.prompt_tokens} tokens; "
                f"prefilled {r.prefilled_prompt_tokens}, reused {r.reused_prompt_tokens}"
            )
        else:
            _info("reply stopped before its first token; the message was dropped")
        if turn.kept:
            self.transcript_dirty = self.checkpoint_dirty = True
            await self._save(client, announce=False)

    # -- saving -----------------------------------------------------------------------------------

    async def _save_transcript(self) -> bool:
        if not self.transcript_dirty:
            return True
        try:
            await trio.to_thread.run_sync(self.conv.save, self._transcript_path(self.name))
        except OSError as exc:
            _info(f"transcript not saved: {exc}")
            return False
        self.transcript_dirty = False
        return True

    async def _save(self, client: MultiplexedWorkerClient, *, announce: bool) -> None:
        """Transcript first, then the checkpoint: if only the first lands, the next start still has
        the whole conversation and recomputes the KV the checkpoint lacks."""
        assert self.store is not None
        if not self.conv.messages:
            if announce:
                _info("nothing to save")
            return
        saved = await self._save_transcript()
        if self.checkpoint_dirty:
            try:
                await client.save_session(self.name)
            except WorkerDiedError:
                raise
            except (MuxError, OSError) as exc:
                _info(f"KV checkpoint not saved ({exc}); the conversation is saved, and its KV is recomputed on resume")
                return
            self.checkpoint_dirty = False
        if announce and saved:
            _info(f"saved {len(self.conv.history_ids)} tokens to {self._where(self.name)}")

    async def _reset(self, client: MultiplexedWorkerClient) -> None:
        assert self.store is not None
        await client.reset_session(self.name)
        self.conv = Conversation(self.name)
        transcript = self._transcript_path(self.name)
        try:
            # An empty transcript first: should the deletes not happen, the next start still
            # sees a reset conversation rather than the checkpoint's.
            await trio.to_thread.run_sync(self.conv.save, transcript)
            await trio.to_thread.run_sync(self.store.delete, self.name)
            transcript.unlink(missing_ok=True)
        except (MuxError, OSError) as exc:
            _info(f"session reset, but its saved files could not all be deleted: {exc}")
        else:
            _info("session reset; its saved files are deleted")
        self.transcript_dirty = self.checkpoint_dirty = False


class _Progress:
    """A progress line until :meth:`stop`: elapsed seconds on a terminal, one line elsewhere."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.done = trio.Event()
        self.tty = sys.stderr.isatty()

    async def run(self) -> None:
        t0 = time.monotonic()
        if not self.tty and not self.done.is_set():
            _info(f"{self.label} ...")
        while not self.done.is_set():
            if self.tty:
                sys.stderr.write(f"\r[{self.label}... {time.monotonic() - t0:.0f} s]")
                sys.stderr.flush()
            with trio.move_on_after(1):
                await self.done.wait()

    def stop(self) -> None:
        """Idempotent; clears the line here, so nothing printed next lands after it."""
        if self.done.is_set():
            return
        self.done.set()
        if self.tty:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Resolve (and on first use convert) the model here, so its progress shows on this terminal
    # and the store is bound to the exact files the worker will load.
    _info(f"loading model {args.model or 'SmolLM2-135M-Instruct (bundled)'}")
    try:
        model_dir = resolve_model(args.model, progress=sys.stderr)
    except KeyboardInterrupt:
        return 130
    except (ModelLoadError, OSError) as exc:
        _info(f"cannot load the model: {exc}")
        return 2
    sampling, source = chat_sampling(model_dir, {k: getattr(args, k) for k in CHAT_SAMPLING_DEFAULTS})
    try:
        check_sampling(sampling, args.max_new_tokens)
    except MuxError as exc:
        _info(f"invalid sampling settings ({source}): {exc}")
        return 2
    reader = LineReader()
    try:
        return trio.run(_Chat(args, model_dir, reader, sampling, source).run)
    except KeyboardInterrupt:
        return 130
    finally:
        reader.restore()


if __name__ == "__main__":
    sys.exit(main())
