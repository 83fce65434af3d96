"""Async GRPO with multi-turn tool rollouts (`trainer.mode=async` + `rollout.multi_turn`,
async_rl/agent_tickets.py): a rollout rank's groups run as agent-loop samples over its engine,
weights are pulled between engine steps while samples are mid-turn or await a tool, and every
model token records the version that sampled it (tool tokens, masked out, have no policy).

The model is agent_scripted's tiny Llama: greedy, it calls the calculator, reads the answer and
answers, so a trajectory holds model tokens, tool tokens, then model tokens again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from agent_scripted import (
    ANSWER,
    CALL,
    UNKNOWN,
    GatedTool,
    HangingTool,
    hermes_tokenizer,
    save_scripted_model,
)
from agent_scripted import tool_config as write_tool_config
from safetensors.torch import load_file

from patrl.orchestrator.agent import AgentLoop, AgentLoopOutput, register
from patrl.orchestrator.agent.multi_turn import MultiTurnRollout
from patrl.orchestrator.async_loop import AsyncGRPO
from patrl.orchestrator.async_rl.agent_tickets import (
    AgentGroups,
    FinishedGroup,
    SampleRecord,
    response_versions,
)
from patrl.orchestrator.async_rl.flight_reports import FlightReport, TicketReport
from patrl.orchestrator.async_rl.job import AsyncJob
from patrl.orchestrator.async_rl.rollout_worker import RolloutWorker
from patrl.orchestrator.async_rl.tickets import GroupRecord, sample_key, ticket_params
from patrl.orchestrator.async_rl.trainer_worker import TrainerWorker
from patrl.orchestrator.build import load_data
from patrl.orchestrator.config import JobConfig, load_config
from patrl.orchestrator.control import ControlPlane
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.distributed import World
from patrl.orchestrator.scoring import TrajectoryOutput
from patrl.orchestrator.support import multi_turn_refusals, unsupported
from patrl.orchestrator.sync_loop import SyncGRPO
from patrl.orchestrator.weight_store import WeightStore
from patrl.rollout import Engine, EngineConfig, SamplingParams
from patrl_testkit.multirank import run_ranks

CALCULATOR = "patrl.orchestrator.agent.calculator.CalculatorTool"
HANGING = "agent_scripted.HangingTool"
DIGITS = "patrl_testkit.jobs:digit_reward"
OTHER = "It is forty-two."  # what the second model answers after the tool
QUESTION = [{"role": "user", "content": "What is 6*7?"}]
ITEM = PromptItem(7, [], "What is 6*7?", "42", {}, QUESTION)
GREEDY = SamplingParams(n=2, temperature=0.0, max_tokens=64, seed=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Scripted models of one tokenizer: "a" answers ANSWER after the tool, "b" OTHER; "c"
    calls the calculator or an unknown tool, each as likely (groups whose rewards differ)."""
    tok = hermes_tokenizer([OTHER])
    root = tmp_path_factory.mktemp("amt")
    return {
        "a": save_scripted_model(root / "a", tok, CALL),
        "b": save_scripted_model(root / "b", tok, CALL, answer=OTHER),
        "c": save_scripted_model(root / "c", tok, CALL, other_calls=[UNKNOWN]),
    }


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


def drive(
    agents: AgentGroups,
    between_steps: Callable[[], None] = lambda: None,
    replay: list[SampleRecord] | None = None,
    params: SamplingParams = GREEDY,
) -> list[FinishedGroup]:
    """Run ITEM's group (replaying `replay`) to its end as a rollout rank's control loop
    does: yield to the engine's step task, then `between_steps` (where a rank pulls weights
    and reports)."""

    async def loop() -> list[FinishedGroup]:
        agents.start("ticket-0", ITEM, params, replay)
        done: list[FinishedGroup] = []
        while agents.live():
            await asyncio.sleep(0)  # one engine step (if any), the samples' turns go on
            between_steps()
            done += agents.finished()
        agents.close()
        return done

    return asyncio.run(loop())


def test_groups_sample_what_the_sync_schedule_samples(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """The slow twin: the sync schedule's `MultiTurnRollout.generate` on a fresh engine. Same
    seeds, same weights: the same trajectories (ids and masks exactly; logprobs to 1e-5, as
    the batches around a turn may differ with the tools' timing), every token version 0."""
    config = job(write_tool_config(tmp_path / "tools.yaml", CALCULATOR))
    (group,) = drive(AgentGroups(config, engine_of(models["a"])))
    (twin,) = MultiTurnRollout(config, engine_of(models["a"])).generate([ITEM], [GREEDY])
    assert group.output.prompt_token_ids == twin.prompt_token_ids
    assert len(group.output.outputs) == len(twin.outputs) == 2
    for got, want, versions in zip(group.output.outputs, twin.outputs, group.versions, strict=True):
        assert got.token_ids == want.token_ids
        assert got.response_mask == want.response_mask
        assert 0 in got.response_mask and got.response_mask[-1] == 1
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert got.text == want.text and "42" in got.text
        assert versions == [0] * len(got.token_ids)
    assert group.metrics["multi_turn/tool_calls"] == 2.0
    assert group.metrics["multi_turn/tool_tokens/mean"] > 0


def test_a_pull_mid_turn_switches_the_version_at_the_next_model_token(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """Version 1 (the same weights) is loaded once both samples' first turns sampled exactly
    one token: that token is version 0, every later model token version 1, and the tokens
    are those of a run without the pull."""
    config = job(write_tool_config(tmp_path / "tools.yaml", CALCULATOR))
    engine = engine_of(models["a"])
    agents = AgentGroups(config, engine)
    weights = load_file(models["a"] / "model.safetensors")
    seen: list[list[int]] = []

    def pull() -> None:
        seqs = engine.unfinished_seqs()
        if engine.weight_version == 0 and seqs and all(s.output_token_ids for s in seqs):
            seen.append([len(s.output_token_ids) for s in seqs])
            agents.server.note_pull(1)
            engine.load_weights(weights.items(), version=1)

    (group,) = drive(agents, pull)
    (twin,) = drive(AgentGroups(config, engine_of(models["a"])))
    assert seen == [[1, 1]]  # the pull happened where the test says
    for got, want, versions in zip(
        group.output.outputs, twin.output.outputs, group.versions, strict=True
    ):
        assert got.token_ids == want.token_ids and got.response_mask == want.response_mask
        model = [v for v, m in zip(versions, got.response_mask, strict=True) if m]
        assert model == [0] + [1] * (len(model) - 1)


def test_a_sample_awaiting_its_tool_holds_no_decode_slot_and_goes_on_under_new_weights(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """Both samples' calls block in the tool; meanwhile no sequence of theirs is in the
    engine (only their kept turns), and the weights of model "b" are loaded as version 1.
    After the tool answers, the samples go on under "b": they answer OTHER, whose tokens are
    version 1; the call turn's tokens are version 0; the tool's tokens are masked out."""
    HangingTool.gate.clear()
    config = job(write_tool_config(tmp_path / "tools.yaml", HANGING))
    engine = engine_of(models["a"])
    agents = AgentGroups(config, engine)
    weights_b = load_file(models["b"] / "model.safetensors")
    waited: list[tuple[int, int]] = []

    def pull() -> None:
        kept = engine.kept_request_ids()
        if engine.weight_version == 0 and len(kept) == 2 and not engine.has_unfinished():
            waited.append((len(engine.unfinished_seqs()), len(kept)))
            agents.server.note_pull(1)
            engine.load_weights(weights_b.items(), version=1)
            HangingTool.gate.set()

    try:
        (group,) = drive(agents, pull)
    finally:
        HangingTool.gate.set()
    assert waited == [(0, 2)]
    tok = engine.tokenizer
    for traj, versions in zip(group.output.outputs, group.versions, strict=True):
        mask = traj.response_mask
        first_tool = mask.index(0)
        after = first_tool + mask[first_tool:].index(1)  # the first model token after the tool
        assert tok.decode(traj.token_ids[:first_tool]) == f"<tool_call>{CALL}</tool_call>"
        assert "too late" in tok.decode(traj.token_ids[first_tool:after])
        assert tok.decode(traj.token_ids[after:], skip_special_tokens=True) == OTHER
        assert ANSWER not in traj.text
        assert versions[:first_tool] == [0] * first_tool
        assert versions[after:] == [1] * (len(versions) - after)
        assert all(lp == 0.0 for lp, m in zip(traj.logprobs, mask, strict=True) if m == 0)
    assert engine.kept_request_ids() == []  # the finished samples' turns were released


@register("async_test_raising")
class Raising(AgentLoop):
    """Fails in its first turn's result, as a buggy custom loop would."""

    async def run(self, sampling_params: SamplingParams, **kwargs: Any) -> AgentLoopOutput:
        await self.server_manager.generate(
            f"raising-{kwargs['sample_index']}",
            prompt_ids=[5, 6, 7],
            sampling_params=sampling_params,
        )
        raise RuntimeError("the loop is broken")


def test_a_failing_agent_loop_fails_the_rank_not_hangs(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    config = job(write_tool_config(tmp_path / "tools.yaml", CALCULATOR))
    agents = AgentGroups(config, engine_of(models["a"]))
    item = PromptItem(7, [], "What is 6*7?", "42", {"agent_name": "async_test_raising"}, QUESTION)

    async def loop() -> None:
        agents.start("ticket-0", item, GREEDY)
        for _ in range(10_000):
            await asyncio.sleep(0)
            agents.finished()

    with pytest.raises(RuntimeError, match="the loop is broken"):
        asyncio.run(loop())


def test_a_replayed_sample_reuses_its_recorded_turns_and_answers(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """A group's records taken once both samples' tool answered (the call turn ended, the
    answer turn maybe too: the tools' timing decides) replay on a fresh engine: the tool is
    not called again, the recorded turns' model tokens are answered from the record, and the
    trajectories and versions are the first run's. A record whose conversation does not
    match is dropped at its first turn: the sample runs as a fresh one does, calling the
    tool."""
    GatedTool.gate.set()  # every call answers "42" at once; `calls` counts them
    GatedTool.calls = 0
    config = job(write_tool_config(tmp_path / "tools.yaml", "agent_scripted.GatedTool"))
    first = AgentGroups(config, engine_of(models["a"]))
    taken: list[list[SampleRecord]] = []

    def take() -> None:
        if first.live() and not taken:
            records = first.records("ticket-0")
            if all(len(r.outcomes) == 1 for r in records):
                taken.append(records)

    (done,) = drive(first, take)
    assert GatedTool.calls == 2 and len(taken) == 1
    GatedTool.calls = 0
    (replayed,) = drive(AgentGroups(config, engine_of(models["a"])), replay=taken[0])
    assert GatedTool.calls == 0 and replayed.replayed == sum(r.tokens() for r in taken[0]) >= 6
    assert replayed.output == done.output and replayed.versions == done.versions
    wrong = [
        SampleRecord([dataclasses.replace(t, key=t.key + 1) for t in r.turns], r.outcomes)
        for r in taken[0]
    ]
    (diverged,) = drive(AgentGroups(config, engine_of(models["a"])), replay=wrong)
    assert GatedTool.calls == 2 and diverged.replayed == 0
    assert diverged.output == done.output


def _mid_turn_records(
    agents: AgentGroups,
    taken: list[list[SampleRecord]],
    every: list[list[SampleRecord]] | None = None,
) -> Callable[[], None]:
    """A `between_steps` that takes group ticket-0's records, through a flight report's
    bytes (as a peer reads them), whenever a sample's open turn has sampled tokens (and
    into `every` at every step)."""

    def take() -> None:
        if not agents.live():
            return
        records = agents.records("ticket-0")
        if every is not None:
            every.append(records)
        if any(r.open is not None and r.open.tokens() > 0 for r in records):
            report = FlightReport(1, 1, {0: TicketReport([], [], None, records)})
            got = FlightReport.from_bytes(report.to_bytes()).tickets[0].records
            assert got is not None
            taken.append(got)

    return take


@pytest.mark.parametrize(("model", "temperature"), [("a", 0.0), ("c", 1.0)])
def test_a_turn_open_at_the_report_is_continued_from_its_tokens(
    tmp_path: Path, models: dict[str, Path], model: str, temperature: float
) -> None:
    """Records taken at every engine step at which a sample's turn is open mid-generation
    (its snapshot: tokens so far, logprobs, generator state) each replay on a fresh engine
    to exactly the uninterrupted run (ids, masks, texts and versions; logprobs as
    `assert_continued` says): greedily, and sampling at temperature 1 with seeds (the
    generator state carries the draws on). Every recorded and reported model token is
    answered from the record (counted as replayed), and only calls not answered at the
    report are made again. The continued turn keeps its KV for the next turn (no turn is
    submitted whole), and every kept turn is released at the end. A sample's reported
    tokens never shrink from step to step (a turn the engine ended is reported before its
    sample takes it)."""
    GatedTool.gate.set()
    GatedTool.calls = 0
    config = job(write_tool_config(tmp_path / "tools.yaml", "agent_scripted.GatedTool"))
    params = dataclasses.replace(GREEDY, temperature=temperature)
    first = AgentGroups(config, engine_of(models[model]))
    taken: list[list[SampleRecord]] = []
    every: list[list[SampleRecord]] = []
    (done,) = drive(first, _mid_turn_records(first, taken, every), params=params)
    calls = GatedTool.calls
    assert len(taken) >= 3, "the run had too few mid-turn steps to test"
    for k in range(params.n):  # a turn that just ended is reported before its sample runs
        reported = [records[k].tokens() for records in every]
        assert reported == sorted(reported), reported
    kinds = {(bool(r.outcomes), r.open.tokens()) for rs in taken for r in rs if r.open}
    if temperature == 0:  # open call turns of 1 and 2 tokens, an open answer turn after a tool
        assert {(False, 1), (False, 2), (True, 1)} <= kinds, kinds
    for records in taken:
        GatedTool.calls = 0
        agents = AgentGroups(config, engine_of(models[model]))
        (replayed,) = drive(agents, replay=records, params=params)
        assert agents.engine.kept_request_ids() == [] and not agents.engine.has_unfinished()
        if all(r.open is not None for r in records):  # imported, then each turn extends its KV
            assert agents.server.submitted_tokens == 0
        assert replayed.versions == done.versions
        assert_continued(replayed.output, done.output, records)
        assert replayed.replayed == sum(r.tokens() for r in records)
        answered = sum(o.text == "42" for r in records for o in r.outcomes)  # by GatedTool
        assert GatedTool.calls == calls - answered


def assert_continued(
    got: TrajectoryOutput, want: TrajectoryOutput, records: list[SampleRecord]
) -> None:
    """`got` is `want` token for token (ids, masks, texts, finish reasons exactly); the
    logprobs of the tokens `records` hold are the recorded ones bit for bit (copied, not
    sampled again), the others within 1e-5 of `want`'s (their KV recomputed in one prefill,
    not decoded token by token)."""
    assert got.prompt_token_ids == want.prompt_token_ids
    for g, w, r in zip(got.outputs, want.outputs, records, strict=True):
        assert (g.token_ids, g.response_mask, g.text) == (w.token_ids, w.response_mask, w.text)
        assert g.finish_reason == w.finish_reason
        recorded = [lp for t in r.turns for lp in t.output.log_probs]
        if r.open is not None:
            recorded += r.open.state.output_logprobs
        model_lps = [lp for lp, m in zip(g.logprobs, g.response_mask, strict=True) if m]
        assert model_lps[: len(recorded)] == recorded
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)


def test_a_group_started_from_records_reports_them_before_its_samples_run(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """A peer reports an adopted ticket at once, before its samples' tasks first run: the
    report holds the lost rank's records (finished turns, answers, open turns) as given,
    so a second loss loses none of them."""
    GatedTool.gate.set()
    config = job(write_tool_config(tmp_path / "tools.yaml", "agent_scripted.GatedTool"))
    first = AgentGroups(config, engine_of(models["a"]))
    taken: list[list[SampleRecord]] = []
    drive(first, _mid_turn_records(first, taken))
    records = next(rs for rs in taken if any(r.turns for r in rs))
    agents = AgentGroups(config, engine_of(models["a"]))

    async def start_and_report() -> list[SampleRecord]:
        agents.start("ticket-0", ITEM, GREEDY, records)
        reported = agents.records("ticket-0")
        agents.close()
        return reported

    assert asyncio.run(start_and_report()) == records


def test_a_continued_turn_keeps_its_reported_tokens_under_newer_weights(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """Model "a" answers ANSWER after the tool, model "b" OTHER. Records taken once a
    sample's answer turn has sampled ANSWER under "a" (version 0) replay on an engine that
    holds "b" as version 1: that sample's reported tokens stay exactly as reported (ids,
    logprobs, version 0; the turn is not sampled again, which would write OTHER), and the
    rest of the turn is "b"'s continuation of the conversation and those tokens (version
    1), equal to a slow twin that prefills them all as a prompt on "b"."""
    GatedTool.gate.set()
    config = job(write_tool_config(tmp_path / "tools.yaml", "agent_scripted.GatedTool"))
    first = AgentGroups(config, engine_of(models["a"]))
    taken: list[list[SampleRecord]] = []
    take = _mid_turn_records(first, taken)

    def take_after_the_tool() -> None:
        if not taken:
            take()
            if taken and not any(r.open is not None and r.outcomes for r in taken[0]):
                taken.clear()

    drive(first, take_after_the_tool)
    assert taken, "no step had an answer turn open"
    engine = engine_of(models["a"])
    engine.load_weights(load_file(models["b"] / "model.safetensors").items(), version=1)
    (group,) = drive(AgentGroups(config, engine), replay=taken[0])
    tok = engine.tokenizer
    answer = tok.convert_tokens_to_ids(ANSWER)
    continued = 0
    for record, traj, versions in zip(taken[0], group.output.outputs, group.versions, strict=True):
        model_ids = [t for t, m in zip(traj.token_ids, traj.response_mask, strict=True) if m]
        model_lps = [lp for lp, m in zip(traj.logprobs, traj.response_mask, strict=True) if m]
        model_versions = [v for v, m in zip(versions, traj.response_mask, strict=True) if m]
        reported = [t.output for t in record.turns]
        ids = [i for o in reported for i in o.token_ids]
        lps = [lp for o in reported for lp in o.log_probs]
        if record.open is not None:
            ids += record.open.state.output_token_ids
            lps += record.open.state.output_logprobs
        n = len(ids)
        assert model_ids[:n] == ids and model_lps[:n] == lps  # bit-equal: copied, not resampled
        assert model_versions == [0] * n + [1] * (len(model_ids) - n)
        if record.open is None or not record.outcomes:
            continue
        continued += 1
        state = record.open.state
        assert state.output_token_ids[0] == answer
        left = state.params.max_tokens - len(state.output_token_ids)
        twin_params = dataclasses.replace(state.params, max_tokens=left)
        (twin,) = engine_of(models["b"]).generate(
            [state.prompt_token_ids + state.output_token_ids], twin_params
        )
        rest = twin.outputs[0]  # then "b" may call the tool again: later turns follow
        assert rest.token_ids and model_ids[n : n + len(rest.token_ids)] == rest.token_ids
        assert model_lps[n : n + len(rest.token_ids)] == pytest.approx(rest.logprobs, abs=1e-5)
    assert continued >= 1


def test_a_dropped_group_runs_out_and_is_discarded(tmp_path: Path, models: dict[str, Path]) -> None:
    """A stalled rank that wakes to find a ticket claimed drops it: its samples run to their
    end (their turns could not be taken from them), nothing is handed back, and the engine
    is left with no request and no kept turn."""
    config = job(write_tool_config(tmp_path / "tools.yaml", CALCULATOR))
    engine = engine_of(models["a"])
    agents = AgentGroups(config, engine)
    dropped: list[bool] = []

    def drop_once_generating() -> None:
        if not dropped and engine.has_unfinished():
            agents.drop("ticket-0")
            dropped.append(True)

    assert drive(agents, drop_once_generating) == []
    assert dropped and not engine.has_unfinished() and engine.kept_request_ids() == []


def test_response_versions_lay_model_versions_on_the_mask() -> None:
    assert response_versions([1, 1, 0, 0, 1], [3, 4, 5]) == [3, 4, 4, 4, 5]
    assert response_versions([], []) == []
    with pytest.raises(ValueError, match="response_mask has 2 model tokens"):
        response_versions([1, 0, 1], [3])


def test_async_multi_turn_is_no_longer_refused(tmp_path: Path) -> None:
    tools = write_tool_config(tmp_path / "tools.yaml", CALCULATOR)
    assert unsupported(job(tools, "trainer.mode=async"), 2) == []
    no_tools = load_config(
        None,
        [
            "data.train_files=/d.jsonl",
            "rollout.adaptive_tp.enable=false",
            "rollout.multi_turn.enable=true",
            "trainer.mode=async",
        ],
    )
    (problem,) = multi_turn_refusals(no_tools)  # the others stay
    assert "rollout.multi_turn.tool_config_path is unset" in problem


# ---------------------------------------------------------------------- end to end


def _overrides(model: Path, root: Path, mode: str) -> list[str]:
    data = root / "train.jsonl"
    overrides: dict[str, Any] = {
        "model.path": model,
        "data.train_files": data,
        "data.val_files": data,
        "data.train_batch_size": 2,
        "data.max_prompt_length": 512,  # the tools' schemas are in the rendered prompt
        "data.max_response_length": 48,
        "actor.ppo_mini_batch_size": 2,
        "rollout.n": 2,
        "rollout.temperature": 0.5,  # the scripted tokens; either call, each as likely
        "rollout.block_size": 4,
        "rollout.num_kv_blocks": 512,
        "rollout.adaptive_tp.enable": "false",
        "rollout.multi_turn.enable": "true",
        "rollout.multi_turn.tool_config_path": root / "tools.yaml",
        "rollout.multi_turn.max_assistant_turns": 3,
        "reward.functions": f'[{{name: "{DIGITS}"}}]',
        "reward.num_workers": 0,
        "trainer.mode": mode,
        "async_rl.rollout_ranks": 1,
        "async_rl.max_staleness": 0,
        "trainer.total_training_steps": 2,
        "trainer.save_freq": 0,
        "trainer.test_freq": 2,
        "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.default_local_dir": root / mode,
    }
    return [f"{k}={v}" for k, v in overrides.items()]


def _run(rank: int, world_size: int, model: Path, root: Path, mode: str) -> dict[str, Any]:
    config = load_config(None, _overrides(model, root, mode))
    world = World(rank, world_size, rank, torch.device("cpu"))
    files = (config.data.train_files, config.data.val_files)
    if mode == "sync":
        return {"history": SyncGRPO(config, world, str(model), *files).run().history}
    loop = AsyncGRPO(config, world, str(model), *files, peer_timeout_s=120)
    result = loop.run()
    if not isinstance(loop.role, TrainerWorker):
        return {"role": "rollout"}
    return {"role": "trainer", "history": result.history}


SAME = (  # what the samples decide: equal when both schedules sample the same trajectories
    "critic/score/mean",
    "critic/advantages/max",
    "response_length/mean",
    "response_length/model_tokens/mean",
    "prompt_length/mean",
    "multi_turn/tool_calls",
    "multi_turn/num_turns/mean",
    "multi_turn/tool_tokens/mean",
)


@pytest.mark.e2e
@pytest.mark.multirank
def test_async_multi_turn_at_staleness_zero_trains_as_the_sync_schedule(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """1 rollout + 1 trainer rank at max_staleness=0 against the sync schedule on one rank,
    2 steps, same seeds: the same tool-calling trajectories (the samples' metrics and the
    multi_turn/* counters equal), trained with the tool tokens out of the loss mask as the
    sync schedule trains them (the actor's metrics equal up to decoupled PPO's behaviour
    weight, 1 within the engine/trainer logprob mismatch: rtol 1e-4), validated alike."""
    rows = [{"prompt": f"What is {a}*7?", "answer": str(7 * a)} for a in range(2, 6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_tool_config(tmp_path / "tools.yaml", CALCULATOR)
    model = models["c"]
    results = run_ranks(_run, world_size=2, args=(model, tmp_path, "async"), timeout_s=300)
    assert [r["role"] for r in results] == ["rollout", "trainer"]
    (sync,) = run_ranks(_run, world_size=1, args=(model, tmp_path, "sync"), timeout_s=300)

    def steps(history: list[dict[str, float]]) -> list[dict[str, float]]:
        return [h for h in history if "actor/pg_loss" in h]

    async_steps, sync_steps = steps(results[1]["history"]), steps(sync["history"])
    assert len(async_steps) == len(sync_steps) == 2
    for a, s in zip(async_steps, sync_steps, strict=True):
        assert a["multi_turn/tool_calls"] > 0 and a["multi_turn/tool_tokens/mean"] > 0
        assert a["response_length/model_tokens/mean"] < a["response_length/mean"]
        for key in SAME:
            assert a[key] == pytest.approx(s[key], rel=1e-6, abs=1e-9), key
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert a[key] == pytest.approx(s[key], rel=1e-4, abs=1e-6), key
        assert a["async/staleness_max"] == 0.0
    assert any(s["critic/advantages/max"] > 0 for s in sync_steps)  # a real update

    def validation(history: list[dict[str, float]]) -> list[tuple[float, float]]:
        return [
            (h["step"], h["val-core/acc/mean@1"]) for h in history if "val-core/acc/mean@1" in h
        ]

    assert validation(results[1]["history"]) == validation(sync["history"])
    assert [step for step, _ in validation(sync["history"])] == [2.0]


# ----------------------------------------------------------------- migration


def _rollout_worker(rank: int, config: JobConfig, model: Path, store: Any) -> RolloutWorker:
    """Rollout rank `rank` of a job whose ranks share `store` (in this process)."""
    world = World(rank, 3, rank, torch.device("cpu"))
    data = load_data(config, str(model), config.data.train_files, None)
    control = ControlPlane(store, rank, timeout_s=120)
    job = AsyncJob(
        data.config,
        world,
        str(model),
        config.run_dir,
        data.loader,
        None,
        control,
        WeightStore(config.run_dir / "weights"),
    )
    return RolloutWorker(job)


def _wait(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    until = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > until:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_a_lost_ranks_multi_turn_tickets_replay_on_a_peer(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """Rollout rank 1 takes both tickets of the step; its samples' calls block in the tool
    when it is preempted, their call turns reported as their loops' records. Rank 0 claims
    the tickets and replays them: each group is handed over complete, migrated from rank 1
    with the reported call turns kept (3 model tokens per sample), the unanswered calls made
    again, and equal, token for token, to a fresh run of the ticket (same seeds and
    weights)."""
    HangingTool.gate.clear()
    rows = [{"prompt": f"What is {a}*7?", "answer": str(7 * a)} for a in (6, 3)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = job(
        write_tool_config(tmp_path / "tools.yaml", HANGING),
        f"data.train_files={data}",
        "data.train_batch_size=2",
        "data.max_prompt_length=512",
        "rollout.temperature=0.05",  # seeded: a rerun samples the same tokens
        "rollout.block_size=4",
        "rollout.num_kv_blocks=512",
        "trainer.mode=async",
        "async_rl.rollout_ranks=2",
        "async_rl.max_staleness=0",
        "trainer.total_training_steps=1",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    )
    store = dist.HashStore()
    first = _rollout_worker(0, config, models["a"], store)
    lost = _rollout_worker(1, config, models["a"], store)
    control = ControlPlane(store, 2, timeout_s=120)  # the trainer's side of the store
    loader = load_data(config, str(models["a"]), config.data.train_files, None).loader
    control.put("start", pickle.dumps({"step": 0, "loader": loader.state_dict()}))
    threads = [threading.Thread(target=w.run, daemon=True) for w in (lost, first)]
    try:
        threads[0].start()
        # both tickets' samples wait in the tool, their call turns (3 tokens each) reported
        _wait(lambda: lost.last_report.tokens() == 12, "rank 1 to report both call turns")
        reported = lost.last_report
        control.preempt(1, 600)  # away until the run ends
        _wait(lambda: bool(lost.preempted), "rank 1 to drop its work")
        HangingTool.gate.set()
        threads[1].start()
        _wait(lambda: control.has([sample_key(0), sample_key(1)]), "both groups handed over")
    finally:
        HangingTool.gate.set()
        control.finish()
        for t in threads:
            t.join(60)
    for r in reported.tickets.values():
        assert not r.states and not r.switches and r.records is not None
        assert [(len(x.turns), len(x.outcomes)) for x in r.records] == [(1, 0), (1, 0)]
    assert lost.preempted[0]["tickets"] == [0, 1] and lost.preempted[0]["reported_tokens"] == 12
    for ticket in (0, 1):
        record: GroupRecord = pickle.loads(control.get(sample_key(ticket)))
        assert (record.rank, record.migrated_from, record.migrated_tokens) == (0, 1, 6)
        item = loader_item(config, models["a"], ticket)
        twin_agents = AgentGroups(config, engine_of(models["a"]))
        twin = drive_one(twin_agents, item, ticket_params(config, ticket, item))
        assert len(record.samples) == 2
        for s, want in zip(record.samples, twin.output.outputs, strict=True):
            assert s.token_ids == want.token_ids and s.response_mask == want.response_mask
            assert s.prompt_token_ids == twin.output.prompt_token_ids
            assert "too late" in engine_tokenizer(models["a"]).decode(s.token_ids)
        assert record.versions == twin.versions


def loader_item(config: JobConfig, model: Path, ticket: int) -> PromptItem:
    batch = load_data(config, str(model), config.data.train_files, None).loader.next_batch()
    return batch[ticket % config.data.train_batch_size]


def drive_one(agents: AgentGroups, item: PromptItem, params: SamplingParams) -> FinishedGroup:
    async def loop() -> FinishedGroup:
        agents.start("twin", item, params)
        done: list[FinishedGroup] = []
        while agents.live():
            await asyncio.sleep(0)
            done += agents.finished()
        agents.close()
        (group,) = done
        return group

    return asyncio.run(loop())


def engine_tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model, local_files_only=True)


def test_a_rank_lost_mid_turn_has_its_open_turns_continued_by_a_peer(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    """Rollout rank 1 takes both tickets of the step (sampled at the default temperature,
    seeded) and is preempted (from inside its own engine step, so that the step's report is
    its last) once a sample's answer turn, after the tool, has sampled its first token. Its
    last report holds every sample's open turn (tokens so far, generator state, switch
    points). Rank 0 claims the tickets and continues them: each group is handed over
    complete, migrated from rank 1 with every reported model token kept (`migrated_tokens`
    counts the open turns' too, which only a continuation adds), and equal, token for
    token, to a fresh run of the ticket (same seeds and weights: the carried generator
    states draw on as the lost rank would have)."""
    GatedTool.gate.set()
    rows = [{"prompt": f"What is {a}*7?", "answer": str(7 * a)} for a in (6, 3)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = job(
        write_tool_config(tmp_path / "tools.yaml", "agent_scripted.GatedTool"),
        f"data.train_files={data}",
        "data.train_batch_size=2",
        "data.max_prompt_length=512",
        "rollout.block_size=4",
        "rollout.num_kv_blocks=512",
        "trainer.mode=async",
        "async_rl.rollout_ranks=2",
        "async_rl.max_staleness=0",
        "async_rl.report_every=1",
        "trainer.total_training_steps=1",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    )
    store = dist.HashStore()
    first = _rollout_worker(0, config, models["a"], store)
    lost = _rollout_worker(1, config, models["a"], store)
    control = ControlPlane(store, 2, timeout_s=120)  # the trainer's side of the store
    loader = load_data(config, str(models["a"]), config.data.train_files, None).loader
    control.put("start", pickle.dumps({"step": 0, "loader": loader.state_dict()}))
    answer = engine_tokenizer(models["a"]).convert_tokens_to_ids(ANSWER)
    engine, step = lost.engine, lost.engine.step

    def step_then_preempt() -> list[Any]:
        out = step()
        if any(s.output_token_ids == [answer] for s in engine.unfinished_seqs()):
            control.preempt(1, 600)  # away until the run ends
        return out

    engine.step = step_then_preempt  # type: ignore[method-assign]
    threads = [threading.Thread(target=w.run, daemon=True) for w in (lost, first)]
    try:
        threads[0].start()
        _wait(lambda: bool(lost.preempted), "rank 1 to be preempted mid-turn")
        threads[1].start()
        _wait(lambda: control.has([sample_key(0), sample_key(1)]), "both groups handed over")
    finally:
        control.finish()
        for t in threads:
            t.join(60)
    reported = lost.last_report
    opened = [
        r.open
        for ticket in reported.tickets.values()
        for r in ticket.records or []
        if r.open is not None and r.outcomes
    ]
    assert any(o.state.output_token_ids == [answer] for o in opened)
    assert lost.preempted[0]["reported_tokens"] == reported.tokens()
    for ticket in (0, 1):
        record: GroupRecord = pickle.loads(control.get(sample_key(ticket)))
        assert (record.rank, record.migrated_from) == (0, 1)
        assert record.migrated_tokens == reported.tickets[ticket].tokens()
        item = loader_item(config, models["a"], ticket)
        twin = drive_one(
            AgentGroups(config, engine_of(models["a"])), item, ticket_params(config, ticket, item)
        )
        for s, want in zip(record.samples, twin.output.outputs, strict=True):
            assert s.token_ids == want.token_ids and s.response_mask == want.response_mask
            assert s.prompt_token_ids == twin.output.prompt_token_ids
        assert record.versions == twin.versions
