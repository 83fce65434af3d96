"""The critic: a token-level value model trained on GAE returns with verl's clipped value loss.

A `Trainer` whose model is a value head (`AutoModelForTokenClassification`, one label):
same SPMD contract, micro-batching, packing, FSDP2 build, optimizer, schedule and checkpoints
as the policy. Values are aligned like logprobs: `values[i][p]` is the head's output at
position p - 1, the state before token p (verl's `values[:, -response_length - 1 : -1]`).
On-policy (`values` not given) the update's own forward is the values pass. docs/training.md.
"""

from __future__ import annotations

import math
import time

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from patrl.trainer.config import CriticConfig
from patrl.trainer.gae import gae
from patrl.trainer.losses import value_loss
from patrl.trainer.model import ModelSource
from patrl.trainer.packing import pack, packed_values
from patrl.trainer.policy_batch import PolicyBatch, pad_field
from patrl.trainer.trainer import Trainer

# Order of the per-step sums that are all-reduced once per step.
_VSUMS = ("vf_loss", "vf_clipfrac", "vpred")
_DUMMY_IDS = torch.zeros(2, dtype=torch.long)


class Critic(Trainer):
    """Owns the value model, its optimizer and schedule; `update` is one optimizer step."""

    config: CriticConfig
    head = "value"

    def __init__(
        self,
        config: CriticConfig,
        model: ModelSource,
        mesh: DeviceMesh | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        if config.use_kl_loss:
            raise ValueError("the critic has no reference model: use_kl_loss must be False")
        super().__init__(config, model, mesh, device)
        self._scored_values: tuple[dict[int, torch.Tensor], int] | None = None

    def train_step(self, batch: PolicyBatch) -> dict[str, float]:
        raise TypeError("a Critic has no policy step: train it with update(batch, rewards, ...)")

    def compute_logprobs(self, batch: PolicyBatch) -> list[torch.Tensor]:
        raise TypeError("a Critic has no logprobs: its forward gives values (compute_values)")

    # ---- values ---------------------------------------------------------------------------

    def _values(self, ids: list[torch.Tensor]) -> torch.Tensor:
        """Aligned values `[batch, longest]` (fp32) of `ids`, 0 at position 0 and padding."""
        if self.config.use_remove_padding:
            row = pack(ids, self.device)
            varlen = not self.attn_implementation.startswith("flash_attention")
            with self._autocast():
                out = self.model(**row.model_kwargs(varlen), use_cache=False).logits
            return packed_values(out.reshape(-1).float(), row)
        longest = max(int(t.numel()) for t in ids)
        input_ids = pad_field(ids, longest).to(self.device)
        attention = pad_field([torch.ones_like(t) for t in ids], longest).to(self.device)
        with self._autocast():
            out = self.model(input_ids=input_ids, attention_mask=attention, use_cache=False)
        head = out.logits[..., 0].float()
        shifted = torch.cat([head.new_zeros(len(ids), 1), head[:, :-1]], dim=1)
        return torch.where(attention.bool(), shifted, torch.zeros_like(shifted))

    @torch.no_grad()
    def compute_values(self, batch: PolicyBatch) -> list[torch.Tensor]:
        """Per-sample values (fp32, CPU) aligned to `input_ids`; the full list on every rank."""
        batch.validate()
        out: dict[int, torch.Tensor] = {}
        for mb in self._plan(batch):
            values = self._values([batch.input_ids[i] for i in mb] or [_DUMMY_IDS])
            for row, i in enumerate(mb):
                out[i] = values[row, : batch.input_ids[i].numel()]
        if isinstance(self.model, FSDPModule):
            self.model.reshard()  # no backward follows: give the gathered root back
        return self._gather(out, len(batch))

    def scored_values(self) -> list[torch.Tensor]:
        """The values the last on-policy `update` took (the critic before it), on every rank."""
        if self._scored_values is None:
            raise RuntimeError("no on-policy values: the last update was given values")
        local, n = self._scored_values
        return self._gather(local, n)

    # ---- training -------------------------------------------------------------------------

    def update(
        self,
        batch: PolicyBatch,
        rewards: list[torch.Tensor],
        gamma: float,
        lam: float,
        values: list[torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """One optimizer step on the value loss over `batch.loss_mask` tokens.

        `rewards`: token-level rewards aligned to `input_ids`. Returns are GAE's (gamma, lam)
        of `values`, the critic's before this update; None takes them from this update's own
        forward (on-policy, one step: no separate values pass; see `scored_values`).
        """
        start = time.perf_counter()
        self._check_step_input(batch)
        if len(rewards) != len(batch) or (values is not None and len(values) != len(batch)):
            raise ValueError(f"rewards / values must have one entry per sample ({len(batch)})")
        num_tokens = float(sum(int(m.sum()) for m in batch.loss_mask))
        num_seqs = float(sum(bool(m.any()) for m in batch.loss_mask))
        scored: dict[int, torch.Tensor] = {}
        self._scored_values = None
        sums = torch.zeros(len(_VSUMS), dtype=self._sum_dtype(), device=self.device)
        for mb in self._plan(batch):
            loss, mb_sums = self._value_micro_step(
                batch, mb, rewards, values, scored, (gamma, lam), (num_tokens, num_seqs)
            )
            (loss * self.group.size).backward()
            sums += mb_sums
        if values is None:
            self._scored_values = (scored, len(batch))
        grad_norm = self._clip_grad_norm()
        sums = self._sum_over_ranks(sums)
        finite = math.isfinite(grad_norm) and math.isfinite(float(sums[0]))
        lr = float(self.scheduler.get_last_lr()[0])
        self._apply_or_skip(finite)
        s = dict(zip(_VSUMS, sums.tolist(), strict=True))
        return {
            "critic/vf_loss": s["vf_loss"],
            "critic/vf_clipfrac": s["vf_clipfrac"] / num_tokens,
            "critic/vpred_mean": s["vpred"] / num_tokens,
            "critic/grad_norm": grad_norm,
            "critic/lr": lr,
            "critic/nonfinite_skipped": float(not finite),
            "perf/critic_time_per_step": time.perf_counter() - start,
        }

    def _value_micro_step(
        self,
        batch: PolicyBatch,
        mb: list[int],
        rewards: list[torch.Tensor],
        values: list[torch.Tensor] | None,
        scored: dict[int, torch.Tensor],
        gamma_lam: tuple[float, float],
        counts: tuple[float, float],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward one micro-batch; its share of the step's value loss and its metric sums."""
        if mb:
            ids = [batch.input_ids[i] for i in mb]
            masks = [batch.loss_mask[i] for i in mb]
            rews = [rewards[i].float() for i in mb]
        else:  # keeps this rank in step with FSDP's collectives; contributes exactly zero
            ids, masks, rews = [_DUMMY_IDS], [torch.zeros(2, dtype=torch.bool)], [torch.zeros(2)]
        longest = max(int(t.numel()) for t in ids)
        vpreds = self._values(ids)
        if values is None:
            old = vpreds.detach()
            for row, i in enumerate(mb):
                scored[i] = old[row, : batch.input_ids[i].numel()]
        else:
            old = pad_field([values[i].float() for i in mb] or [torch.zeros(2)], longest)
            old = old.to(self.device)
        mask = pad_field(masks, longest, False).to(self.device)
        reward = pad_field(rews, longest).to(self.device)
        _, returns = gae(reward, old, mask, *gamma_lam)
        loss, stats = value_loss(
            vpreds,
            returns,
            old,
            mask,
            cliprange_value=self.config.cliprange_value,
            agg_mode=self.config.loss_agg_mode,
            num_tokens=counts[0],
            num_seqs=counts[1],
        )
        n = mask.sum().to(self._sum_dtype())
        dtype = self._sum_dtype()
        parts = [
            loss.detach().to(dtype),
            stats.clipfrac.to(dtype) * n,
            stats.vpred_mean.to(dtype) * n,
        ]
        return loss, torch.stack(parts)
