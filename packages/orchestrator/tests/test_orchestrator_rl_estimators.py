"""REINFORCE++ (both), ReMax, KL in the reward and the KL controllers against plain Python
loops, and against verl's formulas (transcribed from verl/trainer/ppo/core_algos.py and ray_trainer.py's
apply_kl_penalty) on the same padded inputs."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from patrl.orchestrator.advantages import (
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    token_advantages,
    token_level_scores,
)
from patrl.orchestrator.config import ConfigError, KLControlConfig, load_config
from patrl.orchestrator.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
)

# Six responses of lengths 3, 1 (length-1), 4, 2, 1, 5 in three groups (one group of one).
LENGTHS = [3, 1, 4, 2, 1, 5]
GROUPS = np.array([7, 7, 7, 2, 2, 9])
SCORES = np.array([1.0, 0.0, 0.5, 2.0, -1.0, 0.25])


def _token_rewards(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=n) for n in LENGTHS]


def _whiten_loop(values: list[list[float]]) -> list[list[float]]:
    flat = [v for row in values for v in row]
    mean = sum(flat) / len(flat)
    var = sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in row] for row in values]


def test_reinforce_plus_plus_matches_loop_twin() -> None:
    rewards = _token_rewards(0)
    gamma = 0.9
    returns = []
    for r in rewards:
        row = []
        for t in range(len(r)):
            row.append(sum(gamma ** (k - t) * r[k] for k in range(t, len(r))))
        returns.append(row)
    want = _whiten_loop(returns)
    got = reinforce_plus_plus_advantages(rewards, gamma)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12)


def test_reinforce_plus_plus_baseline_matches_loop_twin() -> None:
    centred = []
    for i, score in enumerate(SCORES):
        group = [SCORES[j] for j in range(len(SCORES)) if GROUPS[j] == GROUPS[i]]
        baseline = sum(group) / len(group) if len(group) > 1 else 0.0
        centred.append([score - baseline] * LENGTHS[i])
    want = _whiten_loop(centred)
    got = reinforce_plus_plus_baseline_advantages(SCORES, GROUPS, LENGTHS)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12)


def _pad(rows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) + 2 for r in rows)  # right padding beyond every response
    values = torch.zeros(len(rows), width, dtype=torch.float64)
    mask = torch.zeros(len(rows), width, dtype=torch.float64)
    for b, r in enumerate(rows):
        values[b, : len(r)] = torch.as_tensor(r)
        mask[b, : len(r)] = 1.0
    return values, mask


def _verl_masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum()
    var = var * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _verl_rpp(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    returns = torch.zeros_like(token_level_rewards)
    running_return: torch.Tensor | float = 0
    for t in reversed(range(token_level_rewards.shape[1])):
        running_return = token_level_rewards[:, t] + gamma * running_return
        returns[:, t] = running_return
        running_return = running_return * response_mask[:, t]
    return _verl_masked_whiten(returns, response_mask) * response_mask


def _verl_rpp_baseline(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: list[int]
) -> torch.Tensor:
    response_length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1)
    id2score: dict[int, list[torch.Tensor]] = defaultdict(list)
    id2mean = {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        id2mean[idx] = torch.tensor(0.0) if len(group) == 1 else torch.mean(torch.stack(group))
    for i in range(scores.shape[0]):
        scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1).tile([1, response_length]) * response_mask
    return _verl_masked_whiten(scores, response_mask) * response_mask


def _unpad(values: torch.Tensor) -> list[np.ndarray]:
    return [values[b, :n].numpy() for b, n in enumerate(LENGTHS)]


def test_reinforce_plus_plus_matches_verl() -> None:
    rewards = _token_rewards(1)
    padded, mask = _pad(rewards)
    theirs = _unpad(_verl_rpp(padded, mask, gamma=0.95))
    ours = token_advantages("reinforce_plus_plus", rewards, GROUPS, gamma=0.95)
    for o, t in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(o, t, rtol=1e-10, atol=1e-12)


def test_reinforce_plus_plus_baseline_matches_verl() -> None:
    rewards = token_level_scores(SCORES, LENGTHS)
    padded, mask = _pad(rewards)
    theirs = _unpad(_verl_rpp_baseline(padded, mask, GROUPS.tolist()))
    ours = token_advantages("reinforce_plus_plus_baseline", rewards, GROUPS)
    for o, t in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(o, t, rtol=1e-10, atol=1e-12)


def test_outcome_estimators_score_the_sum_of_token_rewards() -> None:
    rewards = _token_rewards(2)
    got = token_advantages("rloo", rewards, GROUPS)
    for i, row in enumerate(got):
        mates = [j for j in range(len(LENGTHS)) if GROUPS[j] == GROUPS[i] and j != i]
        want = 0.0
        if mates:
            want = rewards[i].sum() - sum(rewards[j].sum() for j in mates) / len(mates)
        np.testing.assert_allclose(row, np.full(LENGTHS[i], want), rtol=1e-12, atol=1e-12)


def test_whitening_needs_two_tokens() -> None:
    assert [a.tolist() for a in reinforce_plus_plus_advantages([[3.0]])] == [[0.0]]
    equal = reinforce_plus_plus_baseline_advantages([1.0, 1.0], [0, 0], [1, 2])
    assert all(np.all(a == 0.0) for a in equal)


def test_token_level_scores_put_the_score_on_the_last_token() -> None:
    got = token_level_scores([1.5, -2.0, 3.0], [3, 1, 0])
    assert [g.tolist() for g in got] == [[0.0, 0.0, 1.5], [-2.0], []]


# ------------------------------------------------------------------ KL controllers


def test_fixed_controller_never_moves() -> None:
    ctrl = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        ctrl.update(kl, n_steps=64)
    assert ctrl.value == 0.05


def test_adaptive_controller_matches_loop_twin() -> None:
    ctrl = AdaptiveKLController(0.2, target_kl=0.1, horizon=1000)
    value = 0.2
    for kl, n in [(0.05, 16), (0.5, 16), (0.11, 32), (0.0, 8), (10.0, 100)]:
        error = min(max(kl / 0.1 - 1, -0.2), 0.2)
        value = value * (1 + error * n / 1000)
        ctrl.update(kl, n)
        assert ctrl.value == pytest.approx(value, rel=1e-15)
    assert build_kl_controller(KLControlConfig(type="adaptive", kl_coef=0.3)).value == 0.3


def test_adaptive_controller_steers_toward_the_target() -> None:
    ctrl = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    ctrl.update(1.0, 10)  # too much KL: a larger coefficient
    assert ctrl.value > 0.1
    high = ctrl.value
    ctrl.update(0.0, 10)  # too little: smaller
    assert ctrl.value < high


# ------------------------------------------------------------------ KL in the reward


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_apply_kl_penalty_matches_loop_twin(kind: str) -> None:
    rng = np.random.default_rng(3)
    old = [torch.tensor(-rng.random(n) * 2) for n in LENGTHS]
    ref = [o + torch.tensor(rng.normal(size=o.numel()) * 0.3) for o in old]
    scores = token_level_scores(SCORES, LENGTHS)
    ctrl = AdaptiveKLController(0.2, target_kl=0.05, horizon=500)
    rewards, metrics = apply_kl_penalty(scores, old, ref, ctrl, kind)

    def kl(lp: float, rp: float) -> float:
        d = lp - rp
        if kind in ("kl", "k1"):
            return d
        if kind == "abs":
            return abs(d)
        if kind in ("mse", "k2"):
            return 0.5 * d * d
        return min(max(math.exp(-d) + d - 1, -10.0), 10.0)

    seq_kls = []
    for i, n in enumerate(LENGTHS):
        kls = [kl(float(old[i][t]), float(ref[i][t])) for t in range(n)]
        want = [float(scores[i][t]) - 0.2 * kls[t] for t in range(n)]
        np.testing.assert_allclose(rewards[i], want, rtol=1e-12, atol=1e-14)
        seq_kls.append(sum(kls) / n)
    current = sum(seq_kls) / len(seq_kls)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current, rel=1e-12)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.2  # the coefficient used, pre-update
    error = min(max(current / 0.05 - 1, -0.2), 0.2)
    assert ctrl.value == pytest.approx(0.2 * (1 + error * len(LENGTHS) / 500), rel=1e-12)


def test_apply_kl_penalty_matches_verl() -> None:
    """verl: token_level_rewards = scores - beta * kl * mask; current_kl = mean over samples of
    the masked per-sequence mean; the controller updated with n_steps = batch size."""
    rng = np.random.default_rng(4)
    old = [torch.tensor(-rng.random(n) * 2) for n in LENGTHS]
    ref = [o + torch.tensor(rng.normal(size=o.numel()) * 0.3) for o in old]
    scores = token_level_scores(SCORES, LENGTHS)
    s_pad, mask = _pad(scores)
    o_pad, _ = _pad([o.numpy() for o in old])
    r_pad, _ = _pad([r.numpy() for r in ref])
    kld = (r_pad - o_pad).clamp(-20, 20)
    kld = (kld.exp() - kld - 1).clamp(-10, 10) * mask  # low_var_kl
    theirs = s_pad - 0.1 * kld
    current_kl = ((kld * mask).sum(-1) / mask.sum(-1)).mean().item()
    ours, metrics = apply_kl_penalty(scores, old, ref, FixedKLController(0.1), "low_var_kl")
    for o, t in zip(ours, _unpad(theirs), strict=True):
        np.testing.assert_allclose(o, t, rtol=1e-12, atol=1e-14)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current_kl, rel=1e-12)


def test_apply_kl_penalty_rejects_misaligned_logprobs() -> None:
    with pytest.raises(ValueError, match="response 0: 2 token scores"):
        apply_kl_penalty(
            [np.zeros(2)], [torch.zeros(3)], [torch.zeros(3)], FixedKLController(0.1), "kl"
        )


BASELINES = np.array([0.5, 0.5, 0.5, -1.0, -1.0, 2.0])  # one greedy reward per prompt


def test_remax_matches_loop_twin() -> None:
    rewards = _token_rewards(2)
    want = [
        [sum(r[k] for k in range(t, len(r))) - b for t in range(len(r))]
        for r, b in zip(rewards, BASELINES, strict=True)
    ]
    got = remax_advantages(rewards, BASELINES)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def _verl_remax(
    token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - reward_baselines.unsqueeze(-1) * response_mask


def test_remax_matches_verl() -> None:
    rewards = _token_rewards(3)
    padded, mask = _pad(rewards)
    theirs = _unpad(_verl_remax(padded, torch.from_numpy(BASELINES), mask))
    ours = token_advantages("remax", rewards, GROUPS, baselines=BASELINES)
    for o, t in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(o, t, rtol=1e-10, atol=1e-12)


def test_remax_needs_one_finite_baseline_per_response() -> None:
    rewards = _token_rewards(4)
    with pytest.raises(ValueError, match="needs baselines"):
        token_advantages("remax", rewards, GROUPS)
    with pytest.raises(ValueError, match="one greedy-response reward per response"):
        remax_advantages(rewards, BASELINES[:-1])
    with pytest.raises(ValueError, match=r"baselines\[1\] = nan"):
        remax_advantages(rewards, [0.0, float("nan"), 0, 0, 0, 0])


# ------------------------------------------------------------------ configuration


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_estimator_with_one_sample_is_a_config_error(estimator: str) -> None:
    with pytest.raises(
        ConfigError, match=rf"{estimator} with rollout.n=1.*reinforce_plus_plus.*gae"
    ):
        load_config(None, [f"algorithm.adv_estimator={estimator}", "rollout.n=1"])


def test_remax_takes_one_sample_per_prompt() -> None:
    cfg = load_config(None, ["algorithm.adv_estimator=remax", "rollout.n=1"])
    assert cfg.algorithm.adv_estimator == "remax"


def test_reinforce_plus_plus_runs_with_one_sample_and_kl_keys_load() -> None:
    cfg = load_config(
        None,
        [
            "algorithm.adv_estimator=reinforce_plus_plus",
            "rollout.n=1",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_penalty=abs",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.target_kl=0.02",
            "actor.policy_loss.loss_mode=gspo",
            "actor.loss_agg_mode=seq-mean-token-sum-norm",
            "actor.clip_ratio=0.25",
        ],
    )
    assert cfg.algorithm.kl_ctrl.horizon == 10000  # verl's default
    assert (cfg.actor.clip_low, cfg.actor.clip_high) == (0.25, 0.25)
    with pytest.raises(ConfigError, match="kl_penalty"):
        load_config(None, ["algorithm.kl_penalty=k4"])
    with pytest.raises(ConfigError, match=r"kl_ctrl\.type"):
        load_config(None, ["algorithm.kl_ctrl.type=pid"])


def test_a_batch_of_lone_samples_stops_a_group_estimator() -> None:
    from patrl.orchestrator.errors import JobError
    from patrl.orchestrator.scoring import Sample
    from patrl.orchestrator.update import check_groups

    def sample(group: int) -> Sample:
        return Sample(group, [1, 2], [3], [-0.1], "stop", 1.0)

    lone = [sample(0), sample(1), sample(2)]
    with pytest.raises(JobError, match=r"grpo: every one of the 3 groups .* single sample"):
        check_groups("grpo", lone)
    check_groups("reinforce_plus_plus", lone)  # no group baseline: fine with one sample
    check_groups("grpo", [*lone, sample(1)])  # one group of two carries a signal


def test_the_engine_s_rejection_reason_reaches_the_user() -> None:
    from patrl.orchestrator.data import PromptItem
    from patrl.orchestrator.errors import JobError
    from patrl.orchestrator.scoring import check_not_rejected
    from patrl.rollout import RequestOutput

    item = PromptItem(7, [1, 300], "p", "a")
    ok = RequestOutput("r0", [1, 2], [], None)
    bad = RequestOutput("r1", [1, 300], [], "token ids [300] are outside the vocabulary [0, 256)")
    check_not_rejected([(item, ok)])
    with pytest.raises(
        JobError, match=r"rejected 1 of 2 prompts; .*row 7 .*outside the vocabulary"
    ):
        check_not_rejected([(item, ok), (item, bad)])
