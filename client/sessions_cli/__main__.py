"""Inspect and maintain a session store: ``python -m muxworker.sessions DIR COMMAND``.

    list                     every saved session: id, tokens, size, segments, dtype, model identity, times
    show ID                  one session in full, with its files
    delete ID...             remove saved sessions (live sessions in a worker are untouched)
    prune --older-than T     delete the sessions last saved more than T ago (T: 3600, 90m, 12h, 7d)
    verify [ID...]           read every byte and check every checksum (all sessions by default)
    clean                    remove what killed writers left (temp files, unpublished segments) and
                             shared blocks no session names, only when no writer holds the store;
                             a manifest it cannot read keeps its session's segments and every block
    migrate                  convert checkpoint files of versions 1 and 2 (one file per session, or
                             one save_checkpoint file) to version 3, in place; run it once, with no
                             worker saving, after upgrading from a release that wrote them

The commands that change the store (delete, prune, clean, migrate) take its shared writers' lock:
they run beside ``--shared-store`` servers and the chat app, but not beside a server that holds
the store alone (the default), whose sessions are deleted through its HTTP API.

Exit status: 0 on success, 1 when a session is missing, cannot be deleted or fails verification, or
``clean`` met a manifest it could not read, or ``migrate`` a file it could not convert; 2 on a usage error or when the store cannot be used
(``clean`` while a writer holds it, a change while a server holds the store alone). Errors are one
line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from collections.abc import Sequence

from muxworker.client import MuxError, SessionInfo, SessionStore, StoreBusy

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Seconds in ``3600``, ``90m``, ``12h``, ``7d``, ``2w``."""
    match = _DURATION.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 3600, 90m, 12h or 7d")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _time(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _table(infos: Sequence[SessionInfo]) -> str:
    rows = [["session", "tokens", "MiB", "segments", "dtype", "identity", "created", "saved"]]
    for i in infos:
        rows.append(
            [
                i.session_id,
                f"{i.tokens}",
                _mib(i.nbytes),
                f"{i.segments}",
                i.dtype,
                (i.identity or "-")[:12],
                _time(i.created),
                _time(i.saved),
            ]
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    right = {1, 2, 3}
    return "\n".join(
        "  ".join(
            cell.rjust(w) if c in right else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m muxworker.sessions",
        description="Inspect and maintain a muxworker session store.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    p.add_argument("store", metavar="DIR", help="the session store directory")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("list", help="every saved session")
    show = sub.add_parser("show", help="one session in full")
    show.add_argument("session_id", metavar="ID")
    delete = sub.add_parser("delete", help="remove saved sessions")
    delete.add_argument("session_ids", metavar="ID", nargs="+")
    prune = sub.add_parser("prune", help="delete sessions last saved more than T ago")
    prune.add_argument("--older-than", dest="older_than", type=parse_duration, required=True, metavar="T")
    verify = sub.add_parser("verify", help="check every checksum")
    verify.add_argument("session_ids", metavar="ID", nargs="*")
    sub.add_parser(
        "clean", help="remove temp files and unpublished segments of killed writers, and blocks no session names"
    )
    sub.add_parser("migrate", help="convert checkpoint files of versions 1 and 2 to version 3")
    return p


def _error(exc: BaseException | str) -> str:
    """One line naming what failed (messages from the system may span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        store = SessionStore.inspect(args.store)
    except (MuxError, OSError) as exc:
        print(f"error: {_error(exc)}", file=sys.stderr)
        return 2
    if args.command in _WRITES:
        try:
            # Beside --shared-store servers and the chat app, never beside a server that holds the
            # store alone (its sessions are its own: delete them through its HTTP API).
            store.hold(shared=True, role=f"python -m muxworker.sessions {args.command}")
        except (MuxError, OSError) as exc:
            print(f"error: {_error(exc)}", file=sys.stderr)
            return 2
    try:
        return _run(store, args)
    except StoreBusy as exc:
        print(f"error: {_error(exc)}; run clean when no worker or client is saving", file=sys.stderr)
        return 2
    except (MuxError, OSError) as exc:  # the store or the system failed: one line, no traceback
        print(f"error: {_error(exc)}", file=sys.stderr)
        return 2


#: The commands that change the store, and so take its shared writers' lock (list, show and verify read).
_WRITES = {"delete", "prune", "clean", "migrate"}


def _run(store: SessionStore, args: argparse.Namespace) -> int:
    status = 0
    if args.command == "list":
        infos = store.list_info()
        print(_table(infos))
        total = sum(i.nbytes for i in infos)
        print(f"{len(infos)} session(s), {_mib(total)} MiB")
    elif args.command == "show":
        try:
            info = store.info(args.session_id)
            files = [(path, path.lstat().st_size) for path in store.files_of(args.session_id)]
        except (MuxError, OSError) as exc:
            print(f"error: {_error(exc)}", file=sys.stderr)
            return 1
        for key in ("session_id", "tokens", "nbytes", "segments", "dtype", "backend", "identity", "file_version"):
            print(f"{key + ':':14} {getattr(info, key)}")
        print(f"{'created:':14} {_time(info.created)}")
        print(f"{'saved:':14} {_time(info.saved)}")
        for path, size in files:
            print(f"{'file:':14} {path.name} ({size} bytes)")
    elif args.command == "delete":
        for sid in args.session_ids:
            try:
                deleted = store.delete(sid)
            except MuxError as exc:
                print(f"error: {_error(exc)}", file=sys.stderr)
                status = 1
                continue
            if deleted:
                print(f"deleted {sid}")
            else:
                print(f"no saved session {sid!r}", file=sys.stderr)
                status = 1
    elif args.command == "prune":
        for sid in store.prune(args.older_than):
            print(f"deleted {sid}")
    elif args.command == "verify":
        ids = args.session_ids or [i.session_id for i in store.list_info()]
        damaged = store.unreadable() if not args.session_ids else []
        for name, why in damaged:
            print(f"BAD  {name}: {_error(why)}")
            status = 1
        for sid in ids:
            try:
                info = store.verify(sid)
            except MuxError as exc:
                print(f"BAD  {sid}: {_error(exc)}")
                status = 1
            else:
                print(f"ok   {sid} ({info.tokens} tokens, {info.segments} segment(s), {_mib(info.nbytes)} MiB)")
    elif args.command == "migrate":
        from .migrate import migrate

        migrated = migrate(args.store)
        for name, sid in migrated.converted:
            print(f"converted {name} ({'session ' + repr(sid) if sid is not None else 'a checkpoint file'})")
        for name, why in migrated.failed:
            print(f"BAD  {name}: {why}", file=sys.stderr)
            status = 1
        print(f"{len(migrated.converted)} file(s) converted, {len(migrated.failed)} left as they were")
    elif args.command == "clean":
        result = store.clean()
        for name in result.removed:
            print(f"removed {name}")
        print(f"{len(result.removed)} file(s), {_mib(result.nbytes)} MiB")
        if result.unreadable:
            for name, why in result.unreadable:
                print(f"unreadable {name}: {_error(why)}", file=sys.stderr)
            print(
                f"kept {len(result.kept)} file(s) of {len(result.unreadable)} manifest(s) that could not be read "
                "(their sessions' segments, and every block no readable manifest names); run "
                f"`python -m muxworker.sessions {args.store} verify` to see why, then restore or delete them",
                file=sys.stderr,
            )
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
