"""Scoring token sequences with a Hugging Face sequence-classification reward model.

The model is replicated: each scoring rank holds the whole RM and scores its own samples (the
ranks that score hold different numbers of samples, so a sharded model, whose every forward is
a collective, would need them padded to one schedule). A sequence's score is the RM's logit on
its last non-pad token, HF's own pooling (`model(input_ids, attention_mask).logits`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from patrl.trainer.reward_model.checks import check_reward_model_dir, load_tokenizer


class RewardModelScorer:
    """A reward model on `device` scoring batches of token-id sequences, `micro_batch_size`
    sequences per forward (sorted by length, so a micro batch pads little)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        micro_batch_size: int = 8,
    ) -> None:
        from transformers import AutoModelForSequenceClassification

        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        check_reward_model_dir(path)
        self.tokenizer = load_tokenizer(path)
        self.device = torch.device(device)
        self.micro_batch_size = micro_batch_size
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=dtype, local_files_only=True
        )
        self.model.to(self.device).eval().requires_grad_(False)
        self.pad_id = pad_token_id(self.model.config, self.tokenizer)
        self.model.config.pad_token_id = self.pad_id

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """The fp32 score of each sequence (RM token ids), on the host, in the given order."""
        if any(len(s) == 0 for s in sequences):
            raise ValueError("cannot score an empty sequence")
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        out = torch.empty(len(sequences), dtype=torch.float32)
        for start in range(0, len(order), self.micro_batch_size):
            rows = order[start : start + self.micro_batch_size]
            ids, mask = right_pad([sequences[i] for i in rows], self.pad_id)
            logits = self.model(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device)
            ).logits
            out[rows] = logits[:, 0].float().cpu()
        return out


def right_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each [rows, longest], sequences left-aligned."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def pad_token_id(config: object, tokenizer: object) -> int:
    """The id HF's pooling treats as padding: the model's, else the tokenizer's pad, else eos."""
    for owner, name in (
        (config, "pad_token_id"),
        (tokenizer, "pad_token_id"),
        (tokenizer, "eos_token_id"),
    ):
        value = getattr(owner, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(
        "the reward model has no pad_token_id (config, tokenizer) and no eos_token_id: set "
        "pad_token_id in its config.json"
    )
