"""File-system situations tests need: a small real tmpfs (a full disk, a read-only remount) and
things that are not regular files where a store expects one."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``256k``, ``24m``) mounted at ``mount_point`` for the block; skips the
    test where mounting is not allowed (it needs root, as CI and the developers here have)."""
    mount_point.mkdir(exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def place_unusable(kind: str, path: Path, outside: Path) -> None:
    """Put a symlink (to ``outside``), a FIFO or a non-empty directory at a manifest's path."""
    if kind == "symlink":
        path.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        (path / "inner").mkdir(parents=True)
        (path / "inner" / "file").write_bytes(b"x")
        (path / "link").symlink_to(outside)  # removed, never followed
