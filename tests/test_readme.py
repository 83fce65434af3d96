"""The README's promises: two quickstart lines, CI runs the test line verbatim, the config
reference is the one the code generates."""

from __future__ import annotations

import re
from pathlib import Path

from patrl.orchestrator.config import config_reference

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def quickstart_lines() -> list[str]:
    section = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_quickstart_is_two_lines_and_ci_runs_the_test_line() -> None:
    demo, tests = quickstart_lines()
    assert demo.endswith("nox -s demo") and tests.endswith("nox -s tests install_check")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci  # verbatim, on a line of its own
    assert "set -euo pipefail" in ci


def test_config_reference_is_current() -> None:
    start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
    embedded = README.split(start, 1)[1].split(end, 1)[0]
    assert embedded.strip() == config_reference().strip(), (
        "README's config reference is stale: regenerate it from "
        "patrl.orchestrator.config.config_reference()"
    )
