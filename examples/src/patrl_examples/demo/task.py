"""The demo's verifiable task: add a list of labelled numbers, writing every running sum.

Each number follows its letter label (`a7 b1 c5`), and each line of the solution restates the
labelled number it adds, then the new running sum (`c5: 8+5=13`): with labels the next addend
is the token after the line's label in the prompt, so a small model need not count its way
along a list of repeating digits. The warm start also sees problems answered by the boxed
total alone; every problem has at least three numbers, which a model this small mostly sums
wrong in one go, so RL has to find out that writing the lines pays. The number of addends is
log-normal: a long tail of long solutions, what adaptive TP exists for. The last line is
`\\boxed{N}` so that math-verify extracts it; gold answers are plain numbers.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

LABELS = "abcdefghijklmnopqrstuvwxyz"
LABELS_MAX = len(LABELS)


class TaskConfig(BaseModel):
    """How problems are drawn. Part of the cache key: change it and the demo is rebuilt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_addend: int = Field(1, ge=0)
    max_addend: int = Field(9, ge=1)
    # log(number of steps) ~ Normal(mu, sigma); steps = addends - 1.
    steps_log_mu: float = 0.5
    steps_log_sigma: float = Field(1.0, gt=0)
    # At least three numbers: two (one step) are summed in one go as reliably as by the lines,
    # so those problems would only dilute what RL can learn (whether the lines pay).
    min_steps: int = Field(2, ge=1)
    # Caps the tail so prompt + response fit the model's 512 positions with room to spare.
    max_steps: int = Field(19, ge=1, le=LABELS_MAX - 1)


@dataclass(frozen=True, slots=True)
class Problem:
    addends: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 2 <= len(self.addends) <= LABELS_MAX:
            raise ValueError(
                f"a problem has 2 to {LABELS_MAX} addends (one per label), got {len(self.addends)}"
            )

    @property
    def prompt(self) -> str:
        return "Add: " + " ".join(f"{LABELS[i]}{x}" for i, x in enumerate(self.addends))

    @property
    def answer(self) -> int:
        return sum(self.addends)

    @property
    def num_steps(self) -> int:
        return len(self.addends) - 1

    def solution(self) -> str:
        """One line per running sum, then the boxed total."""
        total = self.addends[0]
        lines = [f"a{total}: {total}"]
        # strict=False: there are more labels than addends.
        for label, x in zip(LABELS[1:], self.addends[1:], strict=False):
            lines.append(f"{label}{x}: {total}+{x}={total + x}")
            total += x
        lines.append(f"\\boxed{{{total}}}")
        return "\n".join(lines)

    def direct_solution(self) -> str:
        """The boxed total with no work shown: a sum of three or more numbers in one go, which
        a model this small rarely gets right (see SFTConfig.direct_fraction)."""
        return f"\\boxed{{{self.answer}}}"

    def record(self) -> dict[str, object]:
        return {"prompt": self.prompt, "answer": str(self.answer), "num_steps": self.num_steps}


def draw_problem(rng: random.Random, config: TaskConfig) -> Problem:
    steps = math.ceil(math.exp(rng.gauss(config.steps_log_mu, config.steps_log_sigma)))
    steps = min(max(steps, config.min_steps), config.max_steps)
    addends = tuple(rng.randint(config.min_addend, config.max_addend) for _ in range(steps + 1))
    return Problem(addends)


def iter_problems(seed: int, config: TaskConfig) -> Iterator[Problem]:
    """An endless, reproducible stream of problems."""
    rng = random.Random(seed)
    while True:
        yield draw_problem(rng, config)


def generate_problems(n: int, seed: int, config: TaskConfig | None = None) -> list[Problem]:
    stream = iter_problems(seed, config or TaskConfig())
    return [next(stream) for _ in range(n)]


def write_jsonl(problems: list[Problem], path: Path) -> None:
    with path.open("w") as f:
        for p in problems:
            f.write(json.dumps(p.record()) + "\n")


def read_jsonl(path: Path) -> list[dict[str, object]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]
