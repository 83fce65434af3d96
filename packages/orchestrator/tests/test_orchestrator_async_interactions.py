"""verl's interactions under the async schedule (`trainer.mode=async`, async_rl/agent_tickets.py):
a rollout rank's samples record each interaction answer beside the tools' answers, and a peer
replaying a lost rank's record answers the interaction's calls from it (the interaction is not
called again) and ends with the uninterrupted run's tokens; and interactions that fail on every
call stop the run (`tool_guard.ToolFailureGuard`) in both schedules.

The model is agent_scripted's retry model (test_orchestrator_agent_interactions): greedy, its
first answer is WRONG, its answer after the user's "incorrect" RIGHT; the interaction is the
GSM8K port, counting its generate_response calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from agent_scripted import save_scripted_model
from test_orchestrator_agent_interactions import (
    GSM8K_INTERACTION_CONFIG,
    KWARGS,
    PORT,
    QUESTION,
    RIGHT,
    WRONG,
    CountingGsm8k,
    engine,
    tokenizer,
)

from patrl.orchestrator.agent.gsm8k_interaction import Gsm8kInteraction
from patrl.orchestrator.agent.multi_turn import MultiTurnRollout
from patrl.orchestrator.agent.tool_guard import InteractionsFailed, ToolFailureGuard
from patrl.orchestrator.async_rl.agent_tickets import (
    AgentGroups,
    FinishedGroup,
    InteractionAnswer,
    SampleRecord,
    picklable_answer,
)
from patrl.orchestrator.async_rl.flight_reports import FlightReport, TicketReport
from patrl.orchestrator.config import JobConfig, load_config
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.support import unsupported
from patrl.rollout import SamplingParams

ITEM = PromptItem(
    5, [], "What is 6*7?", "42", {"extra_info": {"interaction_kwargs": dict(KWARGS)}}, QUESTION
)
GREEDY = SamplingParams(n=2, temperature=0.0, max_tokens=64, seed=3)
COUNTING = f"{CountingGsm8k.__module__}.CountingGsm8k"


@pytest.fixture(scope="module")
def retry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The retry model: WRONG first, RIGHT after the user's "incorrect"."""
    root = tmp_path_factory.mktemp("async_interactions")
    return save_scripted_model(root / "retry", tokenizer(), None, RIGHT, first_answer=WRONG)


def job(config: Path, *overrides: str) -> JobConfig:
    return load_config(
        None,
        [
            "data.train_files=/d.jsonl",
            "data.max_response_length=256",
            "rollout.n=2",
            "rollout.adaptive_tp.enable=false",
            "rollout.multi_turn.enable=true",
            f"rollout.multi_turn.interaction_config_path={config}",
            "rollout.multi_turn.max_user_turns=2",
            "actor.ppo_mini_batch_size=1",
            "data.train_batch_size=1",
            *overrides,
        ],
    )


def counting_config(tmp_path: Path) -> Path:
    path = tmp_path / "interaction.yaml"
    path.write_text(GSM8K_INTERACTION_CONFIG.replace(PORT, COUNTING))
    return path


def drive(agents: AgentGroups, take: Any = None, replay: Any = None) -> FinishedGroup:
    """ITEM's group (replaying `replay`) to its end as a rollout rank's control loop runs
    it; `take()` between engine steps (where a rank reports)."""

    async def loop() -> FinishedGroup:
        agents.start("ticket-0", ITEM, GREEDY, replay)
        done: list[FinishedGroup] = []
        while agents.live():
            await asyncio.sleep(0)
            if take is not None:
                take()
            done += agents.finished()
        agents.close()
        (group,) = done
        return group

    return asyncio.run(loop())


def through_bytes(records: list[SampleRecord]) -> list[SampleRecord]:
    """`records` as a peer reads them: through a flight report's bytes."""
    report = FlightReport(1, 1, {0: TicketReport([], [], None, records)})
    got = FlightReport.from_bytes(report.to_bytes()).tickets[0].records
    assert got is not None
    return got


def test_async_interactions_are_no_longer_refused(tmp_path: Path) -> None:
    config = job(counting_config(tmp_path), "trainer.mode=async")
    assert unsupported(config, 2) == []


def test_async_groups_with_an_interaction_sample_what_the_sync_schedule_samples(
    tmp_path: Path, retry: Path
) -> None:
    """The slow twin: `MultiTurnRollout` (sync) on a fresh engine; same seeds and weights:
    the same tokens, masks and turn scores (logprobs to 1e-5: the batches around a turn may
    differ), every token version 0, the interaction counters alike."""
    config = job(counting_config(tmp_path))
    group = drive(AgentGroups(config, engine(retry)))
    twin_rollout = MultiTurnRollout(config, engine(retry))
    (twin,) = twin_rollout.generate([ITEM], [GREEDY])
    for got, want, versions in zip(group.output.outputs, twin.outputs, group.versions, strict=True):
        assert got.token_ids == want.token_ids and got.response_mask == want.response_mask
        assert got.turn_scores == want.turn_scores == [0.0, 1.0]
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert versions == [0] * len(got.token_ids)
    assert group.metrics == pytest.approx(twin_rollout.metrics)
    assert group.metrics["multi_turn/interaction/gsm8k/calls"] == 4.0
    assert group.metrics["multi_turn/interaction/gsm8k/failures"] == 0.0


def test_a_lost_ranks_interaction_answers_replay_on_a_peer_without_calling_it_again(
    tmp_path: Path, retry: Path
) -> None:
    """Records taken at every engine step (through a flight report's bytes) each replay on a
    fresh engine to exactly the uninterrupted run (tokens, masks, turn scores, versions):
    recorded answers are answered from the record, so the interaction is called once per
    answer over both runs together. Among them: a record holding an answer with the turn
    after it open mid-generation (continued from its snapshot), and one whose samples had
    all their answers. A record whose turns do not match drops its answers too: the
    interaction is called for each."""
    config = job(counting_config(tmp_path))
    first = AgentGroups(config, engine(retry))
    every: list[list[SampleRecord]] = []
    CountingGsm8k.responses = 0
    done = drive(first, lambda: every.append(first.records("ticket-0")) if first.live() else None)
    assert CountingGsm8k.responses == 4  # 2 samples x (WRONG, RIGHT)
    assert [o.turn_scores for o in done.output.outputs] == [[0.0, 1.0], [0.0, 1.0]]

    def answers(records: list[SampleRecord]) -> int:
        return sum(len(r.answers) for r in records)

    mid = [
        rs
        for rs in every
        if any(r.answers and r.open is not None and r.open.tokens() > 0 for r in rs)
    ]
    full = [rs for rs in every if answers(rs) == 4]
    assert mid and full, "no record with an answer and an open turn after it"
    picks = [mid[0], full[0]]
    assert all(isinstance(a, InteractionAnswer) for rs in picks for r in rs for a in r.answers)
    for records in picks:
        got = through_bytes(records)
        CountingGsm8k.responses = 0
        replayed = drive(AgentGroups(config, engine(retry)), replay=got)
        assert CountingGsm8k.responses == 4 - answers(records)
        assert replayed.output == done.output
        assert replayed.versions == done.versions
        assert replayed.replayed == sum(r.tokens() for r in records) > 0
    wrong = [
        dataclasses.replace(r, turns=[dataclasses.replace(t, key=t.key + 1) for t in r.turns])
        for r in through_bytes(full[0])
    ]
    CountingGsm8k.responses = 0
    diverged = drive(AgentGroups(config, engine(retry)), replay=wrong)
    assert CountingGsm8k.responses == 4 and diverged.replayed == 0
    assert diverged.output == done.output


def test_a_recorded_failure_replays_as_the_failure(tmp_path: Path) -> None:
    """A failed call's record raises the failure again (the loop counts it as it did), and
    an answer that does not pickle keeps what the loop reads."""
    from patrl.orchestrator.agent.interaction import InteractionFailed

    with pytest.raises(InteractionFailed, match="timed out") as e:
        InteractionAnswer(failure="timeout", message="generate_response timed out").replayed()
    assert e.value.kind == "timeout"
    assert InteractionAnswer((True, "ok", 1.0, {})).replayed() == (True, "ok", 1.0, {})
    lock = __import__("threading").Lock()
    assert picklable_answer((1, "right", 1, {"lock": lock})) == (True, "right", 1.0, {})
    assert picklable_answer(lock) is None


# ---------------------------------------------------------------- failures stop the run


def faulty_config(tmp_path: Path, how: str = "raise", where: str = "respond") -> Path:
    path = tmp_path / "faulty.yaml"
    path.write_text(
        "interaction:\n"
        "  - name: gsm8k\n"
        f"    class_name: {CountingGsm8k.__module__}.Faulty\n"
        f"    config: {{where: {where}, how: {how}}}\n"
    )
    return path


@pytest.mark.parametrize("where", ["respond", "start"])
def test_an_interaction_failing_every_call_stops_the_run_in_both_schedules(
    tmp_path: Path, retry: Path, where: str
) -> None:
    """A raising interaction's step counters (sync: `MultiTurnRollout`; async: a finished
    group's) make the guard report the first failed step and stop the run at the
    reward.max_failed_steps-th, naming the interaction and the count; a step where one
    answer came resets the streak."""
    config = job(faulty_config(tmp_path, where=where))
    (sync_out,) = (rollout := MultiTurnRollout(config, engine(retry))).generate([ITEM], [GREEDY])
    group = drive(AgentGroups(config, engine(retry)))
    assert all(o.response_mask == [1] * len(o.token_ids) for o in sync_out.outputs)
    for metrics in (rollout.metrics, group.metrics):
        assert metrics["multi_turn/interaction/gsm8k/calls"] == 2.0  # one ask per sample
        assert metrics["multi_turn/interaction/gsm8k/failures"] == 2.0
        guard = ToolFailureGuard(max_failed_steps=2)
        line = guard.observe(1, metrics)
        assert line is not None and "interaction 'gsm8k'" in line and "1 of" in line
        with pytest.raises(InteractionsFailed, match=r"'gsm8k'.*2 steps in a row"):
            guard.observe(2, metrics)
        guard = ToolFailureGuard(max_failed_steps=2)
        guard.observe(1, metrics)
        ok = {**metrics, "multi_turn/interaction/gsm8k/failures": 1.0}
        assert guard.observe(2, ok) is None and guard.observe(3, metrics) is not None
        with pytest.raises(InteractionsFailed, match="every step of this run"):
            ToolFailureGuard(max_failed_steps=5).observe(1, metrics, last=True)


def test_a_working_interaction_never_trips_the_guard(tmp_path: Path, retry: Path) -> None:
    config = job(counting_config(tmp_path))
    rollout = MultiTurnRollout(config, engine(retry))
    rollout.generate([ITEM], [GREEDY])
    guard = ToolFailureGuard(max_failed_steps=1)
    assert guard.observe(1, rollout.metrics, last=True) is None


# ---------------------------------------------------------------------- end to end


def _overrides(model: Path, root: Path, mode: str) -> list[str]:
    overrides: dict[str, Any] = {
        "model.path": model,
        "data.train_files": root / "train.jsonl",
        "data.train_batch_size": 2,
        "data.max_response_length": 256,
        "actor.ppo_mini_batch_size": 2,
        "rollout.n": 2,
        "rollout.temperature": 0.05,
        "rollout.block_size": 4,
        "rollout.num_kv_blocks": 512,
        "rollout.adaptive_tp.enable": "false",
        "rollout.multi_turn.enable": "true",
        "rollout.multi_turn.interaction_config_path": root / "interaction.yaml",
        "rollout.multi_turn.max_user_turns": 2,
        "reward.functions": (f'[{{name: "{CountingGsm8k.__module__}:last_turn_score_or_zero"}}]'),
        "reward.num_workers": 0,
        "trainer.mode": mode,
        "async_rl.rollout_ranks": 1,
        "async_rl.max_staleness": 0,
        "trainer.total_training_steps": 2,
        "trainer.save_freq": 0,
        "trainer.test_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.default_local_dir": root / mode,
    }
    return [f"{k}={v}" for k, v in overrides.items()]


def _run(
    rank: int, world_size: int, model: Path, root: Path, mode: str, more: tuple[str, ...] = ()
) -> dict[str, Any]:
    import torch

    from patrl.orchestrator.async_loop import AsyncGRPO
    from patrl.orchestrator.async_rl.trainer_worker import TrainerWorker
    from patrl.orchestrator.distributed import World
    from patrl.orchestrator.sync_loop import SyncGRPO

    config = load_config(None, [*_overrides(model, root, mode), *more])
    world = World(rank, world_size, rank, torch.device("cpu"))
    if mode == "sync":
        return {
            "history": SyncGRPO(config, world, str(model), config.data.train_files, None)
            .run()
            .history
        }
    loop = AsyncGRPO(config, world, str(model), config.data.train_files, None, peer_timeout_s=120)
    result = loop.run()
    if not isinstance(loop.role, TrainerWorker):
        return {"role": "rollout"}
    return {"role": "trainer", "history": result.history}


@pytest.mark.e2e
@pytest.mark.multirank
def test_an_async_job_with_an_interaction_trains_as_the_sync_schedule(
    tmp_path: Path, retry: Path
) -> None:
    """1 rollout + 1 trainer rank at max_staleness=0 against the sync schedule on one rank,
    2 steps, same seeds: the same interaction trajectories (user turns, turn scores, the
    reward read from them, lengths) in both schedules."""

    from patrl_testkit.multirank import run_ranks

    counting_config(tmp_path)
    rows = [
        {
            "prompt": QUESTION,
            "reward_model": {"ground_truth": "42"},
            "extra_info": {"index": i, "interaction_kwargs": KWARGS},
        }
        for i in range(2)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = run_ranks(_run, world_size=2, args=(retry, tmp_path, "async"), timeout_s=300)
    assert [r["role"] for r in results] == ["rollout", "trainer"]
    (sync,) = run_ranks(_run, world_size=1, args=(retry, tmp_path, "sync"), timeout_s=300)

    def steps(history: list[dict[str, float]]) -> list[dict[str, float]]:
        return [h for h in history if "actor/pg_loss" in h]

    async_steps, sync_steps = steps(results[1]["history"]), steps(sync["history"])
    assert len(async_steps) == len(sync_steps) == 2
    same = (
        "critic/score/mean",
        "response_length/mean",
        "response_length/model_tokens/mean",
        "multi_turn/interaction_turns",
        "multi_turn/interaction_turn_score/mean",
        "multi_turn/interaction/gsm8k/calls",
        "multi_turn/interaction/gsm8k/failures",
    )
    for a, s in zip(async_steps, sync_steps, strict=True):
        assert a["multi_turn/interaction_turns"] > 0
        assert a["response_length/model_tokens/mean"] < a["response_length/mean"]
        for key in same:
            assert a[key] == pytest.approx(s[key], rel=1e-6, abs=1e-9), key


@pytest.mark.e2e
@pytest.mark.multirank
def test_a_job_whose_interaction_always_raises_stops_naming_it_in_both_schedules(
    tmp_path: Path, retry: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An interaction whose generate_response always raises: the sync job (main, one rank)
    exits 1 after reward.max_failed_steps=2 all-failed steps, saying so at each; the async
    job (1 rollout + 1 trainer rank) fails its trainer rank with the same message, and its
    rollout rank ends (no hang)."""

    from patrl.orchestrator.main import main
    from patrl_testkit.multirank import RankFailed, run_ranks

    faulty_config(tmp_path)
    (tmp_path / "interaction.yaml").write_text((tmp_path / "faulty.yaml").read_text())
    rows = [
        {
            "prompt": QUESTION,
            "reward_model": {"ground_truth": "42"},
            "extra_info": {"index": i, "interaction_kwargs": KWARGS},
        }
        for i in range(2)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stop = ["reward.max_failed_steps=2", "trainer.total_training_steps=5"]
    assert main([*_overrides(retry, tmp_path, "sync"), *stop]) == 1
    err = capsys.readouterr().err
    assert "patrl: error: step 1: every one of the 4 answers asked of interaction 'gsm8k'" in err
    assert "That is 2 steps in a row (reward.max_failed_steps=2): the run stops." in err
    with pytest.raises(RankFailed, match=r"InteractionsFailed.*'gsm8k'.*2 steps in a row"):
        run_ranks(_run, world_size=2, args=(retry, tmp_path, "async", tuple(stop)), timeout_s=240)


# ----------------------------------------------------------------- a lost rank


class InstanceCounting(Gsm8kInteraction):
    """The GSM8K port, counting its generate_response calls per instance (each rank's
    AgentGroups loads its own); an answer to the RIGHT turn waits for `gate` first."""

    gate = threading.Event()

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.responses = 0

    async def generate_response(self, instance_id: str, messages: Any, **kwargs: Any) -> Any:
        self.responses += 1
        if messages and messages[-1].get("content") == RIGHT:
            InstanceCounting.gate.wait(60)  # in the call's own thread: the engine goes on
        return await super().generate_response(instance_id, messages, **kwargs)


def rollout_worker(rank: int, config: JobConfig, model: Path, store: Any) -> Any:
    """Rollout rank `rank` of a 3-rank job whose ranks share `store` (in this process)."""
    import torch

    from patrl.orchestrator.async_rl.job import AsyncJob
    from patrl.orchestrator.async_rl.rollout_worker import RolloutWorker
    from patrl.orchestrator.build import load_data
    from patrl.orchestrator.control import ControlPlane
    from patrl.orchestrator.distributed import World
    from patrl.orchestrator.weight_store import WeightStore

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


def wait_for(condition: Any, what: str, timeout_s: float = 120.0) -> None:
    until = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > until:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_a_rank_lost_after_an_answer_has_its_tickets_continued_by_a_peer(
    tmp_path: Path, retry: Path
) -> None:
    """Rollout rank 1 takes both tickets of the step; its samples' second answers wait (a
    gate), and it is preempted once a report of it holds an interaction answer. Rank 0
    claims the tickets and continues them: each group is handed over complete, migrated from
    rank 1, equal token for token to a fresh run of the ticket; the peer asks the
    interaction only the answers the lost rank's last report did not hold (the fresh runs'
    count less the reported ones: the waiting answers are asked again)."""
    import pickle

    import torch.distributed as dist
    from test_orchestrator_async_multi_turn import drive_one, loader_item

    from patrl.orchestrator.async_rl.tickets import GroupRecord, sample_key, ticket_params
    from patrl.orchestrator.build import load_data
    from patrl.orchestrator.control import ControlPlane

    config_path = tmp_path / "interaction.yaml"
    config_path.write_text(GSM8K_INTERACTION_CONFIG.replace(PORT, f"{__name__}.InstanceCounting"))
    rows = [
        {
            "prompt": QUESTION,
            "reward_model": {"ground_truth": "42"},
            "extra_info": {"index": i, "interaction_kwargs": KWARGS},
        }
        for i in range(2)
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = job(
        config_path,
        f"data.train_files={data}",
        "data.train_batch_size=2",
        "data.max_prompt_length=512",
        "rollout.block_size=4",
        "rollout.num_kv_blocks=512",
        "rollout.temperature=0.05",  # sampled (seeded), the scripted answers nearly surely
        f'reward.functions=[{{name: "{CountingGsm8k.__module__}:last_turn_score_or_zero"}}]',
        "reward.num_workers=0",
        "trainer.mode=async",
        "async_rl.rollout_ranks=2",
        "async_rl.max_staleness=0",
        "async_rl.report_every=1",
        "trainer.total_training_steps=1",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    )
    store = dist.HashStore()
    first = rollout_worker(0, config, retry, store)
    lost = rollout_worker(1, config, retry, store)
    control = ControlPlane(store, 2, timeout_s=120)
    loader = load_data(config, str(retry), config.data.train_files, None).loader
    control.put("start", pickle.dumps({"step": 0, "loader": loader.state_dict()}))

    def answers_reported() -> int:
        tickets = lost.last_report.tickets.values()
        return sum(len(r.answers) for t in tickets for r in t.records or [])

    InstanceCounting.gate.clear()  # the lost rank cannot finish: its RIGHT answers wait
    threads = [threading.Thread(target=w.run, daemon=True) for w in (lost, first)]
    try:
        threads[0].start()
        wait_for(lambda: answers_reported() > 0, "rank 1 to report an interaction answer")
        control.preempt(1, 600)  # away until the run ends
        wait_for(lambda: bool(lost.preempted), "rank 1 to be preempted")
        InstanceCounting.gate.set()
        threads[1].start()
        wait_for(lambda: control.has([sample_key(0), sample_key(1)]), "both groups handed over")
    finally:
        InstanceCounting.gate.set()
        control.finish()
        for t in threads:
            if t.is_alive():
                t.join(60)
    reported = lost.last_report
    records = [r for ticket in reported.tickets.values() for r in ticket.records or []]
    recorded = sum(len(r.answers) for r in records)
    assert first.agents is not None
    peer = first.agents.interactions["gsm8k"]
    assert isinstance(peer, InstanceCounting)
    asked = 0  # the answers the uninterrupted runs ask for
    for ticket in (0, 1):
        record: GroupRecord = pickle.loads(control.get(sample_key(ticket)))
        assert (record.rank, record.migrated_from) == (0, 1)
        item = loader_item(config, retry, ticket)
        twins = AgentGroups(config, engine(retry))
        twin = drive_one(twins, item, ticket_params(config, ticket, item))
        for s, want in zip(record.samples, twin.output.outputs, strict=True):
            assert s.token_ids == want.token_ids and s.response_mask == want.response_mask
        assert record.versions == twin.versions
        counted = twins.interactions["gsm8k"]
        assert isinstance(counted, InstanceCounting)
        asked += counted.responses
    assert 4 <= asked <= 8  # 2 tickets x 2 samples, each right at its first or second answer
    assert recorded >= 1 and peer.responses == asked - recorded
