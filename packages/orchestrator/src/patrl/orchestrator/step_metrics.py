"""The metrics row of a step (verl's names): timings, what the update left (`PolicyUpdate`), the
batch's scores, advantages and lengths, the critic's values, the rollout/trainer probability gap
and off-policy metrics, and validation's (pass@1 and verl's per-source metrics). `metrics.py` logs the rows."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.scoring import Sample, model_token_mask
from patrl.orchestrator.val_metrics import validation_source_metrics
from patrl.trainer.rollout_correction import ragged_offpolicy_metrics


@dataclass(slots=True)
class PolicyUpdate:
    """What one update left for the step's metrics: the batch's rewards, its advantages (every
    response token's), the actor's (and critic's) metrics, and the trainer's logprobs of the
    batch before the update (None when the actor did not update: critic warmup)."""

    rewards: np.ndarray
    advantages: np.ndarray
    actor_metrics: dict[str, float]
    old_logprobs: list[torch.Tensor] | None
    critic_metrics: dict[str, float] = field(default_factory=dict)
    # each response's summed token rewards after the KL penalty (None: no KL in the reward)
    sequence_rewards: np.ndarray | None = None


@contextlib.contextmanager
def timed(timings: dict[str, float], key: str) -> Iterator[None]:
    """Add the block's wall time to `timings[key]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


def step_metrics(
    config: JobConfig,
    timings: dict[str, float],
    samples: list[Sample],
    update: PolicyUpdate,
    world_size: int,
    *parts: dict[str, float],
) -> dict[str, float]:
    """The metrics row of a step (verl's names): timings, the schedule's own `parts`, the
    actor's, the batch's, the rollout/trainer probability gap and the throughput."""
    metrics = {f"timing_s/{k}": v for k, v in timings.items()}
    for part in parts:
        metrics.update(part)
    metrics.update(update.actor_metrics)
    metrics.update(update.critic_metrics)
    metrics.update(
        batch_metrics(samples, update.rewards, update.advantages, config.data.max_response_length)
    )
    # verl's critic/rewards/*: the summed token-level rewards, after the KL penalty if any.
    summed = update.rewards if update.sequence_rewards is None else update.sequence_rewards
    for name, pick in (("mean", np.mean), ("max", np.max), ("min", np.min)):
        metrics[f"critic/rewards/{name}"] = float(pick(summed))
    if update.old_logprobs is not None:
        metrics.update(probs_diff(samples, update.old_logprobs))
        metrics.update(mismatch_metrics(samples, update.old_logprobs, metrics))
    tokens = sum(len(s.prompt_token_ids) + len(s.token_ids) for s in samples)
    metrics["perf/total_num_tokens"] = float(tokens)
    metrics["perf/throughput"] = tokens / timings["step"] / world_size
    return metrics


def batch_metrics(
    samples: list[Sample], rewards: np.ndarray, advantages: np.ndarray, max_len: int
) -> dict[str, float]:
    """Scores, advantages and lengths of the trained batch. `response_length/*` count every
    response token (verl's: a multi-turn response's tool tokens too); with multi-turn samples,
    `response_length/model_tokens/*` count the trained ones."""
    lengths = np.array([len(s.token_ids) for s in samples], dtype=np.float64)
    prompts = np.array([len(s.prompt_token_ids) for s in samples], dtype=np.float64)
    out: dict[str, float] = {}
    if any(s.response_mask is not None for s in samples):
        model = np.array([s.model_tokens for s in samples], dtype=np.float64)
        out["response_length/model_tokens/mean"] = float(model.mean())
        out["response_length/model_tokens/max"] = float(model.max())
    return out | {
        "critic/score/mean": float(rewards.mean()),
        "critic/score/max": float(rewards.max()),
        "critic/score/min": float(rewards.min()),
        "critic/advantages/mean": float(advantages.mean()),
        "critic/advantages/max": float(advantages.max()),
        "critic/advantages/min": float(advantages.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/p90": float(np.percentile(lengths, 90)),
        "response_length/clip_ratio": float(
            np.mean([s.finish_reason == "length" for s in samples])
        ),
        "prompt_length/mean": float(prompts.mean()),
    }


def value_metrics(
    values: list[torch.Tensor],
    returns: list[np.ndarray],
    lengths: list[int],
    masks: list[np.ndarray] | None = None,
) -> dict[str, float]:
    """verl's critic/values/*, critic/returns/* and critic/vf_explained_var over the response
    tokens (with `masks`, bool per response token: the masked ones, the model's tokens of a
    multi-turn sample): 1 - var(returns - values) / var(returns), variances unbiased."""
    keep = masks or [np.ones(n, dtype=bool) for n in lengths]
    v = np.concatenate(
        [t[-n:].double().numpy()[m] for t, n, m in zip(values, lengths, keep, strict=True)]
    )
    r = np.concatenate([ret[m] for ret, m in zip(returns, keep, strict=True)])
    ddof = 1 if r.size > 1 else 0
    return {
        "critic/values/mean": float(v.mean()),
        "critic/values/max": float(v.max()),
        "critic/values/min": float(v.min()),
        "critic/returns/mean": float(r.mean()),
        "critic/returns/max": float(r.max()),
        "critic/returns/min": float(r.min()),
        "critic/vf_explained_var": float(1.0 - (r - v).var(ddof=ddof) / (r.var(ddof=ddof) + 1e-5)),
    }


def probs_diff(samples: list[Sample], trainer_logprobs: list[torch.Tensor]) -> dict[str, float]:
    """How far the engine's token probabilities are from the trainer's (verl's names), over the
    model's tokens."""
    diffs = []
    for s, lp in zip(samples, trainer_logprobs, strict=True):
        n = len(s.token_ids)
        model = torch.from_numpy(model_token_mask(s))  # tool tokens have no engine logprob
        trainer = lp[lp.numel() - n :].double().exp()[model]
        engine = torch.tensor(s.logprobs, dtype=torch.float64).exp()[model]
        diffs.append((trainer - engine).abs())
    d = torch.cat(diffs)
    return {
        "training/rollout_probs_diff_mean": float(d.mean()),
        "training/rollout_probs_diff_max": float(d.max()),
        "training/rollout_probs_diff_std": float(d.std()) if d.numel() > 1 else 0.0,
    }


def mismatch_metrics(
    samples: list[Sample], trainer_logprobs: list[torch.Tensor], already: dict[str, float]
) -> dict[str, float]:
    """verl's `rollout_corr/*` off-policy metrics (KL, k3 KL, perplexities, chi-squared)
    between the trainer's logprobs of the batch and the engine's, every step, over the
    responses' own model tokens (no padding, no tool tokens); those a rollout correction
    already reported (same inputs) are kept. Responses without model tokens are left out."""
    rows = [
        (lp, s, torch.from_numpy(model_token_mask(s)))
        for lp, s in zip(trainer_logprobs, samples, strict=True)
        if s.model_tokens
    ]
    if not rows:
        return {}
    got = ragged_offpolicy_metrics(
        [lp[lp.numel() - len(s.token_ids) :][m] for lp, s, m in rows],
        [torch.tensor(s.logprobs, dtype=torch.float64)[m] for _, s, m in rows],
    )
    names = list(got)
    values = torch.stack([got[k] for k in names]).tolist()
    return {
        f"rollout_corr/{k}": v
        for k, v in zip(names, values, strict=True)
        if f"rollout_corr/{k}" not in already
    }


def validation_metrics(
    samples: list[Sample], start: float, sources: Mapping[int, str] | None = None
) -> dict[str, float]:
    """A validation run that began at `start` (perf_counter): `val-core/acc/mean@1`, the mean
    reward of every response (pass@1, estimated over `rollout.val_kwargs.n` responses a prompt),
    the mean length, and verl's per-source metrics (`val_metrics`; `sources`: prompt index ->
    data source)."""
    scores = [s.reward for s in samples]
    return {
        "val-core/acc/mean@1": float(np.mean(scores)) if scores else 0.0,
        "val/response_length/mean": float(np.mean([len(s.token_ids) for s in samples]))
        if samples
        else 0.0,
        **validation_source_metrics(samples, sources or {}),
        "timing_s/testing": time.perf_counter() - start,
    }


def data_sources(items: Iterable[PromptItem]) -> dict[int, str]:
    """Each prompt's `data_source` column (verl's), by prompt index; rows without one are
    left out (their source is "unknown")."""
    return {i.index: str(i.extra["data_source"]) for i in items if i.extra.get("data_source")}
