"""An adaptive rollout driven a step at a time from outside (the agent loop's multi-turn
rollout), where `AdaptiveEngine.generate` drives it from a batch it holds whole.

`SteppedRollout` is what every rank of the world runs, in step: `begin`, then rounds of
(the driver's requests added) -> `check` when the driver says one is due -> `step`, then
`end`. The caller makes the world agree on when a check is due (one rank decides and tells
the others): a check is a world collective and a switch moves requests between replicas.
A switch releases every kept turn (`Engine.release_kept`) on every rank first: a fold
rebuilds the KV cache, so no kept turn's KV would survive it, and the merged group's ranks
must hold the same kept turns (the engine's SPMD contract), which they would not (each old
replica kept its own). The caller's continuation of a released turn is then a new request
of the whole conversation, found by prefix caching where it can be. See docs/agent_loop.md.
"""

from __future__ import annotations

import math
import time

from patrl.lenpredict import NEVER, Layout
from patrl.rollout.adaptive.controller import TPController, Verdict
from patrl.rollout.adaptive.driver import AdaptiveEngine, unfinished_rows
from patrl.rollout.engine import Engine
from patrl.rollout.outputs import RequestOutput


class SteppedRollout:
    """One rollout of `adaptive` (an AdaptiveEngine with a controller) stepped by its
    caller. Every rank calls `begin`, `check`, `step` and `end` in the same order (a check
    and a switch are world collectives; a step is its TP group's). `due` (read on the rank
    that decides for the world) says when the controller asked for the next check."""

    def __init__(self, adaptive: AdaptiveEngine) -> None:
        if adaptive.controller is None:
            raise ValueError("SteppedRollout needs an adaptive engine with a controller")
        self.adaptive = adaptive
        self.controller: TPController = adaptive.controller
        self.engine: Engine = adaptive.engine
        self.num_switches = 0  # this rollout's
        self._steps_left = 0
        self._deadline = math.inf
        self._opened = False
        self._started = 0.0
        self._stepping = 0.0
        self._switching_before = 0.0

    def begin(self) -> None:
        """A rollout starts (every rank): the return owed by the last one is paid, the
        controller opens the rollout; the first `check` is due at once."""
        c, engine = self.controller, self.engine
        if engine.has_unfinished():
            raise RuntimeError("a stepped adaptive rollout needs an idle engine")
        engine.reset_timeline()
        c.stats.reset_s += self.adaptive.settle_layout()
        c.begin()
        self.num_switches = 0
        self._steps_left, self._deadline, self._opened = 0, math.inf, False
        if c.never_switches(Layout.of(engine.layout), engine.max_model_len):
            self._steps_left, self._opened = NEVER, True  # no check could switch from here
        self._started, self._stepping = time.perf_counter(), 0.0
        self._switching_before = c.stats.reconfig_s

    def note_request(self, request_id: str) -> None:
        """A request (one turn, one sample) joined this replica: its own length group."""
        self.controller.note_request(request_id, request_id, 1)

    @property
    def due(self) -> bool:
        """Whether the controller asked for a check by now (its steps, or its window)."""
        return self._steps_left <= 0 or time.perf_counter() >= self._deadline

    def check(self, had_work: bool) -> Verdict:
        """A check (every rank of the world at once): this replica's unfinished samples to
        the controller, and its verdict applied (a switch releases every kept turn first).
        `had_work`: this replica has work, or (on the deciding rank) a sample of the
        rollout is still running (awaiting a tool), so the rollout is not over. Returns the
        verdict (target_tp None: over everywhere)."""
        c, engine = self.controller, self.engine
        rows = unfinished_rows(engine) if engine.layout.tp_rank == 0 else None
        verdict = c.check(rows, engine.layout.tp_size, had_work=had_work)
        if verdict.target_tp is None:
            return verdict
        if verdict.target_tp != engine.layout.tp_size:
            engine.release_kept()
            self.adaptive.switch(verdict)
            self.num_switches += 1
        if not self._opened:  # the first check saw the rollout's first turns
            self._opened = True
            c.opening_tp = verdict.opening_tp or engine.layout.tp_size
        self._steps_left = verdict.recheck_steps or c.policy.check_every
        self._deadline = math.inf
        if verdict.window_s is not None:
            self._deadline, self._steps_left = time.perf_counter() + verdict.window_s, NEVER
        return verdict

    def step(self) -> list[RequestOutput]:
        """One engine step (every rank of this replica; none when it has no work): the
        requests it finished (the replica's first rank reports them to the controller)."""
        engine, c = self.engine, self.controller
        if not engine.has_unfinished():
            return []
        t0 = time.perf_counter()
        finished = engine.step()
        self._stepping += time.perf_counter() - t0
        if engine.layout.tp_rank == 0:
            for out in finished:
                c.note_finished(out)
        if engine.timeline and not engine.timeline[-1].is_prefill:
            c.note_decode_step(engine.timeline[-1].duration_s)
        return finished

    def count_round(self) -> None:
        """A round of steps passed (on the deciding rank: it counts the checks' steps)."""
        self._steps_left -= 1

    def end(self) -> None:
        """The rollout is over (every rank, every engine idle): the last check (it feeds the
        length model what finished since the previous one and finds the rollout over), the
        controller's record, and the return owed to where the next rollout opens."""
        c, engine = self.controller, self.engine
        verdict = c.check(
            unfinished_rows(engine) if engine.layout.tp_rank == 0 else None,
            engine.layout.tp_size,
            had_work=False,
        )
        if verdict.target_tp is not None:
            raise RuntimeError(
                "the stepped adaptive rollout ended with a replica still holding work: this "
                "is a bug"
            )
        switching = c.stats.reconfig_s - self._switching_before
        c.end_rollout(self._stepping, time.perf_counter() - self._started - switching)
        groups = self.adaptive.groups
        assert groups is not None  # a controller's engine has its GroupCache
        self.adaptive.return_later(groups.layout(c.opening_tp))
