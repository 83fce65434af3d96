"""Fixtures shared by the test files (registered by the root conftest.py, and by a package's
tests/conftest.py for runs from that package's folder)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def assets(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`jobs.addition_job` assets (a 2-layer hidden-64 Llama with the demo tokenizer, and a tiny
    a+b dataset), built once per test module."""
    from patrl_testkit.jobs import addition_job  # here: the kit's models import transformers

    return addition_job(tmp_path_factory.mktemp(request.module.__name__))
