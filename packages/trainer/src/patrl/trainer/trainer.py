"""The policy trainer: PPO/GRPO steps on an FSDP2-sharded Hugging Face causal LM.

SPMD contract: every rank of the trainer's mesh calls the same methods in the same order with
the same *global* `PolicyBatch`; each rank takes its own token-balanced share (micro_batches.py).
Losses are normalised by the step's global token / sequence counts and scaled by the
data-parallel size against FSDP's gradient averaging, so the update equals a single process's
on the whole batch. See docs/training.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from patrl.trainer.checkpoint import Group, load_checkpoint, save_checkpoint
from patrl.trainer.config import RolloutCorrectionConfig, TrainerConfig
from patrl.trainer.hf_export import export_hf, hf_config, read_source_config, source_dtype
from patrl.trainer.logprobs import token_logprobs
from patrl.trainer.lora import (
    LORA_ADAPTER_DIR,
    adapter_config,
    adapters_disabled,
    add_adapters,
    cast_frozen,
    select_targets,
    write_adapter_dir,
)
from patrl.trainer.losses import CovSettings, aggregate, kl_penalty, policy_loss, reinforce_loss
from patrl.trainer.memory_plan import step_memory_bytes, use_checkpointing
from patrl.trainer.micro_batches import padded_fraction, plan_micro_batches
from patrl.trainer.model import (
    Head,
    ModelSource,
    build_hf_model,
    build_sharded,
    freeze,
    lora_trainable,
    model_dir,
    parallelize,
    start_adapters,
)
from patrl.trainer.packing import pack, packed_token_logprobs
from patrl.trainer.policy_batch import PolicyBatch, pad_field
from patrl.trainer.rollout_correction import is_weights, parse_rs, rejection_mask
from patrl.trainer.schedule import build_scheduler
from patrl.trainer.varlen_attention import register as register_varlen
from patrl.trainer.weights import Bucket, iter_adapter_weights, iter_full_weights

log = logging.getLogger(__name__)

# Order of the per-step sums that are all-reduced once per step (see _metrics).
_SUMS = (
    "pg_loss",
    "kl_loss",
    "entropy",
    "clipfrac",
    "clipfrac_low",
    "clipfrac_high",
    "clipfrac_lower",
    "ppo_kl",
    "behav_capped",
    "behav_weight",
    "loss",
    # rollout correction in bypass mode (taken against the current policy in the loss)
    "rc_kl",
    "rc_k3_kl",
    "rc_is_weight",
    "rc_masked",
    "rc_seq_masked",
)


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class Trainer:
    """Owns the policy (and optional frozen reference), its optimizer, schedule and step."""

    head: ClassVar[Head] = "lm"  # the model's output head (the critic's is "value")

    def __init__(
        self,
        config: TrainerConfig,
        model: ModelSource,
        mesh: DeviceMesh | None = None,
        device: str | torch.device | None = None,
        reference: bool | None = None,
    ) -> None:
        """`reference`: build the frozen reference policy (None: when `use_kl_loss`; a caller
        that puts KL into the reward asks for it too)."""
        self.config = config
        self.mesh = mesh
        self.group = Group(mesh.get_group() if mesh is not None else None)
        self.device = self._resolve_device(mesh, device)
        self.param_dtype = self._resolve_dtype(config.param_dtype, self.device)
        self.source_dir = None if _is_config(model) else Path(str(model))
        self.attn_implementation = self._resolve_attention(config)
        self.checkpointing = self._resolve_checkpointing(model)
        self.model = self._build(model, trainable=True)
        # The dtype the source's weights are stored in: the default of HF exports.
        self.export_dtype = source_dtype(
            model if isinstance(model, PretrainedConfig) else read_source_config(self.source_dir)
        )
        if reference is None:
            reference = config.use_kl_loss
        # With LoRA the reference is the policy with its adapters off: no second model.
        self.has_reference = bool(reference)
        self.lora = self.config.lora if self.config.lora.enabled and self.head == "lm" else None
        self.reference = (
            self._build(model, trainable=False) if reference and self.lora is None else None
        )
        opt = config.optim
        self.optimizer = torch.optim.AdamW(
            # Only what trains has optimizer state (with LoRA: the adapters).
            [p for p in self.model.parameters() if p.requires_grad],
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            foreach=True,  # one kernel per op over all parameters, not a loop over them
        )
        self.scheduler = build_scheduler(self.optimizer, opt)
        self.step = 0
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        # This rank's on-policy logprobs of the last train_step, and that batch's size.
        self._scored: tuple[dict[int, torch.Tensor], int] | None = None

    # ---- building -------------------------------------------------------------------------

    @staticmethod
    def _resolve_device(mesh: DeviceMesh | None, device: str | torch.device | None) -> torch.device:
        if mesh is not None:
            if device is not None and torch.device(device).type != mesh.device_type:
                raise ValueError(f"device {device!r} disagrees with the mesh's {mesh.device_type}")
            if mesh.device_type == "cuda":
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device(mesh.device_type)
        return torch.device(device if device is not None else "cpu")

    @staticmethod
    def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
        if name == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]

    @staticmethod
    def _resolve_attention(cfg: TrainerConfig) -> str:
        """The model's attention: as configured, or `patrl_varlen` in place of SDPA / eager
        when packing (flash-attn implementations take packed rows natively)."""
        name = cfg.attn_implementation
        if not cfg.use_remove_padding or name.startswith("flash_attention"):
            return name
        if name in ("sdpa", "eager"):
            return register_varlen()
        raise ValueError(
            f"use_remove_padding=True needs attn_implementation 'sdpa', 'eager' or "
            f"'flash_attention_*', got {name!r}; set use_remove_padding=False to pad instead"
        )

    def _resolve_checkpointing(self, source: ModelSource) -> bool:
        cfg = self.config
        if not isinstance(cfg.enable_gradient_checkpointing, bool):
            hf = (
                source
                if isinstance(source, PretrainedConfig)
                else AutoConfig.from_pretrained(model_dir(source))
            )
            estimate = step_memory_bytes(
                hf,
                cfg.ppo_max_token_len_per_gpu,
                self.param_dtype,
                self.group.size,
                cfg.lora.lora_rank if cfg.lora.enabled else 0,
            )
            return use_checkpointing(cfg.enable_gradient_checkpointing, self.device, estimate)
        return cfg.enable_gradient_checkpointing

    def _build(self, source: ModelSource, trainable: bool) -> PreTrainedModel:
        """The trained model (`trainable`) or a frozen reference. Trained weights are fp32
        masters. With LoRA the frozen base is held in `param_dtype` (`cast_frozen`): bf16 on
        CUDA by default ("auto"), halving the base's memory, fp32 on CPU by default; the
        adapters (and a critic's head) stay fp32 and alone have AdamW state. The forward
        computes in `param_dtype` either way, so a bf16 base changes no FSDP2 step: the
        all-gather would round fp32 shards to bf16 just as the load rounds the base."""
        cfg = self.config
        checkpointing = trainable and self.checkpointing
        # Adapters on the trained model of either head (a critic's head trains whole too).
        lora = cfg.lora if trainable and cfg.lora.enabled else None
        if self.mesh is not None and self.source_dir is not None:
            model = build_sharded(
                self.source_dir,
                self.attn_implementation,
                self.mesh,
                self.device,
                self.param_dtype,
                checkpointing,
                head=self.head,
                seed=cfg.seed,
                # passed only when on: a full run's build call is unchanged
                **(
                    {"lora": lora, "base_dtype": self.param_dtype}  # type: ignore[arg-type]
                    if lora is not None
                    else {}
                ),
            )
        else:
            model = build_hf_model(source, self.attn_implementation, cfg.seed, head=self.head)
            if lora is not None:
                add_adapters(model, lora, lora_trainable(self.head))
                start_adapters(model, lora, cfg.seed)
                cast_frozen(model, self.param_dtype)
            model.to(self.device)  # type: ignore[arg-type]  # HF's to() is typed oddly
            model = parallelize(model, self.mesh, self.param_dtype, checkpointing)
        if trainable:
            model.train()
        else:
            freeze(model)
        return model

    # ---- forward --------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        # With FSDP, MixedPrecisionPolicy casts; a lone model casts by autocast instead.
        if self.mesh is None and self.param_dtype != torch.float32:
            return torch.autocast(self.device.type, dtype=self.param_dtype)
        return contextlib.nullcontext()

    def _forward(
        self, model: PreTrainedModel, ids: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprob and entropy `[batch, longest]` of each token of `ids`, zero-padded on the
        right; the forward runs one packed row (use_remove_padding) or right-padded rows."""
        cfg = self.config
        if cfg.use_remove_padding:
            row = pack(ids, self.device)
            varlen = not self.attn_implementation.startswith("flash_attention")
            with self._autocast():
                logits = model(**row.model_kwargs(varlen), use_cache=False).logits
            return packed_token_logprobs(logits, row, cfg.temperature, cfg.logprob_chunk_tokens)
        longest = max(int(t.numel()) for t in ids)
        input_ids = pad_field(ids, longest).to(self.device)
        attention = pad_field([torch.ones_like(t) for t in ids], longest).to(self.device)
        with self._autocast():
            logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
        return token_logprobs(logits, input_ids, cfg.temperature, cfg.logprob_chunk_tokens)

    def _plan(self, batch: PolicyBatch) -> list[list[int]]:
        plans = plan_micro_batches(
            batch.lengths,
            self.config.ppo_max_token_len_per_gpu,
            self.group.size,
            self.config.ppo_micro_batch_size_per_gpu,
        )
        return plans[self.group.rank]

    @torch.no_grad()
    def _score(
        self, model: PreTrainedModel, batch: PolicyBatch, micro_batches: list[list[int]]
    ) -> dict[int, torch.Tensor]:
        """Logprobs of this rank's samples, keyed by sample index (unpadded, fp32, on the
        trainer's device: _gather moves them to the host in one transfer)."""
        out: dict[int, torch.Tensor] = {}
        for mb in micro_batches:
            # An empty micro-batch still runs a forward: FSDP's all-gathers need every rank.
            ids = [batch.input_ids[i] for i in mb] or [_DUMMY_IDS]
            logp, _ = self._forward(model, ids)
            for row, i in enumerate(mb):
                out[i] = logp[row, : batch.input_ids[i].numel()].float()
        if isinstance(model, FSDPModule):
            # FSDP2 keeps the root gathered after a forward, for the backward; with no backward
            # coming its full (param_dtype) weights would stay registered in place of the shards.
            model.reshard()
        return out

    def compute_logprobs(self, batch: PolicyBatch) -> list[torch.Tensor]:
        """Per-sample logprobs (fp32, CPU) aligned to `input_ids`, position 0 being 0.

        Every rank scores its share; the full list is returned on every rank.
        """
        batch.validate()
        return self._gather(self._score(self.model, batch, self._plan(batch)), len(batch))

    def compute_ref_logprobs(self, batch: PolicyBatch) -> list[torch.Tensor]:
        """The frozen reference policy's logprobs of `batch`, in `compute_logprobs`' layout.
        Raises RuntimeError when the trainer was built without a reference."""
        if not self.has_reference:
            raise RuntimeError(
                "no reference policy: build the Trainer with use_kl_loss or reference=True"
            )
        batch.validate()
        return self._gather(self._score_reference(batch, self._plan(batch)), len(batch))

    def _score_reference(
        self, batch: PolicyBatch, micro_batches: list[list[int]]
    ) -> dict[int, torch.Tensor]:
        """The reference's logprobs: the frozen model, or with LoRA the policy's base (its
        adapters off)."""
        if self.reference is not None:
            return self._score(self.reference, batch, micro_batches)
        with adapters_disabled(self.model):
            return self._score(self.model, batch, micro_batches)

    def scored_logprobs(self) -> list[torch.Tensor]:
        """The logprobs the last on-policy `train_step` took its ratio against (the policy
        before that update, from the update's own forward), all samples, on every rank; in the
        layout `compute_logprobs` returns. Collective over the trainer's ranks."""
        if self._scored is None:
            raise RuntimeError(
                "no on-policy logprobs to return: the last train_step was given old_logprobs "
                "(or none ran yet); use compute_logprobs"
            )
        local, n = self._scored
        return self._gather(local, n)

    def _gather(self, local: dict[int, torch.Tensor], n: int) -> list[torch.Tensor]:
        """Every rank's `{sample index: logprobs}` merged, as a list of `n` host tensors. The
        values are moved to the host before the object collective pickles them: a pickled
        device tensor would be unpickled onto the sender's device index on every rank."""
        local = _to_host(local)
        if self.group.pg is not None:
            shares: list[dict[int, torch.Tensor] | None] = [None] * self.group.size
            dist.all_gather_object(shares, local, group=self.group.pg)
            local = {i: t for share in shares if share for i, t in share.items()}
        return [local[i] for i in range(n)]

    # ---- training -------------------------------------------------------------------------

    def train_step(self, batch: PolicyBatch) -> dict[str, float]:
        """One optimizer step over `batch` (gradient accumulation over its micro-batches)."""
        cfg = self.config
        start = time.perf_counter()
        self._check_step_input(batch)
        num_tokens = float(sum(int(m.sum()) for m in batch.loss_mask))
        num_seqs = float(sum(bool(m.any()) for m in batch.loss_mask))
        scale = cfg.loss_scale_factor
        if scale is None:  # the longest response of the step (verl: the padded width)
            scale = float(max(int(m.sum()) for m in batch.loss_mask))
        micro_batches = self._plan(batch)
        # On-policy (no old logprobs given) the policy before this update is the one each
        # micro-batch's forward runs (the optimizer steps after the last one): its detached
        # logprobs are the old logprobs, and no separate scoring pass is needed.
        old = self._given(batch.old_logprobs)
        scored: dict[int, torch.Tensor] | None = {} if old is None else None
        self._scored = None
        ref = None
        if cfg.use_kl_loss:
            assert self.has_reference
            ref = self._given(batch.ref_logprobs) or self._score_reference(batch, micro_batches)

        # Metric sums stay on the device until the step's one read (no per-micro-batch sync).
        sums = torch.zeros(len(_SUMS), dtype=self._sum_dtype(), device=self.device)
        for micro_index, mb in enumerate(micro_batches):
            loss, mb_sums = self._micro_step(
                batch, mb, old, scored, ref, (num_tokens, num_seqs, scale), micro_index
            )
            # FSDP averages gradients over ranks; the loss is already a share of the global one.
            (loss * self.group.size).backward()
            sums += mb_sums
        if scored is not None:
            self._scored = (scored, len(batch))
        grad_norm = self._clip_grad_norm()
        sums = self._sum_over_ranks(sums)
        finite = math.isfinite(grad_norm) and math.isfinite(float(sums[_SUMS.index("loss")]))
        lr = float(self.scheduler.get_last_lr()[0])
        self._apply_or_skip(finite)
        elapsed = time.perf_counter() - start
        real = sum(batch.lengths)
        metrics = self._metrics(sums, num_tokens, grad_norm, lr, num_seqs)
        metrics.update(
            {
                "actor/nonfinite_skipped": float(not finite),
                "actor/nonfinite_total": float(self.nonfinite_total),
                "perf/total_num_tokens": float(real),
                "perf/time_per_step": elapsed,
                "perf/tokens_per_s": real / elapsed,
                "perf/throughput": real / elapsed / self.group.size,  # verl: per GPU
                "perf/padded_fraction": self._padded_fraction(batch),
                **_memory_metrics(self.device),
            }
        )
        return metrics

    def _check_step_input(self, batch: PolicyBatch) -> None:
        batch.validate()  # fields may have been reassigned since construction
        if not any(bool(m.any()) for m in batch.loss_mask):
            raise ValueError("PolicyBatch has no loss tokens: every loss_mask is all False")
        rc = self.config.policy_loss.rollout_correction
        if rc is not None and rc.bypass_mode and batch.old_logprobs is None:
            raise ValueError(
                "rollout_correction.bypass_mode needs the rollout's logprobs as the batch's "
                "old_logprobs (the anchor of the loss); none were given"
            )
        if self.config.behav_imp_weight_cap is not None and batch.behaviour_logprobs is None:
            raise ValueError(
                "behav_imp_weight_cap is set (decoupled PPO) but the batch has no "
                "behaviour_logprobs; pass the rollout's logprobs or unset the cap"
            )

    def _given(self, values: list[torch.Tensor] | None) -> dict[int, torch.Tensor] | None:
        return None if values is None else dict(enumerate(values))

    def _micro_step(
        self,
        batch: PolicyBatch,
        mb: list[int],
        old: dict[int, torch.Tensor] | None,
        scored: dict[int, torch.Tensor] | None,
        ref: dict[int, torch.Tensor] | None,
        norms: tuple[float, float, float],
        micro_index: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward one micro-batch; return its share of the step loss and its metric sums.
        With `old` None (on-policy) the ratio is taken against this forward's own detached
        logprobs, which are also recorded into `scored`. `norms`: the step's global token and
        sequence counts and the seq-mean-token-sum-norm scale."""
        cfg = self.config
        num_tokens, num_seqs, scale = norms
        if mb:
            ids = [batch.input_ids[i] for i in mb]
            mask_list = [batch.loss_mask[i] for i in mb]
            adv_list = [batch.advantages[i] for i in mb]
        else:  # keeps this rank in step with FSDP's collectives; contributes exactly zero
            ids, mask_list = [_DUMMY_IDS], [torch.zeros(2, dtype=torch.bool)]
            adv_list = [torch.zeros(2)]
        longest = max(int(t.numel()) for t in ids)

        def pad(values: list[torch.Tensor]) -> torch.Tensor:
            return pad_field([v.float() for v in values], longest).to(self.device)

        logp, entropy = self._forward(self.model, ids)
        if old is None:
            old_logp = logp.detach().float()
            assert scored is not None
            for row, i in enumerate(mb):  # moved to the host once, by scored_logprobs
                scored[i] = old_logp[row, : batch.input_ids[i].numel()]
        else:
            old_logp = pad([old[i] for i in mb] or [torch.zeros(2)])
        mask = pad_field(mask_list, longest, False).to(self.device)
        behaviour = None
        if batch.behaviour_logprobs is not None:
            behaviour = pad([batch.behaviour_logprobs[i] for i in mb] or [torch.zeros(2)])

        def agg(values: torch.Tensor) -> torch.Tensor:
            return aggregate(values, mask, cfg.loss_agg_mode, num_tokens, num_seqs, scale)

        weights = None
        if batch.rollout_is_weights is not None:  # decoupled rollout correction
            weights = pad([batch.rollout_is_weights[i] for i in mb] or [torch.zeros(2)])
        rc = cfg.policy_loss.rollout_correction
        bypass = rc is not None and rc.bypass_mode
        loss_mask: torch.Tensor = mask
        rc_sums: dict[str, torch.Tensor] = {}
        if bypass:
            assert rc is not None
            loss_mask, weights, rc_sums = self._bypass_correction(logp, old_logp, mask, rc)
        common: dict[str, Any] = {
            "agg_mode": cfg.policy_agg_mode,
            "num_tokens": num_tokens,
            "num_seqs": num_seqs,
            "scale_factor": scale,
        }
        if bypass and rc is not None and rc.loss_type == "reinforce":
            pg_loss, stats = reinforce_loss(
                logp, old_logp, pad(adv_list), loss_mask, is_weights=weights, **common
            )
        else:
            pg_loss, stats = policy_loss(
                logp,
                old_logp,
                pad(adv_list),
                loss_mask,
                clip_ratio_low=cfg.clip_low,
                clip_ratio_high=cfg.clip_high,
                clip_ratio_c=cfg.clip_ratio_c,
                # bypass mode's loss is PPO's clip (verl's apply_bypass_mode sets the loss)
                loss_mode="vanilla" if bypass else cfg.policy_loss.loss_mode,
                tau_pos=cfg.tau_pos,
                tau_neg=cfg.tau_neg,
                behaviour_logprobs=behaviour,
                behaviour_weight_cap=cfg.behav_imp_weight_cap,
                # bypass ppo_clip: the ratio to the rollout is the correction (verl)
                is_weights=None if bypass else weights,
                cov=self._cov_settings(),
                # the host's masks: no device sync (only the covariance losses read it)
                num_valid=sum(int(m.sum()) for m in mask_list)
                if cfg.policy_loss.loss_mode in ("clip_cov", "kl_cov")
                else None,
                generator=self._clip_cov_generator(micro_index),
                **common,
            )
        loss = pg_loss
        if cfg.entropy_coeff != 0:
            loss = loss - cfg.entropy_coeff * agg(entropy)
        kl_loss = torch.zeros((), device=self.device)
        if ref is not None:
            ref_t = pad([ref[i] for i in mb] or [torch.zeros(2)])
            kl_loss = agg(kl_penalty(logp, ref_t, cfg.kl_loss_type))
            loss = loss + cfg.kl_loss_coef * kl_loss

        dtype = self._sum_dtype()
        n = mask.sum().to(dtype)
        token_sum = torch.where(mask, entropy, torch.zeros_like(entropy)).sum()
        values = {
            "pg_loss": pg_loss.detach(),
            "kl_loss": kl_loss.detach(),
            "entropy": token_sum.detach(),
            "loss": loss.detach(),
            **{k: getattr(stats, k).to(dtype) * n for k in _SUMS if hasattr(stats, k)},
        }
        # The behaviour weight is a mean over the tokens the cap kept, not over all of them.
        values["behav_weight"] = stats.behav_weight.to(dtype) * (n - values["behav_capped"])
        zero = torch.zeros((), dtype=dtype, device=self.device)
        for k in ("rc_kl", "rc_k3_kl", "rc_is_weight", "rc_masked", "rc_seq_masked"):
            values[k] = rc_sums.get(k, zero)
        return loss, torch.stack([values[k].to(dtype) for k in _SUMS])

    def _cov_settings(self) -> CovSettings:
        p = self.config.policy_loss
        return CovSettings(
            p.clip_cov_ratio, p.clip_cov_lb, p.clip_cov_ub, p.kl_cov_ratio, p.ppo_kl_coef
        )

    def _clip_cov_generator(self, micro_index: int) -> torch.Generator | None:
        """clip_cov's random draw, seeded by the run's seed, step and micro-batch (every rank
        draws its own tokens, reproducibly)."""
        if self.config.policy_loss.loss_mode != "clip_cov":
            return None
        g = torch.Generator(device=self.device)
        key = (self.config.seed, self.step, self.group.rank, micro_index)
        g.manual_seed(hash(key) & 0x7FFF_FFFF_FFFF)
        return g

    @staticmethod
    def _bypass_correction(
        logp: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, rc: RolloutCorrectionConfig
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """Bypass mode (verl's `compute_policy_loss_bypass_mode`): IS weights and the rejection
        of this micro-batch's tokens, taken from the current policy against the rollout's
        logprobs; the loss mask with rejected tokens removed, the weights (None without
        `rollout_is`) and the metric sums (over tokens, rejected sequences counted)."""
        log_ratio = (logp.detach() - rollout).float()
        weights = None
        kept = mask
        sums: dict[str, torch.Tensor] = {}
        if rc.rollout_is is not None:
            weights, is_m = is_weights(
                log_ratio,
                mask,
                rc.rollout_is,
                rc.rollout_is_threshold,
                rc.rollout_is_batch_normalize,
                all_metrics=False,
            )
            # verl's rollout_is_mean: the weights' mean before truncation
            sums["rc_is_weight"] = is_m["rollout_is_mean"] * mask.sum()
        if rc.rollout_rs is not None:
            kept, _ = rejection_mask(
                log_ratio, mask, parse_rs(rc.rollout_rs, rc.rollout_rs_threshold)
            )
            sums["rc_masked"] = (mask & ~kept).sum()
            sums["rc_seq_masked"] = (mask & ~kept).any(dim=-1).sum()
        k3 = log_ratio.exp() - log_ratio - 1
        zero = torch.zeros_like(log_ratio)
        sums["rc_kl"] = torch.where(mask, -log_ratio, zero).sum()
        sums["rc_k3_kl"] = torch.where(mask, k3, zero).sum()
        return kept, weights, sums

    def _sum_dtype(self) -> torch.dtype:
        return torch.float32 if self.device.type == "mps" else torch.float64

    def _sum_over_ranks(self, sums: torch.Tensor) -> torch.Tensor:
        """`sums` (on the trainer's device, float64 unless the device has none: MPS) summed over
        the trainer's ranks and read to the host as float64. The all-reduce runs on the
        trainer's device, as NCCL requires (the trainer imports no patrl package, so this is
        its one tensor collective, checked by patrl.tpreshard.device_check's patched
        torch.distributed in tests)."""
        if self.group.pg is not None:
            dist.all_reduce(sums, group=self.group.pg)
        return sums.to("cpu", torch.float64)

    def _clip_grad_norm(self) -> float:
        """Global grad norm (over all ranks' shards), gradients clipped to `grad_clip`."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])  # type: ignore[misc]
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if torch.isfinite(norm):
            torch.nn.utils.clip_grads_with_norm_(params, self.config.grad_clip, norm)
        return float(norm)

    def _apply_or_skip(self, finite: bool) -> None:
        if finite:
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            self.nonfinite_in_a_row = 0
        else:
            self.nonfinite_in_a_row += 1
            self.nonfinite_total += 1
            log.warning(
                "skipped a step with a non-finite loss or gradient (%d in a row, %d in all); "
                "weights unchanged at step %d",
                self.nonfinite_in_a_row,
                self.nonfinite_total,
                self.step,
            )
        self.optimizer.zero_grad(set_to_none=True)
        limit = self.config.max_nonfinite_steps
        if self.nonfinite_in_a_row >= limit:
            raise NonFiniteError(
                f"{self.nonfinite_in_a_row} steps in a row had a non-finite loss or gradient "
                f"(max_nonfinite_steps={limit}); last good step {self.step}. Lower optim.lr, "
                "check advantages/logprobs for inf/NaN, or resume from a checkpoint"
            )

    def _metrics(
        self,
        sums: torch.Tensor,
        num_tokens: float,
        grad_norm: float,
        lr: float,
        num_seqs: float = 1.0,
    ) -> dict[str, float]:
        s = dict(zip(_SUMS, sums.tolist(), strict=True))
        per_token = {k: s[k] / num_tokens for k in _SUMS if k not in ("pg_loss", "kl_loss", "loss")}
        rc = self.config.policy_loss.rollout_correction
        bypass: dict[str, float] = {}
        if rc is not None and rc.bypass_mode:
            bypass["rollout_corr/kl"] = per_token["rc_kl"]
            bypass["rollout_corr/k3_kl"] = per_token["rc_k3_kl"]
            if rc.rollout_is is not None:
                bypass["rollout_corr/rollout_is_mean"] = per_token["rc_is_weight"]
            if rc.rollout_rs is not None:
                bypass["rollout_corr/rollout_rs_masked_fraction"] = per_token["rc_masked"]
                bypass["rollout_corr/rollout_rs_seq_masked_fraction"] = s["rc_seq_masked"] / max(
                    num_seqs, 1.0
                )
        return {
            **bypass,
            "actor/pg_loss": s["pg_loss"],
            "actor/kl_loss": s["kl_loss"],
            "actor/entropy": per_token["entropy"],
            "actor/pg_clipfrac": per_token["clipfrac"],
            "actor/pg_clipfrac_low": per_token["clipfrac_low"],
            "actor/pg_clipfrac_high": per_token["clipfrac_high"],
            "actor/pg_clipfrac_lower": per_token["clipfrac_lower"],
            "actor/ppo_kl": per_token["ppo_kl"],
            "actor/behav_capped_frac": per_token["behav_capped"],
            "actor/behav_imp_weight": s["behav_weight"] / max(num_tokens - s["behav_capped"], 1.0),
            "actor/loss": s["loss"],
            "actor/grad_norm": grad_norm,
            "actor/lr": lr,
        }

    def _padded_fraction(self, batch: PolicyBatch) -> float:
        plans = plan_micro_batches(
            batch.lengths,
            self.config.ppo_max_token_len_per_gpu,
            self.group.size,
            self.config.ppo_micro_batch_size_per_gpu,
        )
        return padded_fraction(batch.lengths, [mb for plan in plans for mb in plan])

    # ---- weights and checkpoints ----------------------------------------------------------

    def iter_full_weights(
        self, bucket_bytes: int, dtype: torch.dtype | None = None
    ) -> Iterator[Bucket]:
        """Buckets of `(hf_name, full_tensor)`, on every rank of the trainer (see weights.py).
        With LoRA only the adapters (`<module>.lora_A.weight`, `.lora_B.weight`): the engine's
        base never changes."""
        if self.lora is not None:
            return iter_adapter_weights(self.model, bucket_bytes, dtype)
        return iter_full_weights(self.model, bucket_bytes, dtype)

    def save_adapter(self, path: str | Path) -> Path | None:
        """With LoRA: a PEFT adapter directory (`adapter_config.json`,
        `adapter_model.safetensors`) at `path`, written atomically by the first rank; None
        without LoRA. The policy's is PEFT's CAUSAL_LM task; the critic's is TOKEN_CLS with
        its value head (`score`) in `modules_to_save`, saved whole beside the adapters, so
        `PeftModel.from_pretrained` over `AutoModelForTokenClassification` (one label) of the
        base gives the critic's values. Collective over the trainer's ranks."""
        lora = self.config.lora if self.config.lora.enabled else None
        if lora is None:
            return None
        heads = lora_trainable(self.head)
        tensors = {
            n: t
            for bucket in iter_adapter_weights(self.model, 1 << 62, modules_to_save=heads)
            for n, t in bucket
        }
        out = None
        if self.group.rank == 0:
            base = None if self.source_dir is None else str(self.source_dir.resolve())
            targets = select_targets(self.model, lora)
            task = "TOKEN_CLS" if self.head == "value" else "CAUSAL_LM"
            about = adapter_config(lora, targets, base, task, list(heads) or None)
            out = write_adapter_dir(path, about, tensors)
        self.group.barrier()
        return out

    def check_finite(self) -> None:
        """Raise NonFiniteError when any weight holds inf or NaN, on any rank (a collective
        over the trainer's ranks; one host sync). A checkpoint of such weights would only
        resume a diverged run."""
        bad = torch.zeros((), device=self.device)
        for p in self.model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            bad = torch.maximum(bad, (~torch.isfinite(local)).any().float())
        if self.group.pg is not None:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group.pg)
        if bad.item():
            role = {"lm": "policy", "value": "critic"}.get(self.head, self.head)
            raise NonFiniteError(
                f"the {role}'s weights hold inf or NaN after step {self.step} (an "
                "update diverged: too high a learning rate, or inf/NaN advantages); no "
                "checkpoint is written from them. Resume from the newest checkpoint with a "
                "lower optim.lr"
            )

    def save(self, path: str | Path) -> Path:
        """Checkpoint what `config.checkpoint.save_contents` names of policy, optimizer and
        extra state (schedule, step, RNG) to `path` (checkpoint.py); "hf_model" is
        `export_hf`'s. The frozen reference is not saved: it is rebuilt from the model source.
        Weights that are not finite are refused (`check_finite`)."""
        self.check_finite()
        extra = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "nonfinite_total": self.nonfinite_total,
        }
        about = {
            "head": self.head,
            "source": None if self.source_dir is None else str(self.source_dir.resolve()),
        }
        out = save_checkpoint(
            path,
            self.model,
            self.optimizer,
            extra,
            self.group,
            self.config.checkpoint.save_contents,
            about,
        )
        self.save_adapter(Path(path) / LORA_ADAPTER_DIR)
        return out

    def load(self, path: str | Path) -> None:
        """Restore a checkpoint `save` wrote, at this or any other number of trainer ranks."""
        extra = load_checkpoint(path, self.model, self.optimizer, self.group)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.step = extra["step"]
        self.nonfinite_in_a_row = extra["nonfinite_in_a_row"]
        self.nonfinite_total = extra["nonfinite_total"]

    def export_hf(
        self, path: str | Path, dtype: torch.dtype | None = None, weights: bool = True
    ) -> Path:
        """A directory `from_pretrained` and patrl's engine load (hf_export.py): safetensors
        in `dtype` (None: the source model's, `export_dtype`), config, generation config and
        the source's tokenizer. `weights` False writes all but the weights. Collective over
        the trainer's ranks; the first writes."""
        dtype = dtype or self.export_dtype
        config = hf_config(self.model.config, self.head, dtype)
        return export_hf(path, self.model, config, self.source_dir, self.group, dtype, weights)


# Two tokens: the least a causal-LM forward needs to produce one prediction.
_DUMMY_IDS = torch.zeros(2, dtype=torch.long)


def _to_host(values: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Fresh host copies of `values` (fp32), in one device-to-host transfer."""
    if not values:
        return {}
    keys = list(values)
    flat = torch.cat([values[i].float().reshape(-1) for i in keys]).cpu()
    parts = flat.split([values[i].numel() for i in keys])
    # Own storage each: views of one buffer would each pickle all of it (all_gather_object).
    return {i: p.view(values[i].shape).clone() for i, p in zip(keys, parts, strict=True)}


def _is_config(source: ModelSource) -> bool:
    return isinstance(source, PretrainedConfig)


def _memory_metrics(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    # ru_maxrss is in KiB on Linux: the peak resident set of this process.
    return {"perf/max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
