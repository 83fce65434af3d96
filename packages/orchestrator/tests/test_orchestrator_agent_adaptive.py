"""Multi-turn rollouts over adaptive TP (issue 46): world rank 0 runs every sample's agent
loop and tools, the replicas run the turns, and a fold mid-rollout (samples running, samples
awaiting a tool with their last turn kept) changes no token: each rank's trajectories equal
its own run on a static TP 1 engine with no fold (the slow twin).

The model is agent_scripted's tiny Llama, with one more script: after a lowercase letter it
writes the next one (z -> a), so a "busy" sample's long turn keeps the engines stepping while
the tool samples wait at a gate that the fold opens.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from agent_scripted import hermes_tokenizer, one_token, save_scripted_model, tool_config
from safetensors.torch import load_file, save_file

from patrl.lenpredict import Decision, Layout, LengthPredictor, RunningSet, assign_replicas
from patrl.lenpredict.planner import Option
from patrl.orchestrator.agent import (
    AgentLoop,
    AgentLoopOutput,
    BaseTool,
    ToolResponse,
    register,
)
from patrl.orchestrator.agent.multi_turn import MultiTurnRollout
from patrl.orchestrator.config import JobConfig, load_config
from patrl.orchestrator.data import PromptItem
from patrl.rollout import Engine, EngineConfig, SamplingParams
from patrl_testkit.multirank import run_ranks

QUESTION = [{"role": "user", "content": "What is 6*7?"}]
BUSY_TOKENS = 120  # long enough for every tool sample to reach the gate meanwhile
TOOL_SAMPLES = 2  # per rank
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def save_busy_model(path: Path) -> Path:
    """agent_scripted's model (every turn calls the tool) with the letter cycle scripted."""
    tok = hermes_tokenizer()
    save_scripted_model(path, tok, call_after_tool=True)
    weights = load_file(path / "model.safetensors")
    head = weights["lm_head.weight"]
    for a, b in zip(LETTERS, LETTERS[1:] + LETTERS[0], strict=True):
        head[one_token(tok, b), one_token(tok, a)] = 0.5
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_busy_model(tmp_path_factory.mktemp("mta") / "busy")


class GateTool(BaseTool):
    """Answers "42" once `GATE` is open (the fold opens it); counts its calls and those
    waiting at the gate, in this process."""

    GATE = threading.Event()
    lock = threading.Lock()
    calls = 0
    waiting = 0

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        with GateTool.lock:
            GateTool.calls += 1
            GateTool.waiting += 1
        opened = GateTool.GATE.wait(60.0)
        with GateTool.lock:
            GateTool.waiting -= 1
        return ToolResponse(text="42" if opened else "gate never opened"), 0.0, {}


@register("busy_agent")
class BusyAgentLoop(AgentLoop):
    """One long greedy turn after "go a" (the letter cycle), EOS ignored."""

    async def run(self, sampling_params: SamplingParams, **kwargs: Any) -> AgentLoopOutput:
        prompt = list(self.tokenizer.encode("go a"))
        turn = await self.server_manager.generate(
            f"busy-{kwargs['sample_index']}",
            prompt_ids=prompt,
            sampling_params=SamplingParams(
                temperature=0.0, max_tokens=BUSY_TOKENS, ignore_eos=True
            ),
        )
        n = len(turn.token_ids)
        return AgentLoopOutput(prompt, turn.token_ids, [1] * n, turn.log_probs, num_turns=1)


@register("adaptive_raising_agent")
class RaisingAgentLoop(AgentLoop):
    """Generates one turn, then raises (on the driver, where the loops run)."""

    async def run(self, sampling_params: SamplingParams, **kwargs: Any) -> AgentLoopOutput:
        await self.server_manager.generate(
            f"raising-{kwargs['sample_index']}",
            prompt_ids=list(self.tokenizer.encode("go a")),
            sampling_params=SamplingParams(temperature=0.0, max_tokens=3),
        )
        raise RuntimeError("the loop broke")


class GatedFoldPlanner:
    """Folds to TP 2 at the first check where every tool sample of the world waits at the
    gate (the tools run in this process, the driver's), then opens the gate; else stays.
    Records the running set it folded."""

    latency: Any = None

    def __init__(self, waiting: int) -> None:
        self.waiting = waiting
        self.folded_running: list[tuple[int, int]] | None = None  # (replica, context)

    def new_rollout(self) -> None:
        pass

    def may_switch(self, running: RunningSet, current: Layout) -> bool:
        return True

    def never_switches_from(self, current: Layout, max_context: int) -> bool:
        return False

    def shrinking_share(self, running: RunningSet, current: Layout, steps: int) -> float:
        return 1.0

    def decide(self, running: RunningSet, current: Layout) -> Decision:
        n = len(running)
        stay = Option(current, 1.0, 0.0, np.inf, 0, running.replica, np.zeros(n, dtype=bool))
        fold = self.folded_running is None and current.tp == 1 and n > 0
        if not (fold and GateTool.waiting >= self.waiting):
            return Decision("stay", current, current, 0.0, 0.0, "stay", [stay], running.seq_ids)
        self.folded_running = [
            (int(r), int(c)) for r, c in zip(running.replica, running.context, strict=True)
        ]
        target = Layout(dp=1, tp=2)
        migrate = np.arange(n) % 2 == 0  # one migrates its KV, one recomputes it
        go = Option(target, 0.5, 0.1, np.inf, 0, assign_replicas(running, current, target), migrate)
        GateTool.GATE.set()  # the tools answer after the fold (the driver is in the check)
        return Decision("switch", current, target, 0.5, 0.1, "fold", [stay, go], running.seq_ids)


def job(tools: Path) -> JobConfig:
    return load_config(
        None,
        [
            "data.train_files=/d.jsonl",
            "data.max_response_length=256",
            "rollout.multi_turn.enable=true",
            "rollout.multi_turn.max_assistant_turns=3",
            f"rollout.multi_turn.tool_config_path={tools}",
        ],
    )


def engine_config(model_dir: str, **extra: Any) -> EngineConfig:
    return EngineConfig(
        model=model_dir,
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=512,
        max_model_len=1024,
        **extra,
    )


def items_of(rank: int) -> tuple[list[PromptItem], list[SamplingParams]]:
    """A rank's prompts: one with TOOL_SAMPLES tool-calling samples, one busy sample."""
    tool = PromptItem(10 * rank, [], "What is 6*7?", "42", {}, QUESTION)
    busy = PromptItem(10 * rank + 1, [], "go", "", {"agent_name": "busy_agent"}, QUESTION)
    greedy = SamplingParams(n=TOOL_SAMPLES, temperature=0.0, max_tokens=256, seed=3 + rank)
    return [tool, busy], [greedy, SamplingParams(n=1, temperature=0.0, seed=5)]


def trajectories(outs: list[Any]) -> dict[str, Any]:
    return {
        "tokens": [[c.token_ids for c in o.outputs] for o in outs],
        "masks": [[c.response_mask for c in o.outputs] for o in outs],
        "logprobs": [[c.logprobs for c in o.outputs] for o in outs],
        "prompts": [o.prompt_token_ids for o in outs],
    }


def _adaptive(rank: int, world_size: int, model_dir: str, tools: str) -> dict[str, Any]:
    from patrl.orchestrator.agent import agent_loop
    from patrl.orchestrator.agent.adaptive_agent_loop import AdaptiveMultiTurnRollout
    from patrl.rollout.adaptive import AdaptiveEngine
    from patrl.tpreshard import GroupCache

    agent_loop.HEARTBEAT_S = 0.05
    groups = GroupCache([1, 2], world_size=world_size, rank=rank)
    policy = {
        "kind": "adaptive",
        "candidates": (1, 2),
        "check_every": 2,
        "check_budget": 0.0,
        "kv_policy": "auto",
    }
    planner = GatedFoldPlanner(waiting=TOOL_SAMPLES * world_size)
    engine = AdaptiveEngine(
        engine_config(model_dir, tp_policy=policy),
        groups=groups,
        planner=planner,
        lengths=LengthPredictor(),
    )
    rollout = AdaptiveMultiTurnRollout(job(Path(tools)), engine)
    items, params = items_of(rank)
    out = rollout.generate(items, params)
    inner = engine.engine
    result: dict[str, Any] = {
        **trajectories(out),
        "tool_calls_here": GateTool.calls,
        "metrics": dict(rollout.metrics),
        "switches": engine.stats()["tp_switches"],
        "tp_at_end": engine.layout.tp_size,
        "folded_running": planner.folded_running,
        "rounds": rollout.runner.server.rounds,
        "idle": not inner.has_unfinished() and not inner.kept_request_ids(),
        "blocks_free": inner.cache.blocks.num_free_blocks == inner.cache.blocks.num_blocks,
    }
    # the next rollout folds at its first check, every first turn in flight (kept when it
    # completes: the fold carries that): the same tokens again; a rank with no prompt of its
    # own takes part
    assert engine.controller is not None
    engine.controller.planner = GatedFoldPlanner(waiting=0)
    again = rollout.generate(items if rank == 0 else [], params if rank == 0 else [])
    result["again"] = trajectories(again)
    result["tp_opened_again"] = engine.stats()["timeline"][0]["tp_size"]
    result["switches_again"] = engine.stats()["tp_switches"]
    result["opening_after"] = engine.controller.opening_tp
    # a loop that raises on the driver: every rank raises, none hangs, and the world goes on
    try:
        rollout.generate(
            [PromptItem(99, [], "go", "", {"agent_name": "adaptive_raising_agent"}, QUESTION)],
            [SamplingParams(n=1, temperature=0.0, seed=1)],
        )
    except RuntimeError as e:
        result["error"] = str(e)
    result["idle_after_error"] = not inner.has_unfinished() and not inner.kept_request_ids()
    result["after_error"] = trajectories(rollout.generate(items, params))["tokens"]
    return result


@pytest.mark.multirank
def test_a_fold_with_samples_awaiting_tools_changes_no_token(
    tmp_path: Path, model_dir: Path
) -> None:
    tools = tool_config(tmp_path / "tools.yaml", f"{__name__}.GateTool")
    GateTool.GATE.set()  # the twin: no gate, no fold
    twins, twin_calls = [], 0.0
    for rank in range(2):
        twin = MultiTurnRollout(job(tools), Engine(engine_config(str(model_dir))))
        items, params = items_of(rank)
        twins.append(trajectories(twin.generate(items, params)))
        twin_calls += twin.metrics["multi_turn/tool_calls"]
    tool_tokens, busy_tokens = twins[0]["tokens"][0][0], twins[0]["tokens"][1][0]
    masks = twins[0]["masks"][0][0]
    assert masks.count(0) > 0 and masks[-1] == 1  # tool turns inside, a model turn last
    assert len(busy_tokens) == BUSY_TOKENS
    assert twin_calls == 2 * TOOL_SAMPLES * 2  # each sample: 3 turns, 2 tool calls
    assert sum(masks) == 3 * 3 < len(tool_tokens)  # 3 turns of <tool_call>CALL</tool_call>

    results = run_ranks(_adaptive, world_size=2, args=(str(model_dir), str(tools)), timeout_s=300)
    for rank, r in enumerate(results):
        want = twins[rank]
        assert r["tokens"] == want["tokens"]
        assert r["masks"] == want["masks"]
        assert r["prompts"] == want["prompts"]
        for got, exp in zip(r["logprobs"], want["logprobs"], strict=True):
            for g, e in zip(got, exp, strict=True):
                np.testing.assert_allclose(g, e, atol=1e-4)  # TP 2 sums heads in another order
        assert r["switches"] == 1 and r["tp_at_end"] == 2
        assert r["idle"] and r["blocks_free"]
        assert r["again"]["tokens"] == (want["tokens"] if rank == 0 else [])
        # it opened at TP 1 (the return owed) and folded at its first check, before a step;
        # that check chose TP 2 for the whole batch, so the later rollouts open there
        assert r["tp_opened_again"] == 2 and r["switches_again"] == 2
        assert r["opening_after"] == 2
        assert r["after_error"] == want["tokens"]
        assert r["idle_after_error"]
        # each rank's own samples' metrics: the world's calls counted once over the ranks
        assert r["metrics"]["multi_turn/tool_calls"] == 2 * TOOL_SAMPLES
    driver, peer = results
    # the fold came while every tool sample awaited its tool: only the busy turns ran (a
    # sample awaiting a tool holds no decode slot), one per replica
    folded = driver["folded_running"]
    assert folded is not None and sorted(r for r, _ in folded) == [0, 1]
    busy_prompt = len(twins[0]["prompts"][1])
    tool_prompt = len(twins[0]["prompts"][0])
    assert busy_prompt < tool_prompt
    assert all(busy_prompt < c < busy_prompt + BUSY_TOKENS for _, c in folded)
    # tools ran once per sample call, on the driver only
    assert driver["tool_calls_here"] == twin_calls and peer["tool_calls_here"] == 0
    assert driver["rounds"] == peer["rounds"]  # every rank played every round
    assert driver["error"] == "the loop broke"
    assert peer["error"].startswith("the adaptive rollout's driver (rank 0) failed: ")
    assert "RuntimeError: the loop broke" in peer["error"]


# ------------------------------------------------------------------ a training job


def _two_rank_job(rank: int, world_size: int, model_dir: str, root: Path) -> list[dict[str, Any]]:
    import torch

    from patrl.orchestrator.distributed import World
    from patrl.orchestrator.sync_loop import SyncGRPO
    from patrl_testkit.profiles import synthetic_profile

    profile = root / "profile.json"
    if rank == 0:  # tp 2 always pays: the first rollout folds at its first check
        synthetic_profile(model_dir, tp2_speedup=20.0).save(profile)
    torch.distributed.barrier()
    overrides: dict[str, Any] = {
        "model.path": model_dir,
        "data.train_files": root / "train.jsonl",
        "data.train_batch_size": 2,
        "data.max_prompt_length": 512,  # the tools' schemas are in the rendered prompt
        "data.max_response_length": 48,
        "actor.ppo_mini_batch_size": 2,
        "rollout.n": 2,
        "rollout.temperature": 0.05,  # the scripted calls, nearly always
        "rollout.block_size": 4,
        "rollout.num_kv_blocks": 512,
        "rollout.adaptive_tp.enable": "true",
        "rollout.adaptive_tp.profile": profile,
        "rollout.multi_turn.enable": "true",
        "rollout.multi_turn.tool_config_path": root / "tools.yaml",
        "rollout.multi_turn.max_assistant_turns": 2,
        "reward.functions": '[{name: "patrl_testkit.jobs:digit_reward"}]',
        "reward.num_workers": 0,
        "trainer.total_training_steps": 2,
        "trainer.save_freq": 0,
        "trainer.test_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.default_local_dir": root / "run",
    }
    config = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    world = World(rank, world_size, rank, torch.device("cpu"))
    loop = SyncGRPO(config, world, model_dir, config.data.train_files, None)
    return list(loop.run().history)


@pytest.mark.e2e
@pytest.mark.multirank
def test_a_two_rank_adaptive_multi_turn_job_runs_two_steps(tmp_path: Path, model_dir: Path) -> None:
    import json

    rows = [{"prompt": f"What is {a}*7?", "answer": str(7 * a)} for a in range(2, 6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tool_config(tmp_path / "tools.yaml", "patrl.orchestrator.agent.calculator.CalculatorTool")
    history, _ = run_ranks(
        _two_rank_job, world_size=2, args=(str(model_dir), tmp_path), timeout_s=600
    )
    steps = [h for h in history if "actor/pg_loss" in h]
    assert [h["step"] for h in steps] == [1.0, 2.0]
    for h in steps:
        assert h["multi_turn/tool_calls"] > 0 and h["multi_turn/tool_tokens/mean"] > 0
        assert h["response_length/model_tokens/mean"] < h["response_length/mean"]
        assert h["actor/pg_loss"] == h["actor/pg_loss"]  # a number, not NaN
    assert steps[0]["rollout/tp_switches"] == 1  # the first rollout folded to tp 2
    assert all(h["rollout/tp_max"] == 2 for h in steps)


def test_one_process_has_nothing_to_adapt_and_runs_as_static_tp1(
    tmp_path: Path, model_dir: Path
) -> None:
    from patrl.orchestrator.agent.adaptive_agent_loop import (
        AdaptiveAgentLoopRunner,
        AdaptiveMultiTurnRollout,
    )
    from patrl.rollout.adaptive import AdaptiveEngine

    tools = tool_config(tmp_path / "tools.yaml", f"{__name__}.GateTool")
    GateTool.GATE.set()
    items, params = items_of(0)
    twin = MultiTurnRollout(job(tools), Engine(engine_config(str(model_dir))))
    want = trajectories(twin.generate(items, params))
    policy = {"kind": "adaptive", "candidates": (1, 2)}
    engine = AdaptiveEngine(engine_config(str(model_dir), tp_policy=policy))
    assert engine.controller is None
    rollout = AdaptiveMultiTurnRollout(job(tools), engine)
    assert not isinstance(rollout.runner, AdaptiveAgentLoopRunner)
    got = trajectories(rollout.generate(items, params))
    for key in ("tokens", "masks", "prompts"):
        assert got[key] == want[key]
    for g, w in zip(got["logprobs"], want["logprobs"], strict=True):
        for a, b in zip(g, w, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)  # batches vary with the tools' timing
