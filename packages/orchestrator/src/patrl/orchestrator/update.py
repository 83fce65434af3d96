"""The update of one step, from scored samples: advantages (after the KL penalty in the reward,
or GAE on the critic's values), the trainer's batch, rollout correction, and the PPO epochs over
mini-batches of whole prompt groups for the actor (and the critic)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from patrl.orchestrator.advantages import (
    GROUP_ESTIMATORS,
    gae_advantages,
    token_advantages,
    token_level_scores,
)
from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.errors import JobError
from patrl.orchestrator.kl_control import KLController, apply_kl_penalty, needs_reference
from patrl.orchestrator.scoring import Sample, model_token_mask
from patrl.orchestrator.step_metrics import PolicyUpdate, timed, value_metrics
from patrl.trainer import Critic, PolicyBatch, Trainer
from patrl.trainer.rollout_correction import correction


def update_policy(
    config: JobConfig,
    trainer: Trainer,
    samples: list[Sample],
    step: int,
    timings: dict[str, float],
    decoupled: bool = False,
    kl_ctrl: KLController | None = None,
    critic: Critic | None = None,
) -> PolicyUpdate:
    """Advantages, the batch, and the PPO update of one step (timed into `timings`); with a
    `critic`, `update_with_critic`.

    The PPO "old" logprobs come from a scoring pass before the first update, or, when the batch
    makes a single on-policy optimizer step and the reward needs no KL, from that update's own
    forward (as TRL does with num_iterations=1). `decoupled` (async data) always scores: those
    are the proximal logprobs, and the samples' own logprobs are the behaviour policy's. The
    reference scores the batch only when a KL term needs it; `kl_ctrl` sets the KL-in-reward
    coefficient (required with `algorithm.use_kl_in_reward`). With a `critic`: PPO with GAE
    (`update_with_critic`)."""
    if critic is not None:
        return update_with_critic(
            config, trainer, critic, samples, step, timings, kl_ctrl, decoupled
        )
    batch, rewards, advantages = policy_batch(config, samples, behaviour=decoupled)
    kl_metrics: dict[str, float] = {}
    summed: np.ndarray | None = None
    if config.algorithm.use_kl_in_reward:
        token_rewards, kl_metrics = kl_penalized_rewards(
            config, trainer, batch, samples, rewards, timings, kl_ctrl
        )
        summed = np.array([t.sum() for t in token_rewards], dtype=np.float64)
        with timed(timings, "adv"):
            scored, _, advantages = policy_batch(config, samples, decoupled, token_rewards)
            batch.advantages = scored.advantages
    actor_metrics, old = update_actor(config, trainer, batch, samples, step, timings, decoupled)
    return PolicyUpdate(
        rewards, advantages, {**actor_metrics, **kl_metrics}, old, sequence_rewards=summed
    )


def update_with_critic(
    config: JobConfig,
    trainer: Trainer,
    critic: Critic,
    samples: list[Sample],
    step: int,
    timings: dict[str, float],
    kl_ctrl: KLController | None = None,
    decoupled: bool = False,
) -> PolicyUpdate:
    """PPO with a critic (verl's order): values of the batch, the critic's update on GAE
    returns, whitened GAE advantages, then the actor's update unless `step` is within
    `trainer.critic_warmup`. When the critic makes one step its update's forward is the
    values pass (no separate one), as the actor's is for the old logprobs. With
    `algorithm.use_kl_in_reward` the token rewards carry the KL penalty first. `decoupled`
    (async data): the samples' own logprobs are the behaviour policy's, as in
    `update_policy`; the critic is trained on-policy for itself either way (its values are
    its current ones)."""
    a = config.algorithm
    batch = PolicyBatch.from_responses(
        [s.prompt_token_ids for s in samples],
        [s.token_ids for s in samples],
        [0.0] * len(samples),
        behaviour_logprobs=[s.logprobs for s in samples] if decoupled else None,
    )
    mask_tool_tokens(batch, samples)
    rewards = np.array([s.reward for s in samples], dtype=np.float64)
    lengths = [len(s.token_ids) for s in samples]
    scores = token_level_scores(rewards, lengths)
    kl_metrics: dict[str, float] = {}
    summed: np.ndarray | None = None
    if a.use_kl_in_reward:
        scores, kl_metrics = kl_penalized_rewards(
            config, trainer, batch, samples, rewards, timings, kl_ctrl
        )
        summed = np.array([t.sum() for t in scores], dtype=np.float64)
    # on the prompt + response layout the critic reads (0 on the prompt)
    token_rewards = [
        _on_response(ids.numel(), r) for ids, r in zip(batch.input_ids, scores, strict=True)
    ]
    if single_update(config, samples, critic=True):
        with timed(timings, "update_critic"):
            critic_metrics = critic.update(batch, token_rewards, a.gamma, a.lam)
        values = critic.scored_values()
    else:
        with timed(timings, "values"):
            values = critic.compute_values(batch)
        with timed(timings, "update_critic"):
            critic_metrics = critic_update(
                config, critic, batch, samples, step, token_rewards, values
            )
    masks = [model_token_mask(s) for s in samples]  # GAE skips tool tokens (verl's)
    advantages, returns = gae_advantages(
        [t[-n:].numpy() for t, n in zip(token_rewards, lengths, strict=True)],
        [v[-n:].double().numpy() for v, n in zip(values, lengths, strict=True)],
        gamma=a.gamma,
        lam=a.lam,
        masks=masks,
    )
    batch.advantages = [
        _on_response(ids.numel(), adv) for ids, adv in zip(batch.input_ids, advantages, strict=True)
    ]
    critic_metrics.update(value_metrics(values, returns, lengths, masks))
    actor_metrics: dict[str, float] = {}
    old: list[torch.Tensor] | None = None
    if step > config.trainer.critic_warmup:
        actor_metrics, old = update_actor(config, trainer, batch, samples, step, timings, decoupled)
    flat = np.concatenate([adv[m] for adv, m in zip(advantages, masks, strict=True)])
    return PolicyUpdate(rewards, flat, {**actor_metrics, **kl_metrics}, old, critic_metrics, summed)


def update_actor(
    config: JobConfig,
    trainer: Trainer,
    batch: PolicyBatch,
    samples: list[Sample],
    step: int,
    timings: dict[str, float],
    decoupled: bool = False,
) -> tuple[dict[str, float], list[torch.Tensor] | None]:
    """The actor's PPO update of `batch` (advantages set) and the trainer's logprobs of the
    batch before it: from the update's own forward when it makes one on-policy step and nothing
    scored them yet. With `algorithm.rollout_correction` (verl's): in bypass mode the samples'
    own logprobs are the old logprobs and nothing is rescored (the logprobs returned are None:
    the trainer never computed them); with IS weights or rejection (decoupled) the batch is
    rescored and corrected first, its `rollout_corr/*` metrics joining the actor's."""
    rc = config.algorithm.rollout_correction
    if rc.bypass_mode:
        batch.old_logprobs = _aligned(batch, [s.logprobs for s in samples])
    fused = not decoupled and batch.old_logprobs is None and single_update(config, samples)
    if rc.active and not rc.bypass_mode:
        fused = False
    if fused:
        if needs_reference(config) and batch.ref_logprobs is None:
            with timed(timings, "ref"):
                batch.ref_logprobs = trainer.compute_ref_logprobs(batch)
    else:
        score_old_and_ref(config, trainer, batch, timings)
    rc_metrics: dict[str, float] = {}
    if rc.active and not rc.bypass_mode:
        rc_metrics = correct_batch(config, batch, samples)
    with timed(timings, "update_actor"):
        actor_metrics = ppo_update(config, trainer, batch, samples, step)
    if rc.bypass_mode:
        return {**actor_metrics, **rc_metrics}, None
    old = trainer.scored_logprobs() if fused else batch.old_logprobs
    assert old is not None
    return {**actor_metrics, **rc_metrics}, old


def policy_batch(
    config: JobConfig,
    samples: list[Sample],
    behaviour: bool = False,
    token_rewards: list[np.ndarray] | None = None,
) -> tuple[PolicyBatch, np.ndarray, np.ndarray]:
    """Advantages of scored samples, and the trainer's batch (with the samples' own logprobs
    as behaviour logprobs, for decoupled PPO, when `behaviour`). `token_rewards`: each
    response's token-level rewards (None: its score on the last token)."""
    rewards = np.array([s.reward for s in samples], dtype=np.float64)
    if token_rewards is None:
        token_rewards = token_level_scores(rewards, [len(s.token_ids) for s in samples])
    algo = config.algorithm
    check_groups(algo.adv_estimator, samples)
    advantages = token_advantages(
        algo.adv_estimator,
        token_rewards,
        np.array([s.prompt_index for s in samples]),
        gamma=algo.gamma,
        norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        baselines=[s.baseline for s in samples],
        masks=[model_token_mask(s) for s in samples],
    )
    batch = PolicyBatch.from_responses(
        [s.prompt_token_ids for s in samples],
        [s.token_ids for s in samples],
        [a.tolist() for a in advantages],
        behaviour_logprobs=[s.logprobs for s in samples] if behaviour else None,
    )
    mask_tool_tokens(batch, samples)
    trained = [a[model_token_mask(s)] for a, s in zip(advantages, samples, strict=True)]
    return batch, rewards, np.concatenate(trained)


def mask_tool_tokens(batch: PolicyBatch, samples: Sequence[Sample]) -> None:
    """Multi-turn samples' appended tool tokens out of `batch.loss_mask` (the response part of
    row b is `samples[b]`'s tokens): the trainer's loss, entropy, KL loss and token counts all
    read the loss mask, so tool tokens are never trained on nor counted."""
    for b, s in enumerate(samples):
        if s.response_mask is None:
            continue
        m = batch.loss_mask[b].clone()
        m[m.numel() - len(s.token_ids) :] &= torch.as_tensor(s.response_mask, dtype=torch.bool)
        batch.loss_mask[b] = m


def check_groups(estimator: str, samples: list[Sample]) -> None:
    """A group estimator on a batch whose every group holds one sample has no signal: every
    advantage would be 0 and the run would learn nothing while reporting success. The config
    refuses rollout.n=1; this is the guard for a batch that got there another way."""
    if estimator not in GROUP_ESTIMATORS or not samples:
        return
    sizes = Counter(s.prompt_index for s in samples)
    if max(sizes.values()) == 1:
        raise JobError(
            f"algorithm.adv_estimator={estimator}: every one of the {len(sizes)} groups of this "
            "batch holds a single sample, so every advantage is 0 and nothing is learned; "
            "sample rollout.n > 1 per prompt, or use reinforce_plus_plus, remax or gae"
        )


def kl_penalized_rewards(
    config: JobConfig,
    trainer: Trainer,
    batch: PolicyBatch,
    samples: list[Sample],
    rewards: np.ndarray,
    timings: dict[str, float],
    kl_ctrl: KLController | None,
) -> tuple[list[np.ndarray], dict[str, float]]:
    """Each response's token rewards (its score on the last token) minus the KL penalty, and
    verl's KL metrics; scores the batch's old and reference logprobs into `batch` first."""
    if kl_ctrl is None:
        raise ValueError("algorithm.use_kl_in_reward needs a KL controller (kl_ctrl)")
    score_old_and_ref(config, trainer, batch, timings)
    assert batch.old_logprobs is not None and batch.ref_logprobs is not None
    return apply_kl_penalty(
        token_level_scores(rewards, [len(s.token_ids) for s in samples]),
        _responses(batch.old_logprobs, samples),
        _responses(batch.ref_logprobs, samples),
        kl_ctrl,
        config.algorithm.kl_penalty,
        masks=[model_token_mask(s) for s in samples],  # no KL on tool tokens
    )


def score_old_and_ref(
    config: JobConfig, trainer: Trainer, batch: PolicyBatch, timings: dict[str, float]
) -> None:
    """The batch's old logprobs, and the reference's when a KL term needs them, unless set."""
    if batch.old_logprobs is None:
        with timed(timings, "old_log_prob"):
            batch.old_logprobs = trainer.compute_logprobs(batch)
    if needs_reference(config) and batch.ref_logprobs is None:
        with timed(timings, "ref"):
            batch.ref_logprobs = trainer.compute_ref_logprobs(batch)


def correct_batch(config: JobConfig, batch: PolicyBatch, samples: list[Sample]) -> dict[str, float]:
    """verl's decoupled rollout correction over the whole batch (its
    `compute_rollout_correction_and_add_to_batch`): IS weights of the trainer's old logprobs
    against the samples' own into `batch.rollout_is_weights`, rejected tokens out of
    `batch.loss_mask`; returns the `rollout_corr/*` metrics."""
    assert batch.old_logprobs is not None
    rc = config.algorithm.rollout_correction
    # padded fp32 [samples, longest response], as verl's batch holds them
    width = max(len(s.token_ids) for s in samples)
    train = torch.zeros(len(samples), width, dtype=torch.float32)
    rollout = torch.zeros_like(train)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    for b, (lp, s) in enumerate(zip(batch.old_logprobs, samples, strict=True)):
        n = len(s.token_ids)
        train[b, :n] = lp[lp.numel() - n :].float()
        rollout[b, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
        mask[b, :n] = torch.from_numpy(model_token_mask(s))  # tool tokens have no rollout logprob
    weights, kept, metrics = correction(
        train,
        rollout,
        mask,
        rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold,
        rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
        rollout_rs=rc.rollout_rs,
        rollout_rs_threshold=rc.rollout_rs_threshold,
    )
    if not bool(kept.any()):
        raise JobError(
            f"algorithm.rollout_correction.rollout_rs={rc.rollout_rs} rejected every token of "
            f"the batch (rollout_rs_threshold={rc.rollout_rs_threshold}; "
            f"rollout_corr/kl={metrics['rollout_corr/kl']:.4g}): nothing is left to train on; "
            "loosen the threshold, or check the engine's and the trainer's dtypes"
        )
    lengths = [len(s.token_ids) for s in samples]
    if weights is not None:
        batch.rollout_is_weights = _aligned(batch, [weights[b, :n] for b, n in enumerate(lengths)])
    for b, n in enumerate(lengths):
        m = batch.loss_mask[b].clone()
        m[m.numel() - n :] &= kept[b, :n]
        batch.loss_mask[b] = m
    return metrics


def single_update(config: JobConfig, samples: list[Sample], critic: bool = False) -> bool:
    """Whether `ppo_update` (`critic`: `critic_update`) makes exactly one optimizer step over
    the whole batch."""
    prompts = len({s.prompt_index for s in samples})
    mini, epochs = _mini_and_epochs(config, critic)
    return epochs == 1 and prompts_per_mini_batch(config, prompts, mini) >= prompts


def _mini_and_epochs(config: JobConfig, critic: bool) -> tuple[int, int]:
    actor, c = config.actor, config.critic
    if not critic:
        return actor.ppo_mini_batch_size, actor.ppo_epochs
    return c.ppo_mini_batch_size or actor.ppo_mini_batch_size, c.ppo_epochs or actor.ppo_epochs


def prompts_per_mini_batch(config: JobConfig, prompts: int, mini: int | None = None) -> int:
    """A mini-batch's prompts: its share of the batch, which may hold more or fewer prompts
    than train_batch_size (dynamic sampling, over-sampling)."""
    mini = config.actor.ppo_mini_batch_size if mini is None else mini
    return max(1, prompts * mini // max(1, config.data.train_batch_size))


def mini_batches(
    config: JobConfig, samples: list[Sample], step: int, critic: bool = False
) -> Iterator[list[int]]:
    """The sample rows of each mini-batch of whole prompt groups, over all epochs (the actor's
    sizes, or the critic's with `critic`); shuffled per epoch when there are several."""
    mini, epochs = _mini_and_epochs(config, critic)
    prompts = sorted({s.prompt_index for s in samples})
    per_mini = prompts_per_mini_batch(config, len(prompts), mini)
    rng = np.random.default_rng(config.trainer.seed * 7919 + step + (1 << 20) * critic)
    for _ in range(epochs):
        order = rng.permutation(len(prompts)) if epochs > 1 else np.arange(len(prompts))
        for start in range(0, len(prompts), per_mini):
            chosen = {prompts[i] for i in order[start : start + per_mini]}
            yield [i for i, s in enumerate(samples) if s.prompt_index in chosen]


def ppo_update(
    config: JobConfig, trainer: Trainer, batch: PolicyBatch, samples: list[Sample], step: int
) -> dict[str, float]:
    """`ppo_epochs` passes over mini-batches of whole prompt groups; the mean of each metric."""
    sums: dict[str, list[float]] = {}
    for rows in mini_batches(config, samples, step):
        if not any(bool(batch.loss_mask[i].any()) for i in rows):
            continue  # rollout correction rejected all of it (every rank skips alike)
        metrics = trainer.train_step(batch_rows(batch, rows))
        for k, v in metrics.items():
            sums.setdefault(k, []).append(v)
    return {k: float(np.mean(v)) for k, v in sums.items()}


def critic_update(
    config: JobConfig,
    critic: Critic,
    batch: PolicyBatch,
    samples: list[Sample],
    step: int,
    rewards: list[torch.Tensor],
    values: list[torch.Tensor],
) -> dict[str, float]:
    """The critic's epochs over its mini-batches, returns from the pre-update `values`."""
    a = config.algorithm
    sums: dict[str, list[float]] = {}
    for rows in mini_batches(config, samples, step, critic=True):
        picked = ([rewards[i] for i in rows], [values[i] for i in rows])
        metrics = critic.update(batch_rows(batch, rows), picked[0], a.gamma, a.lam, picked[1])
        for k, v in metrics.items():
            sums.setdefault(k, []).append(v)
    return {k: float(np.mean(v)) for k, v in sums.items()}


def batch_rows(batch: PolicyBatch, rows: list[int]) -> PolicyBatch:
    """The rows `rows` of `batch`, every field alike."""

    def pick(values: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        return None if values is None else [values[i] for i in rows]

    return PolicyBatch(
        input_ids=[batch.input_ids[i] for i in rows],
        loss_mask=[batch.loss_mask[i] for i in rows],
        advantages=[batch.advantages[i] for i in rows],
        old_logprobs=pick(batch.old_logprobs),
        ref_logprobs=pick(batch.ref_logprobs),
        behaviour_logprobs=pick(batch.behaviour_logprobs),
        rollout_is_weights=pick(batch.rollout_is_weights),
    )


def _aligned(
    batch: PolicyBatch, responses: Sequence[Sequence[float] | torch.Tensor]
) -> list[torch.Tensor]:
    """Per-response-token values placed in the batch's prompt + response layout (0 on the
    prompt)."""
    out = []
    for ids, values in zip(batch.input_ids, responses, strict=True):
        row = torch.zeros(ids.numel(), dtype=torch.float32)
        row[ids.numel() - len(values) :] = torch.as_tensor(values, dtype=torch.float32)
        out.append(row)
    return out


def _responses(logprobs: list[torch.Tensor], samples: list[Sample]) -> list[torch.Tensor]:
    """The response tokens' part of per-sample logprobs aligned to prompt + response."""
    return [lp[lp.numel() - len(s.token_ids) :] for lp, s in zip(logprobs, samples, strict=True)]


def _on_response(length: int, values: np.ndarray) -> torch.Tensor:
    """Per-response-token `values` placed at the end of a `length`-token row, 0 before."""
    out = torch.zeros(length, dtype=torch.float32)
    out[length - len(values) :] = torch.from_numpy(values).float()
    return out
