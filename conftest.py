"""Repo-wide pytest hooks: tests marked `gpu` skip, saying why, where CUDA is absent; there,
Triton kernels run under triton's interpreter. The kit's fixtures are registered here. A test
that runs a job without the `e2e` marker fails, so the fast tier (`-m "not e2e"`) stays fast.

triton reads TRITON_INTERPRET when it is imported and when `@triton.jit` decorates, and again
while a kernel runs, so it is set here, before any test module can import triton, for the whole
process (a CPU machine cannot run compiled Triton kernels anyway). An explicit value wins.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

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
        # the marker, not `"gpu" in item.keywords`: keywords hold every node name, a checkout
        # folder named gpu included
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# Where a job runs in this process (a loop's `run`), and what starts torchrun.
_LOOPS = {"patrl.orchestrator.run": "RunLoop", "patrl.orchestrator.async_loop": "AsyncGRPO"}
_LAUNCHERS = ("torch.distributed.run", "torchrun")


@pytest.fixture(autouse=True)
def _jobs_are_marked_e2e(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test not marked `e2e` that runs a loop in this process or starts torchrun (the
    loops of spawned ranks are not seen: multi-rank jobs are marked by hand)."""
    if request.node.get_closest_marker("e2e") is not None:
        yield
        return
    name = request.node.nodeid

    def refuse(what: str) -> None:
        pytest.fail(f"{name} {what}: mark it @pytest.mark.e2e (a job)", pytrace=False)

    with pytest.MonkeyPatch.context() as patch:
        for module_name, cls_name in _LOOPS.items():
            module = sys.modules.get(module_name)
            if module is not None:
                cls = getattr(module, cls_name)
                patch.setattr(cls, "run", lambda self, _c=cls_name: refuse(f"runs {_c}.run"))
        popen_init = subprocess.Popen.__init__

        def popen(self: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
            argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
            if any(launcher in a for a in argv for launcher in _LAUNCHERS):
                refuse("starts torchrun")
            popen_init(self, args, *rest, **kwargs)

        patch.setattr(subprocess.Popen, "__init__", popen)
        yield
