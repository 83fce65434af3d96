"""What the adaptive-TP controller needs of a planner and of a length model."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from patrl.lenpredict import Decision, Layout, RunningSet


class StepPrices(Protocol):
    """Predicted seconds of a decode step and of a prefill (lenpredict.LatencyModel)."""

    def step_time(self, tp: int, batch: int, context: int, /) -> np.ndarray | float: ...

    def prefill_time(self, tp: int, lengths: list[int], /) -> float: ...


class Planner(Protocol):
    """Every planner method the controller calls (patrl.lenpredict.ReconfigPlanner, or a
    test's planner, which answers the optional questions conservatively)."""

    @property
    def latency(self) -> StepPrices | None:
        """The step prices the check windows are timed with; None: count steps instead."""
        ...

    def new_rollout(self) -> None: ...

    def decide(self, running: RunningSet, current: Layout, /) -> Decision: ...

    def may_switch(self, running: RunningSet, current: Layout, /) -> bool:
        """Whether a switch could pay with every sequence at its bound (`running.remaining`);
        False lets the controller skip predicting lengths."""
        ...

    def never_switches_from(self, current: Layout, max_context: int, /) -> bool:
        """Whether no rollout opened at `current` can ever switch (then no checks are run)."""
        ...

    def shrinking_share(self, running: RunningSet, current: Layout, steps: int, /) -> float:
        """The share of `steps` decode steps at this batch's pace that the next `steps`
        steps take, as sequences finish on the way (1.0: no shrink)."""
        ...


class Lengths(Protocol):
    """Remaining-length quantiles of running samples (LengthPredictor, or an oracle)."""

    def start_group(self, group_id: str, prompt_id: str, size: int) -> None: ...

    def extend_group(self, group_id: str, extra: int) -> None: ...

    def observe_finished(self, seq_id: str, group_id: str, length: int) -> None: ...

    def end_group(self, group_id: str) -> None: ...

    def predict_remaining_many(
        self, seq_ids: list[str], group_ids: list[str], current_lengths: np.ndarray
    ) -> np.ndarray: ...
