"""What an RL loop uses of a rollout engine, whichever kind it holds (`RolloutEngine`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from patrl.rollout.drafter import Drafter
from patrl.rollout.outputs import RequestOutput, SequenceState
from patrl.rollout.sampler import SamplingParams
from patrl.tpreshard import ParallelLayout


@runtime_checkable
class RolloutEngine(Protocol):
    """The rollout calls of an RL loop: a batch generated (whole, or partially with a quota),
    new weights loaded, the engine asleep during the update, its stats, layout and drafter.
    `Engine` (one layout) and `AdaptiveEngine` (a planner changes the layout) both are one;
    an adaptive engine's `generate`, `generate_partial` and `load_weights` are collectives
    over the world. Driving an engine a step at a time (`add_request`, `step`, moving
    requests) is `Engine`'s alone: a loop that does so (the async rollout ranks, the agent
    loop) holds an `Engine`, whose layout never changes under it."""

    @property
    def layout(self) -> ParallelLayout:
        """This rank's TP group and place in the data-parallel world, now."""
        ...

    @property
    def drafter(self) -> Drafter | None:
        """The speculation drafter (None: speculation off); the loop checkpoints its history."""
        ...

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
        prompt_keys: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the order of `prompts`. `prompt_keys` name
        each prompt across rollouts (its length history)."""
        ...

    def generate_partial(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: Sequence[SamplingParams],
        quota: int,
        request_ids: Sequence[str] | None = None,
        prompt_keys: Sequence[str] | None = None,
        resume: Sequence[SequenceState] = (),
    ) -> tuple[list[RequestOutput], list[SequenceState]]:
        """A partial rollout (APRIL): `resume` continued, then `prompts`, until `quota`
        requests have finished; the finished requests and the unfinished ones' samples."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Full tensors under their HF names, cut for the engine's layout; `version` names them."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 2: the weights too, to host memory) until `wake_up`."""
        ...

    def wake_up(self) -> None:
        """Undo `sleep`: the weights back bit for bit and an empty KV cache."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters and the latest rollout's timeline (an adaptive engine adds its planner's)."""
        ...
