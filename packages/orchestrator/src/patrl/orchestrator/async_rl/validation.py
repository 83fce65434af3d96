"""Rollout rank 0's validation of one weight version, run beside the training tickets with the
sync schedule's requests (same prompts, seeds, temperature); the result goes to the store as
`val/<version>` for the trainer to log. Newer weights wait until it is done, so every
validation token comes from that version."""

from __future__ import annotations

import pickle
import time

from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.control import ControlPlane
from patrl.orchestrator.data import PromptDataset, PromptItem
from patrl.orchestrator.rewards import RewardManager
from patrl.orchestrator.step import (
    VALIDATION_SEED_KEY,
    Sample,
    sampling_params,
    score_outputs,
    validation_metrics,
    validation_prompts,
)
from patrl.rollout import Engine, RequestOutput


class Validation:
    """The validation requests in flight (`pending`, by request id) and what they scored."""

    def __init__(
        self,
        config: JobConfig,
        val_set: PromptDataset,
        rewards: RewardManager,
        control: ControlPlane,
    ) -> None:
        self.config = config
        self.val_set = val_set
        self.rewards = rewards
        self.control = control
        self.pending: dict[str, PromptItem] = {}
        self.results: list[Sample] = []
        self.version = 0
        self.start = 0.0

    def begin(self, engine: Engine) -> None:
        """Add the requests validating the engine's current weights."""
        temperature, version = self.config.rollout.val_temperature, engine.weight_version
        for item in validation_prompts(self.config, self.val_set):
            params = sampling_params(self.config, item, 1, temperature, VALIDATION_SEED_KEY)
            rid = f"val-{version}-{item.index}"
            engine.add_request(item.prompt_token_ids, params, request_id=rid)
            self.pending[rid] = item
        self.version, self.start, self.results = version, time.perf_counter(), []

    def finish(self, out: RequestOutput) -> None:
        """Score a finished request; the last one publishes the version's metrics."""
        item = self.pending.pop(out.request_id)
        self.results += score_outputs(self.rewards, [(item, out)])[0]
        if self.pending:
            return
        metrics = validation_metrics(self.results, self.start)
        self.control.put(f"val/{self.version}", pickle.dumps(metrics))
