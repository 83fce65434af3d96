"""KL control: the coefficient beta of the KL to the reference policy in the reward (verl's
`algorithm.use_kl_in_reward`, `algorithm.kl_ctrl`), its controllers and their checkpoint state,
the penalty it scales, and whether a KL term needs the reference at all.

Each response token's reward becomes score - beta * kl_t, the score sitting on the last token
and kl_t a per-token estimate of KL(pi_old || pi_ref) (`patrl.trainer.kl_penalty`). beta comes
from a fixed or an adaptive controller (Ziegler et al. 2019, verl's AdaptiveKLController), which
is updated once per step with the batch's KL and is part of the run's checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from patrl.orchestrator.config import JobConfig, KLControlConfig
from patrl.trainer import kl_penalty


class FixedKLController:
    """beta stays at `kl_coef`."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon after each batch."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0 or target_kl <= 0:
            raise ValueError(
                f"adaptive KL needs horizon > 0 and target_kl > 0, got {horizon}, {target_kl}"
            )
        self.value = kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta toward holding `current_kl` at the target; `n_steps`: samples seen."""
        error = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + error * n_steps / self.horizon


KLController = FixedKLController | AdaptiveKLController


def build_kl_controller(config: KLControlConfig) -> KLController:
    """The controller `algorithm.kl_ctrl` names."""
    if config.type == "adaptive":
        return AdaptiveKLController(config.kl_coef, config.target_kl, config.horizon)
    return FixedKLController(config.kl_coef)


KL_STATE_FILE = "kl_ctrl.json"


def save_kl_state(controller: KLController, checkpoint: Path) -> None:
    """Write the controller's coefficient into a checkpoint directory being staged."""
    (checkpoint / KL_STATE_FILE).write_text(json.dumps({"kl_coef": controller.value}))


def load_kl_state(controller: KLController, checkpoint: Path) -> None:
    """Restore the coefficient a checkpoint holds (one written without KL state: unchanged)."""
    path = checkpoint / KL_STATE_FILE
    if path.is_file():
        controller.value = float(json.loads(path.read_text())["kl_coef"])


def needs_reference(config: JobConfig) -> bool:
    """Whether some KL term needs the reference policy's logprobs (else it is never built)."""
    return config.actor.use_kl_loss or config.algorithm.use_kl_in_reward


def apply_kl_penalty(
    token_scores: Sequence[npt.ArrayLike],
    old_logprobs: Sequence[torch.Tensor],
    ref_logprobs: Sequence[torch.Tensor],
    controller: KLController,
    kl_type: str,
    masks: Sequence[npt.ArrayLike] | None = None,
) -> tuple[list[npt.NDArray[np.float64]], dict[str, float]]:
    """Token rewards score_t - beta * kl_t of each response (logprobs: its response tokens),
    verl's metrics, and the controller updated with the batch's mean per-sequence KL.
    `masks` (bool, one per response token; multi-turn: False on tool tokens): verl's
    response_mask, the KL is 0 off it and each sequence's KL is its mean over the masked
    tokens (a sequence with none counts 0)."""
    beta = controller.value
    rewards, seq_kls = [], []
    for i, (scores, old, ref) in enumerate(
        zip(token_scores, old_logprobs, ref_logprobs, strict=True)
    ):
        s = np.asarray(scores, dtype=np.float64)
        if old.shape != (s.size,) or ref.shape != (s.size,):
            raise ValueError(
                f"response {i}: {s.size} token scores but logprobs of shape "
                f"{tuple(old.shape)} / {tuple(ref.shape)}"
            )
        m = np.ones(s.size, dtype=bool) if masks is None else np.asarray(masks[i], dtype=bool)
        if m.shape != (s.size,):
            raise ValueError(f"response {i}: {s.size} token scores but a mask of {m.shape}")
        kl = np.where(m, kl_penalty(old.double(), ref.double(), kl_type).numpy(), 0.0)
        rewards.append(s - beta * kl)
        seq_kls.append(float(kl[m].mean()) if m.any() else 0.0)
    current_kl = float(np.mean(seq_kls)) if seq_kls else 0.0
    controller.update(current_kl, n_steps=len(seq_kls))
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
