"""Tickets: the prompt stream cut into one ticket per prompt group. Ticket t is prompt t % B of
the loader's batch t // B (B = data.train_batch_size), sampled with the sync schedule's seeds
for step t // B + 1; step s trains exactly tickets [(s-1)B, sB). A finished ticket travels to
the trainer as a GroupRecord under `sample_key(t)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from patrl.orchestrator.config import JobConfig
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.rewards import FailureSummary
from patrl.orchestrator.sampling import sampling_params, training_seed_key
from patrl.orchestrator.scoring import Sample
from patrl.rollout import SamplingParams
from patrl.rollout.drafter import SOURCES, Drafter, speculation_metrics

# What a trained ticket's sample key holds afterwards: a late duplicate cannot be written.
TRAINED = b"trained"


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
    failures: FailureSummary = field(default_factory=FailureSummary)  # its reward calls'
    # the speculation counts (SPEC_COUNTS) its rank's engine added since that rank's previous
    # hand-over; empty without speculation
    spec_counts: dict[str, float] = field(default_factory=dict)


# The drafter's counters that add up across engines and intervals (`DraftStats.stats`).
SPEC_COUNTS = (
    "spec_sample_steps",
    "spec_emitted_tokens",
    "spec_drafted_tokens",
    "spec_accepted_tokens",
    *(f"spec_accepted_tokens/{s}" for s in SOURCES),
)


def spec_totals(drafter: Drafter | None) -> dict[str, float]:
    """The drafter's running `SPEC_COUNTS` since it was made; empty without speculation."""
    if drafter is None:
        return {}
    stats = drafter.counts.stats()
    return {k: stats[k] for k in SPEC_COUNTS}


def spec_metrics(records: Sequence[GroupRecord]) -> dict[str, float]:
    """The sync loop's `rollout/spec_*` metrics (`speculation_metrics`) over the counts the
    records carry, summed: every counted step lands in exactly one handed-over record (the
    interval before it), so a step's row prices the rollout work that produced its groups,
    give or take the in-flight groups at each hand-over. Empty when no record carries counts."""
    total: dict[str, float] = {}
    for r in records:
        for k, v in r.spec_counts.items():
            total[k] = total.get(k, 0.0) + v
    return speculation_metrics({}, total)


@dataclass(slots=True)
class InFlight:
    """A ticket a rollout rank is generating."""

    ticket: int
    item: PromptItem
    # Per sample: (index of the first token sampled with it, version), one per weight change.
    switches: list[list[tuple[int, int]]] = field(default_factory=list)
    migrated_from: int | None = None
    migrated_tokens: int = 0


def sample_key(ticket: int) -> str:
    """Where a ticket's GroupRecord (then its tombstone, TRAINED) is stored."""
    return f"sample/{ticket}"


def request_id(ticket: int) -> str:
    return f"ticket-{ticket}"


def step_tickets(step: int, batch_size: int) -> range:
    """The tickets training step `step` trains."""
    return range((step - 1) * batch_size, step * batch_size)


def admission_limit(config: JobConfig, version: int) -> int:
    """Tickets below this may start on a rank holding weights `version`: AReaL's capacity
    (max_staleness + version + 1) batches, and no ticket past the last step."""
    batch = config.data.train_batch_size
    total = config.total_steps
    return min((config.async_rl.max_staleness + version + 1) * batch, total * batch)


def ticket_params(config: JobConfig, ticket: int, item: PromptItem) -> SamplingParams:
    """How `ticket` is sampled: as the sync schedule samples its prompt at step t // B + 1."""
    step = ticket // config.data.train_batch_size + 1
    r = config.rollout
    return sampling_params(config, item, r.n, r.temperature, training_seed_key(config, step))


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
