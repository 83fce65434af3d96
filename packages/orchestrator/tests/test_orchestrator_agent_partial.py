"""Partial rollouts of agent loops (issue 46): `AgentLoopRunner.run_partial` stops once its
quota of groups has ended and hands back each cut sample's `TurnState`; the state pickles, and
`ToolAgentLoop.run(..., resume=state)` goes on from it. Greedy on agent_scripted's tiny Llama
(every turn calls the calculator, 4 turns): a sample cut after any engine step, or right after
a tool call, then pickled and resumed on a fresh engine, equals the uncut sample token for
token (mask exactly, logprobs within 1e-5: the resumed turn's KV is recomputed by a prefill,
where the uncut one was decoded token by token); no tool call runs twice. The quota: groups
past it are cut, a loop that cannot resume runs to its end, nothing stays in the engine."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
from agent_scripted import hermes_tokenizer, save_scripted_model
from test_orchestrator_agent_loop import samples

from patrl.orchestrator.agent import (
    AgentLoopOutput,
    AgentLoopRunner,
    CalculatorTool,
    SingleTurnAgentLoop,
    ToolAgentLoop,
    ToolPool,
)
from patrl.orchestrator.agent.agent_loop import TurnState
from patrl.rollout import Engine, EngineConfig, SamplingParams

TURNS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=64)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("agent_partial")
    return save_scripted_model(root / "again", hermes_tokenizer(), call_after_tool=True)


def engine(model: Path) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            device="cpu",
            block_size=4,
            num_kv_blocks=1024,
            max_model_len=1024,
        )
    )


class CountingPool(ToolPool):
    """A calculator pool that counts its calls and may run `after_call` after each."""

    def __init__(self) -> None:
        super().__init__([CalculatorTool()])
        self.calls = 0
        self.after_call: Any = None

    async def call(self, *args: Any, **kwargs: Any) -> Any:
        out = await super().call(*args, **kwargs)
        self.calls += 1
        if self.after_call is not None:
            self.after_call(self.calls)
        return out


def runner_of(eng: Engine, pool: ToolPool, **loops: Any) -> AgentLoopRunner:
    tool = ToolAgentLoop(
        eng.tokenizer, pool, sorted(eng.eos_token_ids), 400, max_assistant_turns=TURNS
    )
    return AgentLoopRunner(eng, {"tool_agent": tool, **loops})


def uncut(model: Path, n: int) -> tuple[list[AgentLoopOutput], int]:
    pool = CountingPool()
    outs = runner_of(engine(model), pool).run(samples(n), GREEDY)
    return outs, pool.calls


def check_idle(eng: Engine) -> None:
    """Nothing left in the engine: no request, no kept turn, every block free."""
    assert not eng.has_unfinished()
    assert eng.kept_request_ids() == []
    blocks = eng.cache.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def resume_all(
    model: Path, first: list[Any], n: int, pool: CountingPool, extended: set[str] | None = None
) -> list[AgentLoopOutput]:
    """The cut samples of `first` (pickled and unpickled, as a checkpoint does) resumed to
    their end on a fresh engine; the finished ones as they were. `extended` collects the
    resumed open turns whose KV a later turn extended (kept, then continued)."""
    cut = {
        i: pickle.loads(pickle.dumps(o)) for i, o in enumerate(first) if isinstance(o, TurnState)
    }
    rows = [{**s, "resume": cut[i]} for i, s in enumerate(samples(n)) if i in cut]
    eng = engine(model)
    imported: set[str] = set()
    import_requests, continue_request = eng.import_requests, eng.continue_request

    def importing(states: Any, *args: Any, **kwargs: Any) -> Any:
        imported.update(st.request_id for st in states)
        return import_requests(states, *args, **kwargs)

    def continuing(kept: str, *args: Any, **kwargs: Any) -> Any:
        if kept in imported and extended is not None:
            extended.add(kept)
        return continue_request(kept, *args, **kwargs)

    eng.import_requests = importing  # type: ignore[method-assign]
    eng.continue_request = continuing  # type: ignore[method-assign]
    resumed = iter(runner_of(eng, pool).run(rows, GREEDY) if rows else [])
    check_idle(eng)
    return [next(resumed) if i in cut else o for i, o in enumerate(first)]


def assert_same(got: list[AgentLoopOutput], want: list[AgentLoopOutput]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.prompt_ids == w.prompt_ids
        assert g.response_ids == w.response_ids  # position by position
        assert g.response_mask == w.response_mask
        assert g.response_logprobs == pytest.approx(w.response_logprobs, abs=1e-5)
        assert g.num_turns == w.num_turns
        assert g.metrics == w.metrics


def test_a_sample_cut_after_any_engine_step_resumes_to_the_uncut_trajectory(model: Path) -> None:
    n = 2
    want, want_calls = uncut(model, n)
    assert all(sum(o.response_mask) < len(o.response_ids) for o in want)  # tool turns in it
    kinds = set()
    extended: set[str] = set()
    steps = 1
    while True:
        eng = engine(model)
        pool = CountingPool()
        runner = runner_of(eng, pool)
        step, count = eng.step, [0]

        def stepping(
            step: Any = step, count: list[int] = count, at: int = steps, runner: Any = runner
        ) -> Any:
            count[0] += 1
            if count[0] == at:
                runner.server.stop()
            return step()

        eng.step = stepping  # type: ignore[method-assign]
        first = runner.run_partial(samples(n), GREEDY, groups=[0, 1], quota=n + 1)
        check_idle(eng)
        states = [o for o in first if isinstance(o, TurnState)]
        if not states:
            break  # the stop came after every sample ended
        for st in states:
            assert len(st.response_ids) == len(st.response_mask) == len(st.response_logprobs)
            kinds.add("open" if st.open_turn is not None else "between")
            if st.open_turn is not None:
                assert st.model_tokens() == sum(st.response_mask) + len(
                    st.open_turn.output_token_ids
                )
        assert_same(resume_all(model, first, n, pool, extended), want)
        assert pool.calls == want_calls  # no call ran twice
        steps += 1
    assert steps > 5 and "open" in kinds
    # a resumed open turn is kept: the turn after it extends its KV (no re-prefill)
    assert extended


def test_a_cut_during_a_tool_call_lets_the_call_finish_and_appends_its_answer(
    model: Path,
) -> None:
    n = 1
    want, want_calls = uncut(model, n)
    for at in range(1, TURNS):
        eng = engine(model)
        pool = CountingPool()
        runner = runner_of(eng, pool)
        pool.after_call = lambda calls, at=at, r=runner: calls == at and r.server.stop()
        (st,) = runner.run_partial(samples(n), GREEDY, groups=[0], quota=1)
        check_idle(eng)
        assert isinstance(st, TurnState)
        assert st.open_turn is None  # stopped between turns
        assert st.assistant_turns == at and st.user_turns == at
        assert st.response_mask[-1] == 0  # the call's answer is appended
        assert st.metrics["tool_calls"] == at
        assert st.response_ids == want[0].response_ids[: len(st.response_ids)]
        pool.after_call = None
        assert_same(resume_all(model, [st], n, pool), want)
        assert pool.calls == want_calls


def test_the_quota_cuts_the_groups_past_it_and_a_loop_that_cannot_resume_ends_in_step(
    model: Path,
) -> None:
    eng = engine(model)
    short = ToolAgentLoop(
        eng.tokenizer,
        ToolPool([CalculatorTool()]),
        sorted(eng.eos_token_ids),
        400,
        max_assistant_turns=1,
    )
    runner = runner_of(
        eng,
        ToolPool([CalculatorTool()]),
        short=short,
        single=SingleTurnAgentLoop(eng.tokenizer, 400),
    )
    rows = [
        {**samples(1)[0], "agent_name": "short"},
        {**samples(2)[1], "agent_name": "short"},
        *samples(2),
        *samples(3)[2:],
        {**samples(1)[0], "agent_name": "single"},
    ]
    groups = ["short", "short", "long", "long", "mixed", "mixed"]
    params = [GREEDY] * 5 + [SamplingParams(temperature=0, max_tokens=60)]
    finished: list[int] = []
    outs = runner.run_partial(
        rows, params, groups, quota=1, on_finish=lambda i, _: finished.append(i)
    )
    check_idle(eng)
    assert [type(o).__name__ for o in outs] == [
        "AgentLoopOutput",
        "AgentLoopOutput",
        "TurnState",
        "TurnState",
        "TurnState",
        "AgentLoopOutput",  # single_turn_agent cannot resume: it ran to its end
    ]
    assert sorted(finished) == [0, 1, 5]
    assert len(outs[5].response_ids) == 60  # type: ignore[union-attr]
    # a quota of 0 stops at once: every resumable sample is cut before its first turn
    outs = runner.run_partial(samples(2), GREEDY, [0, 1], quota=0)
    assert all(isinstance(o, TurnState) and not o.response_ids for o in outs)
    check_idle(eng)
    with pytest.raises(ValueError, match="2 group keys for 3 samples"):
        runner.run_partial(samples(3), GREEDY, [0, 1], quota=1)


@pytest.mark.e2e
def test_a_multi_turn_job_with_partial_rollouts_buffers_checkpoints_and_resumes_turn_states(
    tmp_path: Path,
) -> None:
    """Two steps with a checkpoint each, then a restart that runs the third: unfinished
    groups are buffered as turn states, saved in the checkpoint, and resumed after the
    restart. The engine admits two samples at a time, so groups end one after another and
    the quota (2 of the 4 groups drawn) cuts the later ones (a turn in the engine, or queued,
    or after its tool call)."""
    import json

    import torch
    from agent_scripted import tool_config

    from patrl.orchestrator import run_checkpoint
    from patrl.orchestrator.main import main
    from patrl.orchestrator.sync_loop import PARTIALS_FILE

    # calls the calculator, then answers and ends: a group ends at its last model turn
    model = save_scripted_model(tmp_path / "answers", hermes_tokenizer())
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"What is {a}*7?", "answer": str(7 * a)} for a in range(2, 10)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tools = tool_config(
        tmp_path / "tools.yaml", "patrl.orchestrator.agent.calculator.CalculatorTool"
    )
    run = tmp_path / "run"
    overrides: dict[str, Any] = {
        "model.path": model,
        "data.train_files": data,
        "data.train_batch_size": 2,
        "data.max_prompt_length": 512,
        "data.max_response_length": 48,
        "actor.ppo_mini_batch_size": 2,
        "rollout.n": 2,
        "rollout.over_sample_rate": 1.0,
        "rollout.temperature": 0.05,
        "rollout.block_size": 4,
        "rollout.num_kv_blocks": 512,
        "rollout.max_num_seqs": 2,
        "rollout.adaptive_tp.enable": "false",
        "rollout.multi_turn.enable": "true",
        "rollout.multi_turn.tool_config_path": tools,
        "rollout.multi_turn.max_assistant_turns": 3,
        "reward.functions": '[{name: "patrl_testkit.jobs:digit_reward"}]',
        "reward.num_workers": 0,
        "trainer.total_training_steps": 2,
        "trainer.save_freq": 1,
        "trainer.test_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.default_local_dir": run,
    }
    assert main([f"{k}={v}" for k, v in overrides.items()]) == 0
    saved = torch.load(run_checkpoint.step_dir(run, 2) / PARTIALS_FILE, weights_only=False)
    carried = [st for p in saved["partials"].values() for st in p.states]
    assert any(isinstance(st, TurnState) for st in carried)
    assert all(isinstance(st, TurnState | AgentLoopOutput) for st in carried)
    for p in saved["partials"].values():
        assert len(p.states) == 2  # a group's every sample, ended or not
    assert saved["stale_tokens"] == {
        rid: sum(
            st.model_tokens() if isinstance(st, TurnState) else sum(st.response_mask)
            for st in p.states
        )
        for rid, p in saved["partials"].items()
    }
    overrides["trainer.total_training_steps"] = 3
    assert main([f"{k}={v}" for k, v in overrides.items()]) == 0  # resumes from step 2
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in logged if "actor/pg_loss" in r}
    assert sorted(steps) == [1, 2, 3]
    assert steps[1]["partial/buffered_groups"] > 0
    assert steps[3]["partial/resumed_groups"] == len(saved["partials"])
    # the resumed groups' model tokens sampled under the weights of earlier steps
    assert any(r["partial/off_policy_token_frac"] > 0 for r in steps.values())
    for r in steps.values():
        assert 0 <= r["partial/off_policy_token_frac"] < 1
        assert r["partial/finished_groups"] >= 2
        assert r["multi_turn/tool_calls"] > 0
        assert r["response_length/model_tokens/mean"] < r["response_length/mean"]
        assert r["actor/pg_loss"] == r["actor/pg_loss"]  # a number, not NaN


# ------------------------------------------------------------------ TP 2

CALL_ONCE = "call_once"  # the model fixture of the TP test: call, read the answer, answer


def _mt_job(tools: Path) -> Any:
    from patrl.orchestrator.config import load_config

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
        ],
    )


def _item(index: int) -> Any:
    from patrl.orchestrator.data import PromptItem

    question = QUESTIONS_TP[index]
    return PromptItem(index, [], question, "42", {}, [{"role": "user", "content": question}])


QUESTIONS_TP = ["What is 6*7?", "Compute 6*7 please."]
GREEDY_N2 = SamplingParams(n=2, temperature=0.0, max_tokens=64, seed=3)


def _partial_then_resume(engine: Engine, tools: Path, cut_at: int, leader: bool) -> dict[str, Any]:
    """Two groups run by `generate_partial`, the first rank stopping the rollout at its
    `cut_at`-th engine step; the cut groups pickled and resumed to their end. Each group's
    trajectories and masks, which groups were cut, and whether the engine is idle."""
    from patrl.orchestrator.agent.multi_turn import MultiTurnRollout

    rollout = MultiTurnRollout(_mt_job(tools), engine)
    step, count = engine.step, [0]

    def stepping() -> Any:
        count[0] += 1
        if count[0] == cut_at:
            rollout.runner.server.stop()
        return step()

    if leader:
        engine.step = stepping  # type: ignore[method-assign]
    groups = [(f"g{i}", _item(i), [], GREEDY_N2) for i in range(2)]
    done, rest = rollout.generate_partial(groups, quota=len(groups) + 1)
    engine.step = step  # type: ignore[method-assign]
    carried = [
        (rid, it, pickle.loads(pickle.dumps(rest[rid])), p)
        for rid, it, _, p in groups
        if rid in rest
    ]
    more, left = rollout.generate_partial(carried, quota=len(groups) + 1) if carried else ([], {})
    assert left == {}
    return {
        "cut": sorted(rest),
        "open": sum(
            st.open_turn is not None for v in rest.values() for st in v if isinstance(st, TurnState)
        ),
        "tokens": {o.request_id: [c.token_ids for c in o.outputs] for o in [*done, *more]},
        "masks": {o.request_id: [c.response_mask for c in o.outputs] for o in [*done, *more]},
        "idle": not engine.has_unfinished()
        and not engine.kept_request_ids()
        and engine.cache.blocks.num_free_blocks == engine.cache.blocks.num_blocks,
    }


def _tp_partial(rank: int, world_size: int, model_dir: str, tools: str) -> dict[str, Any]:
    import torch.distributed as dist

    from patrl.tpreshard import ParallelLayout

    group = dist.new_group(list(range(world_size)))
    layout = ParallelLayout(tp_size=world_size, tp_rank=rank, tp_group=group)
    engine = Engine(
        EngineConfig(
            model=model_dir, dtype="float32", block_size=4, num_kv_blocks=512, max_model_len=1024
        ),
        layout,
    )
    return _partial_then_resume(engine, Path(tools), 4, rank == 0)


@pytest.mark.multirank
def test_tp2_cuts_and_resumes_a_partial_multi_turn_rollout_as_tp1_runs_it_uncut(
    tmp_path: Path,
) -> None:
    from agent_scripted import tool_config

    from patrl.orchestrator.agent.multi_turn import MultiTurnRollout
    from patrl_testkit.multirank import run_ranks

    model_dir = save_scripted_model(tmp_path / "once", hermes_tokenizer())
    tools = tool_config(
        tmp_path / "tools.yaml", "patrl.orchestrator.agent.calculator.CalculatorTool"
    )
    uncut_rollout = MultiTurnRollout(_mt_job(tools), engine(model_dir))
    outs = uncut_rollout.generate([_item(0), _item(1)], [GREEDY_N2] * 2)
    want = {f"g{i}": [c.token_ids for c in o.outputs] for i, o in enumerate(outs)}
    want_masks = {f"g{i}": [c.response_mask for c in o.outputs] for i, o in enumerate(outs)}
    assert 0 in want_masks["g0"][0]  # a tool turn in it
    tp1 = _partial_then_resume(engine(model_dir), tools, 4, True)
    assert tp1["cut"] == ["g0", "g1"] and tp1["open"] > 0
    assert tp1["tokens"] == want and tp1["masks"] == want_masks and tp1["idle"]
    ranks = run_ranks(_tp_partial, world_size=2, args=(str(model_dir), str(tools)), timeout_s=300)
    assert ranks[0] == ranks[1]  # the peer cut and resumed what the first rank did
    # (where the cut falls differs from TP 1's: at TP > 1 a turn reaches the engine a step
    # later, with the step's broadcast)
    assert ranks[0]["cut"] == ["g0", "g1"] and ranks[0]["open"] > 0
    for key in ("tokens", "masks", "idle"):
        assert ranks[0][key] == tp1[key], key
