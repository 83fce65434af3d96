"""Preemption and token-level migration in async mode (async_rl/, RLBoost): a rollout rank
that is preempted, or stalls past the peer timeout, loses its requests to the other rollout
rank, which continues them from their last report; the lost rank rejoins with the newest
weights; the run completes and trains every ticket once within the staleness bound."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_orchestrator_async import job_config

from patrl.orchestrator.async_loop import AsyncGRPO
from patrl.orchestrator.async_rl.flight_reports import (
    FlightReport,
    TicketReport,
    claim_orphans,
    continued_switches,
    read_report,
)
from patrl.orchestrator.async_rl.rollout_worker import RolloutWorker
from patrl.orchestrator.async_rl.tickets import GroupRecord, token_versions
from patrl.orchestrator.async_rl.trainer_worker import TrainerWorker
from patrl.orchestrator.config import ConfigError, load_config
from patrl.orchestrator.control import ControlPlane, PeerFailed
from patrl.orchestrator.distributed import World
from patrl.rollout import Engine, EngineConfig, SamplingParams, SequenceState
from patrl_testkit.clock import FakeClock
from patrl_testkit.multirank import run_ranks

BATCH = 4  # data.train_batch_size of job_config


def _mid_generation(role: RolloutWorker) -> bool:
    """Trained once already, and the last report holds unfinished samples with tokens."""
    report = role.last_report
    return role.engine.weight_version >= 1 and any(
        s.output_token_ids and s.finish_reason is None
        for t in report.tickets.values()
        for s in t.states
    )


def _inject(role: RolloutWorker, fault: dict[str, Any], seen: dict[str, Any]) -> None:
    """The fault, once, right after an engine step of this (the first) engine: a preemption
    notice in the store, or a stall (no loop, so no heartbeat) of fault["stall_s"]."""
    engine = role.engine
    step = engine.step

    def faulty_step() -> Any:
        out = step()
        if not seen and _mid_generation(role):
            seen["report"], seen["at"] = role.last_report, time.time()
            if fault["kind"] == "preempt":
                role.control.preempt(role.world.rank, fault["down_s"])
            else:
                time.sleep(fault["stall_s"])
                seen["woke"] = time.time()
        return out

    engine.step = faulty_step  # type: ignore[method-assign]


def _record_batches(role: TrainerWorker, records: list[GroupRecord]) -> None:
    take = role._take_batch

    def taking(timings: dict[str, float]) -> list[GroupRecord]:
        records.extend(take(timings))
        return records[-BATCH:]

    role._take_batch = taking  # type: ignore[method-assign]


def _slow_down(role: TrainerWorker, step_s: float) -> None:
    """Each training step takes step_s longer (beating: a big model's step, not a stall), so
    the run lasts long enough for the lost rank to come back while steps remain."""
    train = role.train_step

    def slow_step() -> dict[str, float]:
        metrics = train()
        until = time.monotonic() + step_s
        while time.monotonic() < until:
            role.control.beat()
            time.sleep(0.05)
        return metrics

    role.train_step = slow_step  # type: ignore[method-assign]


def _run(
    rank: int, world_size: int, assets: Path, run_dir: Path, extra: dict[str, Any], fault: Any
) -> dict[str, Any]:
    world = World(rank, world_size, rank, torch.device("cpu"))
    config = job_config(assets, run_dir, **{"trainer.mode": "async", **extra})
    files = (config.data.train_files, config.data.val_files)
    loop = AsyncGRPO(config, world, str(assets / "model"), *files)
    role = loop.role
    seen: dict[str, Any] = {}
    records: list[GroupRecord] = []
    if isinstance(role, RolloutWorker) and rank == fault["rank"]:
        _inject(role, fault, seen)
    if isinstance(role, TrainerWorker):
        _record_batches(role, records)
        _slow_down(role, fault["step_s"])
    result = loop.run()
    if isinstance(role, RolloutWorker):
        return {
            "role": "rollout",
            "seen": seen,
            "preempted": role.preempted,
            "declared_gone": role.declared_gone,
            "rejoins": role.rejoins,
            "handed": role.handed,
            "duplicates": role.duplicates,
        }
    assert isinstance(role, TrainerWorker)
    return {
        "role": "trainer",
        "history": [h for h in result.history if "critic/score/mean" in h],
        "groups": role.trained_groups,
        "published": role.published,
        "tokens": {r.ticket: [s.token_ids for s in r.samples] for r in records},
    }


def _newest_before(published: list[tuple[int, float]], t: float) -> int:
    return max([v for v, when in published if when <= t], default=0)


def _check_run(trainer: dict[str, Any], steps: int) -> None:
    """All steps ran, each trained its own tickets, each ticket once."""
    assert [h["step"] for h in trainer["history"]] == [float(s) for s in range(1, steps + 1)]
    tickets = [g[1] for g in trainer["groups"]]
    assert sorted(tickets) == list(range(steps * BATCH))
    for step, ticket, *_ in trainer["groups"]:
        assert (step - 1) * BATCH <= ticket < step * BATCH


def _check_rejoin(rejoin: dict[str, Any], published: list[tuple[int, float]]) -> None:
    """It loaded the version that was the newest when it rejoined (a newer one may have come
    out while it loaded)."""
    assert rejoin["life"] == 2
    newest = _newest_before(published, rejoin["started"])
    assert newest >= 1
    assert newest <= rejoin["loaded"] <= _newest_before(published, rejoin["done"])


def _recovered_s(lost: dict[str, Any], trainer: dict[str, Any], migrated: Any) -> float:
    """Seconds from the fault to the publication of the last step with a migrated ticket."""
    published = dict(trainer["published"])
    return max(published[t // BATCH + 1] for t in migrated) - float(lost["seen"]["at"])


def _check_migrated_tokens(report: FlightReport, tickets: set[int], trained: Any) -> None:
    """Token-level: each migrated sample starts with the tokens its lost rank reported."""
    for ticket in tickets:
        for state in report.tickets[ticket].states:
            got = trained[ticket][state.sample_index]
            assert got[: len(state.output_token_ids)] == state.output_token_ids


EXTRA: dict[str, Any] = {
    "async_rl.rollout_ranks": 2,
    "async_rl.max_staleness": 1,
    "async_rl.report_every": 2,
}


@pytest.mark.e2e
@pytest.mark.multirank
def test_preempted_rollout_rank_migrates_its_requests_and_rejoins(
    assets: Path, tmp_path: Path
) -> None:
    """Rank 1 of 2 rollout ranks (+1 trainer) is preempted mid-generation for 1 s: every
    request it had in flight finishes on rank 0 with the reported tokens kept, rank 1 rejoins
    with the newest weights and generates again."""
    steps = 6
    extra = {**EXTRA, "async_rl.peer_timeout_s": 60, "trainer.total_training_steps": steps}
    fault = {"rank": 1, "kind": "preempt", "down_s": 1.0, "step_s": 0.5}
    results = run_ranks(_run, world_size=3, args=(assets, tmp_path, extra, fault), timeout_s=240)
    rank1, trainer = results[1], results[2]
    _check_run(trainer, steps)

    [preempted] = rank1["preempted"]
    in_flight = set(preempted["tickets"])
    assert in_flight  # it was preempted mid-generation
    migrated = {g[1]: g for g in trainer["groups"] if g[4] is not None}
    assert set(migrated) == in_flight  # every one of them, and nothing else
    assert all(g[2] == 0 and g[4] == 1 for g in migrated.values())  # finished on rank 0
    kept = sum(g[5] for g in migrated.values())
    assert kept == preempted["reported_tokens"] > 0  # token-level: reported tokens were kept
    _check_migrated_tokens(rank1["seen"]["report"], in_flight, trainer["tokens"])

    history = trainer["history"]
    assert sum(h["async/migrated_requests"] for h in history) == len(in_flight)
    assert sum(h["async/migrated_tokens"] for h in history) == kept
    assert history[-1]["async/preemptions"] == 1.0
    assert history[-1]["async/stalls"] == 0.0
    assert max(h["async/staleness_max"] for h in history) <= 1

    [rejoin] = rank1["rejoins"]
    _check_rejoin(rejoin, trainer["published"])
    assert any(life == 2 for _, life in rank1["handed"])  # it generated after rejoining
    print(
        f"\npreempt: {len(in_flight)} requests in flight migrated, {kept} reported tokens kept, "
        f"their step trained {_recovered_s(rank1, trainer, migrated):.2f} s after the notice; "
        f"rank 1 rejoined at version {rejoin['loaded']}, handed over "
        f"{sum(1 for _, life in rank1['handed'] if life == 2)} groups afterwards"
    )


@pytest.mark.e2e
@pytest.mark.multirank
def test_stalled_rollout_rank_is_declared_gone_and_not_waited_for(
    assets: Path, tmp_path: Path
) -> None:
    """Rank 1 stalls (no heartbeat) for 9 s mid-generation, peer timeout 3 s: rank 0 declares
    it gone and finishes its tickets, and the trainer trains them before rank 1 wakes up; rank
    1 then finds its life gone, drops what rank 0 took and rejoins with the newest weights."""
    steps, stall_s = 14, 9.0
    extra = {**EXTRA, "async_rl.peer_timeout_s": 3, "trainer.total_training_steps": steps}
    fault = {"rank": 1, "kind": "stall", "stall_s": stall_s, "step_s": 0.8}
    results = run_ranks(_run, world_size=3, args=(assets, tmp_path, extra, fault), timeout_s=240)
    rank1, trainer = results[1], results[2]
    _check_run(trainer, steps)

    report: FlightReport = rank1["seen"]["report"]
    woke = rank1["seen"]["woke"]
    migrated = {g[1]: g for g in trainer["groups"] if g[4] is not None}
    assert migrated  # rank 0 took over work from the stalled rank
    assert set(migrated) <= set(report.tickets)
    assert all(g[2] == 0 and g[4] == 1 for g in migrated.values())
    _check_migrated_tokens(report, set(migrated), trainer["tokens"])
    # Nobody waited for the stalled rank: the steps of its migrated tickets were trained (and
    # their weights published) while it still slept.
    for ticket in migrated:
        step = ticket // BATCH + 1
        published = dict(trainer["published"])
        assert published[step] < woke, (ticket, published[step], woke)

    [gone] = rank1["declared_gone"]
    assert gone["life"] == 1
    assert set(gone["dropped"]) >= set(migrated)  # what rank 0 had taken, rank 1 dropped
    assert not set(gone["kept"]) & set(migrated)
    history = trainer["history"]
    assert history[-1]["async/stalls"] == 1.0
    assert history[-1]["async/preemptions"] == 0.0
    assert sum(h["async/migrated_requests"] for h in history) == len(migrated)
    [rejoin] = rank1["rejoins"]
    _check_rejoin(rejoin, trainer["published"])
    print(
        f"\nstall: {len(migrated)} requests migrated "
        f"({sum(g[5] for g in migrated.values())} reported tokens kept), their steps trained "
        f"{_recovered_s(rank1, trainer, migrated):.2f} s after the stall began, "
        f"{rank1['duplicates']} late duplicates refused; rank 1 rejoined at version "
        f"{rejoin['loaded']}"
    )


# ------------------------------------------------------------------ single-process parts


def _state_report(engine: Engine, ids: list[str], version: int, rank: int = 1) -> FlightReport:
    """What RolloutWorker._report writes, for requests added directly to an engine."""
    tickets = {}
    for i, rid in enumerate(ids):
        states = engine.snapshot_requests([rid])
        tickets[i] = TicketReport(states, [[(0, version)] for _ in states])
    return FlightReport(rank, 1, tickets)


def test_a_report_continues_on_another_engine_token_for_token(assets: Path) -> None:
    """The migration path against the uninterrupted run: report after a few steps, send it
    through the store, continue it elsewhere: the same tokens (same weights, same RNG states),
    the reported ones kept, and the adopter's version recorded from the migration point on."""
    config = EngineConfig(model=str(assets / "model"), block_size=4, num_kv_blocks=64)
    prompts = [[5, 9, 11, 3], [7, 2, 8]]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)

    def start(engine: Engine) -> list[str]:
        return [
            engine.add_request(p, params, request_id=f"ticket-{i}") for i, p in enumerate(prompts)
        ]

    def finish(engine: Engine) -> dict[str, list[list[int]]]:
        done: dict[str, list[list[int]]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                done[out.request_id] = [c.token_ids for c in out.outputs]
        return done

    reference = Engine(config)
    start(reference)
    expected = finish(reference)

    lost = Engine(config)
    ids = start(lost)
    for _ in range(5):
        lost.step()
    store = dist.HashStore()
    reporter, adopter = ControlPlane(store, 1, 5.0), ControlPlane(store, 0, 5.0)
    sent = _state_report(lost, ids, version=2)
    reporter.put(sent.key(), sent.to_bytes())
    del lost  # preempted

    report = read_report(adopter, 1, 1)
    assert report is not None and report.tokens() == sent.tokens() > 0
    for t in sent.tickets:  # the generator states travel as bytes, and come back as they were
        for a, b in zip(sent.tickets[t].states, report.tickets[t].states, strict=True):
            assert b.generator_state.dtype == torch.uint8
            assert torch.equal(a.generator_state, b.generator_state)
    won = claim_orphans(adopter, report)
    assert sorted(won) == [0, 1]
    other = Engine(config)
    for ticket_report in won.values():
        other.import_requests(ticket_report.states)
    got = finish(other)
    assert got == expected
    for ticket, ticket_report in won.items():
        switches = continued_switches(ticket_report, 3)
        for state, sw in zip(ticket_report.states, switches, strict=True):
            tokens = got[f"ticket-{ticket}"][state.sample_index]
            kept = len(state.output_token_ids)
            assert tokens[:kept] == state.output_token_ids
            expect = [2] * kept + [3] * (len(tokens) - kept)
            if state.finish_reason is not None:
                expect = [2] * kept
            assert token_versions(sw, len(tokens)) == expect


def test_orphaned_tickets_have_exactly_one_taker() -> None:
    store = dist.HashStore()
    a, b, lost = (ControlPlane(store, r, 5.0) for r in (0, 2, 1))
    report = FlightReport(1, 1, {t: TicketReport([], []) for t in (3, 4, 5)})
    lost.put_first("sample/4", b"finished before it was lost")
    assert sorted(claim_orphans(a, report)) == [3, 5]  # 4 was handed over: nobody's
    assert claim_orphans(b, report) == {}  # a second adopter gets nothing
    assert not lost.claim("5/1.1")  # nor the lost rank, waking up
    assert lost.claim("6/1.1")  # what no adopter saw, it keeps
    # The same tickets in another life (the rank lost again after taking them back) are new.
    assert sorted(claim_orphans(b, FlightReport(1, 2, report.tickets))) == [3, 5]


def test_continued_switches_keep_the_past_and_add_the_adopter() -> None:
    def s(index: int, tokens: int, finished: bool) -> SequenceState:
        return SequenceState(
            "ticket-0",
            index,
            [1],
            list(range(tokens)),
            [0.0] * tokens,
            SamplingParams(),
            torch.zeros(1),
            finish_reason="stop" if finished else None,
        )

    report = TicketReport(
        [s(0, 5, False), s(1, 2, True), s(2, 0, False)],
        [[(0, 1), (3, 2)], [(0, 1)], [(0, 1)]],
    )
    assert continued_switches(report, 4) == [[(0, 1), (3, 2), (5, 4)], [(0, 1)], [(0, 1), (0, 4)]]
    assert token_versions(continued_switches(report, 4)[0], 7) == [1, 1, 1, 2, 2, 4, 4]


def test_control_plane_first_writes_claims_and_any_peer_waits() -> None:
    store, clock = dist.HashStore(), FakeClock()
    a, b = (ControlPlane(store, r, timeout_s=0.2, clock=clock, sleep=clock.sleep) for r in (0, 1))
    assert a.put_first("sample/1", b"a")
    assert not b.put_first("sample/1", b"b")
    assert b.get("sample/1") == b"a"
    b.put("sample/1", b"trained")  # a tombstone: still not writable
    assert not a.put_first("sample/1", b"late")
    with pytest.raises(ValueError, match="non-empty"):
        a.put_first("sample/2", b"")
    assert [a.claim("t"), b.claim("t"), a.claim("t")] == [True, False, False]
    a.preempt(1, 2.5)
    assert float(b.get("preempt/1")) == 2.5
    with pytest.raises(ValueError, match="down_s"):
        a.preempt(1, -1)

    # Waiting on interchangeable peers: one silent is fine, all silent fails, named.
    peers = [ControlPlane(store, r, 0.2, clock=clock, sleep=clock.sleep) for r in (2, 3)]
    for p in peers:
        p.beat()
    a.check_any_alive([2, 3])  # first sight
    clock.advance(0.3)
    peers[0].beat(now=True)
    a.check_any_alive([2, 3])  # 2 is alive: fine, though 3 is silent
    assert a.stale_peers([3]) == [3]
    clock.advance(0.3)
    with pytest.raises(PeerFailed, match=r"all of ranks \[2, 3\] sent no heartbeat"):
        a.wait_until(lambda: False, "samples", [2, 3], any_peer=True)


def test_report_every_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"async_rl\.report_every"):
        load_config(None, ["async_rl.report_every=0"])


def test_the_validating_rank_refuses_preemption(assets: Path, tmp_path: Path) -> None:
    """Validation does not migrate: rank 0, validating, fails the job with the reason (a
    worker built bare: only what a preemption notice reads)."""
    worker = RolloutWorker.__new__(RolloutWorker)
    worker.config = job_config(assets, tmp_path, **{"trainer.test_freq": 2})
    worker.world = World(0, 3, 0, torch.device("cpu"))
    worker.control = ControlPlane(dist.HashStore(), 0, 5.0)
    worker.validator, worker.life = True, 1
    assert not worker._lost()
    worker.control.preempt(0, 1.0)
    with pytest.raises(RuntimeError, match=r"rank 0 validates .* cannot be preempted"):
        worker._lost()
