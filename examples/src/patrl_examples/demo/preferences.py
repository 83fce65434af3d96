"""Synthetic preference pairs of the demo task, for training its reward model (RLHF stage 2).

`chosen` is always the worked, correct solution (`Problem.solution`); `rejected` is one of the
`REJECTED_KINDS` asked for, drawn evenly: a bare correct total (right but unworked), a bare wrong
total, worked lines with one slipped sum carried to a wrong box, or right lines boxed wrong.
`DEFAULT_KINDS` (the unworked ones) teach a tiny RM to prefer working it out, which is what RL on
the demo should find; the worked-but-wrong kinds need an RM that checks sums, the rule reward's job.
Rows are `{"prompt", "chosen", "rejected", "kind", "answer"}`, as `read_preferences` reads them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from patrl_examples.demo.task import LABELS, Problem, TaskConfig, draw_problem

REJECTED_KINDS = ("bare", "bare_wrong", "slip", "wrong_box")
DEFAULT_KINDS = ("bare", "bare_wrong")


def preference_pairs(
    n: int,
    seed: int,
    task: TaskConfig | None = None,
    kinds: tuple[str, ...] = DEFAULT_KINDS,
) -> list[dict[str, Any]]:
    """`n` reproducible preference rows (see the module), the rejected `kinds` in equal shares
    (in a seeded order)."""
    unknown = sorted(set(kinds) - set(REJECTED_KINDS))
    if not kinds or unknown:
        raise ValueError(f"rejected kinds {list(kinds)}; accepted: {list(REJECTED_KINDS)}")
    rng = random.Random(seed)
    config = task or TaskConfig()
    order = [kinds[i % len(kinds)] for i in range(n)]
    rng.shuffle(order)
    rows = []
    for kind in order:
        problem = draw_problem(rng, config)
        rows.append(
            {
                "prompt": problem.prompt,
                "chosen": problem.solution(),
                "rejected": rejected_response(problem, kind, rng),
                "kind": kind,
                "answer": str(problem.answer),
            }
        )
    return rows


def rejected_response(problem: Problem, kind: str, rng: random.Random) -> str:
    """A worse response to `problem` of the given kind (one of REJECTED_KINDS)."""
    if kind == "bare":
        return problem.direct_solution()
    if kind == "bare_wrong":
        return f"\\boxed{{{problem.answer + _offset(rng)}}}"
    if kind == "slip":
        at, slip = rng.randrange(1, len(problem.addends)), _offset(rng)
        if sum(problem.addends[: at + 1]) + slip < 0:  # no negative running sums
            slip = -slip
        return worked_lines(problem.addends, slip_at=at, slip=slip)
    if kind == "wrong_box":
        lines = worked_lines(problem.addends).splitlines()[:-1]
        return "\n".join([*lines, f"\\boxed{{{problem.answer + _offset(rng)}}}"])
    raise ValueError(f"rejected kind {kind!r}; accepted: {REJECTED_KINDS}")


def worked_lines(addends: tuple[int, ...], slip_at: int = 0, slip: int = 0) -> str:
    """`Problem.solution`'s lines, the running sum of line `slip_at` (>= 1) off by `slip` and
    carried on, so the boxed total is off by `slip` too; `slip=0` is the gold solution."""
    total = addends[0]
    lines = [f"a{total}: {total}"]
    for i, (label, x) in enumerate(zip(LABELS[1:], addends[1:], strict=False), start=1):
        new = total + x + (slip if i == slip_at else 0)
        lines.append(f"{label}{x}: {total}+{x}={new}")
        total = new
    lines.append(f"\\boxed{{{total}}}")
    return "\n".join(lines)


def _offset(rng: random.Random) -> int:
    """A small non-zero error, as a small model's wrong sums mostly are."""
    return rng.choice((-3, -2, -1, 1, 2, 3))


def write_preference_splits(
    out_dir: Path,
    num_train: int,
    num_val: int,
    seed: int,
    task: TaskConfig | None = None,
    kinds: tuple[str, ...] = DEFAULT_KINDS,
) -> tuple[Path, Path]:
    """`out_dir/{train,val}.jsonl` from disjoint seeded streams; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.jsonl", out_dir / "val.jsonl"
    for path, n, stream in zip(paths, (num_train, num_val), (1, 2), strict=True):
        rows = preference_pairs(n, seed * 1000 + stream, task, kinds)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths
