"""Multi-turn rollouts composed with the rest of patrl (issue 46): a data row's `agent_name`
picks its registered agent loop (verl's per-sample selection); at static TP 2 the group's
first rank runs the loops and tools and drives its peer, which samples what TP 1 samples.

The model is agent_scripted's tiny Llama: greedy, it calls the calculator, reads the answer
and answers, so a tool_agent trajectory holds model tokens, tool tokens, then model tokens.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from agent_scripted import CALL, hermes_tokenizer, save_scripted_model, tool_config

from patrl.orchestrator.advantages import gae_advantages, token_advantages, token_level_scores
from patrl.orchestrator.agent import (
    AgentLoop,
    AgentLoopOutput,
    BaseTool,
    ToolResponse,
    register,
)
from patrl.orchestrator.agent.multi_turn import MultiTurnRollout, agent_loop_classes
from patrl.orchestrator.config import JobConfig, load_config
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.kl_control import AdaptiveKLController
from patrl.orchestrator.preflight import PreflightError, check, multi_turn_problems
from patrl.orchestrator.scoring import Sample
from patrl.rollout import Engine, EngineConfig, SamplingParams
from patrl_testkit.multirank import run_ranks

CALCULATOR = "patrl.orchestrator.agent.calculator.CalculatorTool"
QUESTION = [{"role": "user", "content": "What is 6*7?"}]
GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=64, seed=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_scripted_model(tmp_path_factory.mktemp("mtc") / "call", hermes_tokenizer(), CALL)


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
            *overrides,
        ],
    )


def engine_of(model_dir: Path) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            block_size=4,
            num_kv_blocks=512,
            max_model_len=1024,
        )
    )


class PrefixAgentLoop(AgentLoop):
    """A job's own loop (named by an agent loop config YAML): one turn over the raw prompt's
    last message's text, encoded as is (no chat template), at most 5 tokens."""

    async def run(self, sampling_params: SamplingParams, **kwargs: Any) -> AgentLoopOutput:
        prompt = list(self.tokenizer.encode(kwargs["raw_prompt"][-1]["content"] + "\n"))
        turn = await self.server_manager.generate(
            f"prefix-{kwargs['sample_index']}",
            prompt_ids=prompt,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=5),
        )
        return AgentLoopOutput(
            prompt, turn.token_ids, [1] * len(turn.token_ids), turn.log_probs, num_turns=7
        )


@register("decorated_agent")
class DecoratedAgentLoop(PrefixAgentLoop):
    """A loop registered by verl's decorator (its module imported)."""


@register("needs_more_agent")
class NeedsMoreAgentLoop(PrefixAgentLoop):
    """Registered, never named by a row, and not buildable from a job's context: a job builds
    only the loops its rows name, so it does not fail on this one."""

    def __init__(self, tokenizer: Any, extra: int) -> None:
        super().__init__(tokenizer)


def item(index: int, **extra: Any) -> PromptItem:
    return PromptItem(index, [], "What is 6*7?", "42", extra, QUESTION)


def test_a_rows_agent_name_picks_its_registered_loop(tmp_path: Path, model_dir: Path) -> None:
    loops = tmp_path / "agent_loops.yaml"
    target = f"{__name__}.PrefixAgentLoop"
    loops.write_text(yaml.safe_dump([{"name": "prefix_agent", "_target_": target}]))
    config = job(
        tool_config(tmp_path / "tools.yaml", CALCULATOR),
        f"rollout.agent.agent_loop_config_path={loops}",
    )
    names = agent_loop_classes(config)
    assert {"tool_agent", "single_turn_agent", "prefix_agent", "decorated_agent"} <= set(names)
    engine = engine_of(model_dir)
    rollout = MultiTurnRollout(config, engine)
    items = [
        item(0),  # no agent_name: verl's default, tool_agent
        item(1, agent_name="single_turn_agent"),
        item(2, agent_name="prefix_agent"),
        item(3, agent_name="tool_agent"),
        item(4, agent_name="decorated_agent"),
    ]
    outs = rollout.generate(items, [GREEDY] * len(items))
    tool_default, single, prefix, tool_named, decorated = (o.outputs[0] for o in outs)
    # tool_agent: the tools' schemas in the prompt, a tool turn in the response
    assert outs[0].prompt_token_ids == rollout.loop.prompt_ids(QUESTION)
    assert 0 in (tool_default.response_mask or []) and "42" in tool_default.text
    assert tool_named.token_ids == tool_default.token_ids
    # single_turn_agent: the slow twin is the engine's greedy turn over the template's prompt
    tok = engine.tokenizer
    prompt = tok.encode(
        tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    (twin,) = engine_of(model_dir).generate([prompt], GREEDY)
    assert outs[1].prompt_token_ids == prompt
    assert single.token_ids == list(twin.outputs[0].token_ids)
    assert single.response_mask == [1] * len(single.token_ids)
    # the job's own loops: their prompts and budgets
    for out, got in ((outs[2], prefix), (outs[4], decorated)):
        assert out.prompt_token_ids == tok.encode("What is 6*7?\n")
        assert 0 < len(got.token_ids) <= 5 and got.response_mask == [1] * len(got.token_ids)
    assert rollout.metrics["multi_turn/num_turns/mean"] > 0


def test_an_unknown_agent_name_is_an_error_naming_the_value_and_the_registered_names(
    tmp_path: Path, model_dir: Path
) -> None:
    config = job(tool_config(tmp_path / "tools.yaml", CALCULATOR))
    rollout = MultiTurnRollout(config, engine_of(model_dir))
    with pytest.raises(ValueError, match=r"row 5: agent_name='react_agent' is not a registered"):
        rollout.generate([item(4), item(5, agent_name="react_agent")], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match=r"registered: \[.*'single_turn_agent', 'tool_agent'"):
        rollout.generate([item(5, agent_name=["a list"])], [GREEDY])

    # preflight reads the rows: the train file's unknown name, with the registered names
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": "What is 6*7?", "answer": "42", "agent_name": "tool_agent"}]
    rows += [{"prompt": "What is 2*7?", "answer": "14", "agent_name": "react_agent"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = job(
        tool_config(tmp_path / "tools.yaml", CALCULATOR),
        f"model.path={model_dir}",
        f"data.train_files={data}",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
        "data.max_prompt_length=512",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    )
    with pytest.raises(PreflightError) as e:
        check(bad, 1)
    (problem,) = [p for p in e.value.problems if "agent_name" in p]
    assert problem.startswith("data.train_files: row 1: agent_name='react_agent'"), problem
    assert "'tool_agent'" in problem and "'single_turn_agent'" in problem


@pytest.mark.parametrize(
    ("entries", "named"),
    [
        ("- {name: x, _target_: no_such_module.Loop}", "0._target_='no_such_module.Loop': cannot"),
        ("- {name: x, _target_: json.JSONDecoder}", "is not a subclass of"),
        ("- {_target_: json.JSONDecoder}", "0.name is missing"),
        ("{name: x}", "is a list of {name, _target_}"),
        (
            f"- {{name: tool_agent, _target_: {__name__}.PrefixAgentLoop}}",
            "0.name='tool_agent' is a built-in agent loop",
        ),
    ],
)
def test_an_agent_loop_config_that_does_not_load_is_a_preflight_error(
    tmp_path: Path, entries: str, named: str
) -> None:
    loops = tmp_path / "agent_loops.yaml"
    loops.write_text(entries)
    config = job(
        tool_config(tmp_path / "tools.yaml", CALCULATOR),
        f"rollout.agent.agent_loop_config_path={loops}",
    )
    (problem,) = multi_turn_problems(config)
    assert problem.startswith(f"rollout.agent.agent_loop_config_path: {loops}: "), problem
    assert named in problem, problem


# ------------------------------------------------------------------------- static TP > 1


class PidTool(BaseTool):
    """Nondeterministic: answers with its process id and a random number, and counts its
    calls in this process."""

    calls = 0

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        PidTool.calls += 1
        time.sleep(0.05)  # the group's peer waits: the heartbeat path (HEARTBEAT_S is 0)
        return ToolResponse(text=f"{os.getpid()}-{random.random()}"), 0.0, {}


@register("raising_agent")
class RaisingAgentLoop(AgentLoop):
    """Generates one turn, then raises (on the TP group's first rank, where loops run)."""

    async def run(self, sampling_params: SamplingParams, **kwargs: Any) -> AgentLoopOutput:
        prompt = list(self.tokenizer.encode("What is 6*7?\n"))
        await self.server_manager.generate(
            f"raising-{kwargs['sample_index']}",
            prompt_ids=prompt,
            sampling_params=SamplingParams(max_tokens=3),
        )
        raise RuntimeError("the loop broke")


def _tp_rollout(
    rank: int, world_size: int, model_dir: str, tools: str, pid_tools: str
) -> dict[str, Any]:
    import torch.distributed as dist

    from patrl.orchestrator.agent import agent_loop
    from patrl.tpreshard import ParallelLayout

    agent_loop.HEARTBEAT_S = 0.0  # every wait on a tool pings the peer
    group = dist.new_group(list(range(world_size)))
    layout = ParallelLayout(tp_size=world_size, tp_rank=rank, tp_group=group)
    engine = Engine(
        EngineConfig(
            model=model_dir,
            dtype="float32",
            block_size=4,
            num_kv_blocks=512,
            max_model_len=1024,
        ),
        layout,
    )
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=64, seed=3)
    calculator = MultiTurnRollout(job(Path(tools)), engine)
    out = calculator.generate([item(0), item(1, agent_name="single_turn_agent")], [greedy] * 2)
    result: dict[str, Any] = {
        "tokens": [[c.token_ids for c in o.outputs] for o in out],
        "masks": [[c.response_mask for c in o.outputs] for o in out],
        "tool_calls": calculator.metrics.get("multi_turn/tool_calls"),
        # the continuations took the kept-KV path on every rank, and nothing is left kept
        "prefill_tokens": engine.counters.prefill_tokens,
        "kept": engine.kept_request_ids(),
        "blocks_free": engine.cache.blocks.num_free_blocks == engine.cache.blocks.num_blocks,
    }
    random_tool = MultiTurnRollout(job(Path(pid_tools)), engine)
    out = random_tool.generate([item(2)], [greedy])
    result["random_text"] = [c.text for c in out[0].outputs]
    result["pid_tool_calls"] = PidTool.calls
    try:  # a loop that raises on the first rank: every rank raises, no rank hangs
        random_tool.generate([item(3, agent_name="raising_agent")], [greedy])
    except RuntimeError as e:
        result["error"] = str(e)
    result["idle_after_error"] = not engine.has_unfinished()
    out = calculator.generate([item(4)], [greedy])  # and the group goes on in step
    result["after_error"] = [c.token_ids for c in out[0].outputs]
    result["all_free_at_end"] = (
        engine.cache.blocks.num_free_blocks == engine.cache.blocks.num_blocks
        and not engine.kept_request_ids()
    )
    return result


@pytest.mark.multirank
def test_tp2_runs_tools_once_per_group_and_samples_what_tp1_samples(
    tmp_path: Path, model_dir: Path
) -> None:
    tools = tool_config(tmp_path / "tools.yaml", CALCULATOR)
    pid_tools = tool_config(tmp_path / "pid.yaml", f"{__name__}.PidTool")
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=64, seed=3)
    tp1 = MultiTurnRollout(job(tools), engine_of(model_dir))
    out = tp1.generate([item(0), item(1, agent_name="single_turn_agent")], [greedy] * 2)
    expected = [[c.token_ids for c in o.outputs] for o in out]
    expected_masks = [[c.response_mask for c in o.outputs] for o in out]
    assert 0 in expected_masks[0][0]  # a tool turn in the trajectory
    tp1_prefill = tp1.engine.counters.prefill_tokens
    slow = MultiTurnRollout(job(tools), engine_of(model_dir))
    slow.runner.server.keep_kv = False  # each turn a new request, over prefix caching
    out = slow.generate([item(0), item(1, agent_name="single_turn_agent")], [greedy] * 2)
    assert [[c.token_ids for c in o.outputs] for o in out] == expected
    # the two paths prefill differently (here the kept one more: the group's two greedy
    # samples are one conversation, which the slow path's scheduler prefills once for both,
    # while each sample extends its own kept KV), so equal counts below mean the kept path
    assert slow.engine.counters.prefill_tokens != tp1_prefill

    leader, peer = run_ranks(
        _tp_rollout,
        world_size=2,
        args=(str(model_dir), str(tools), str(pid_tools)),
        timeout_s=300,
    )
    for rank in (leader, peer):
        assert rank["tokens"] == expected and rank["masks"] == expected_masks
        assert rank["tool_calls"] == 2.0  # the group's calls, on every rank's metrics
        assert rank["after_error"] == expected[0]
        assert rank["idle_after_error"]
        assert rank["prefill_tokens"] == tp1_prefill  # the same kept-KV continuations
        assert rank["kept"] == [] and rank["blocks_free"] and rank["all_free_at_end"]
    # the random tool ran on the first rank only, and both ranks hold its answers
    assert leader["pid_tool_calls"] == 2 and peer["pid_tool_calls"] == 0
    assert leader["random_text"] == peer["random_text"]
    assert leader["random_text"][0] != leader["random_text"][1]  # two calls, two answers
    assert leader["error"] == "the loop broke"
    assert peer["error"].startswith("the TP group's first rank failed its agent loops: ")
    assert "RuntimeError: the loop broke" in peer["error"]


# ------------------------------------------- masked estimators and KL in the reward
# The slow twin of each: the same function on the model's tokens alone (the tool tokens cut
# out of every response), its result put back in place (0 on tool tokens).

MASKS = [
    np.array([1, 1, 0, 0, 1, 1, 0, 1], dtype=bool),
    np.array([1, 0, 0, 1, 1], dtype=bool),
    np.array([1, 1, 1], dtype=bool),
    np.array([0, 1, 1, 0, 0, 1], dtype=bool),
]
GROUPS = np.array([0, 0, 1, 1])


def cut(arrays: list[Any]) -> list[np.ndarray]:
    return [np.asarray(a)[m] for a, m in zip(arrays, MASKS, strict=True)]


def put_back(arrays: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for a, m in zip(arrays, MASKS, strict=True):
        full = np.zeros(m.size)
        full[m] = a
        out.append(full)
    return out


def token_rewards(seed: int) -> list[np.ndarray]:
    """Per-token rewards on the model's tokens (a score and KL-like terms), 0 on tool ones."""
    rng = np.random.default_rng(seed)
    return [np.where(m, rng.normal(size=m.size), 0.0) for m in MASKS]


def assert_lists_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)  # float64, the same sums


@pytest.mark.parametrize(
    "estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "grpo"]
)
def test_token_estimators_read_the_model_tokens_only(estimator: str) -> None:
    rewards = token_rewards(1)
    got = token_advantages(estimator, rewards, GROUPS, gamma=0.9, masks=MASKS)
    twin = put_back(token_advantages(estimator, cut(rewards), GROUPS, gamma=0.9))
    unmasked = token_advantages(estimator, rewards, GROUPS, gamma=0.9)
    if estimator in ("opo", "grpo"):
        # outcome estimators: one value over every token (the loss mask drops tool tokens)
        assert all(np.ptp(g) == 0 for g in got)
        got = [np.where(m, g, 0.0) for g, m in zip(got, MASKS, strict=True)]
    assert_lists_close(got, twin)
    # the control: without the masks the tool tokens change the answer (grpo never reads them)
    differs = not all(
        np.allclose(u[m], t[m]) for u, t, m in zip(unmasked, twin, MASKS, strict=True)
    )
    assert differs == (estimator != "grpo")


def test_gae_skips_the_tool_tokens_as_on_the_model_tokens_alone() -> None:
    rewards = token_rewards(2)
    values = [np.random.default_rng(3 + i).normal(size=m.size) for i, m in enumerate(MASKS)]
    adv, ret = gae_advantages(rewards, values, gamma=0.9, lam=0.8, masks=MASKS)
    twin_adv, twin_ret = gae_advantages(cut(rewards), cut(values), gamma=0.9, lam=0.8)
    assert_lists_close(adv, put_back(twin_adv))
    assert_lists_close(ret, put_back(twin_ret))
    plain, _ = gae_advantages(rewards, values, gamma=0.9, lam=0.8)
    assert not np.allclose(plain[0][MASKS[0]], twin_adv[0])  # the control


def test_kl_in_the_reward_is_masked_and_its_metric_is_the_model_tokens_mean() -> None:
    from patrl.orchestrator.kl_control import apply_kl_penalty

    rng = np.random.default_rng(4)
    scores = token_level_scores([1.0, 0.0, 0.5, 1.0], [m.size for m in MASKS])
    old = [torch.tensor(rng.normal(size=m.size) - 2.0) for m in MASKS]
    ref = [torch.tensor(rng.normal(size=m.size) - 2.0) for m in MASKS]
    masked = AdaptiveKLController(0.1, target_kl=0.01, horizon=100)
    rewards, metrics = apply_kl_penalty(scores, old, ref, masked, "kl", masks=MASKS)
    twin = AdaptiveKLController(0.1, target_kl=0.01, horizon=100)
    cut_old = [o[torch.from_numpy(m)] for o, m in zip(old, MASKS, strict=True)]
    cut_ref = [r[torch.from_numpy(m)] for r, m in zip(ref, MASKS, strict=True)]
    twin_rewards, twin_metrics = apply_kl_penalty(cut(scores), cut_old, cut_ref, twin, "kl")
    for got, score, want, m in zip(rewards, scores, twin_rewards, MASKS, strict=True):
        np.testing.assert_allclose(got[m], want, rtol=1e-12, atol=1e-12)
        assert (got[~m] == score[~m]).all()  # no penalty on a tool token
    assert metrics == pytest.approx(twin_metrics, rel=1e-12)
    assert masked.value == pytest.approx(twin.value, rel=1e-12)


def test_policy_batch_and_the_kl_reward_use_the_samples_masks() -> None:
    """The wiring in update.py: multi-turn samples give what their model tokens alone give."""
    from patrl.orchestrator.update import kl_penalized_rewards, policy_batch

    def samples(masked: bool) -> list[Sample]:
        out = []
        for i, m in enumerate(MASKS):
            ids = list(range(10, 10 + m.size))
            lps = [-0.5] * m.size
            if not masked:
                ids, lps = [t for t, k in zip(ids, m, strict=True) if k], [-0.5] * int(m.sum())
            mask = [int(k) for k in m] if masked else None
            out.append(
                Sample(int(GROUPS[i]), [1, 2], ids, lps, "stop", float(i % 3), response_mask=mask)
            )
        return out

    config = load_config(
        None,
        [
            "data.train_files=/d.jsonl",
            "algorithm.adv_estimator=reinforce_plus_plus",
            "algorithm.gamma=0.9",
            "algorithm.use_kl_in_reward=true",
        ],
    )
    with_tools, alone = samples(True), samples(False)
    _, _, adv = policy_batch(config, with_tools)
    _, _, twin = policy_batch(config, alone)
    np.testing.assert_allclose(adv, twin, rtol=1e-12, atol=1e-12)

    rng = np.random.default_rng(5)
    old = [torch.tensor(rng.normal(size=2 + m.size)) for m in MASKS]
    ref = [torch.tensor(rng.normal(size=2 + m.size)) for m in MASKS]

    def kl_rewards(batch_samples: list[Sample]) -> tuple[list[np.ndarray], dict[str, float]]:
        batch, rewards, _ = policy_batch(config, batch_samples)
        keep = [
            np.r_[True, True, m] if s.response_mask is None else np.ones(2 + m.size, bool)
            for s, m in zip(batch_samples, MASKS, strict=True)
        ]
        batch.old_logprobs = [o[torch.from_numpy(k)] for o, k in zip(old, keep, strict=True)]
        batch.ref_logprobs = [r[torch.from_numpy(k)] for r, k in zip(ref, keep, strict=True)]
        ctrl = AdaptiveKLController(0.1, target_kl=0.01, horizon=100)
        return kl_penalized_rewards(config, None, batch, batch_samples, rewards, {}, ctrl)  # type: ignore[arg-type]

    got, metrics = kl_rewards(with_tools)
    want, twin_metrics = kl_rewards(alone)
    assert_lists_close(cut(got), want)
    assert metrics == pytest.approx(twin_metrics, rel=1e-12)


def test_ppo_with_a_critic_gae_reads_the_model_tokens_only(model_dir: Path) -> None:
    """update_with_critic on multi-turn samples: its advantages (model tokens) and value
    metrics are GAE's on the model tokens alone, over the critic's values of the batch."""
    from patrl.orchestrator.build import critic_config
    from patrl.orchestrator.update import update_with_critic
    from patrl.trainer import Critic, PolicyBatch

    config = load_config(
        None,
        [
            "data.train_files=/d.jsonl",
            "algorithm.adv_estimator=gae",
            "algorithm.gamma=0.9",
            "algorithm.lam=0.8",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2",
            "rollout.n=2",
        ],
    )
    samples = [
        Sample(
            0,
            [5, 6, 7],
            list(range(20, 20 + m.size)),
            [-0.5] * m.size,
            "stop",
            float(i),
            response_mask=[int(k) for k in m],
        )
        for i, m in enumerate(MASKS)
    ]
    critic = Critic(critic_config(config), str(model_dir))
    batch = PolicyBatch.from_responses(
        [s.prompt_token_ids for s in samples], [s.token_ids for s in samples], [0.0] * 4
    )
    values = [
        v[-m.size :].double().numpy()
        for v, m in zip(critic.compute_values(batch), MASKS, strict=True)
    ]
    # step 0 is within critic_warmup=0's reach: the critic updates, the actor does not
    update = update_with_critic(config, None, critic, samples, 0, {})  # type: ignore[arg-type]
    rewards = token_level_scores([s.reward for s in samples], [m.size for m in MASKS])
    twin_adv, twin_ret = gae_advantages(cut(rewards), cut(values), gamma=0.9, lam=0.8)
    np.testing.assert_allclose(update.advantages, np.concatenate(twin_adv), rtol=1e-4, atol=1e-5)
    m = update.critic_metrics
    assert m["critic/values/mean"] == pytest.approx(np.concatenate(cut(values)).mean(), abs=1e-5)
    assert m["critic/returns/max"] == pytest.approx(np.concatenate(twin_ret).max(), abs=1e-5)
    assert update.old_logprobs is None and update.actor_metrics == {}


@pytest.mark.e2e
def test_a_multi_turn_job_at_tp2_with_reinforce_pp_and_kl_in_the_reward_runs_two_steps(
    tmp_path: Path, model_dir: Path
) -> None:
    """torchrun, 2 ranks, one TP 2 group: the sync schedule drives the agent loop from the
    group's first rank; REINFORCE++ and the KL reward read the model's tokens; the group's
    tool calls are counted once (2 prompts x 2 samples, at most one call each); speculative
    rollouts on (test_orchestrator_agent_speculative.py checks their tokens)."""
    import subprocess
    import sys

    from patrl_testkit.processes import kill_tree

    data = tmp_path / "train.jsonl"
    # two rows, a batch of two: step 2 repeats step 1's prompts (drafts from their history)
    rows = [{"prompt": f"What is {a}*7?", "answer": str(7 * a)} for a in range(2, 4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    overrides: dict[str, Any] = {
        "model.path": model_dir,
        "data.train_files": data,
        "data.train_batch_size": 2,
        "data.max_prompt_length": 512,  # the tools' schemas are in the rendered prompt
        "data.max_response_length": 48,
        "actor.ppo_mini_batch_size": 2,
        "algorithm.adv_estimator": "reinforce_plus_plus",
        "algorithm.use_kl_in_reward": "true",
        "rollout.n": 2,
        "rollout.temperature": 0.05,  # the scripted calls, nearly always
        "rollout.block_size": 4,
        "rollout.num_kv_blocks": 512,
        "rollout.adaptive_tp.enable": "false",
        "rollout.tensor_model_parallel_size": 2,
        "rollout.multi_turn.enable": "true",
        "rollout.multi_turn.tool_config_path": tool_config(tmp_path / "tools.yaml", CALCULATOR),
        "rollout.multi_turn.max_assistant_turns": 3,
        "rollout.speculative.enable": "true",
        "reward.functions": '[{name: "patrl_testkit.jobs:digit_reward"}]',
        "reward.num_workers": 0,
        "trainer.total_training_steps": 2,
        "trainer.save_freq": 0,
        "trainer.test_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.default_local_dir": run,
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", "-m", "patrl.orchestrator"]
    command += [f"{k}={v}" for k, v in overrides.items()]
    here = Path(__file__).resolve().parent
    paths = [str(here), str(here.parents[2] / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=300)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, output[-4000:]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "actor/pg_loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert 0 < r["multi_turn/tool_calls"] <= 4  # counted once per TP group, not per rank
        assert r["multi_turn/tool_tokens/mean"] > 0
        assert r["response_length/model_tokens/mean"] < r["response_length/mean"]
        assert r["rollout/spec_tokens_per_step"] >= 1.0  # the engines speculated
        for key in ("actor/pg_loss", "actor/reward_kl_penalty", "critic/advantages/mean"):
            assert r[key] == r[key], key  # a finite number, not NaN
    # step 1's siblings run in lockstep (nothing to draft); step 2's conversations draft
    # from step 1's, remembered whole under their first turn's prompt
    assert steps[1]["rollout/spec_accepted_share/history"] > 0
    assert steps[1]["rollout/spec_tokens_per_step"] > 1.0
