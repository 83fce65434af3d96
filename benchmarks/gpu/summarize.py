"""The device check's summary (benchmarks/gpu/check.sh calls it last): each step's exit status,
seconds and test counts from `OUT/steps.txt` and its JUnit XML, and every failed test with its
message, written to `OUT/summary.json` and printed (failures first), so that a run whose logs
do not come back still says what failed.

    python benchmarks/gpu/summarize.py OUT [--pack]

`--pack` then moves the steps' logs and XML into `OUT/logs.tar.gz` (written whole, then
renamed), leaving a handful of files: for a lent machine that returns only a few files.
Exit status: 0 when every step passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

MESSAGE_CHARS = 1500  # of each failure's message kept in summary.json


def failures(junit: Path) -> list[dict[str, str]]:
    """Each failed or erroring test case of a JUnit XML file: its id and message."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    found = []
    for suite in suites:
        for case in suite.iter("testcase"):
            bad = case.find("failure")
            if bad is None:
                bad = case.find("error")
            if bad is None:
                continue
            text = (bad.get("message") or "") + "\n" + (bad.text or "")
            found.append(
                {
                    "test": f"{case.get('classname')}::{case.get('name')}",
                    "message": text.strip()[:MESSAGE_CHARS],
                }
            )
    return found


def counts(junit: Path) -> dict[str, int]:
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    return {
        k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    }


def summarize(out: Path) -> dict[str, Any]:
    """The summary of the steps recorded under `out` (see the module docstring)."""
    steps = []
    for line in (out / "steps.txt").read_text().splitlines():
        if not line.strip():
            continue
        name, status, seconds = line.split()
        step: dict[str, Any] = {
            "name": name,
            "exit_status": int(status),
            "timed_out": int(status) in (124, 137),
            "seconds": int(seconds),
        }
        junit = out / f"{name}.xml"
        if junit.is_file():
            step["tests"] = counts(junit)
            step["failed"] = failures(junit)
        steps.append(step)
    return {"passed": all(s["exit_status"] == 0 for s in steps), "steps": steps}


def pack(out: Path) -> Path:
    """Move `out`'s *.log, *.xml and steps.txt into out/logs.tar.gz (complete or absent)."""
    members = sorted([*out.glob("*.log"), *out.glob("*.xml"), out / "steps.txt"])
    members = [m for m in members if m.is_file()]
    partial = out / "logs.tar.gz.partial"
    with tarfile.open(partial, "w:gz") as tar:
        for member in members:
            tar.add(member, arcname=member.name)
    os.replace(partial, out / "logs.tar.gz")
    for member in members:
        member.unlink()
    return out / "logs.tar.gz"


def report(summary: dict[str, Any]) -> str:
    """A few lines: each step's status and counts, then each failure's first lines."""
    lines = []
    for step in summary["steps"]:
        state = "timed out" if step["timed_out"] else f"exit {step['exit_status']}"
        tests = step.get("tests")
        counted = f", {tests}" if tests else ""
        lines.append(f"{step['name']}: {state}, {step['seconds']} s{counted}")
        for bad in step.get("failed", []):
            first = "\n      ".join(bad["message"].splitlines()[:6])
            lines.append(f"  FAILED {bad['test']}\n      {first}")
    lines.append("passed" if summary["passed"] else "FAILED")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--pack", action="store_true")
    args = parser.parse_args(argv)
    summary = summarize(args.out)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(report(summary))
    if args.pack:
        print(f"logs: {pack(args.out)}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
