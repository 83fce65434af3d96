"""Rollout rank 0's validation of one weight version, run beside the training tickets with the
sync schedule's requests (same prompts, seeds, sampling), `data.val_batch_size` prompts at a
time; the result goes to the store as `val/<version>` for the trainer to log (and, with
`trainer.validation_data_dir`, the responses to `<dir>/<version>.jsonl`). Newer weights
wait until it is done, so every validation token comes from that version. With
`rollout.multi_turn` each prompt runs as an agent-loop sample (`agents`), as the sync schedule
validates it."""

from __future__ import annotations

import pickle
import time

from patrl.orchestrator.async_rl.agent_tickets import AgentGroups
from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.control import ControlPlane
from patrl.orchestrator.data import PromptDataset, PromptItem
from patrl.orchestrator.generations import dump_generations, generation_rows
from patrl.orchestrator.rewards import RewardManager
from patrl.orchestrator.sampling import VALIDATION_SEED_KEY, sampling_params, validation_batches
from patrl.orchestrator.scoring import Sample, TrajectoryOutput, score_outputs
from patrl.orchestrator.step_metrics import data_sources, validation_metrics
from patrl.rollout import Engine, RequestOutput


class Validation:
    """The validation requests in flight (`pending`, by request id), the batches still to
    start (`queued`) and what they scored. `agents`: where the requests run with
    `rollout.multi_turn` (None: as engine requests)."""

    def __init__(
        self,
        config: JobConfig,
        val_set: PromptDataset,
        rewards: RewardManager,
        control: ControlPlane,
        agents: AgentGroups | None = None,
    ) -> None:
        self.config = config
        self.val_set = val_set
        self.rewards = rewards
        self.control = control
        self.agents = agents
        self.pending: dict[str, PromptItem] = {}
        self.queued: list[list[PromptItem]] = []
        self.results: list[Sample] = []
        self.version = 0
        self.start = 0.0

    def begin(self, engine: Engine) -> None:
        """Start validating the engine's current weights: its first batch of requests."""
        self.queued = validation_batches(self.config, self.val_set)
        self.version, self.start, self.results = engine.weight_version, time.perf_counter(), []
        self._add_batch(engine)

    def _add_batch(self, engine: Engine) -> None:
        val = self.config.rollout.val_kwargs
        for item in self.queued.pop(0):
            params = sampling_params(
                self.config, item, val.n, val.temperature, VALIDATION_SEED_KEY, validation=True
            )
            rid = f"val-{self.version}-{item.index}"
            if self.agents is not None:
                self.agents.start(rid, item, params)
            else:
                engine.add_request(item.prompt_token_ids, params, request_id=rid)
            self.pending[rid] = item

    def finish(self, out: RequestOutput | TrajectoryOutput, engine: Engine) -> None:
        """Score a finished request; a batch's last one starts the next batch on `engine`, the
        last batch's last one publishes the version's metrics."""
        item = self.pending.pop(out.request_id)
        self.results += score_outputs(self.rewards, [(item, out)])[0]
        if self.pending:
            return
        if self.queued:
            self._add_batch(engine)
            return
        if self.config.trainer.validation_data_dir:
            items = {i.index: i for i in self.val_set.items}
            rows = generation_rows(self.results, items, engine.tokenizer, self.version)
            dump_generations(self.config.trainer.validation_data_dir, self.version, rows)
        metrics = validation_metrics(self.results, self.start, data_sources(self.val_set.items))
        self.control.put(f"val/{self.version}", pickle.dumps(metrics))
