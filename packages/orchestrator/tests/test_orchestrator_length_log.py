"""The run's length log: what a step appends, what a resumed run redoes, a crash's half line,
and that `patrl.lenpredict` reads it as is."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from patrl.lenpredict import group_by_rollout, read_lengths
from patrl.orchestrator.length_log import LENGTH_LOG, append_lengths


@dataclass
class FakeSample:
    prompt_index: int
    token_ids: list[int]
    finish_reason: str = "stop"
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])


def batch(lengths: dict[int, list[int]]) -> list[FakeSample]:
    return [
        FakeSample(p, list(range(n)), "length" if n == 8 else "stop")
        for p, ns in lengths.items()
        for n in ns
    ]


def test_steps_append_rollouts_the_simulator_reads(tmp_path: Path) -> None:
    append_lengths(tmp_path, 1, batch({7: [3, 8], 9: [5, 1]}))
    append_lengths(tmp_path, 2, batch({7: [2, 2]}), round_=0)
    append_lengths(tmp_path, 2, batch({4: [6, 4]}), round_=1)  # DAPO's second round
    append_lengths(tmp_path, 3, [FakeSample(5, [])])  # nothing to simulate: nothing written
    records = read_lengths(tmp_path / LENGTH_LOG)
    assert [(r.step, r.round, r.prompt_id, r.sample, r.response_tokens) for r in records] == [
        (1, 0, "7", 0, 3), (1, 0, "7", 1, 8), (1, 0, "9", 0, 5), (1, 0, "9", 1, 1),
        (2, 0, "7", 0, 2), (2, 0, "7", 1, 2), (2, 1, "4", 0, 6), (2, 1, "4", 1, 4),
    ]  # fmt: skip
    assert records[1].finish_reason == "length" and records[0].prompt_tokens == 3
    assert list(group_by_rollout(records)) == [(1, 0), (2, 0), (2, 1)]


def test_a_resumed_run_replaces_the_steps_it_redoes(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        append_lengths(tmp_path, step, batch({step: [step, step]}))
    append_lengths(tmp_path, 3, batch({30: [9, 9, 9]}))  # resumed from step 2: step 3 again
    append_lengths(tmp_path, 4, batch({40: [4]}))
    records = read_lengths(tmp_path / LENGTH_LOG)
    assert [(r.step, r.prompt_id) for r in records] == [
        (1, "1"), (1, "1"), (2, "2"), (2, "2"), (3, "30"), (3, "30"), (3, "30"), (4, "40"),
    ]  # fmt: skip


def test_a_half_written_line_is_dropped_at_the_next_step(tmp_path: Path) -> None:
    append_lengths(tmp_path, 1, batch({1: [2]}))
    path = tmp_path / LENGTH_LOG
    path.write_text(path.read_text() + '{"step": 2, "prompt_id": "1", "sam')  # crash mid-write
    append_lengths(tmp_path, 2, batch({1: [5]}))
    assert [(r.step, r.response_tokens) for r in read_lengths(path)] == [(1, 2), (2, 5)]
    assert not list(tmp_path.glob(".*.tmp"))
