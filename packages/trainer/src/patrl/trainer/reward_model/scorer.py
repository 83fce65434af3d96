"""Scoring token sequences with a Hugging Face sequence-classification reward model.

Two placements. `RewardModelScorer` is replicated: the rank holds the whole RM and scores its
own sequences, no communication. `ShardedRewardModelScorer` is FSDP2-sharded over a mesh, for
an RM too large to hold beside the engine and the trainer: its `score` is a collective in which
every rank passes the same sequences, runs the forwards of its share, and gets every score.
A sequence's score is the RM's logit on its last non-pad token, HF's own pooling
(`model(input_ids, attention_mask).logits`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from transformers import PreTrainedModel

from patrl.trainer.model import build_sharded
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
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        check_reward_model_dir(path)
        self.tokenizer = load_tokenizer(path)
        self.device = torch.device(device)
        self.micro_batch_size = micro_batch_size
        self.model = self._build(path, dtype)
        self.model.eval().requires_grad_(False)
        self.pad_id = pad_token_id(self.model.config, self.tokenizer)
        self.model.config.pad_token_id = self.pad_id

    def _build(self, path: str | os.PathLike[str], dtype: torch.dtype) -> PreTrainedModel:
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=dtype, local_files_only=True
        )
        return model.to(self.device)

    def _forward(self, batch: Sequence[Sequence[int]]) -> torch.Tensor:
        """The fp32 scores of one right-padded micro batch, on the device."""
        ids, mask = right_pad(batch, self.pad_id)
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        return out.logits[:, 0].float()

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """The fp32 score of each sequence (RM token ids), on the host, in the given order."""
        _check_not_empty(sequences)
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        out = torch.empty(len(sequences), dtype=torch.float32, device=self.device)
        for start in range(0, len(order), self.micro_batch_size):
            rows = order[start : start + self.micro_batch_size]
            out[rows] = self._forward([sequences[i] for i in rows])
        return out.cpu()


class ShardedRewardModelScorer(RewardModelScorer):
    """A reward model FSDP2-sharded over the 1-D `mesh` (built on the meta device, each rank
    reading only its own shards, parameters kept in `dtype`), scoring like `RewardModelScorer`.

    `score` is a collective over the mesh: every rank passes the same sequences. Rank r runs the
    forwards of every world-th sequence by length (so the shares hold similar token counts),
    `micro_batch_size` at a time; every rank runs the same number of forwards, a rank short of
    sequences a one-token stand-in, because each forward all-gathers the layers' shards."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        mesh: DeviceMesh,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        micro_batch_size: int = 8,
    ) -> None:
        self.mesh = mesh
        super().__init__(path, device, dtype, micro_batch_size)

    def _build(self, path: str | os.PathLike[str], dtype: torch.dtype) -> PreTrainedModel:
        return build_sharded(
            path,
            "sdpa",
            self.mesh,
            self.device,
            param_dtype=dtype,
            activation_checkpointing=False,
            head="score",
            dtype=dtype,
        )

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """The fp32 score of each sequence, on the host, in the given order, on every rank."""
        _check_not_empty(sequences)
        rank, world = self.mesh.get_local_rank(), self.mesh.size()
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        mine = order[rank::world]
        width = math.ceil(len(order) / world)  # the largest share
        local = torch.zeros(max(width, 1), dtype=torch.float32, device=self.device)
        for start in range(0, width, self.micro_batch_size):
            rows = mine[start : start + self.micro_batch_size]
            scores = self._forward([sequences[i] for i in rows] or [[self.pad_id]])
            local[start : start + len(rows)] = scores[: len(rows)]
        gathered = torch.empty(world * local.numel(), dtype=torch.float32, device=self.device)
        dist.all_gather_into_tensor(gathered, local, group=self.mesh.get_group())
        shares = gathered.cpu().view(world, -1)
        out = torch.empty(len(sequences), dtype=torch.float32)
        for r in range(world):
            rows = order[r::world]
            out[rows] = shares[r, : len(rows)]
        return out


def _check_not_empty(sequences: Sequence[Sequence[int]]) -> None:
    if any(len(s) == 0 for s in sequences):
        raise ValueError("cannot score an empty sequence")


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
