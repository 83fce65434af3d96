"""`LengthGroups`, the length model's one writer: each finished response updates the model
exactly once, whether an adaptive engine's controller learnt it during the rollout (`learn`)
or the schedule reports it after (`learn_groups`), in each case the sync schedule has: a
static engine, an adaptive one, a partial rollout resumed in a later one, and responses the
schedule does not report (validation)."""

from __future__ import annotations

from collections import Counter

from patrl.lenpredict import LengthPredictor
from patrl.rollout.adaptive import LengthGroups


class RecordingPredictor(LengthPredictor):
    """Counts the writes of every finished sample, by (prompt, length)."""

    def __init__(self) -> None:
        super().__init__()
        self.observed: Counter[tuple[str, int]] = Counter()
        self.prompt_of: dict[str, str] = {}

    def start_group(self, group_id: str, prompt_id: str, size: int) -> None:
        super().start_group(group_id, prompt_id, size)
        self.prompt_of[group_id] = prompt_id

    def observe_finished(self, seq_id: str, group_id: str, length: int) -> None:
        self.observed[(self.prompt_of[group_id], length)] += 1
        super().observe_finished(seq_id, group_id, length)


# two prompts' groups as the schedule reports them: (key, [(request id, length)])
REPORT = [("train/0", [("r0", 12), ("r0", 30)]), ("train/1", [("r1", 7), ("r1", 9)])]
ONCE = Counter({("train/0", 12): 1, ("train/0", 30): 1, ("train/1", 7): 1, ("train/1", 9): 1})


def test_a_static_engines_responses_are_learnt_from_the_report() -> None:
    predictor = RecordingPredictor()
    writer = LengthGroups(predictor)
    writer.new_rollout()
    writer.learn_groups(REPORT)
    assert predictor.observed == ONCE
    # the same calls the schedule made of the predictor itself: the same model, bit for bit
    # (the same float operations in the same order)
    reference = LengthPredictor()
    for g, (key, samples) in enumerate(REPORT):
        reference.start_group(f"g{g}", key, len(samples))
        for i, (_, length) in enumerate(samples):
            reference.observe_finished(f"g{g}:{i}", f"g{g}", length)
    for key in ("train/0", "train/1", "unseen"):
        assert predictor.expected_length(key) == reference.expected_length(key)
    assert predictor.global_mean() == reference.global_mean()
    assert predictor.state_dict()["groups"] == {}  # every group closed


def test_an_adaptive_engines_responses_are_learnt_during_the_rollout_only() -> None:
    predictor = RecordingPredictor()
    writer = LengthGroups(predictor)
    writer.new_rollout()
    writer.learn([("r0", "train/0", 2), ("r1", "train/1", 2)], [("r1", 0, 7, "stop")])
    writer.learn([], [("r1", 1, 9, "length"), ("r0", 0, 12, "stop"), ("r0", 1, 30, "stop")])
    assert predictor.observed == ONCE
    writer.learn_groups(REPORT)  # the schedule's report after the rollout
    assert predictor.observed == ONCE


def test_a_partial_rollouts_request_resumed_later_is_learnt_once() -> None:
    predictor = RecordingPredictor()
    writer = LengthGroups(predictor)
    writer.new_rollout()
    writer.learn([("r0", "train/0", 2), ("r1", "train/1", 2)], [("r1", 0, 7, "stop")])
    writer.learn([], [("r1", 1, 9, "stop")])
    writer.learn_groups([REPORT[1]])  # r1 finished; r0 is buffered, unfinished
    # the next rollout resumes r0 (same id): the controller learns it into its open group
    writer.new_rollout()
    writer.learn([], [("r0", 0, 12, "stop"), ("r0", 1, 30, "stop")])
    writer.learn_groups([REPORT[0]])
    assert predictor.observed == ONCE
    assert predictor.state_dict()["groups"] == {}


def test_unreported_responses_count_once_and_a_missed_one_is_learnt_from_the_report() -> None:
    predictor = RecordingPredictor()
    writer = LengthGroups(predictor)
    writer.new_rollout()  # validation: learnt during the rollout, never reported
    writer.learn([("v0", "validation/0", 1)], [("v0", 0, 5, "stop")])
    writer.new_rollout()
    # the next rollout: r0 was learnt, r1 finished unseen by the controller
    writer.learn([("r0", "train/0", 2)], [("r0", 0, 12, "stop"), ("r0", 1, 30, "stop")])
    writer.learn_groups(REPORT)
    assert predictor.observed == ONCE + Counter({("validation/0", 5): 1})
