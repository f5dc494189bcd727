"""A real full disk: a small tmpfs mounted for one test, so that writes fail as they do on a disk that fills up
(``ENOSPC`` wherever the kernel says so, not where a fake file object chooses). Mounting needs root: elsewhere
the test is skipped, its reason naming the cause and the fix."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(directory: Path, size: str) -> Iterator[Path]:
    """``directory`` (made if needed) with a tmpfs of ``size`` (``mount``'s form: ``64k``, ``1m``) mounted on it
    until the block ends."""
    if os.geteuid() != 0:
        pytest.skip("a real full disk needs a tmpfs, and mounting one needs root: run this test as root")
    directory.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True, text=True
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({mount.stderr.strip()}): run this test as root with CAP_SYS_ADMIN")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)
