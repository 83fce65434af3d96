"""Repo-wide pytest hooks: tests marked `gpu` skip, saying why, where CUDA is absent; there,
Triton kernels run under triton's interpreter. The kit's fixtures are registered here.

triton reads TRITON_INTERPRET when it is imported and when `@triton.jit` decorates, and again
while a kernel runs, so it is set here, before any test module can import triton, for the whole
process (a CPU machine cannot run compiled Triton kernels anyway). An explicit value wins.
"""

from __future__ import annotations

import os

import pytest
import torch

# The kit's shared fixtures (`assets`); `pythonpath` in pyproject.toml puts tests/ on sys.path.
from patrl_testkit.fixtures import assets  # noqa: F401

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `nox -s gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
