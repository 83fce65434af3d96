"""Puts the repo's `tests/` folder (the shared `patrl_testkit`) on sys.path, so this folder's
tests also run without the root pyproject's `pythonpath`, as the packages' tests/conftest.py
do."""

import sys
from pathlib import Path

_SHARED = str(Path(__file__).resolve().parents[2] / "tests")
if _SHARED not in sys.path:
    sys.path.insert(0, _SHARED)
