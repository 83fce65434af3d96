"""Developer sessions: `nox -s tests`, `lint`, `typecheck`, `bench`, `demo`, `gpu`.

Every session installs the pinned CPU torch first: an unpinned torch would pull several GB of
CUDA packages, and the packages' own `torch>=2.6` range is then satisfied by what is there.
Virtualenvs are reused, so a second `nox -s tests` only re-checks the installs.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests", "lint", "typecheck"]

ROOT = Path(__file__).parent
TORCH = "torch==2.13.0"
# Order matters only for readability: pip resolves them together, the local ones first.
PACKAGES = ["kvstore", "tpreshard", "lenpredict", "rollout", "trainer", "orchestrator"]
# Triton runs the GPU paged-attention kernels' tests on CPU through its interpreter
# (TRITON_INTERPRET=1); its wheels exist for Linux x86-64 only, elsewhere those tests skip.
TRITON = "triton>=3.2; platform_system == 'Linux' and platform_machine == 'x86_64'"
TEST_DEPS = ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3", TRITON]


def install_patrl(session: nox.Session, *extra: str) -> None:
    session.install(TORCH)
    editable: list[str] = []
    for name in PACKAGES:
        editable += ["-e", f"packages/{name}"]
    session.install(*editable, *extra)


@nox.session
def tests(session: nox.Session) -> None:
    """All package tests and the cross-package tests in tests/."""
    install_patrl(session, *TEST_DEPS)
    # One thread per process: multi-rank tests put several ranks on two cores.
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    session.run("pytest", *session.posargs, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over every package's sources."""
    install_patrl(session, "mypy>=1.10")
    session.run("mypy", *[f"packages/{name}/src" for name in PACKAGES])


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark in benchmarks/; each writes JSON under benchmarks/results/."""
    install_patrl(session)
    scripts = sorted((ROOT / "benchmarks").glob("*_bench.py"))
    wanted = set(session.posargs)
    for script in scripts:
        if wanted and script.stem not in wanted:
            continue
        session.run("python", str(script.relative_to(ROOT)))


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: GRPO with adaptive TP on the embedded model and dataset, 2 ranks."""
    install_patrl(session)
    example = ROOT / "examples" / "grpo_adaptive_tp.py"
    if not example.exists():
        session.error(
            "examples/grpo_adaptive_tp.py does not exist yet: it arrives with the orchestrator "
            "issue. Until then `nox -s tests` is the thing to run."
        )
    session.run("torchrun", "--nproc_per_node", "2", str(example), *session.posargs)


@nox.session
def gpu(session: nox.Session) -> None:
    """CUDA-only tests (flash backend, CUDA parity); skipped cleanly on a CPU machine."""
    install_patrl(session, *TEST_DEPS)
    has_cuda = session.run(
        "python", "-c", "import torch; print(torch.cuda.is_available())", silent=True
    )
    if "True" not in str(has_cuda):
        session.skip("no CUDA device here")
    session.run("pytest", "-m", "gpu", *session.posargs)
