"""Token-level migration of an async rollout rank's work (RLBoost): what a rank reports of its
tickets in flight, and how a peer claims and continues those of a lost rank.

A rank reports under `flight/<rank>.<life>` each ticket's samples so far (tokens, logprobs,
finish state, sampler RNG state: `Engine.snapshot_requests`, no KV) and their policy version
switch points. When the rank is lost, its peers `claim_orphans` from its last report, one
winner per ticket over the whole job, and continue them by recompute (`Engine.import_requests`):
reported tokens are kept, and the RNG state resamples the rest alike under the same weights.
A multi-turn ticket's samples are reported as their agent loops' records instead
(`agent_tickets.SampleRecord`: finished turns, tool answers, and the open turn's snapshot),
which the adopter replays, continuing the open turn from its reported tokens.
`rollout_worker.RolloutWorker` drives this; the protocol is in docs/async.md.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from patrl.orchestrator.async_rl.agent_tickets import SampleRecord
from patrl.orchestrator.control import ControlPlane
from patrl.rollout import SequenceState


@dataclass(slots=True)
class TicketReport:
    """What a peer needs to continue one ticket: its samples as they stood (none: not started,
    start it afresh) and their version switch points; a multi-turn ticket's in `records`
    instead (one per sample; None for a single-turn ticket)."""

    states: list[SequenceState]
    switches: list[list[tuple[int, int]]]
    migrated_from: int | None = None  # kept along when an adopted ticket moves on again
    records: list[SampleRecord] | None = None

    def tokens(self) -> int:
        """The model tokens reported."""
        turns = sum(r.tokens() for r in self.records or [])
        return sum(len(s.output_token_ids) for s in self.states) + turns


@dataclass(slots=True)
class FlightReport:
    """A rollout rank's tickets in one of its lives, as it last reported them."""

    rank: int
    life: int
    tickets: dict[int, TicketReport]

    def key(self) -> str:
        return report_key(self.rank, self.life)

    def tokens(self) -> int:
        return sum(t.tokens() for t in self.tickets.values())

    def to_bytes(self) -> bytes:
        """Pickled, with the samples' generator states (uint8 tensors) as plain bytes, which
        pickle far faster than torch's own tensor pickling (a report is written often)."""
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}
        pickler.dump(self)
        return buffer.getvalue()

    @staticmethod
    def from_bytes(data: bytes) -> FlightReport:
        report = pickle.loads(data)
        if not isinstance(report, FlightReport):
            raise TypeError(f"not a FlightReport: {type(report).__name__}")
        return report


def _reduce_tensor(t: torch.Tensor) -> tuple[Any, ...]:
    if t.dtype is torch.uint8 and t.device.type == "cpu" and t.dim() == 1:
        return _uint8_tensor, (t.contiguous().numpy().tobytes(),)
    return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def _uint8_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def report_key(rank: int, life: int) -> str:
    return f"flight/{rank}.{life}"


def read_report(control: ControlPlane, rank: int, life: int) -> FlightReport | None:
    """The last report of `rank` in `life`; None if it never reported in it."""
    key = report_key(rank, life)
    if not control.has([key]):
        return None
    return FlightReport.from_bytes(control.get(key))


def claim_orphans(control: ControlPlane, report: FlightReport) -> dict[int, TicketReport]:
    """The tickets of a lost life that this caller wins (each has exactly one winner over the
    job: the adopters and the rank itself, should it wake up); tickets already handed over
    are nobody's."""
    won = {}
    for ticket, ticket_report in sorted(report.tickets.items()):
        if control.has([f"sample/{ticket}"]):
            continue
        if control.claim(f"{ticket}/{report.rank}.{report.life}"):
            won[ticket] = ticket_report
    return won


def continued_switches(report: TicketReport, version: int) -> list[list[tuple[int, int]]]:
    """An adopted ticket's switch points: the reported ones, then `version` from the first
    token the adopter samples (finished samples take no more tokens)."""
    states = {s.sample_index: s for s in report.states}
    out = []
    for index, switches in enumerate(report.switches):
        state = states[index]
        if state.finish_reason is not None:
            out.append(list(switches))
        else:
            out.append([*switches, (len(state.output_token_ids), version)])
    return out
