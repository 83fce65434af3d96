"""Asynchronous GRPO with bounded staleness (AReaL): generation never waits for a full step.

The world is split: ranks [0, R) only generate (R = async_rl.rollout_ranks, each rank its own
static tp=1 engine), ranks [R, W) only train (FSDP2 over just them). They never meet in a
collective: small control values go through the job's store (control.py), weights and samples
through the store and the run directory (weight_store.py), so a dead or stalled peer is named
after a timeout instead of hanging everybody.

Tickets. The prompt stream is cut into tickets: ticket t is prompt t % B of the loader's batch
t // B (B = data.train_batch_size), sampled with the synchronous loop's seeds for step
t // B + 1. Training step s trains exactly tickets [(s-1)B, sB).

Admission (AReaL's rule). A rollout rank whose newest weights are version v may start a ticket
only while capacity = (max_staleness + v + 1) * B - (accepted + running) > 0. Tickets are
handed out in order, so accepted + running is the number of tickets handed out, and the rule
reads: ticket t may start once t < (max_staleness + v + 1) * B.

Consumption in ticket order, not finish order. AReaL trains on whichever groups finished first;
here step s waits for its own tickets. Why: ticket t started with weights v >= t // B -
max_staleness and is trained at version s - 1 = t // B, so no trained token is more than
max_staleness versions old, strictly (in finish order a slow old group can be trained later
than the bound allows), and a run is reproducible: max_staleness=0 is the synchronous loop. The
price is head-of-line blocking: a slow group holds back its step while later groups wait,
finished, in the store; generation goes on meanwhile, up to the staleness bound.

Weights. After the update of step s the trainer publishes version s; rollout ranks poll for it
between engine steps and load it when it is complete on disk (pull-based). Running sequences go
on under the new weights (their KV stays), so one sample may mix versions: every token records
the version that sampled it, and the logprob it was sampled with (the behaviour policy). The
trainer recomputes the proximal logprobs and uses decoupled PPO with the behaviour weight
capped at async_rl.behaviour_weight_cap.

Validation. Rollout rank 0 validates version v (v % trainer.test_freq == 0, and v = 0 with
trainer.val_before_train) as the synchronous loop would after step v: its requests run beside
the training tickets, and rank 0 holds off newer weights until they are done, so every
validation token comes from version v. The trainer logs the result when it arrives, as a row
of step v, and waits for the last one before ending the run.

Preemption and token-level migration (RLBoost). Rollout ranks are interchangeable, so losing
one must not lose the job, nor its work. A rank reports what it holds under
`flight/<rank>.<life>`: every async_rl.report_every engine steps, and at once when it takes a
ticket. For each ticket: its samples so far (tokens, logprobs, finish state, sampler RNG state;
Engine.snapshot_requests, no KV) and their version switch points; a ticket taken but not
started yet has no samples. A rank is lost when it is preempted (`ControlPlane.preempt`, a spot
instance taken back: at its next engine step it drops everything, engine included, and marks
its life gone; it does not beat while away) or when its heartbeat stops for
async_rl.peer_timeout_s (a peer marks its life gone). The other rollout ranks then claim its
reported tickets through the store (`claim`: one winner per ticket and life) and continue them
as admission allows, by recompute: the reported tokens are kept; tokens sampled after the last
report are sampled again, the same ones if the adopter holds the same weights (the RNG state
travels with the sample), else by its newer weights. Either way every token's version is
recorded: the adopter keeps the reported switch points and adds its own version from the
migration point, and it starts a ticket only when admission allows it with its own weights, so
the staleness bound holds for migrated samples too. A ticket is lost only if its rank dies
between taking it and reporting it (one loop iteration) and never returns; the trainer's wait
then fails by name. Each (re)join is a new life with its own report and claims: a preempted
rank rejoins after its down time with a fresh engine and the newest weights, and claims what
nobody claimed of its earlier lives; a stalled rank that wakes to find its life gone keeps the
tickets nobody claimed, drops the others, and rejoins. Samples are written with `put_first`, so
if a woken rank and an adopter both finish a ticket the first one counts; a trained ticket
leaves a tombstone, so the trainer never sees a ticket twice. The trainer's wait for samples
fails only when every rollout rank is silent. Validation is rank 0's alone and does not
migrate: with validation configured rank 0 refuses a preemption (the job fails, saying so); a
stalled rank 0 keeps its validation requests, and the run's end waits for them by name.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from patrl.lenpredict import LengthPredictor
from patrl.orchestrator import checkpointing
from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.control import ControlPlane
from patrl.orchestrator.data import PromptItem, PromptLoader, dataset_for
from patrl.orchestrator.distributed import World
from patrl.orchestrator.metrics import MetricsLogger, plot_run
from patrl.orchestrator.migration import (
    FlightReport,
    TicketReport,
    claim_orphans,
    continued_switches,
    read_report,
)
from patrl.orchestrator.rewards import RewardManager
from patrl.orchestrator.sync_loop import (
    RunResult,
    Sample,
    _batch_metrics,
    _load_tokenizer,
    _merge_reward_metrics,
    _probs_diff,
    _timed,
    engine_config,
    policy_batch,
    ppo_update,
    seed_everything,
    trainer_config,
)
from patrl.orchestrator.weight_store import WeightStore
from patrl.rollout import Engine, RequestOutput, SamplingParams, SequenceState
from patrl.trainer import Trainer

# Seconds an idle rollout rank sleeps between polls, and a waiting trainer.
_IDLE_POLL_S = 0.005
# Seconds between a rollout rank's looks at its peers' lives (a few store reads each).
_WATCH_EVERY_S = 0.1
# What a trained ticket's sample key holds afterwards: a late duplicate cannot be written.
_TRAINED = b"trained"


@dataclass(slots=True)
class GroupRecord:
    """One finished prompt group, as a rollout rank hands it to the trainer."""

    ticket: int
    rank: int  # the rollout rank that finished it
    samples: list[Sample]
    versions: list[list[int]]  # versions[i][j]: policy version that sampled token j of sample i
    reward_metrics: dict[str, float]
    life: int = 1  # of `rank`
    migrated_from: int | None = None  # the lost rank it was taken over from, if any
    migrated_tokens: int = 0  # tokens the adopter kept from that rank's report


@dataclass(slots=True)
class _InFlight:
    ticket: int
    item: PromptItem
    # Per sample: (index of the first token sampled with it, version), one per weight change.
    switches: list[list[tuple[int, int]]] = field(default_factory=list)
    migrated_from: int | None = None
    migrated_tokens: int = 0


def token_versions(switches: Sequence[tuple[int, int]], num_tokens: int) -> list[int]:
    """Expand (first token, version) switch points into one version per token."""
    out = []
    current = switches[0][1]
    pending = iter(switches[1:])
    upcoming = next(pending, None)
    for j in range(num_tokens):
        while upcoming is not None and upcoming[0] <= j:
            current = upcoming[1]
            upcoming = next(pending, None)
        out.append(current)
    return out


class AsyncGRPO:
    """The job's entry: builds this rank's role (rollout or trainer) and runs it."""

    def __init__(
        self,
        config: JobConfig,
        world: World,
        model_dir: str,
        train_files: Any,
        val_files: Any,
        peer_timeout_s: float | None = None,
    ) -> None:
        """`peer_timeout_s`: None = async_rl.peer_timeout_s."""
        _check_supported(config, world)
        # Async rollout replicas are static tp=1 engines: adaptive TP needs collectives over
        # the rollout ranks, which async mode avoids.
        self.config = config.model_copy(deep=True)
        self.config.rollout.adaptive_tp.enable = False
        self.world = world
        self.model_dir = model_dir
        self.run_dir = config.run_dir
        self.num_rollout = config.async_rl.rollout_ranks
        self.rollout_ranks = list(range(self.num_rollout))
        self.trainer_ranks = list(range(self.num_rollout, world.size))
        seed_everything(config.trainer.seed)
        self.tokenizer = _load_tokenizer(model_dir)
        self.train_set = dataset_for(config, self.tokenizer, train_files)
        self.val_set = (
            dataset_for(config, self.tokenizer, val_files)
            if val_files and config.trainer.test_freq
            else None
        )
        self.loader = PromptLoader(
            self.train_set.items,
            config.data.train_batch_size,
            shuffle=config.data.shuffle,
            seed=config.data.seed,
        )
        timeout = config.async_rl.peer_timeout_s if peer_timeout_s is None else peer_timeout_s
        self.control = ControlPlane.of_default_group(world.rank, timeout)
        self.weights = WeightStore(self.run_dir / "weights")
        # new_group is collective over the world: every rank makes the trainers' group.
        trainer_group = dist.new_group(self.trainer_ranks)
        self.role: RolloutWorker | TrainerWorker
        if world.rank < self.num_rollout:
            self.role = RolloutWorker(self)
        else:
            self.role = TrainerWorker(self, trainer_group)

    def run(self) -> RunResult:
        try:
            return self.role.run()
        except BaseException as err:
            # Peers polling the store stop at once instead of after their timeout.
            self.control.fail(f"{type(err).__name__}: {err}"[:500])
            raise


def validates(config: JobConfig, version: int) -> bool:
    """Whether version `version` is validated (the sync loop's rule, after step `version`)."""
    t = config.trainer
    if not t.test_freq:
        return False
    if version == 0:
        return t.val_before_train
    return version % t.test_freq == 0


def _check_supported(config: JobConfig, world: World) -> None:
    """What async mode does not do (yet) fails here, by name, before any work."""
    r = config.async_rl.rollout_ranks
    if r >= world.size:
        raise ValueError(
            f"async_rl.rollout_ranks={r} leaves no trainer rank in a world of {world.size}: "
            f"accepted 1..{world.size - 1}"
        )
    if config.algorithm.filter_groups.enable:
        raise ValueError("trainer.mode=async does not support algorithm.filter_groups.enable=true")
    if config.rollout.over_sample_rate:
        raise ValueError(
            "trainer.mode=async does not support partial rollouts: set rollout.over_sample_rate=0 "
            f"(got {config.rollout.over_sample_rate})"
        )


# ---------------------------------------------------------------------------- rollout ranks


class RolloutWorker:
    """Generates tickets as admission allows, pulls newer weights between engine steps, hands
    each finished group to the trainer through the store, reports its tickets in flight, and
    continues those of lost peers."""

    def __init__(self, job: AsyncGRPO) -> None:
        self.job = job
        self.config = job.config
        self.world = job.world
        self.model_dir = job.model_dir
        self.control = job.control
        self.batch_size = job.config.data.train_batch_size
        self.engine = self._new_engine()
        self.rewards = RewardManager(
            [(f.name, f.weight) for f in self.config.reward.functions],
            num_workers=self.config.reward.num_workers,
            timeout_s=self.config.reward.timeout_s,
        )
        self.in_flight: dict[str, _InFlight] = {}
        self.held: int | None = None  # a ticket taken but not yet admissible
        self.adopted: dict[int, TicketReport] = {}  # claimed from a lost life, not started yet
        self.batch_index = -1  # the newest loader batch read
        self.batches: dict[int, list[PromptItem]] = {}  # loader batches that may still be needed
        self.idle_s = 0.0
        self.validator = job.val_set is not None and self.world.rank == 0
        self.validating: dict[str, PromptItem] = {}  # request id -> item, of version val_version
        self.val_results: list[Sample] = []
        self.val_version = 0
        self.val_start = 0.0
        self.joined_at = 0  # the step the run (re)started at: validated before, if due
        self.life = 0  # this rank's current life: 1 at the start, one more at every rejoin
        self.watched: dict[int, int] = {r: 1 for r in job.rollout_ranks}  # first life to watch
        self._last_watch = -float("inf")
        self.steps_since_report = 0
        self.report_due = False  # a ticket was taken: report before the next engine step
        self.last_report = FlightReport(self.world.rank, 0, {})
        # What happened to this rank, for tests and logs: preemptions, declared gone, rejoins,
        # tickets handed over (ticket, life), and hand-overs that another rank had beaten.
        self.preempted: list[dict[str, Any]] = []
        self.declared_gone: list[dict[str, Any]] = []
        self.rejoins: list[dict[str, Any]] = []
        self.handed: list[tuple[int, int]] = []
        self.duplicates = 0

    def _new_engine(self) -> Engine:
        return Engine(engine_config(self.config, self.model_dir, self.world))

    def run(self) -> RunResult:
        try:
            self._join()
            while not self.control.done():
                self.control.beat()
                if self._lost():
                    continue
                self._pull_newest()
                self._watch_peers()
                self._admit()
                if self.report_due:
                    self._report()
                if self.engine.has_unfinished():
                    self.control.progress()
                    for out in self.engine.step():
                        if out.request_id in self.validating:
                            self._validated(out)
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

    def _join(self) -> None:
        """Wait for the trainer to say where the run starts (a resumed step, its loader)."""
        first_trainer = self.job.trainer_ranks[0]
        self.control.wait_until(
            lambda: self.control.has(["start"]), "the trainer to start", [first_trainer]
        )
        start = pickle.loads(self.control.get("start"))
        self.job.loader.load_state_dict(start["loader"])
        self.batch_index = start["step"] - 1
        self.joined_at = start["step"]
        self.life = self.control.bump(f"life/{self.world.rank}")
        self._report()
        if start["step"] > 0:
            self._pull_newest()
        elif validates(self.config, 0):
            self._start_validation()
        self._report_loaded()

    def _idle(self) -> None:
        """Nothing to run: admission waits for newer weights (or the run's last tickets are
        out). Counted as time/wait_for_weights; the trainer is watched meanwhile."""
        start = time.monotonic()
        self.control.check_alive(self.job.trainer_ranks)
        time.sleep(_IDLE_POLL_S)
        waited = time.monotonic() - start
        self.idle_s += waited
        self.control.bump(f"wait_weights_us/{self.world.rank}", int(waited * 1e6))

    # ------------------------------------------------------------------ weights

    def _pull_newest(self) -> None:
        if self.validating:
            return  # validation of the held version first: its tokens must all come from it
        latest = self.control.counter("weights/latest")
        if latest <= self.engine.weight_version:
            return
        # Tokens sampled from here on come from the new version.
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
        """Tickets below this may start: AReaL's capacity, and no ticket past the last step."""
        eta = self.config.async_rl.max_staleness
        version = self.engine.weight_version
        total = self.config.trainer.total_training_steps
        return min((eta + version + 1) * self.batch_size, total * self.batch_size)

    def _admit(self) -> None:
        """Start admissible tickets, at most a fair share of a batch per loop pass. Taking
        every admissible ticket at once let the first rank to see new weights take the whole
        batch while its peers idled (and a rejoined rank could find nothing left to do)."""
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

    def _start(self, ticket: int, migrated_from: int | None = None) -> None:
        b, n = ticket // self.batch_size, self.config.rollout.n
        item = self._item(ticket)
        r, version = self.config.rollout, self.engine.weight_version
        params = SamplingParams(
            n=n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=self.config.data.max_response_length,
            # The synchronous loop's seed for this prompt at step b + 1, round 1.
            seed=hash((self.config.trainer.seed, b + 1, 1, item.index)) & 0x7FFF_FFFF_FFFF,
        )
        request_id = f"ticket-{ticket}"
        self.engine.add_request(item.prompt_token_ids, params, request_id=request_id)
        switches = [[(0, version)] for _ in range(n)]
        self.in_flight[request_id] = _InFlight(ticket, item, switches, migrated_from)

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

    # --------------------------------------------------------------- validation

    def _start_validation(self) -> None:
        """The sync loop's validation requests (same prompts, seeds, temperature), added
        beside the training tickets. Only rank 0 validates."""
        if not self.validator:
            return
        assert self.job.val_set is not None
        items = self.job.val_set.items
        if self.config.data.val_batch_size:
            items = items[: self.config.data.val_batch_size]
        r, temperature = self.config.rollout, self.config.rollout.val_temperature
        version = self.engine.weight_version
        for item in items:
            params = SamplingParams(
                n=1,
                temperature=temperature,
                top_p=r.top_p if temperature > 0 else 1.0,
                top_k=r.top_k if temperature > 0 else 0,
                max_tokens=self.config.data.max_response_length,
                seed=hash((-1, item.index)) & 0x7FFF_FFFF_FFFF,
            )
            request_id = f"val-{version}-{item.index}"
            self.engine.add_request(item.prompt_token_ids, params, request_id=request_id)
            self.validating[request_id] = item
        self.val_version, self.val_start, self.val_results = version, time.perf_counter(), []

    def _validated(self, out: RequestOutput) -> None:
        item = self.validating.pop(out.request_id)
        c = out.outputs[0]
        reward = self.rewards.score([c.text or ""], [item.answer], [dict(item.extra)]).rewards[0]
        self.val_results.append(
            Sample(item.index, item.prompt_token_ids, c.token_ids, c.logprobs, "", reward)
        )
        if self.validating:
            return
        scores = [s.reward for s in self.val_results]
        metrics = {
            "val-core/acc/mean@1": float(np.mean(scores)) if scores else 0.0,
            "val/response_length/mean": float(np.mean([len(s.token_ids) for s in self.val_results]))
            if scores
            else 0.0,
            "timing_s/testing": time.perf_counter() - self.val_start,
        }
        self.control.put(f"val/{self.val_version}", pickle.dumps(metrics))

    # ---------------------------------------------------------------- hand over

    def _hand_over(self, out: RequestOutput) -> None:
        flight = self.in_flight.pop(out.request_id)
        item = flight.item
        result = self.rewards.score(
            [c.text if c.text is not None else "" for c in out.outputs],
            [item.answer] * len(out.outputs),
            [dict(item.extra) for _ in out.outputs],
        )
        samples = [
            Sample(
                item.index, item.prompt_token_ids, c.token_ids, c.logprobs, c.finish_reason, reward
            )
            for c, reward in zip(out.outputs, result.rewards, strict=True)
        ]
        versions = [token_versions(flight.switches[c.index], len(c.token_ids)) for c in out.outputs]
        record = GroupRecord(
            flight.ticket,
            self.world.rank,
            samples,
            versions,
            result.metrics(),
            self.life,
            flight.migrated_from,
            flight.migrated_tokens,
        )
        # First writer wins: a woken rank and the peer that adopted its ticket may both finish.
        if self.control.put_first(f"sample/{flight.ticket}", pickle.dumps(record)):
            self.handed.append((flight.ticket, self.life))
        else:
            self.duplicates += 1
            self.control.bump("duplicates")

    # --------------------------------------------------------------- migration

    def _report(self) -> None:
        """Tell the others what this rank holds, so they can continue it if it is lost."""
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
        if now - self._last_watch < _WATCH_EVERY_S:
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
            if self.control.has([f"sample/{ticket}"]):
                continue  # its lost rank woke up and handed it over after all
            self.report_due = True
            if not report.states:
                self._start(ticket, report.migrated_from)
                continue
            version = self.engine.weight_version
            self.engine.import_requests(report.states)
            self.in_flight[f"ticket-{ticket}"] = _InFlight(
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
            raise RuntimeError(
                f"rollout rank {me} validates (trainer.test_freq={self.config.trainer.test_freq}) "
                "and cannot be preempted: validation does not migrate. Preempt another rollout "
                "rank, or run without validation (trainer.test_freq=0)"
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
        del self.engine  # reclaimed with its instance: the replacement starts from the model
        self._stay_away(down_s)
        if not self.control.done():
            self.engine = self._new_engine()
            self._rejoin()

    def _stay_away(self, down_s: float) -> None:
        """Silent (no heartbeat: nothing runs there) until the down time passes, `resume`, or
        the run ends."""
        until, resume = time.monotonic() + down_s, f"resume/{self.world.rank}"
        while time.monotonic() < until and not self.control.has([resume]):
            if self.control.done():
                return
            time.sleep(_IDLE_POLL_S * 10)
        if self.control.has([resume]):
            self.control.delete(resume)

    def _woke_up_gone(self) -> None:
        """This rank stalled past the peer timeout and a peer declared it gone: keep the
        tickets nobody has claimed (still in this engine), drop the others, rejoin."""
        me, life = self.world.rank, self.life
        dropped, kept = [], []
        for rid, flight in list(self.in_flight.items()):
            if self.control.has([f"sample/{flight.ticket}"]) or not self.control.claim(
                f"{flight.ticket}/{me}.{life}"
            ):
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


# ---------------------------------------------------------------------------- trainer ranks


class TrainerWorker:
    """Takes each step's tickets from the store, trains on them with decoupled PPO and
    publishes the new weights; the first trainer rank logs, checkpoints and ends the run."""

    def __init__(self, job: AsyncGRPO, group: dist.ProcessGroup) -> None:
        self.job = job
        self.config = job.config
        self.world = job.world
        self.control = job.control
        self.batch_size = job.config.data.train_batch_size
        self.is_first = job.world.rank == job.trainer_ranks[0]
        mesh = None
        if len(job.trainer_ranks) > 1:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(group, job.world.device.type)
        config = trainer_config(self.config)
        config.behav_imp_weight_cap = self.config.async_rl.behaviour_weight_cap
        self.trainer = Trainer(config, job.model_dir, mesh=mesh, device=job.world.device)
        self.step = 0
        # (step, ticket, oldest, newest token version) of every trained sample.
        self.trained_versions: list[tuple[int, int, int, int]] = []
        # (step, ticket, rank, life, migrated_from, migrated_tokens) of every trained group.
        self.trained_groups: list[tuple[int, int, int, int, int | None, int]] = []
        self.published: list[tuple[int, float]] = []  # (version, when announced: time.time())
        self.all_lengths: list[int] = []
        self._waited_us = 0
        self._val_logged = -1  # the newest validated version logged

    def run(self) -> RunResult:
        cfg = self.config.trainer
        self._maybe_resume()
        self._announce_start()
        logger = (
            MetricsLogger(self.job.run_dir, cfg.logger, cfg.total_training_steps, self.step)
            if self.is_first
            else None
        )
        try:
            self._val_logged = self.step if self.step > 0 else -1
            while self.step < cfg.total_training_steps:
                self.step += 1
                metrics = self.train_one_step()
                if logger is not None:
                    logger.log(self.step, metrics)
                    self._log_validation(logger, wait=False)
                last = self.step == cfg.total_training_steps
                if (cfg.save_freq and self.step % cfg.save_freq == 0) or last:
                    self.save()
            if logger is not None:
                self._log_validation(logger, wait=True)
            if self.is_first:
                self.control.finish()
        finally:
            if logger is not None:
                logger.close()
        history = logger.history if logger is not None else []
        if logger is not None:
            print("\n" + logger.summary())
            if cfg.plots:
                written = plot_run(history, self.all_lengths, [], self.job.run_dir)
                print("plots: " + ", ".join(str(p) for p in written))
        return RunResult(self.step, history, self.job.run_dir)

    def _log_validation(self, logger: MetricsLogger, wait: bool) -> None:
        """Log the validations rank 0 finished, in version order; with `wait`, all that are
        due up to the current step (the run's end)."""
        due = [
            v
            for v in range(self._val_logged + 1, self.step + 1)
            if self.job.val_set is not None and validates(self.config, v)
        ]
        for v in due:
            key = f"val/{v}"

            def arrived(key: str = key) -> bool:
                return self.control.has([key])

            if wait:
                self.control.wait_until(arrived, f"validation {v}", [0])
            elif not arrived():
                return
            logger.log(v, pickle.loads(self.control.get(key)))
            self._val_logged = v

    def _announce_start(self) -> None:
        """Weights of a resumed step, the ticket counter and the loader, then "start"."""
        if self.step > 0:
            self._publish(self.step)
        if self.is_first:
            self.control.bump("tickets", self.step * self.batch_size)
            start = {"step": self.step, "loader": self.job.loader.state_dict()}
            self.control.put("start", pickle.dumps(start))

    # --------------------------------------------------------------------- step

    def train_one_step(self) -> dict[str, float]:
        cfg = self.config
        timings: dict[str, float] = {}
        start = time.perf_counter()
        self.control.beat()  # a step may take a while: the rollout ranks watch this beat
        records = self._take_batch(timings)
        samples = [s for r in records for s in r.samples]
        batch, rewards, advantages = policy_batch(cfg, samples, behaviour=True)
        with _timed(timings, "old_log_prob"):
            proximal = self.trainer.compute_logprobs(batch)
        batch.old_logprobs = proximal
        with _timed(timings, "update_actor"):
            actor_metrics = ppo_update(self.config, self.trainer, batch, samples, self.step)
        self.control.beat()
        last = self.step == cfg.trainer.total_training_steps
        # After the last step nobody generates; only a validation would read the weights.
        if not last or (self.job.val_set is not None and validates(cfg, self.step)):
            with _timed(timings, "update_weights"):
                self._publish(self.step)
        timings["step"] = time.perf_counter() - start
        self.job.loader.next_batch()  # kept in step with the tickets, for checkpoints
        metrics = {f"timing_s/{k}": v for k, v in timings.items()}
        metrics["time/wait_for_batch"] = timings["wait_for_batch"]
        metrics["time/wait_for_weights"] = self._rollout_wait_s()
        _merge_reward_metrics(metrics, [r.reward_metrics for r in records if r.reward_metrics])
        metrics.update(actor_metrics)
        metrics.update(_batch_metrics(samples, rewards, advantages, cfg.data.max_response_length))
        metrics.update(_probs_diff(samples, proximal))
        metrics.update(self._staleness(records))
        metrics.update(self._migrations(records))
        tokens = sum(len(s.prompt_token_ids) + len(s.token_ids) for s in samples)
        metrics["perf/total_num_tokens"] = float(tokens)
        metrics["perf/throughput"] = tokens / timings["step"] / self.world.size
        self.all_lengths += [len(s.token_ids) for s in samples]
        return metrics

    def _tickets(self) -> range:
        return range((self.step - 1) * self.batch_size, self.step * self.batch_size)

    def _take_batch(self, timings: dict[str, float]) -> list[GroupRecord]:
        """This step's groups, in ticket order; waits (idle) until all of them are in."""
        keys = [f"sample/{t}" for t in self._tickets()]
        with _timed(timings, "wait_for_batch"):
            # A lost rollout rank's tickets migrate: only all of them lost fails the wait.
            self.control.wait_until(
                lambda: self.control.has(keys),
                f"the samples of step {self.step}",
                self.job.rollout_ranks,
                need_progress=True,
                any_peer=True,
            )
        records = [pickle.loads(self.control.get(k)) for k in keys]
        # The last trainer rank to read a step's samples replaces them by a tombstone: the
        # store's memory is freed, and a late duplicate (see put_first) cannot come back.
        readers = len(self.job.trainer_ranks)
        if self.control.bump(f"read/{self.step}") == readers:
            for t in self._tickets():
                self.control.put(f"sample/{t}", _TRAINED)
        return records

    def _staleness(self, records: list[GroupRecord]) -> dict[str, float]:
        """How many versions behind the trainer each trained sample's oldest token was."""
        version = self.step - 1  # the weights this step's update starts from
        eta = self.config.async_rl.max_staleness
        per_sample, per_token = [], []
        for r in records:
            for vs in r.versions:
                oldest, newest = (min(vs), max(vs)) if vs else (version, version)
                self.trained_versions.append((self.step, r.ticket, oldest, newest))
                per_sample.append(version - oldest)
                per_token += [version - v for v in vs]
        worst = max(per_sample)
        if worst > eta:  # the admission rule makes this impossible: a bug, not a condition
            raise RuntimeError(
                f"step {self.step}: a sample is {worst} versions stale, above "
                f"async_rl.max_staleness={eta}"
            )
        out = {
            "async/staleness_mean": float(np.mean(per_sample)),
            "async/staleness_max": float(worst),
            "async/token_staleness_mean": float(np.mean(per_token)) if per_token else 0.0,
            "async/mixed_version_samples": float(
                sum(1 for r in records for vs in r.versions if vs and min(vs) != max(vs))
            ),
        }
        for s in range(eta + 1):
            out[f"async/staleness_count/{s}"] = float(per_sample.count(s))
        return out

    def _migrations(self, records: list[GroupRecord]) -> dict[str, float]:
        """This step's groups finished by another rank than the one that lost them, and the
        tokens kept from the lost rank's reports; lost ranks so far (counters of the run)."""
        migrated = [r for r in records if r.migrated_from is not None]
        for r in records:
            self.trained_groups.append(
                (self.step, r.ticket, r.rank, r.life, r.migrated_from, r.migrated_tokens)
            )
        return {
            "async/migrated_requests": float(len(migrated)),
            "async/migrated_tokens": float(sum(r.migrated_tokens for r in migrated)),
            "async/preemptions": float(self.control.counter("preemptions")),
            "async/stalls": float(self.control.counter("stalls")),
            "async/rejoins": float(self.control.counter("rejoins")),
            "async/duplicate_groups": float(self.control.counter("duplicates")),
        }

    def _rollout_wait_s(self) -> float:
        """Rollout ranks' idle time since the last step, per rank (they wait for weights)."""
        total = sum(self.control.counter(f"wait_weights_us/{r}") for r in self.job.rollout_ranks)
        delta, self._waited_us = total - self._waited_us, total
        return delta / 1e6 / len(self.job.rollout_ranks)

    # ------------------------------------------------------------------ weights

    def _publish(self, version: int) -> None:
        """Full weights to disk as `version` (every trainer rank gathers, the first writes),
        then announce it; versions no rollout rank still holds are deleted."""
        bucket_bytes = self.config.rollout.update_weights_bucket_megabytes << 20
        buckets = self.trainer.iter_full_weights(bucket_bytes)
        if not self.is_first:
            for _ in buckets:  # the gathers are collectives of the trainer group
                pass
            return
        self.job.weights.publish(version, buckets)
        self.control.bump("weights/latest", version - self.control.counter("weights/latest"))
        self.published.append((version, time.time()))
        held = [self._loaded(r) for r in self.job.rollout_ranks]
        self.job.weights.prune(min([*held, version]))

    def _loaded(self, rank: int) -> int:
        key = f"loaded/{rank}"
        return int(self.control.get(key)) if self.control.has([key]) else 0

    # ------------------------------------------------------------ checkpoints

    def save(self) -> Path:
        """The synchronous loop's checkpoint layout, written by the trainer ranks alone."""
        run_dir, group = self.job.run_dir, self.trainer.group
        staging = checkpointing.staging_dir(run_dir, self.step)
        if self.is_first:
            checkpointing.prepare_staging(run_dir, self.step)
        group.barrier()
        self.trainer.save(staging / "trainer")
        group.barrier()
        if self.is_first:
            state = {
                "step": self.step,
                "loader": self.job.loader.state_dict(),
                "length_predictor": LengthPredictor().state_dict(),
            }
            checkpointing.commit(
                run_dir, self.step, state, self.config.trainer.max_checkpoints_to_keep
            )
        group.barrier()
        return checkpointing.step_dir(run_dir, self.step)

    def _maybe_resume(self) -> None:
        t = self.config.trainer
        if t.resume_mode == "disable":
            return
        if t.resume_mode == "resume_path" and t.resume_from_path:
            found: Path | None = Path(t.resume_from_path)
        else:
            found = checkpointing.latest_checkpoint(self.job.run_dir)
        if found is None:
            return
        if not (found / checkpointing.STATE_FILE).is_file():
            raise FileNotFoundError(
                f"{found} is not a complete patrl checkpoint (no {checkpointing.STATE_FILE})"
            )
        state = checkpointing.read_state(found)
        self.trainer.load(found / "trainer")
        self.job.loader.load_state_dict(state["loader"])
        self.step = int(state["step"])
        if self.is_first:
            print(f"resumed from {found} at step {self.step}")
