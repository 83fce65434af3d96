"""Multi-turn rollouts wired into training (`rollout.multi_turn.enable`, issue 46): a replica's
prompts run through the tool agent loop, the trajectories are scored on their decoded text,
and their tool tokens are out of the trainer's loss mask, so the loss does not see them; the
narrower preflight refusals; and a 2-step job end to end.

The model is agent_scripted's tiny Llama: greedy, it calls the calculator, reads the answer
and answers, so a trajectory holds model tokens, tool tokens, then model tokens again.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from agent_scripted import CALL, hermes_tokenizer, save_scripted_model, tool_config

from patrl.orchestrator.agent.multi_turn import MultiTurnRollout
from patrl.orchestrator.build import trainer_config
from patrl.orchestrator.config import JobConfig, load_config
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.preflight import multi_turn_problems
from patrl.orchestrator.rewards import RewardManager
from patrl.orchestrator.scoring import Sample, score_outputs
from patrl.orchestrator.update import policy_batch
from patrl.rollout import Engine, EngineConfig, SamplingParams
from patrl.trainer import Trainer
from patrl_testkit.jobs import digit_reward

CALCULATOR = "patrl.orchestrator.agent.calculator.CalculatorTool"
DIGITS = "patrl_testkit.jobs:digit_reward"
QUESTION = [{"role": "user", "content": "What is 6*7?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_scripted_model(tmp_path_factory.mktemp("mt") / "call", hermes_tokenizer(), CALL)


def job(tools: Path, *overrides: str) -> JobConfig:
    return load_config(
        None,
        [
            "data.train_files=/d.jsonl",
            "data.max_response_length=64",
            "rollout.n=2",
            "rollout.adaptive_tp.enable=false",
            "rollout.multi_turn.enable=true",
            f"rollout.multi_turn.tool_config_path={tools}",
            "actor.ppo_mini_batch_size=1",
            "data.train_batch_size=1",
            *overrides,
        ],
    )


def engine_of(model_dir: Path, device: str = "cpu") -> Engine:
    return Engine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device=device,
            block_size=4,
            num_kv_blocks=512,
            max_model_len=1024,
        )
    )


def trajectories(config: JobConfig, model_dir: Path, device: str = "cpu") -> list[Sample]:
    """Two greedy trajectories of QUESTION on `device`, scored by the digit share of their
    text."""
    engine = engine_of(model_dir, device)
    rollout = MultiTurnRollout(config, engine)
    item = PromptItem(7, [], "What is 6*7?", "42", {}, QUESTION)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=64, seed=3)
    (out,) = rollout.generate([item], [params])
    assert rollout.metrics["multi_turn/tool_calls"] == 2.0
    rewards = RewardManager([(DIGITS, 1.0)], num_workers=0)
    try:
        samples, _, _ = score_outputs(rewards, [(item, out)])
    finally:
        rewards.close()
    tok = engine.tokenizer
    for s, c in zip(samples, out.outputs, strict=True):
        # the trained prompt is the agent loop's (tools in the system turn), not the item's
        assert s.prompt_token_ids == rollout.loop.prompt_ids(QUESTION)
        assert s.response_mask is not None and 0 in s.response_mask and 1 in s.response_mask
        tool = [t for t, m in zip(s.token_ids, s.response_mask, strict=True) if m == 0]
        assert "<tool_response>" in tok.decode(tool) and "42" in tok.decode(tool)
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.response_mask, strict=True) if m == 0)
        assert s.response_mask[-1] == 1  # a trajectory never ends on a tool turn
        # the reward saw the decoded full response, tool answer included
        assert s.reward == pytest.approx(digit_reward(c.text, "42"), abs=0.0)
        assert "42" in c.text and c.text == tok.decode(s.token_ids, skip_special_tokens=True)
    return samples


def test_tool_tokens_are_out_of_the_loss_mask_and_do_not_move_the_loss(
    tmp_path: Path, model_dir: Path
) -> None:
    config = job(tool_config(tmp_path / "tools.yaml", CALCULATOR))
    samples = trajectories(config, model_dir)
    samples[0].reward, samples[1].reward = 1.0, 0.0  # a learning signal in the group

    batch, _, advantages = policy_batch(config, samples, behaviour=True)
    for row, s in enumerate(samples):
        response = batch.loss_mask[row][len(s.prompt_token_ids) :]
        assert response.tolist() == [bool(m) for m in s.response_mask or []]
        assert not batch.loss_mask[row][: len(s.prompt_token_ids)].any()
    # the advantages reported are the model tokens' only
    assert advantages.size == sum(s.model_tokens for s in samples)

    def perturbed(where: int) -> list[Sample]:
        """The samples with engine logprobs moved by 3 on response tokens of mask `where`."""
        out = []
        for s in samples:
            mask = s.response_mask or []
            lp = [x + 3.0 if m == where else x for x, m in zip(s.logprobs, mask, strict=True)]
            out.append(dataclasses.replace(s, logprobs=lp))
        return out

    def loss(batch_samples: list[Sample], shift_where: int | None) -> dict[str, float]:
        """One train step's metrics on a fresh trainer; old logprobs are the trainer's own,
        moved by 3 on response tokens of mask `shift_where` (None: not moved)."""
        trainer = Trainer(trainer_config(config), str(model_dir))
        b, _, _ = policy_batch(config, batch_samples, behaviour=True)
        old = trainer.compute_logprobs(b)
        if shift_where is not None:
            for row, s in enumerate(batch_samples):
                n = len(s.token_ids)
                shift = torch.tensor(
                    [3.0 if m == shift_where else 0.0 for m in s.response_mask or []]
                )
                old[row] = old[row].clone()
                old[row][old[row].numel() - n :] += shift
        b.old_logprobs = old
        return trainer.train_step(b)

    base = loss(samples, None)
    tool_moved = loss(perturbed(0), 0)  # tool tokens' engine and old logprobs moved
    assert base.keys() == tool_moved.keys()
    actor = [k for k in base if k.startswith("actor/")]  # loss, clip fractions, KL, grad norm
    assert "actor/pg_loss" in actor and "actor/grad_norm" in actor
    for key in actor:
        # the same forward on the same weights; the moved values are multiplied by a 0 mask
        assert tool_moved[key] == pytest.approx(base[key], rel=1e-6, abs=1e-7), key
    # the control: moving the model tokens' old logprobs changes the loss
    model_moved = loss(samples, 1)
    assert model_moved["actor/pg_loss"] != pytest.approx(base["actor/pg_loss"], rel=1e-3)


def test_a_rows_verl_tools_kwargs_reach_the_tools_create(tmp_path: Path, model_dir: Path) -> None:
    config = job(tool_config(tmp_path / "tools.yaml", "agent_scripted.RememberingTool"))
    rollout = MultiTurnRollout(config, engine_of(model_dir))
    kwargs = {"calculator": {"create_kwargs": {"ground_truth": "42"}}}
    with_kwargs = PromptItem(1, [], "q", "42", {"extra_info": {"tools_kwargs": kwargs}}, QUESTION)
    without = PromptItem(2, [], "q", "42", {}, QUESTION)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=64, seed=3)
    first, second = rollout.generate([with_kwargs, without], [greedy, greedy])
    assert "{'ground_truth': '42'}" in first.outputs[0].text
    assert "<tool_response>\n{}\n" in second.outputs[0].text  # no create kwargs


def test_every_schedule_composes_and_a_missing_tool_config_is_refused_by_key(
    tmp_path: Path,
) -> None:
    tools = tool_config(tmp_path / "tools.yaml", CALCULATOR)
    assert multi_turn_problems(job(tools)) == []
    for accepted in (
        "rollout.tensor_model_parallel_size=2",
        "algorithm.adv_estimator=gae",
        "algorithm.adv_estimator=reinforce_plus_plus",
        "algorithm.adv_estimator=opo",
        "algorithm.use_kl_in_reward=true",
        "rollout.speculative.enable=true",  # test_orchestrator_agent_speculative.py
        "rollout.adaptive_tp.enable=true",  # test_orchestrator_agent_adaptive.py
        "trainer.mode=async",  # test_orchestrator_async_multi_turn.py
        "rollout.over_sample_rate=0.5",  # test_orchestrator_agent_partial.py
    ):
        assert multi_turn_problems(job(tools, accepted)) == [], accepted
    (problem,) = multi_turn_problems(
        load_config(
            None,
            [
                "data.train_files=/d.jsonl",
                "rollout.adaptive_tp.enable=false",
                "rollout.multi_turn.enable=true",
            ],
        )
    )
    assert "rollout.multi_turn.tool_config_path is unset" in problem


@pytest.mark.gpu
def test_greedy_trajectories_on_cuda_equal_the_cpu_ones(tmp_path: Path, model_dir: Path) -> None:
    """The agent loop on a CUDA engine (fp32, CUDA graphs on, the KV kept between turns)
    samples the CPU engine's greedy trajectories, token for token: the scripted model's
    successor logits are far apart (one-hot embedding), so no near-tie can flip. Exact
    logprobs are not compared (matmuls differ across devices), only to a tolerance."""
    config = job(tool_config(tmp_path / "tools.yaml", CALCULATOR))
    on_cpu = trajectories(config, model_dir, "cpu")
    on_cuda = trajectories(config, model_dir, "cuda")
    for a, b in zip(on_cpu, on_cuda, strict=True):
        assert b.token_ids == a.token_ids
        assert b.response_mask == a.response_mask
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)


@pytest.mark.e2e
def test_a_multi_turn_job_runs_two_steps(tmp_path: Path, model_dir: Path) -> None:
    """Two GRPO steps of a multi-turn job on whatever device main() picks (CPU here; the
    gpu-marked twin below asks for CUDA)."""
    two_multi_turn_steps(tmp_path, model_dir)


@pytest.mark.gpu
@pytest.mark.e2e
def test_a_multi_turn_job_runs_two_steps_on_cuda(tmp_path: Path, model_dir: Path) -> None:
    assert torch.cuda.is_available()  # main() then runs the job on cuda:0
    two_multi_turn_steps(tmp_path, model_dir)


def two_multi_turn_steps(tmp_path: Path, model_dir: Path) -> None:
    from patrl.orchestrator.main import main

    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"What is {a}*7?", "answer": str(7 * a)} for a in range(2, 6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tools = tool_config(tmp_path / "tools.yaml", CALCULATOR)
    run = tmp_path / "run"
    overrides: dict[str, Any] = {
        "model.path": model_dir,
        "data.train_files": data,
        "data.train_batch_size": 2,
        "data.max_prompt_length": 512,  # the tools' schemas are in the rendered prompt
        "data.max_response_length": 48,
        "actor.ppo_mini_batch_size": 2,
        "rollout.n": 2,
        "rollout.temperature": 0.05,  # the scripted calls, nearly always
        "rollout.block_size": 4,
        "rollout.num_kv_blocks": 512,
        "rollout.adaptive_tp.enable": "false",
        "rollout.multi_turn.enable": "true",
        "rollout.multi_turn.tool_config_path": tools,
        "rollout.multi_turn.max_assistant_turns": 3,
        "reward.functions": f'[{{name: "{DIGITS}"}}]',
        "reward.num_workers": 0,
        "trainer.total_training_steps": 2,
        "trainer.save_freq": 0,
        "trainer.test_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.default_local_dir": run,
    }
    assert main([f"{k}={v}" for k, v in overrides.items()]) == 0
    rows_logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows_logged if "actor/pg_loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["multi_turn/tool_calls"] > 0
        assert r["multi_turn/tool_tokens/mean"] > 0
        assert r["response_length/model_tokens/mean"] < r["response_length/mean"]
        assert all(
            r[k] == r[k] for k in ("actor/pg_loss", "actor/entropy", "critic/score/mean")
        )  # finite numbers, not NaN


def test_rollout_correction_and_gap_metrics_read_model_tokens_only() -> None:
    """Rollout correction, `training/rollout_probs_diff_*` and `rollout_corr/*` are the same
    whatever the tool tokens' logprobs are (the engine's 0.0, or anything)."""
    from patrl.orchestrator.step_metrics import mismatch_metrics, probs_diff
    from patrl.orchestrator.update import correct_batch

    cfg = load_config(
        None,
        [
            "data.train_files=/d.jsonl",
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=2.0",
        ],
    )
    mask = [1, 1, 0, 0, 0, 1]
    engine = [-0.5, -1.0, 0.0, 0.0, 0.0, -0.25]

    def case(tool_value: float) -> tuple[dict[str, float], list[torch.Tensor], list[bool]]:
        lp = [tool_value if m == 0 else x for x, m in zip(engine, mask, strict=True)]
        s = Sample(0, [5, 6], [7, 8, 9, 10, 11, 12], lp, "stop", 1.0, response_mask=mask)
        batch, _, _ = policy_batch(cfg, [s, s])
        # the trainer's old logprobs: the engine's + 0.1 on model tokens, anything on tool ones
        old = [torch.tensor([0.0, 0.0, *[x + 0.1 for x in lp]]) for _ in range(2)]
        for o in old:
            o[2:][torch.tensor(mask) == 0] = tool_value * 2 - 1.0
        batch.old_logprobs = old
        metrics = correct_batch(cfg, batch, [s, s])
        metrics |= probs_diff([s, s], old) | mismatch_metrics([s, s], old, {})
        assert batch.rollout_is_weights is not None
        return metrics, batch.rollout_is_weights, batch.loss_mask[0].tolist()

    base, weights, loss_mask = case(0.0)
    assert loss_mask == [False, False, True, True, False, False, False, True]
    moved, moved_weights, moved_mask = case(-7.0)
    assert moved_mask == loss_mask and base.keys() == moved.keys()
    for key in base:
        assert moved[key] == pytest.approx(base[key], rel=1e-6, abs=1e-9), key
    on_model = torch.tensor(loss_mask)
    for w, mw in zip(weights, moved_weights, strict=True):
        torch.testing.assert_close(mw[on_model], w[on_model], rtol=1e-6, atol=0.0)
    assert base["rollout_corr/kl"] == pytest.approx(-0.1, rel=1e-5)  # 0.1 on every model token
