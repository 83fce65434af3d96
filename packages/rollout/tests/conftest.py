"""Puts the repo's `tests/` folder (the shared `patrl_testkit`) on sys.path, so this folder's
tests also run without the root pyproject's `pythonpath` (e.g. `pytest -c <package>/pyproject.toml`),
and, as the root conftest does, runs Triton kernels under the interpreter where CUDA is absent
(set before any test module imports triton, which reads it then and while kernels run)."""

import os
import sys
from pathlib import Path

import torch

_SHARED = str(Path(__file__).resolve().parents[3] / "tests")
if _SHARED not in sys.path:
    sys.path.insert(0, _SHARED)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
