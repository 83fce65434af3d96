"""Partial multi-turn rollouts under adaptive TP on two ranks (issue 46): the driver (world
rank 0) counts the world's ended groups against the world's quota, cuts every replica's
resumable turns (the cut reaching whichever replica holds each turn, a fold in the same
round), gets their exported states back in the round's all-gather, and the cut samples,
pickled and resumed in the next rollout (imported on the least loaded replica, their
conversation re-prefilled), end as the uncut samples of a static TP 1 engine: tokens and
masks exactly, logprobs within 1e-4 (TP 2 sums heads in another order; a resumed turn's KV
is recomputed by a prefill). Tools run once per call, all on the driver.

The model is test_orchestrator_agent_adaptive's busy model: every tool turn calls the
calculator again (4 turns, 3 calls a sample), and "go a" starts a long letter cycle that a
`busy_agent` sample (not resumable: it runs to its end through a cut) decodes meanwhile.

And the job (e2e): adaptive TP + multi-turn + partial rollouts on 2 ranks runs, buffers its
cut groups as turn states in partial_rollouts.pt, and a restart resumes them.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_orchestrator_agent_adaptive import (
    BUSY_TOKENS,
    BusyAgentLoop,
    engine_config,
    save_busy_model,
)

from patrl.lenpredict import Decision, Layout, LengthPredictor, RunningSet, assign_replicas
from patrl.lenpredict.planner import Option
from patrl.orchestrator.agent import (
    AgentLoopOutput,
    AgentLoopRunner,
    CalculatorTool,
    ToolAgentLoop,
    ToolPool,
)
from patrl.orchestrator.agent.agent_loop import TurnState
from patrl.rollout import Engine, SamplingParams
from patrl_testkit.multirank import run_ranks

TURNS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=64)
QUESTIONS = ["What is 6*7?", "Six times seven?"]
STOP_AT = (2, 6, 10, 20)  # the driver's round at which the forced cut is asked for


def _tool_row(rank: int) -> dict[str, Any]:
    return {"raw_prompt": [{"role": "user", "content": QUESTIONS[rank % len(QUESTIONS)]}]}


def forced_rows(rank: int) -> tuple[list[dict[str, Any]], list[str]]:
    """A rank's rows for the forced cut: a group of two tool samples, one busy sample."""
    busy = {**_tool_row(rank), "agent_name": "busy_agent"}
    return [_tool_row(rank), _tool_row(rank), busy], ["tools", "tools", "busy"]


def quota_rows(rank: int) -> tuple[list[dict[str, Any]], list[str]]:
    """A rank's rows for the quota's cut: a group of two one-turn samples (they end first),
    a group of two 4-turn ones."""
    short = {**_tool_row(rank), "agent_name": "short"}
    return [short, short, _tool_row(rank), _tool_row(rank)], ["short", "short", "long", "long"]


class CountingPool(ToolPool):
    """The calculator, counting its calls in this process."""

    def __init__(self) -> None:
        super().__init__([CalculatorTool()])
        self.calls = 0

    async def call(self, *args: Any, **kwargs: Any) -> Any:
        out = await super().call(*args, **kwargs)
        self.calls += 1
        return out


def loops(tokenizer: Any, eos: Any, pool: ToolPool) -> dict[str, Any]:
    def tool(turns: int) -> ToolAgentLoop:
        return ToolAgentLoop(tokenizer, pool, sorted(eos), 400, max_assistant_turns=turns)

    return {
        "tool_agent": tool(TURNS),
        "short": tool(1),
        "busy_agent": BusyAgentLoop(tokenizer),
    }


class ArmedFoldPlanner:
    """Stays until armed, then folds to TP 2 at the next check that sees a running turn
    (once a rollout, never at its first check: the rollouts all open at TP 1, where a stay
    at the first check leaves the opening); records what ran at the fold (replica, context)
    and the driver's rounds then."""

    latency: Any = None

    def __init__(self) -> None:
        self.armed = False
        self.rounds: Any = None  # the driver's round counter, read at the fold
        self.folds: list[tuple[int, list[tuple[int, int]]]] = []

    def new_rollout(self) -> None:
        self.folded = False
        self.checks = 0

    def may_switch(self, running: RunningSet, current: Layout) -> bool:
        return True

    def never_switches_from(self, current: Layout, max_context: int) -> bool:
        return False

    def shrinking_share(self, running: RunningSet, current: Layout, steps: int) -> float:
        return 1.0

    def decide(self, running: RunningSet, current: Layout) -> Decision:
        n = len(running)
        self.checks += 1
        stay = Option(current, 1.0, 0.0, np.inf, 0, running.replica, np.zeros(n, dtype=bool))
        if not (self.armed and not self.folded and self.checks > 1 and current.tp == 1 and n):
            return Decision("stay", current, current, 0.0, 0.0, "stay", [stay], running.seq_ids)
        self.folded = True
        ran = [(int(r), int(c)) for r, c in zip(running.replica, running.context, strict=True)]
        self.folds.append((self.rounds(), ran))
        target = Layout(dp=1, tp=2)
        migrate = np.arange(n) % 2 == 0  # one migrates its KV, one recomputes it
        go = Option(target, 0.5, 0.1, np.inf, 0, assign_replicas(running, current, target), migrate)
        return Decision("switch", current, target, 0.5, 0.1, "fold", [stay, go], running.seq_ids)


def _idle(engine: Engine) -> bool:
    blocks = engine.cache.blocks
    return (
        not engine.has_unfinished()
        and not engine.kept_request_ids()
        and blocks.num_free_blocks == blocks.num_blocks
    )


def _cut_then_resume(
    runner: Any, planner: ArmedFoldPlanner, rows: list[dict[str, Any]], keys: list[str], quota: int
) -> dict[str, Any]:
    """`rows` run partially, the cut ones pickled (as the checkpoint does) and resumed to
    their end by a second partial rollout (a rank with none takes part with no rows): the
    first run's outputs (summed up: ended, or cut and whether in a turn), the final
    outputs, this rank's switches in both runs, the driver's planner's folds in each, and
    whether the engine is idle after."""
    adaptive = runner.adaptive_server.stepped.adaptive
    before, folds = adaptive.stats()["tp_switches"], len(planner.folds)
    first = runner.run_partial(rows, GREEDY, keys, quota)
    cut_folds = planner.folds[folds:]
    carried = {i: pickle.loads(pickle.dumps(o)) for i, o in enumerate(first)}
    again = [i for i, o in carried.items() if isinstance(o, TurnState)]
    resumed = runner.run_partial(
        [{**rows[i], "resume": carried[i]} for i in again],
        [carried[i].sampling_params for i in again],
        [keys[i] for i in again],
        len(again),
    )
    assert all(isinstance(o, AgentLoopOutput) for o in resumed)
    final = list(first)
    for i, o in zip(again, resumed, strict=True):
        final[i] = o
    return {
        "first": [_summary(o) for o in first],
        "final": final,
        "switches": adaptive.stats()["tp_switches"] - before,
        "cut_folds": cut_folds,
        "resume_folds": planner.folds[folds + len(cut_folds) :],
        "idle": _idle(adaptive.engine),
    }


def _summary(out: Any) -> Any:
    if isinstance(out, TurnState):
        return ("cut", out.open_turn is not None)
    return ("ended", out.prompt_ids, out.response_ids, out.response_mask, out.num_turns)


def _adaptive_partial(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    from patrl.orchestrator.agent import agent_loop
    from patrl.orchestrator.agent.adaptive_agent_loop import AdaptiveAgentLoopRunner
    from patrl.rollout.adaptive import AdaptiveEngine
    from patrl.tpreshard import GroupCache

    agent_loop.HEARTBEAT_S = 0.05
    policy = {
        "kind": "adaptive",
        "candidates": (1, 2),
        "check_every": 1,
        "check_budget": 0.0,
        "kv_policy": "auto",
    }
    planner = ArmedFoldPlanner()
    adaptive = AdaptiveEngine(
        engine_config(model_dir, tp_policy=policy),
        groups=GroupCache([1, 2], world_size=world_size, rank=rank),
        planner=planner,
        lengths=LengthPredictor(),
    )
    inner = adaptive.engine
    pool = CountingPool()
    runner = AdaptiveAgentLoopRunner(adaptive, loops(inner.tokenizer, inner.eos_token_ids, pool))
    server = runner.adaptive_server
    planner.rounds = lambda: server.rounds
    result: dict[str, Any] = {"forced": [], "stops": []}

    # a cut forced at the driver's round `at`, the planner armed with it: the fold comes at
    # the next round's check, the round whose calls carry the cut
    step = server.stepped.step
    for at in STOP_AT:
        planner.armed = False
        count = [0]

        def stepping(at: int = at, count: list[int] = count) -> Any:
            count[0] += 1
            if count[0] == at:
                result["stops"].append(server.rounds)
                server.stop()
                planner.armed = True
            return step()

        if rank == 0:
            server.stepped.step = stepping  # type: ignore[method-assign]
        rows, keys = forced_rows(rank)
        result["forced"].append(_cut_then_resume(runner, planner, rows, keys, quota=len(rows)))
        server.stepped.step = step  # type: ignore[method-assign]

    # the quota: the world's (1 group a rank) met once the one-turn groups end; a fold at
    # the first check that sees a turn running
    planner.armed = True
    rows, keys = quota_rows(rank)
    result["quota"] = _cut_then_resume(runner, planner, rows, keys, quota=1)
    result["tool_calls_here"] = pool.calls

    # an engine call that raises on one replica (rank 1's, at TP 1): every rank plays the
    # round to its end, then every rank raises (the driver names the rank and the call),
    # none waits in a collective, every engine is drained, and the next run goes on
    planner.armed = False
    add = inner.add_request

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no room here")

    if rank == 1:
        inner.add_request = failing  # type: ignore[method-assign]
    try:
        runner.run_partial(rows, GREEDY, keys, 1)
    except RuntimeError as e:
        result["error"] = str(e)
    inner.add_request = add  # type: ignore[method-assign]
    result["idle_after_error"] = _idle(inner)
    # a rank's bad arguments: every rank raises them (none waits for it in a collective)
    try:
        runner.run_partial(rows[:2], GREEDY, keys[: 1 if rank == 1 else 2], 1)
    except ValueError as e:
        result["bad_args"] = str(e)
    result["after_error"] = runner.run(rows, GREEDY)
    result["rounds"] = server.rounds
    return result


def _twin(model_dir: Path, rows: list[dict[str, Any]]) -> tuple[list[AgentLoopOutput], int]:
    """`rows` uncut on a static TP 1 engine, and the tool calls made."""
    engine = Engine(engine_config(str(model_dir)))
    pool = CountingPool()
    runner = AgentLoopRunner(engine, loops(engine.tokenizer, engine.eos_token_ids, pool))
    return runner.run(rows, GREEDY), pool.calls


def _assert_same(got: list[AgentLoopOutput], want: list[AgentLoopOutput]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.prompt_ids == w.prompt_ids
        assert g.response_ids == w.response_ids  # position by position
        assert g.response_mask == w.response_mask
        np.testing.assert_allclose(g.response_logprobs, w.response_logprobs, atol=1e-4)
        assert g.num_turns == w.num_turns
        assert g.metrics == w.metrics


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_busy_model(tmp_path_factory.mktemp("mtap") / "busy")


@pytest.mark.multirank
def test_adaptive_cut_and_resume_equals_the_uncut_static_run(model_dir: Path) -> None:
    twins = {}
    calls = 0
    for rank in range(2):
        forced, forced_calls = _twin(model_dir, forced_rows(rank)[0])
        quota, quota_calls = _twin(model_dir, quota_rows(rank)[0])
        twins[rank] = (forced, quota)
        calls += len(STOP_AT) * forced_calls + quota_calls
    long_sample = twins[0][1][2]
    assert long_sample.num_turns == 2 * TURNS and 0 in long_sample.response_mask
    assert len(twins[0][0][2].response_ids) == BUSY_TOKENS

    results = run_ranks(_adaptive_partial, world_size=2, args=(str(model_dir),), timeout_s=600)
    kinds: set[tuple[str, bool]] = set()
    for rank, r in enumerate(results):
        forced_twin, quota_twin = twins[rank]
        for i, run in enumerate(runs_of(r)):
            assert run["idle"]
            # a fold in the rollout that cut, and one in the rollout that resumed, if any
            # sample of the world was cut (the driver's planner folds for the world)
            cut_anywhere = any(s[0] == "cut" for o in results for s in runs_of(o)[i]["first"])
            assert run["switches"] == 1 + cut_anywhere
        for run in r["forced"]:
            _assert_same(run["final"], forced_twin)
            first = run["first"]
            assert first[2][0] == "ended"  # the busy sample cannot resume: it ran through
            kinds |= {s for s in first[:2] if s[0] == "cut"}
        q = r["quota"]
        _assert_same(q["final"], quota_twin)
        # the one-turn groups of both ranks ended (the world's quota: 2), the others were
        # cut (after their first turn: inside a tool call or before their next turn)
        assert [s[0] for s in q["first"]] == ["ended", "ended", "cut", "cut"]
    assert ("cut", True) in kinds  # a turn cut in flight, exported by its replica
    driver, peer = results
    assert driver["tool_calls_here"] == calls and peer["tool_calls_here"] == 0
    assert driver["rounds"] == peer["rounds"]  # every rank played every round
    # each forced cut: the fold came at the check of the round that carried the cut (the
    # round after the stop), and only the busy turns ran there (the cut exported the tool
    # turns first), one per replica, within their letter cycle
    busy_prompt = len(twins[0][0][2].prompt_ids)
    for run, stop in zip(driver["forced"], driver["stops"], strict=True):
        ((rounds, ran),) = run["cut_folds"]
        assert rounds == stop + 1
        assert sorted(replica for replica, _ in ran) == [0, 1]
        assert all(busy_prompt < c <= busy_prompt + BUSY_TOKENS for _, c in ran)
    assert len(driver["quota"]["cut_folds"]) == 1
    assert driver["error"] == ("an engine call failed: rank 1: add: RuntimeError: no room here")
    assert peer["error"].startswith("the adaptive rollout's driver (rank 0) failed: ")
    assert "rank 1: add: RuntimeError: no room here" in peer["error"]
    for rank, r in enumerate(results):
        assert r["idle_after_error"]
        assert r["bad_args"] == "rank 1: 1 group keys for 2 samples"
        _assert_same(r["after_error"], twins[rank][1])


def runs_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A rank's cut-and-resume runs, in order."""
    return [*result["forced"], result["quota"]]


# ------------------------------------------------------------------ a training job


def _partial_job(
    rank: int, world_size: int, model_dir: str, root: Path, steps: int
) -> list[dict[str, Any]]:
    import torch

    from patrl.orchestrator.config import load_config
    from patrl.orchestrator.distributed import World
    from patrl.orchestrator.sync_loop import SyncGRPO
    from patrl_testkit.profiles import synthetic_profile

    profile = root / "profile.json"
    if rank == 0 and not profile.exists():
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
        "rollout.over_sample_rate": 1.0,
        "rollout.max_num_seqs": 1,  # groups end one after another: the quota cuts the rest
        "rollout.temperature": 0.05,  # the scripted calls, nearly always
        "rollout.block_size": 4,
        "rollout.num_kv_blocks": 512,
        "rollout.adaptive_tp.enable": "true",
        "rollout.adaptive_tp.profile": profile,
        "rollout.multi_turn.enable": "true",
        "rollout.multi_turn.tool_config_path": root / "tools.yaml",
        "rollout.multi_turn.max_assistant_turns": 2,  # the last turn calls no tool
        "reward.functions": '[{name: "patrl_testkit.jobs:digit_reward"}]',
        "reward.num_workers": 0,
        "trainer.total_training_steps": steps,
        "trainer.save_freq": 1,
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
def test_a_two_rank_adaptive_multi_turn_job_cuts_checkpoints_and_resumes_turn_states(
    tmp_path: Path, model_dir: Path
) -> None:
    """Adaptive TP + multi-turn + partial rollouts on 2 ranks (refused before): two steps
    with a checkpoint each, the unfinished groups buffered as turn states in
    partial_rollouts.pt, then a restart that resumes them in its third step."""
    import json

    import torch
    from agent_scripted import tool_config

    from patrl.orchestrator import run_checkpoint
    from patrl.orchestrator.sync_loop import PARTIALS_FILE

    rows = [{"prompt": f"What is {a}*7?", "answer": str(7 * a)} for a in range(2, 10)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tool_config(tmp_path / "tools.yaml", "patrl.orchestrator.agent.calculator.CalculatorTool")
    args = (str(model_dir), tmp_path)
    history, _ = run_ranks(_partial_job, world_size=2, args=(*args, 2), timeout_s=600)
    steps = {h["step"]: h for h in history if "actor/pg_loss" in h}
    assert sorted(steps) == [1.0, 2.0]
    assert all(h["rollout/tp_control_fraction"] > 0 for h in steps.values())  # checks ran
    assert steps[1.0]["partial/buffered_groups"] > 0  # the world's quota cut groups
    saved = torch.load(
        run_checkpoint.step_dir(tmp_path / "run", 2) / PARTIALS_FILE, weights_only=False
    )
    carried = [st for p in saved["partials"].values() for st in p.states]
    assert any(isinstance(st, TurnState) for st in carried)
    assert all(isinstance(st, TurnState | AgentLoopOutput) for st in carried)
    for p in saved["partials"].values():
        assert len(p.states) == 2  # a group's every sample, ended or not
    history, _ = run_ranks(_partial_job, world_size=2, args=(*args, 3), timeout_s=600)
    logged = {h["step"]: h for h in history if "actor/pg_loss" in h}
    assert sorted(logged) == [1.0, 2.0, 3.0]  # the history read back, and the third step
    third = logged[3.0]
    assert third["partial/resumed_groups"] == len(saved["partials"])
    assert third["partial/off_policy_token_frac"] > 0  # tokens sampled before the restart
    for h in [*steps.values(), third]:
        assert h["partial/finished_groups"] >= 2
        assert h["multi_turn/tool_calls"] > 0
        assert h["response_length/model_tokens/mean"] < h["response_length/mean"]
        assert h["actor/pg_loss"] == h["actor/pg_loss"]  # a number, not NaN
