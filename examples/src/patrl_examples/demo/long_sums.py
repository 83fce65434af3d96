"""Long sums: the tool demo's task on which calling the calculator pays.

A problem is two to four numbers of two or three digits written as the expression to add,
`Add: 325+267+630`, answered `\\boxed{1222}`. By hand (running sums, `325+267=592`, or a bare
total) a model as small as the demo's mostly gets them wrong; a calculator call copies the
expression from the prompt as it stands (`{"expression": "325+267+630"}`) and boxes the tool's
answer, which it mostly gets right. The plain demo's labelled single digits are the other way
round: there the worked lines beat a call, whose addends the model must pick out by counting.
Gold answers are plain numbers.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LongSumsConfig(BaseModel):
    """How problems are drawn: a count of numbers uniform in [min_numbers, max_numbers], each
    uniform in [min_number, max_number]. Part of the tool demo's cache key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_number: int = Field(10, ge=0)
    max_number: int = Field(999, ge=1)
    min_numbers: int = Field(2, ge=2)
    max_numbers: int = Field(4, ge=2)

    @model_validator(mode="after")
    def _ranges(self) -> LongSumsConfig:
        if self.min_number > self.max_number or self.min_numbers > self.max_numbers:
            raise ValueError(
                f"empty range: numbers {self.min_number}-{self.max_number}, "
                f"counts {self.min_numbers}-{self.max_numbers}"
            )
        return self


@dataclass(frozen=True, slots=True)
class SumProblem:
    """Numbers to add; the same answer interface as the plain demo's `task.Problem`."""

    addends: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.addends) < 2 or any(x < 0 for x in self.addends):
            raise ValueError(f"a sum of two or more non-negative numbers, got {self.addends}")

    @property
    def expression(self) -> str:
        return "+".join(str(x) for x in self.addends)

    @property
    def prompt(self) -> str:
        return f"Add: {self.expression}"

    @property
    def answer(self) -> int:
        return sum(self.addends)

    @property
    def num_steps(self) -> int:
        return len(self.addends) - 1

    def solution(self) -> str:
        """By hand: one line per running sum (`325+267=592`), then the boxed total."""
        total = self.addends[0]
        lines = []
        for x in self.addends[1:]:
            lines.append(f"{total}+{x}={total + x}")
            total += x
        lines.append(f"\\boxed{{{total}}}")
        return "\n".join(lines)

    def direct_solution(self) -> str:
        return f"\\boxed{{{self.answer}}}"

    def record(self) -> dict[str, object]:
        return {"prompt": self.prompt, "answer": str(self.answer), "num_steps": self.num_steps}


def draw_problem(rng: random.Random, config: LongSumsConfig) -> SumProblem:
    count = rng.randint(config.min_numbers, config.max_numbers)
    return SumProblem(
        tuple(rng.randint(config.min_number, config.max_number) for _ in range(count))
    )


def iter_problems(seed: int, config: LongSumsConfig) -> Iterator[SumProblem]:
    """An endless, reproducible stream of problems."""
    rng = random.Random(seed)
    while True:
        yield draw_problem(rng, config)


def generate_problems(n: int, seed: int, config: LongSumsConfig | None = None) -> list[SumProblem]:
    stream = iter_problems(seed, config or LongSumsConfig())
    return [next(stream) for _ in range(n)]
