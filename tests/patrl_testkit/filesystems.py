"""Directories a test process cannot write, for the checks that refuse them up front."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def read_only_dir(path: Path) -> Iterator[Path]:
    """`path` made a directory this process cannot write: a read-only tmpfs where it may mount
    one (root on Linux), else a directory without write permission; the test is skipped where
    neither holds (root without mount)."""
    path.mkdir(parents=True)
    mount = ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)]
    mounted = subprocess.run(mount, capture_output=True).returncode == 0
    if not mounted:
        path.chmod(0o555)
    try:
        if os.access(path, os.W_OK):
            pytest.skip("no read-only directory can be made here (root without mount)")
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)
        else:
            path.chmod(0o755)
