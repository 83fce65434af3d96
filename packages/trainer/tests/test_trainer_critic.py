"""The critic: GAE and the value loss against plain loops, the value alignment, packed vs
padded, and FSDP2 on 2 ranks (sharded build from a directory) against one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from trainer_testkit import full_weights, make_batch, tiny_llama
from transformers import AutoModelForTokenClassification

from patrl.trainer import Critic, CriticConfig, PolicyBatch, gae, value_loss
from patrl.trainer.model import init_value_head
from patrl_testkit.multirank import run_ranks


def critic_config(**overrides: Any) -> CriticConfig:
    base: dict[str, Any] = {"optim": {"lr": 1e-3, "eps": 1e-6}, "ppo_max_token_len_per_gpu": 40}
    base.update(overrides)
    return CriticConfig.model_validate(base)


def make_critic(source: Any, mesh: Any = None, **overrides: Any) -> Critic:
    """A critic whose new head is random (a zero head's values would all be 0: the value
    checks below would hold for any alignment), the same on every rank."""
    critic = Critic(critic_config(**overrides), source, mesh=mesh)
    init_value_head(critic.model, seed=3, std=0.3)
    return critic


def gae_twin(
    rewards: list[float], values: list[float], mask: list[bool], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """GAE of one row written plainly: walk the masked tokens from the last one back."""
    adv = [0.0] * len(rewards)
    ret = [0.0] * len(rewards)
    next_value, running = 0.0, 0.0
    for t in reversed([t for t in range(len(rewards)) if mask[t]]):
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t], ret[t] = running, running + values[t]
        next_value = values[t]
    return adv, ret


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_equals_a_plain_loop_with_masks_padding_and_length_one(
    gamma: float, lam: float
) -> None:
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 9, generator=g), torch.randn(4, 9, generator=g)
    mask = torch.zeros(4, 9, dtype=torch.bool)
    mask[0, 3:9] = True  # a full-width response
    mask[1, 2:5] = True  # right padding after it
    mask[2, 4] = True  # a length-1 response
    mask[3, [2, 3, 6, 7]] = True  # a hole (an observation span) inside
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for row in range(4):
        want_a, want_r = gae_twin(
            rewards[row].tolist(), values[row].tolist(), mask[row].tolist(), gamma, lam
        )
        m = mask[row]
        torch.testing.assert_close(adv[row][m], torch.tensor(want_a)[m])
        torch.testing.assert_close(ret[row][m], torch.tensor(want_r)[m])
    # gamma = lam = 1 with the score on the last token: advantage = score - value, everywhere.
    if gamma == lam == 1.0:
        r = torch.zeros(1, 5)
        r[0, 4] = 2.0
        v = torch.randn(1, 5, generator=g)
        a, _ = gae(r, v, torch.ones(1, 5, dtype=torch.bool), 1.0, 1.0)
        torch.testing.assert_close(a, 2.0 - v)


def value_loss_twin(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    mode: str,
) -> tuple[float, float]:
    per_seq, tokens, clipped, total = [], 0, 0, 0.0
    for i in range(vpreds.shape[0]):
        seq = []
        for t in range(vpreds.shape[1]):
            if not mask[i, t]:
                continue
            v, r, old = float(vpreds[i, t]), float(returns[i, t]), float(values[i, t])
            vc = min(max(v, old - clip), old + clip)
            l1, l2 = (v - r) ** 2, (vc - r) ** 2
            seq.append(max(l1, l2))
            clipped += l2 > l1
        if seq:
            per_seq.append(sum(seq) / len(seq) if mode == "seq-mean-token-mean" else sum(seq))
        tokens += len(seq)
        total += sum(seq)
    loss = total / tokens if mode == "token-mean" else sum(per_seq) / len(per_seq)
    return 0.5 * loss, clipped / tokens


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_value_loss_equals_a_plain_loop(mode: str) -> None:
    g = torch.Generator().manual_seed(1)
    vpreds, returns = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    values = vpreds + 0.8 * torch.randn(3, 6, generator=g)  # some clipped, some not
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[0, 1:6], mask[1, 5], mask[2, 2:4] = True, True, True
    vpreds[~mask] = float("nan")  # padding must not leak
    loss, stats = value_loss(vpreds, returns, values, mask, cliprange_value=0.2, agg_mode=mode)
    want_loss, want_clip = value_loss_twin(vpreds, returns, values, mask, 0.2, mode)
    assert float(loss) == pytest.approx(want_loss, rel=1e-6)
    assert float(stats.clipfrac) == pytest.approx(want_clip)
    assert 0 < want_clip < 1


def test_values_are_the_head_output_one_position_earlier(tmp_path: Path) -> None:
    """verl's `values[:, -response_length - 1 : -1]`: the value of token p is the head's
    output at p - 1; the same model through HF directly gives the same numbers."""
    critic = make_critic(tiny_llama())
    batch = make_batch(0, [3, 6, 1])
    values = critic.compute_values(batch)
    assert min(float(v[1:].abs().min()) for v in values) > 0
    critic.model.save_pretrained(tmp_path)
    hf = AutoModelForTokenClassification.from_pretrained(tmp_path, dtype=torch.float32)
    for ids, v in zip(batch.input_ids, values, strict=True):
        with torch.no_grad():
            head = hf(input_ids=ids[None]).logits[0, :, 0]
        assert v[0] == 0.0
        torch.testing.assert_close(v[1:], head[:-1], atol=1e-5, rtol=1e-5)
    # critic.model.path naming a value model: its head is loaded, not replaced
    reloaded = Critic(critic_config(), str(tmp_path)).compute_values(batch)
    for a, b in zip(reloaded, values, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def _rewards(batch: PolicyBatch, seed: int) -> list[torch.Tensor]:
    """The score on each response's last token, 0 elsewhere (verl's token-level rewards)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for m in batch.loss_mask:
        r = torch.zeros(m.shape)
        r[-1] = float(torch.rand((), generator=g))
        out.append(r)
    return out


def test_on_policy_update_equals_a_separate_values_pass() -> None:
    """The fused path (values from the update's forward) equals values scored first, for
    packed and right-padded rows alike."""
    batch = make_batch(3, [2, 7, 1, 5])
    rewards = _rewards(batch, 0)
    results = []
    for packed, fused in ((True, True), (True, False), (False, True)):
        critic = make_critic(tiny_llama(), use_remove_padding=packed)
        before = None if fused else critic.compute_values(batch)
        metrics = critic.update(batch, rewards, 0.99, 0.95, values=before)
        got = critic.scored_values() if fused else before
        assert got is not None
        results.append((metrics, got, full_weights(critic)))
    first = results[0]
    for metrics, values, weights in results[1:]:
        assert metrics["critic/vf_loss"] == pytest.approx(first[0]["critic/vf_loss"], rel=1e-5)
        for a, b in zip(values, first[1], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for name, t in weights.items():
            torch.testing.assert_close(t, first[2][name], atol=1e-6, rtol=0, msg=name)
    assert first[0]["critic/vf_loss"] > 0 and first[0]["critic/grad_norm"] > 0


def test_the_policy_methods_refuse_a_value_model() -> None:
    critic = Critic(critic_config(), tiny_llama())
    with pytest.raises(TypeError, match="no policy step"):
        critic.train_step(make_batch(0, [2]))
    with pytest.raises(TypeError, match="no logprobs"):
        critic.compute_logprobs(make_batch(0, [2]))


def test_the_critic_learns_returns() -> None:
    batch = make_batch(4, [3, 5, 2])
    rewards = _rewards(batch, 1)
    critic = Critic(critic_config(optim={"lr": 3e-3}), tiny_llama())
    assert all(float(v.abs().max()) == 0 for v in critic.compute_values(batch))  # a zero head
    losses = [critic.update(batch, rewards, 1.0, 1.0)["critic/vf_loss"] for _ in range(15)]
    assert losses[-1] < 0.2 * losses[0], losses


def _mesh(world_size: int) -> Any:
    return init_device_mesh("cpu", (world_size,))


def _batches() -> list[PolicyBatch]:
    return [make_batch(s, [2 + 3 * s, 9, 1, 14, 5, 6 + s, 3]) for s in range(2)]


def _critic_two_steps(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    critic = make_critic(model_dir, mesh=_mesh(world_size))
    out: dict[str, Any] = {"values": critic.compute_values(_batches()[0]), "metrics": []}
    for i, b in enumerate(_batches()):
        out["metrics"].append(critic.update(b, _rewards(b, i), 0.99, 0.95))
    out["scored"] = critic.scored_values()
    out["weights"] = full_weights(critic)
    out["sharded"] = type(critic.model.model.layers[0]).__name__
    return {k: _numpy(v) for k, v in out.items()}


def _numpy(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return {k: _numpy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_numpy(v) for v in obj]
    return obj


@pytest.mark.multirank
def test_critic_fsdp_two_ranks_equals_one_process(tmp_path: Path) -> None:
    """From the policy's directory (no value head: a new one, the same on every rank), built
    sharded on 2 ranks: values, losses and weights after two steps equal one process's."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(tiny_llama()).save_pretrained(tmp_path)
    ranks = run_ranks(_critic_two_steps, world_size=2, args=(str(tmp_path),), timeout_s=240)
    single = make_critic(str(tmp_path))
    values = single.compute_values(_batches()[0])
    metrics = [single.update(b, _rewards(b, i), 0.99, 0.95) for i, b in enumerate(_batches())]
    weights = full_weights(single)
    assert ranks[0]["sharded"].startswith("FSDP")
    for got in ranks:
        for a, b in zip(got["values"], values, strict=True):
            torch.testing.assert_close(torch.from_numpy(a), b, atol=1e-5, rtol=1e-5)
        for a, b in zip(got["scored"], single.scored_values(), strict=True):
            torch.testing.assert_close(torch.from_numpy(a), b, atol=1e-5, rtol=1e-5)
        for got_m, want_m in zip(got["metrics"], metrics, strict=True):
            # the second step's metrics come from weights that FSDP's reduce-scatter summed in
            # another order (they agree within 1e-6): metrics within 1e-6 of one process's
            for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"):
                assert got_m[key] == pytest.approx(want_m[key], rel=1e-5, abs=1e-6), key
        assert got["weights"].keys() == weights.keys()
        for name, t in weights.items():
            torch.testing.assert_close(
                torch.from_numpy(got["weights"][name]), t, atol=1e-6, rtol=0, msg=name
            )
    assert "score.weight" in weights
    assert float(values[0][1:].abs().min()) > 0
    assert metrics[1]["critic/vf_clipfrac"] >= 0 and metrics[1]["critic/grad_norm"] > 0
