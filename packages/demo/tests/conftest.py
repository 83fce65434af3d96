"""Puts the repo's `tests/` folder (the shared `patrl_testkit`) on sys.path, so this folder's
tests also run without the root pyproject's `pythonpath` (e.g. `pytest -c <package>/pyproject.toml`),
and registers the kit's shared fixtures, as the root conftest does."""

import sys
from pathlib import Path

_SHARED = str(Path(__file__).resolve().parents[3] / "tests")
if _SHARED not in sys.path:
    sys.path.insert(0, _SHARED)

from patrl_testkit.fixtures import assets  # noqa: E402, F401
