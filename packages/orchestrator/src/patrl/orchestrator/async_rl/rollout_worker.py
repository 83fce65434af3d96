"""An async rollout rank: generates tickets as admission allows, pulls newer weights between
engine steps, hands each finished group to the trainer through the store, reports its tickets
in flight, and continues those of lost peers (docs/async.md). With `rollout.multi_turn` a
ticket's samples are agent-loop samples (`agent_tickets.AgentGroups`) and the control loop runs
on their event loop, between engine steps."""

from __future__ import annotations

import asyncio
import pickle
import time
from pathlib import Path
from typing import Any

from patrl.orchestrator.async_rl.agent_tickets import AgentGroups, FinishedGroup, SampleRecord
from patrl.orchestrator.async_rl.flight_reports import (
    FlightReport,
    TicketReport,
    claim_orphans,
    continued_switches,
    read_report,
)
from patrl.orchestrator.async_rl.job import AsyncJob
from patrl.orchestrator.async_rl.tickets import (
    GroupRecord,
    InFlight,
    admission_limit,
    request_id,
    sample_key,
    spec_totals,
    ticket_params,
    token_versions,
)
from patrl.orchestrator.async_rl.validation import Validation
from patrl.orchestrator.build import build_engine
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.drafter_checkpoint import load_drafter
from patrl.orchestrator.learned_reward import LearnedReward
from patrl.orchestrator.rewards import RewardManager
from patrl.orchestrator.run import RunResult, validates
from patrl.orchestrator.scoring import TrajectoryOutput, overlong_buffer, score_outputs
from patrl.rollout import Engine, RequestOutput, SequenceState
from patrl.trainer.reward_model import load_tokenizer

# Seconds an idle rollout rank sleeps between polls.
IDLE_POLL_S = 0.005
# Seconds between a rollout rank's looks at its peers' lives (a few store reads each).
WATCH_EVERY_S = 0.1


class RolloutWorker:
    """Generates tickets as admission allows, pulls newer weights between engine steps, hands
    each finished group to the trainer through the store, reports its tickets in flight, and
    continues those of lost peers."""

    def __init__(self, job: AsyncJob) -> None:
        self.job = job
        self.config = job.config
        self.world = job.world
        self.model_dir = job.model_dir
        self.control = job.control
        self.batch_size = job.config.data.train_batch_size
        self.engine = self._new_engine()
        self.agents = self._new_agents()  # rollout.multi_turn: the samples run as agent loops
        self.spec_seen: dict[str, float] = {}  # spec_totals at the last hand-over
        self.rewards = RewardManager(
            [(f.name, f.weight) for f in self.config.reward.functions],
            num_workers=self.config.reward.num_workers,
            timeout_s=self.config.reward.timeout_s,
        )
        # Replicated on every rollout rank: they score on their own, never in a collective.
        self.learned = (
            LearnedReward(self.config, load_tokenizer(self.model_dir, "model.path"), self.world)
            if self.config.reward_model.enable
            else None
        )
        self.in_flight: dict[str, InFlight] = {}
        self.held: int | None = None  # a ticket taken but not yet admissible
        self.adopted: dict[int, TicketReport] = {}  # claimed from a lost life, not started yet
        self.batch_index = -1  # the newest loader batch read
        self.batches: dict[int, list[PromptItem]] = {}  # loader batches that may still be needed
        self.idle_s = 0.0
        self.validator = job.val_set is not None and self.world.rank == 0
        self.validation = (
            Validation(self.config, job.val_set, self.rewards, self.control, self.agents)
            if self.validator and job.val_set is not None
            else None
        )
        self.joined_at = 0  # the step the run (re)started at: validated before, if due
        self.life = 0  # this rank's current life: 1 at the start, one more at every rejoin
        self.watched: dict[int, int] = {r: 1 for r in job.rollout_ranks}  # first life to watch
        self._last_watch = -float("inf")
        self.steps_since_report = 0
        self.report_due = False  # a ticket was taken: report before the next engine step
        self.reported_events = 0  # AgentGroups.events at the last report
        self.last_report = FlightReport(self.world.rank, 0, {})
        # What happened to this rank, for tests and logs: preemptions, declared gone, rejoins,
        # tickets handed over (ticket, life), and hand-overs that another rank had beaten.
        self.preempted: list[dict[str, Any]] = []
        self.declared_gone: list[dict[str, Any]] = []
        self.rejoins: list[dict[str, Any]] = []
        self.handed: list[tuple[int, int]] = []
        self.duplicates = 0

    def _new_engine(self) -> Engine:
        engine = build_engine(self.config, self.model_dir, self.world, span_world=False)
        assert isinstance(engine, Engine), "async rollout ranks run a static layout"
        return engine

    def _new_agents(self) -> AgentGroups | None:
        if not self.config.rollout.multi_turn.enable:
            return None
        return AgentGroups(self.config, self.engine)

    def run(self) -> RunResult:
        try:
            if self.agents is not None:
                asyncio.run(self._run_agents())
                return RunResult(0, [], self.job.run_dir)
            self._join()
            while not self.control.done():
                if not self._between_steps():
                    continue
                if self.engine.has_unfinished():
                    self.control.progress()
                    for out in self.engine.step():
                        if (
                            self.validation is not None
                            and out.request_id in self.validation.pending
                        ):
                            self.validation.finish(out, self.engine)
                        else:
                            self._hand_over(out)
                    self.steps_since_report += 1
                    if self.steps_since_report >= self.config.async_rl.report_every:
                        self._report()
                else:
                    self._idle()
        finally:
            self.rewards.close()
        return RunResult(0, [], self.job.run_dir)

    def _between_steps(self) -> bool:
        """Beat, pull newer weights, watch the peers, admit tickets, report if due; False if
        this rank was lost (and rejoined) instead."""
        self.control.beat()
        if self._lost():
            return False
        self._pull_newest()
        self._watch_peers()
        self._admit()
        if self.report_due:
            self._report()
        return True

    async def _run_agents(self) -> None:
        """The control loop of a multi-turn rank, on the event loop its samples run on: the
        engine's step task (`LLMServer.step_until`) steps while this loop yields (once per
        pass while the engine is busy), so weights are pulled between engine steps; finished
        groups are scored and handed over."""
        self._join()
        try:
            while not self.control.done():
                if not self._between_steps():
                    continue
                assert self.agents is not None
                for group in self.agents.finished():
                    if self.validation is not None and group.key in self.validation.pending:
                        self.validation.finish(group.output, self.engine)
                    else:
                        self._hand_over_group(group)
                if self.engine.has_unfinished():
                    self.control.progress()
                    await asyncio.sleep(0)  # the engine steps; samples whose turn ended go on
                    self.steps_since_report += 1
                    if self.steps_since_report >= self.config.async_rl.report_every:
                        self._report()
                elif self.agents.live():  # every running sample awaits its tool
                    if self.agents.events != self.reported_events:
                        self._report()  # their ended turns and answers, while they wait
                    self.control.check_alive(self.job.trainer_ranks)
                    await asyncio.sleep(IDLE_POLL_S)
                else:
                    await self._idle_async()
        finally:
            if self.agents is not None:
                self.agents.close()

    def _join(self) -> None:
        """Wait for the trainer to say where the run starts (a resumed step, its loader)."""
        first_trainer = self.job.trainer_ranks[0]
        self.control.wait_until(
            lambda: self.control.has(["start"]), "the trainer to start", [first_trainer]
        )
        start = pickle.loads(self.control.get("start"))
        self.job.loader.load_state_dict(start["loader"])
        if start.get("checkpoint"):  # a resumed run: the trained groups' history to draft from
            load_drafter(self.engine.drafter, Path(start["checkpoint"]))
        self.batch_index = start["step"] - 1
        self.joined_at = start["step"]
        self.life = self.control.bump(f"life/{self.world.rank}")
        self._report()
        if start["step"] > 0:
            self._pull_newest()
        else:
            if start.get("published"):  # a fresh run's policy that is not model.path's
                self.engine.load_weights(self.job.weights.load(0), version=0)
            if validates(self.config, 0):
                self._start_validation()
        self._report_loaded()

    def _idle(self) -> None:
        """Nothing to run: admission waits for newer weights (or the run's last tickets are
        out). Counted as time/wait_for_weights; the trainer is watched meanwhile."""
        start = time.monotonic()
        self.control.check_alive(self.job.trainer_ranks)
        time.sleep(IDLE_POLL_S)
        self._count_idle(time.monotonic() - start)

    async def _idle_async(self) -> None:
        """`_idle` on the agents' event loop (the tools' answers arrive meanwhile)."""
        start = time.monotonic()
        self.control.check_alive(self.job.trainer_ranks)
        await asyncio.sleep(IDLE_POLL_S)
        self._count_idle(time.monotonic() - start)

    def _count_idle(self, waited: float) -> None:
        self.idle_s += waited
        self.control.bump(f"wait_weights_us/{self.world.rank}", int(waited * 1e6))

    # ------------------------------------------------------------------ weights

    def _pull_newest(self) -> None:
        if self.validation is not None and self.validation.pending:
            return  # validation of the held version first: its tokens must all come from it
        latest = self.control.counter("weights/latest")
        if latest <= self.engine.weight_version:
            return
        # Tokens sampled from here on come from the new version.
        if self.agents is not None:
            self.agents.server.note_pull(latest)
        else:
            for seq in self.engine.unfinished_seqs():
                flight = self.in_flight[seq.request_id]
                flight.switches[seq.sample_index].append((len(seq.output_token_ids), latest))
        self.engine.load_weights(self.job.weights.load(latest), version=latest)
        self.control.progress()
        self._report_loaded()
        if latest > self.joined_at and validates(self.config, latest):
            self._start_validation()

    def _report_loaded(self) -> None:
        """The version this rank holds: older ones may be deleted."""
        self.control.put(f"loaded/{self.world.rank}", str(self.engine.weight_version))

    # ---------------------------------------------------------------- admission

    def _limit(self) -> int:
        return admission_limit(self.config, self.engine.weight_version)

    def _admit(self) -> None:
        """Start admissible tickets, at most a fair share of a batch per loop pass, so the first
        rank to see new weights does not take the whole batch while its peers idle."""
        self._continue_adopted()
        share = -(-self.batch_size // self.job.num_rollout)
        for _ in range(share):
            if self.held is None:
                if self.control.counter("tickets") >= self._limit():
                    return  # peek first: most polls must not take a ticket they cannot start
                self.held = self.control.bump("tickets") - 1
                self.report_due = True
            if self.held >= self._limit():
                return  # another rank took the last admissible ticket: keep it for later
            self._start(self.held)
            self.held = None

    def _start(
        self,
        ticket: int,
        migrated_from: int | None = None,
        records: list[SampleRecord] | None = None,
    ) -> None:
        """Start `ticket` (multi-turn: replaying a lost rank's `records` first)."""
        item, version = self._item(ticket), self.engine.weight_version
        params = ticket_params(self.config, ticket, item)
        rid = request_id(ticket)
        if self.agents is not None:  # switches: kept per turn by the agents' server
            self.agents.start(rid, item, params, records)
        else:
            self.engine.add_request(item.prompt_token_ids, params, request_id=rid)
        switches = [[(0, version)] for _ in range(params.n)]
        self.in_flight[rid] = InFlight(ticket, item, switches, migrated_from)

    def _item(self, ticket: int) -> PromptItem:
        """The prompt of `ticket`; loader batches are kept while a ticket of theirs may still
        be adopted (until the step that trains them is done)."""
        b = ticket // self.batch_size
        while self.batch_index < b:
            self.batch_index += 1
            self.batches[self.batch_index] = self.job.loader.next_batch()
        for trained in [k for k in self.batches if k < self.engine.weight_version]:
            del self.batches[trained]
        return self.batches[b][ticket % self.batch_size]

    def _start_validation(self) -> None:
        if self.validation is not None:
            self.validation.begin(self.engine)

    # ---------------------------------------------------------------- hand over

    def _hand_over(self, out: RequestOutput) -> None:
        flight = self.in_flight[out.request_id]
        versions = [token_versions(flight.switches[c.index], len(c.token_ids)) for c in out.outputs]
        self._score_and_hand_over(out, versions, {})

    def _hand_over_group(self, group: FinishedGroup) -> None:
        """A multi-turn ticket's samples all ended: its trajectories, their token versions and
        its `multi_turn/*` counters (in the record's metrics: the step row merges them)."""
        self.in_flight[group.key].migrated_tokens = group.replayed
        self._score_and_hand_over(group.output, group.versions, group.metrics)

    def _score_and_hand_over(
        self,
        out: RequestOutput | TrajectoryOutput,
        versions: list[list[int]],
        metrics: dict[str, float],
    ) -> None:
        flight = self.in_flight.pop(out.request_id)
        samples, reward_metrics, failures = score_outputs(
            self.rewards, [(flight.item, out)], self.learned, overlong_buffer(self.config)
        )
        record = GroupRecord(
            flight.ticket,
            self.world.rank,
            samples,
            versions,
            {**reward_metrics, **metrics},
            self.life,
            flight.migrated_from,
            flight.migrated_tokens,
            failures,
            self._spec_counts(),
        )
        # First writer wins: a woken rank and the peer that adopted its ticket may both finish.
        if self.control.put_first(sample_key(flight.ticket), pickle.dumps(record)):
            self.handed.append((flight.ticket, self.life))
        else:
            self.duplicates += 1
            self.control.bump("duplicates")

    def _spec_counts(self) -> dict[str, float]:
        """What the engine's drafter counted since the previous hand-over (or since the
        engine was made: a rejoin's new engine counts from zero)."""
        now, seen = spec_totals(self.engine.drafter), self.spec_seen
        self.spec_seen = now
        return {k: v - seen.get(k, 0.0) for k, v in now.items()}

    # --------------------------------------------------------------- migration

    def _report(self) -> None:
        """Tell the others what this rank holds, so they can continue it if it is lost."""
        if self.agents is not None:
            # A multi-turn ticket's turn state lives in its agent loops, not in the engine: its
            # samples' records (finished turns, tool answers), which an adopter replays.
            tickets = {
                f.ticket: TicketReport([], [], f.migrated_from, self.agents.records(rid))
                for rid, f in self.in_flight.items()
            }
            self.reported_events = self.agents.events
        else:
            ids = list(self.in_flight)
            by_request: dict[str, list[SequenceState]] = {rid: [] for rid in ids}
            for state in self.engine.snapshot_requests(ids):
                by_request[state.request_id].append(state)
            tickets = {
                f.ticket: TicketReport(by_request[rid], f.switches, f.migrated_from)
                for rid, f in self.in_flight.items()
            }
        tickets.update(self.adopted)
        if self.held is not None:
            tickets[self.held] = TicketReport([], [])
        report = FlightReport(self.world.rank, self.life, tickets)
        self.control.put(report.key(), report.to_bytes())
        self.last_report = report
        self.steps_since_report = 0
        self.report_due = False

    def _watch_peers(self) -> None:
        """Adopt the tickets of every ended life of a rollout rank, once: a life ends when its
        rank is preempted, or declared gone here because its heartbeat stopped. This rank's
        own earlier lives are watched too (what nobody else took, it takes back)."""
        now = time.monotonic()
        if now - self._last_watch < WATCH_EVERY_S:
            return
        self._last_watch = now
        me = self.world.rank
        for peer in self.job.rollout_ranks:
            # Its life before its beat: a rank beats before it starts a new life, so a stale
            # beat read after the new life began cannot be blamed on that life.
            current = self.life if peer == me else self.control.counter(f"life/{peer}")
            for ended in range(self.watched[peer], current):
                self._adopt(peer, ended)
            self.watched[peer] = max(self.watched[peer], current)
            if peer == me or current < 1 or self.watched[peer] > current:
                continue
            gone = f"gone/{peer}.{current}"
            if self.control.has([gone]) or peer in self.control.stale_peers([peer]):
                if self.control.put_first(gone, b"stalled"):
                    self.control.bump("stalls")  # declared here, not a preemption
                self._adopt(peer, current)
                self.watched[peer] = current + 1

    def _adopt(self, peer: int, life: int) -> None:
        """Claim what this rank wins of `peer`'s ended `life`; started when admissible."""
        report = read_report(self.control, peer, life)
        if report is None:
            return
        for ticket, ticket_report in claim_orphans(self.control, report).items():
            if ticket_report.migrated_from is None:
                ticket_report.migrated_from = peer
            self.adopted[ticket] = ticket_report
        self.report_due = True

    def _continue_adopted(self) -> None:
        """Start adopted tickets in ticket order as admission allows (with this rank's weights,
        so the staleness bound holds); their reported tokens are kept, the rest recomputed."""
        for ticket in sorted(self.adopted):
            if ticket >= self._limit():
                return
            report = self.adopted.pop(ticket)
            if self.control.has([sample_key(ticket)]):
                continue  # its lost rank woke up and handed it over after all
            self.report_due = True
            if not report.states:
                self._start(ticket, report.migrated_from, report.records)
                continue
            version = self.engine.weight_version
            self.engine.import_requests(report.states)
            self.in_flight[request_id(ticket)] = InFlight(
                ticket,
                self._item(ticket),
                continued_switches(report, version),
                report.migrated_from,
                report.tokens(),
            )

    def _lost(self) -> bool:
        """Preempted, or declared gone by a peer while this rank stalled: either way its
        tickets go to others and it rejoins in a new life. True if it happened."""
        me = self.world.rank
        if self.control.has([f"preempt/{me}"]):
            self._preempted()
            return True
        if self.control.has([f"gone/{me}.{self.life}"]):
            self._woke_up_gone()
            return True
        return False

    def _preempted(self) -> None:
        """The instance is taken back: everything on it is lost at once (the last report is
        what the others continue). It stays away for its down time, then rejoins afresh."""
        me = self.world.rank
        if self.validator:
            t = self.config.trainer
            raise RuntimeError(
                f"rollout rank {me} validates (trainer.test_freq={t.test_freq}, "
                f"trainer.val_before_train={t.val_before_train}) and cannot be preempted: "
                "validation does not migrate. Preempt another rollout rank, or run without "
                "validation (trainer.test_freq=-1 and trainer.val_before_train=false)"
            )
        down_s = float(self.control.get(f"preempt/{me}"))
        self.control.put(f"gone/{me}.{self.life}", "preempted")
        self.control.bump("preemptions")
        self.preempted.append(
            {
                "life": self.life,
                "tickets": sorted(self.last_report.tickets),
                "reported_tokens": self.last_report.tokens(),
                "at": time.time(),
            }
        )
        self.control.delete(f"preempt/{me}")
        self.in_flight, self.held, self.adopted = {}, None, {}
        if self.agents is not None:
            self.agents.close()  # its samples and their turns go with the engine
        del self.engine  # reclaimed with its instance: the replacement starts from the model
        self._stay_away(down_s)
        if not self.control.done():
            self.engine = self._new_engine()
            self.agents = self._new_agents()
            self.spec_seen = {}
            self._rejoin()

    def _stay_away(self, down_s: float) -> None:
        """Silent (no heartbeat: nothing runs there) until the down time passes, `resume`, or
        the run ends."""
        until, resume = time.monotonic() + down_s, f"resume/{self.world.rank}"
        while time.monotonic() < until and not self.control.has([resume]):
            if self.control.done():
                return
            time.sleep(IDLE_POLL_S * 10)
        if self.control.has([resume]):
            self.control.delete(resume)

    def _woke_up_gone(self) -> None:
        """This rank stalled past the peer timeout and a peer declared it gone: keep the
        tickets nobody has claimed (still in this engine), drop the others, rejoin."""
        me, life = self.world.rank, self.life
        dropped, kept = [], []
        for rid, flight in list(self.in_flight.items()):
            if self.control.has([sample_key(flight.ticket)]) or not self.control.claim(
                f"{flight.ticket}/{me}.{life}"
            ):
                if self.agents is not None:
                    self.agents.drop(rid)
                else:
                    self.engine.export_requests([rid], with_kv=False, include_finished=True)
                del self.in_flight[rid]
                dropped.append(flight.ticket)
            else:
                kept.append(flight.ticket)
        for ticket in list(self.adopted):
            if not self.control.claim(f"{ticket}/{me}.{life}"):
                del self.adopted[ticket]
                dropped.append(ticket)
        if self.held is not None and not self.control.claim(f"{self.held}/{me}.{life}"):
            dropped.append(self.held)
            self.held = None
        self.declared_gone.append(
            {"life": life, "dropped": sorted(dropped), "kept": sorted(kept), "at": time.time()}
        )
        self._rejoin()

    def _rejoin(self) -> None:
        """A new life: beat first (see _watch_peers), newest weights, an empty-handed report."""
        self.control.beat(now=True)
        self.life = self.control.bump(f"life/{self.world.rank}")
        start = time.time()
        self._pull_newest()
        self._report_loaded()
        self._report()
        self.control.bump("rejoins")
        self.rejoins.append(
            {
                "life": self.life,
                "loaded": self.engine.weight_version,
                "started": start,
                "done": time.time(),
            }
        )
