"""A file made immutable for a test (``chattr +i``): writes are refused even to root, which a
``chmod`` is not. Skips the test where ``chattr`` is refused (no CAP_LINUX_IMMUTABLE, or a file
system without the flag)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[Path]:
    """``path`` immutable inside the block, writable again after it (also on a failure)."""
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False).returncode != 0:
        pytest.skip("chattr +i is refused here (no CAP_LINUX_IMMUTABLE or no such flag on this file system)")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)
