"""A length model that knows the answer, for benchmarks and tests of the planner."""

from __future__ import annotations

import numpy as np


class OracleLengths:
    """Knows every sample's final response length (from an earlier identical run): the upper
    bound on what a length predictor can give the planner. Keys: (request id, sample index)."""

    def __init__(self, final_lengths: dict[tuple[str, int], int], num_quantiles: int = 5) -> None:
        self.final = final_lengths
        self.num_quantiles = num_quantiles

    # It learns nothing: the `Lengths` protocol's bookkeeping calls are no-ops.
    def start_group(self, group_id: str, prompt_id: str, size: int) -> None:
        pass

    def extend_group(self, group_id: str, extra: int) -> None:
        pass

    def observe_finished(self, seq_id: str, group_id: str, length: int) -> None:
        pass

    def end_group(self, group_id: str) -> None:
        pass

    def predict_remaining(self, seq_id: str, group_id: str, current_length: int) -> np.ndarray:
        """The known remaining length (at least 1) as every quantile; `seq_id` is
        "<request id>#<sample index>"."""
        rid, index = seq_id.rsplit("#", 1)
        left = self.final[(rid, int(index))] - current_length
        return np.full(self.num_quantiles, float(max(left, 1)))

    def predict_remaining_many(
        self, seq_ids: list[str], group_ids: list[str], current_lengths: np.ndarray
    ) -> np.ndarray:
        """`predict_remaining` of each sample, [len(seq_ids), num_quantiles]."""
        rows = [
            self.predict_remaining(s, g, int(c))
            for s, g, c in zip(seq_ids, group_ids, current_lengths, strict=True)
        ]
        return np.stack(rows) if rows else np.zeros((0, self.num_quantiles))
