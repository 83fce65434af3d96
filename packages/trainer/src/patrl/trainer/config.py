"""User-facing trainer configuration. Key names follow verl's `actor_rollout_ref.actor.*`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from patrl.trainer.lora import LoraConfig

AggMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
KLType = Literal["k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"]


class OptimConfig(BaseModel):
    """AdamW plus linear warmup into a constant or cosine schedule (verl `actor.optim`).

    `total_training_steps` (None: not known yet) is the cosine's horizon and the base of
    `lr_warmup_steps_ratio`; a schedule that needs it fails at `build_scheduler` without it (the
    orchestrator fills it in with the run's length)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    lr: float = Field(default=1e-6, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)
    lr_warmup_steps: int = Field(
        default=-1, ge=-1, description="-1 = lr_warmup_steps_ratio x total_training_steps"
    )
    lr_warmup_steps_ratio: float = Field(
        default=0.0, ge=0, le=1, description="warmup share of the run when lr_warmup_steps=-1"
    )
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    # Cosine decays to lr * min_lr_ratio at total_training_steps.
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    total_training_steps: int | None = Field(
        default=None, ge=1, description="None = the run's (trainer.total_training_steps)"
    )

    @property
    def num_warmup_steps(self) -> int:
        """Warmup steps in force: lr_warmup_steps, or (at -1, verl's rule) the ratio's share of
        total_training_steps, rounded down."""
        if self.lr_warmup_steps >= 0:
            return self.lr_warmup_steps
        if self.lr_warmup_steps_ratio == 0:
            return 0
        if self.total_training_steps is None:
            raise ValueError(
                f"lr_warmup_steps_ratio={self.lr_warmup_steps_ratio} needs total_training_steps"
            )
        return int(self.lr_warmup_steps_ratio * self.total_training_steps)

    def check_horizon(self) -> None:
        """Raise ValueError if the schedule needs total_training_steps and it is unset."""
        if self.lr_scheduler_type == "cosine" and self.total_training_steps is None:
            raise ValueError("lr_scheduler_type='cosine' needs total_training_steps")
        self.num_warmup_steps  # noqa: B018 (raises for a ratio without a horizon)


# What a checkpoint can hold (verl's `checkpoint.save_contents` values): "model" and
# "optimizer" the DCP shards, "extra" the LR schedule, step, RNG and counters, "hf_model" a
# Hugging Face directory of the weights. Resuming needs the first three.
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")
RESUMABLE_CONTENTS = ("model", "optimizer", "extra")


class CheckpointConfig(BaseModel):
    """verl's `actor.checkpoint` / `critic.checkpoint`: what each checkpoint holds."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    save_contents: list[str] = Field(
        default_factory=lambda: list(CHECKPOINT_CONTENTS),
        description="any of model, optimizer, extra (all three to resume) and hf_model (the "
        "weights in each checkpoint's Hugging Face directory, global_step_N/huggingface); "
        "patrl's default adds hf_model to verl's",
    )

    @field_validator("save_contents")
    @classmethod
    def _known(cls, contents: list[str]) -> list[str]:
        unknown = [c for c in contents if c not in CHECKPOINT_CONTENTS]
        if unknown or not contents:
            what = f"unknown value(s) {unknown}" if unknown else "an empty list"
            raise ValueError(f"{what}; accepted: a non-empty list of {list(CHECKPOINT_CONTENTS)}")
        return list(dict.fromkeys(contents))  # order kept, repeats dropped


class CriticCheckpointConfig(CheckpointConfig):
    """verl's `critic.checkpoint`: as the actor's, without the Hugging Face directory by
    default (verl's default contents)."""

    save_contents: list[str] = Field(
        default_factory=lambda: list(RESUMABLE_CONTENTS),
        description="as actor.checkpoint.save_contents; hf_model adds critic/huggingface (a "
        "token-classification model with one label), off by default as in verl",
    )


class RolloutCorrectionConfig(BaseModel):
    """verl's `algorithm.rollout_correction`: correct for the rollout engine's policy differing
    from the trainer's (rollout_correction.py; docs/verl.md, "Rollout correction").

    Decoupled (`bypass_mode` false): the trainer rescores the batch (pi_old) and the IS weights
    pi_old / pi_rollout multiply each token's policy loss; rejected tokens leave the loss mask.
    Bypass: the rollout's logprobs are PPO's anchor (no rescoring); the weights and the
    rejection are taken against the current policy inside the loss, which is PPO's clipped
    ratio (`ppo_clip`, no extra weights) or REINFORCE with the IS weights (`reinforce`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    rollout_is: Literal["token", "sequence"] | None = Field(
        default=None, description="truncated IS weights per token or per sequence; null = off"
    )
    rollout_is_threshold: float = Field(
        default=2.0, gt=0, description="IS weights are truncated to at most this"
    )
    rollout_is_batch_normalize: bool = Field(
        default=False, description="divide the IS weights by their batch mean"
    )
    rollout_rs: str | None = Field(
        default=None,
        description="rejection: comma-separated token_k1/2/3, seq_sum_k1/2/3, seq_mean_k1/2/3, "
        "seq_max_k2/3; null = off",
    )
    rollout_rs_threshold: str | float | None = Field(
        default=None,
        description="one bound per rollout_rs option (comma-separated) or one for all; k1 "
        "options take 'lower_upper' ratios or an upper u (lower 1/u)",
    )
    bypass_mode: bool = Field(
        default=False, description="the rollout's logprobs as PPO's anchor (no old-logprob pass)"
    )
    loss_type: Literal["ppo_clip", "reinforce"] = Field(
        default="ppo_clip", description="bypass_mode's loss: PPO's clip, or REINFORCE x IS weights"
    )

    @model_validator(mode="after")
    def _rs_parses(self) -> RolloutCorrectionConfig:
        if self.rollout_rs is not None:
            from patrl.trainer.rollout_correction import parse_rs

            parse_rs(self.rollout_rs, self.rollout_rs_threshold)
        return self

    @property
    def active(self) -> bool:
        """Whether anything is corrected (weights, rejection or the bypass anchor)."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode


class PolicyLossConfig(BaseModel):
    """verl's `actor.policy_loss`: which surrogate the actor minimises."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # Set from algorithm.rollout_correction when its bypass_mode is on (verl's
    # apply_bypass_mode puts it here too); the loss then takes its anchor from the rollout.
    rollout_correction: RolloutCorrectionConfig | None = Field(
        default=None, description="set by algorithm.rollout_correction.bypass_mode; leave unset"
    )

    # vanilla: PPO's token-level clipped ratio; gspo: GSPO's sequence-level ratio (the
    # geometric mean of the token ratios), clipped per sequence; cispo, gpg, sapo, geo_mean
    # (GMPO), clip_cov, kl_cov: verl's losses of those names (losses.py).
    loss_mode: str = Field(
        default="vanilla",
        description="vanilla (PPO token ratio), gspo (sequence ratio), cispo, gpg, sapo, "
        "geo_mean (GMPO), clip_cov, kl_cov",
    )

    # verl's covariance losses (clip_cov, kl_cov), per micro-batch as in verl.
    clip_cov_ratio: float = Field(
        default=0.0002, gt=0, le=1, description="clip_cov: share detached"
    )
    clip_cov_lb: float = Field(default=1.0, description="clip_cov: covariance band, lower")
    clip_cov_ub: float = Field(default=5.0, description="clip_cov: covariance band, upper")
    kl_cov_ratio: float = Field(default=0.0002, gt=0, le=1, description="kl_cov: share penalised")
    ppo_kl_coef: float = Field(default=0.1, ge=0, description="kl_cov: the |log r| coefficient")

    @field_validator("loss_mode")
    @classmethod
    def _known_loss(cls, mode: str) -> str:
        from patrl.trainer.losses import LOSS_MODES, REFUSED_LOSS_MODES

        if mode in REFUSED_LOSS_MODES:
            raise ValueError(f"loss_mode={mode} is not supported: {REFUSED_LOSS_MODES[mode]}")
        if mode not in LOSS_MODES:
            raise ValueError(f"unknown loss_mode {mode!r}; accepted: {', '.join(LOSS_MODES)}")
        return mode


class TrainerConfig(BaseModel):
    """Everything the policy trainer needs besides the model and the device mesh."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    optim: OptimConfig = Field(default_factory=lambda: OptimConfig())
    # LoRA (verl's actor_rollout_ref.model.lora_*): rank 0 trains the full weights.
    lora: LoraConfig = Field(default_factory=lambda: LoraConfig())
    grad_clip: float = Field(default=1.0, gt=0)
    # Micro-batches: padded tokens per micro-batch on one rank, and optionally a sample cap.
    ppo_max_token_len_per_gpu: int = Field(default=16384, ge=2)
    ppo_micro_batch_size_per_gpu: int | None = Field(default=None, ge=1)
    # PPO / GRPO surrogate; clip_ratio_low / _high left None take clip_ratio (verl's rule).
    policy_loss: PolicyLossConfig = Field(default_factory=lambda: PolicyLossConfig())
    clip_ratio: float = Field(default=0.2, ge=0, lt=1, description="PPO's clip range epsilon")
    clip_ratio_low: float | None = Field(
        default=None, ge=0, lt=1, description="ratio floor 1 - this; None = clip_ratio"
    )
    clip_ratio_high: float | None = Field(
        default=None, ge=0, description="ratio ceiling 1 + this; None = clip_ratio"
    )
    clip_ratio_c: float | None = Field(default=3.0, gt=1)
    # SAPO's gate temperatures (verl's actor.tau_pos / tau_neg).
    tau_pos: float = Field(default=1.0, gt=0, description="sapo: gate temperature where A > 0")
    tau_neg: float = Field(default=1.05, gt=0, description="sapo: gate temperature where A <= 0")
    loss_agg_mode: AggMode = "token-mean"
    # seq-mean-token-sum-norm's divisor (verl's name); None: the step's longest response.
    loss_scale_factor: float | None = Field(
        default=None,
        gt=0,
        description="seq-mean-token-sum-norm divisor; None = data.max_response_length",
    )
    entropy_coeff: float = 0.0
    # KL to a frozen reference policy as a loss term (builds the reference when true).
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(default=0.001, ge=0)
    kl_loss_type: KLType = "low_var_kl"
    # Decoupled PPO: tokens whose behaviour importance weight exceeds this are masked out.
    behav_imp_weight_cap: float | None = Field(default=None, gt=0)
    # Logprob convention shared with the rollout engine (see logprobs.py).
    temperature: float = Field(default=1.0, ge=0)
    logprob_chunk_tokens: int = Field(default=1024, ge=1)
    # Sequence packing (verl's name): each micro-batch's samples run as one row, position ids
    # restarting per sample, attention never crossing a sample; off runs right-padded rows.
    use_remove_padding: bool = True
    # Model build.
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    # Activation checkpointing: true / false, or "auto": off on CPU; on CUDA, on only when a
    # full micro-batch's estimated activations plus this rank's weights, gradients and AdamW
    # state exceed 80% of the device's free memory at build time (memory_plan.py).
    enable_gradient_checkpointing: bool | Literal["auto"] = "auto"
    attn_implementation: str = "sdpa"
    seed: int = 0
    # Steps with a non-finite loss or gradient are skipped; this many in a row stop the run.
    max_nonfinite_steps: int = Field(default=3, ge=1)
    checkpoint: CheckpointConfig = Field(default_factory=lambda: CheckpointConfig())

    @property
    def policy_agg_mode(self) -> str:
        """The policy loss's aggregation: GSPO's and SAPO's are always seq-mean-token-mean
        (verl's `compute_policy_loss_gspo` / `_sapo` ignore loss_agg_mode), the others'
        `loss_agg_mode` (geo_mean takes its own mean over sequences). The
        entropy and KL terms always use `loss_agg_mode` (as in verl)."""
        if self.policy_loss.loss_mode in ("gspo", "sapo"):
            return "seq-mean-token-mean"
        return self.loss_agg_mode

    @property
    def clip_low(self) -> float:
        """The lower clip range in force: clip_ratio_low, else clip_ratio."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        """The upper clip range in force: clip_ratio_high, else clip_ratio."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


class CriticConfig(TrainerConfig):
    """The value model's trainer (verl `critic.*`): the policy trainer's settings (optimizer,
    micro-batches, packing, build) and the value loss's clip; the PPO surrogate keys unused.
    Its checkpoints hold no Hugging Face directory unless asked (verl's default contents)."""

    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    checkpoint: CheckpointConfig = Field(default_factory=lambda: CriticCheckpointConfig())
    cliprange_value: float = Field(default=0.5, gt=0)
