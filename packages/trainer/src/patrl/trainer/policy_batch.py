"""The trainer's input: per-sample token lists, all fields aligned to `input_ids`.

Every per-token field of sample i is a 1-D tensor of length `len(input_ids[i])` (prompt and
response together), aligned position by position with `input_ids[i]`: the value at position p
belongs to token p. Values at positions outside `loss_mask` are ignored. Position 0 can never be
a loss token: no logit predicts the first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_FLOAT_FIELDS = (
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "behaviour_logprobs",
    "rollout_is_weights",
)


@dataclass(slots=True)
class PolicyBatch:
    """One optimizer step's samples; a logprob field left None is computed by the trainer.

    `old_logprobs`: what the ratio is taken against (decoupled PPO: the proximal policy); None
    is on-policy, taken from the update's own forward. `ref_logprobs`: the KL reference's; None
    lets the trainer's frozen reference score them. `behaviour_logprobs`: what the sample was
    generated with (decoupled PPO only). `rollout_is_weights`: rollout correction's detached
    IS weights, multiplying each token's policy loss (None: 1).
    """

    input_ids: list[torch.Tensor]
    loss_mask: list[torch.Tensor]
    advantages: list[torch.Tensor]
    old_logprobs: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None
    behaviour_logprobs: list[torch.Tensor] | None = None
    rollout_is_weights: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> list[int]:
        return [int(ids.numel()) for ids in self.input_ids]

    def validate(self) -> None:
        n = len(self.input_ids)
        if n == 0:
            raise ValueError("PolicyBatch has no samples")
        for name in ("loss_mask", *_FLOAT_FIELDS):
            field = getattr(self, name)
            if field is not None and len(field) != n:
                raise ValueError(f"PolicyBatch.{name} has {len(field)} samples, input_ids has {n}")
        for i, ids in enumerate(self.input_ids):
            if ids.dim() != 1 or ids.numel() < 2:
                raise ValueError(
                    f"input_ids[{i}] must be 1-D with >= 2 tokens, got shape {tuple(ids.shape)}"
                )
            for name in ("loss_mask", *_FLOAT_FIELDS):
                field = getattr(self, name)
                if field is not None and field[i].shape != ids.shape:
                    raise ValueError(
                        f"{name}[{i}] has shape {tuple(field[i].shape)} but input_ids[{i}] has "
                        f"{tuple(ids.shape)}: per-token fields are aligned to input_ids"
                    )
            if self.loss_mask[i].dtype != torch.bool:
                raise ValueError(f"loss_mask[{i}] must be bool, got {self.loss_mask[i].dtype}")
            if bool(self.loss_mask[i][0]):
                raise ValueError(f"loss_mask[{i}][0] is True: the first token has no prediction")

    @classmethod
    def from_responses(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        advantages: Sequence[float] | Sequence[Sequence[float]],
        old_logprobs: Sequence[Sequence[float]] | None = None,
        ref_logprobs: Sequence[Sequence[float]] | None = None,
        behaviour_logprobs: Sequence[Sequence[float]] | None = None,
    ) -> PolicyBatch:
        """Build from prompt/response token lists and per-*response*-token values.

        `advantages` is one value per sample (GRPO: broadcast over the response) or one per
        response token; logprob lists have one value per response token.
        """
        if len(prompts) != len(responses) or len(prompts) != len(advantages):
            raise ValueError(
                f"{len(prompts)} prompts, {len(responses)} responses and {len(advantages)} "
                "advantages: need one of each per sample"
            )
        input_ids, masks, advs = [], [], []
        for i, (p, r, a) in enumerate(zip(prompts, responses, advantages, strict=True)):
            if len(p) == 0 or len(r) == 0:
                raise ValueError(f"sample {i}: prompt and response must be non-empty")
            input_ids.append(torch.tensor([*p, *r], dtype=torch.long))
            mask = torch.zeros(len(p) + len(r), dtype=torch.bool)
            mask[len(p) :] = True
            masks.append(mask)
            per_token = [float(a)] * len(r) if isinstance(a, (int, float)) else [*a]  # type: ignore[misc]
            advs.append(_place(per_token, len(p), len(r), f"advantages[{i}]"))

        def align(values: Sequence[Sequence[float]] | None, name: str) -> list[torch.Tensor] | None:
            if values is None:
                return None
            if len(values) != len(prompts):
                raise ValueError(f"{name} has {len(values)} samples, prompts has {len(prompts)}")
            return [
                _place(list(v), len(p), len(r), f"{name}[{i}]")
                for i, (v, p, r) in enumerate(zip(values, prompts, responses, strict=True))
            ]

        return cls(
            input_ids=input_ids,
            loss_mask=masks,
            advantages=advs,
            old_logprobs=align(old_logprobs, "old_logprobs"),
            ref_logprobs=align(ref_logprobs, "ref_logprobs"),
            behaviour_logprobs=align(behaviour_logprobs, "behaviour_logprobs"),
        )


def _place(values: list[float], prompt_len: int, response_len: int, name: str) -> torch.Tensor:
    if len(values) != response_len:
        raise ValueError(f"{name} has {len(values)} values for a response of {response_len} tokens")
    out = torch.zeros(prompt_len + response_len, dtype=torch.float32)
    out[prompt_len:] = torch.tensor(values, dtype=torch.float32)
    return out


def pad_field(
    values: Sequence[torch.Tensor], length: int, fill: float | int | bool = 0
) -> torch.Tensor:
    """Right-pad 1-D tensors to `[len(values), length]`."""
    out = values[0].new_full((len(values), length), fill)
    for row, v in enumerate(values):
        out[row, : v.numel()] = v
    return out
