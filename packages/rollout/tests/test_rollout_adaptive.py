"""Adaptive TP end to end through `generate`: a planner-driven switch mid-rollout changes no
token; a planner for which switching never pays never switches; one for which it always pays
switches once and never back; the engine ends every rollout at its starting layout."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from patrl.lenpredict import (
    Decision,
    Layout,
    LengthPredictor,
    RunningSet,
    assign_replicas,
)
from patrl.lenpredict.planner import NEVER, Option
from patrl.rollout.adaptive import (
    AdaptiveEngine,
    OracleLengths,
    TPController,
    critical_path,
    make_engine,
    make_planner,
    opening_layout,
)
from patrl.rollout.adaptive.controller import _Summary
from patrl.rollout.adaptive.switch_plan import Row
from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.loader import iter_checkpoint
from patrl.rollout.plot import plot_timeline
from patrl.rollout.sampler import SamplingParams
from patrl.rollout.tp_policy import AdaptiveTP
from patrl.tpreshard import GroupCache
from patrl_testkit.models import save_hf_model, tiny_hf_model
from patrl_testkit.multirank import run_ranks
from patrl_testkit.profiles import synthetic_profile

pytestmark = pytest.mark.multirank

GREEDY = SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(tiny_hf_model("llama"), tmp_path_factory.mktemp("llama_adaptive"))


def _config(model_dir: str, **policy: Any) -> EngineConfig:
    # checks exactly check_every steps apart (the forced switches are placed by check count)
    policy = {"check_budget": 0.0, **policy} if policy else policy
    tp_policy = {"kind": "adaptive", "candidates": (1, 2), **policy} if policy else None
    extra = {"tp_policy": tp_policy} if tp_policy else {}
    return EngineConfig(model=model_dir, block_size=4, num_kv_blocks=128, max_model_len=96, **extra)


def _prompts(dp_rank: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Per replica: greedy and sampled requests with different lengths (a short tail)."""
    g = torch.Generator().manual_seed(200 + dp_rank)
    lengths = (5, 11, 8, 3)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in lengths]
    params = [
        GREEDY,
        SAMPLED,
        SamplingParams(temperature=0, max_tokens=6 + 3 * dp_rank, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, seed=5 + dp_rank, max_tokens=25, ignore_eos=True),
    ]
    return prompts, params


def _tokens(outputs: list[Any]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _logprobs(outputs: list[Any]) -> list[float]:
    return [lp for o in outputs for c in o.outputs for lp in c.logprobs]


class _TestPlanner:
    """The planner protocol's questions, answered as a planner without a profile would: a
    switch may always pay, no layout is proved static, steps do not get cheaper, and no
    latency model (checks counted in steps)."""

    latency: Any = None

    def may_switch(self, running: RunningSet, current: Layout) -> bool:
        return True

    def never_switches_from(self, current: Layout, max_context: int) -> bool:
        return False

    def shrinking_share(self, running: RunningSet, current: Layout, steps: int) -> float:
        return 1.0


class ForcedPlanner(_TestPlanner):
    """Switches to `target_tp` at its `at_call`-th check (counted from 1), else stays."""

    def __init__(self, at_call: int, target_tp: int, world_size: int) -> None:
        self.at_call, self.target_tp, self.world_size = at_call, target_tp, world_size
        self.calls = 0

    def new_rollout(self) -> None:
        self.calls = 0

    def decide(self, running: RunningSet, current: Layout) -> Decision:
        self.calls += 1
        n = len(running)
        stay = Option(current, 1.0, 0.0, np.inf, 0, running.replica, np.zeros(n, dtype=bool))
        if self.calls != self.at_call or current.tp == self.target_tp:
            return Decision(
                "stay", current, current, 0.0, 0.0, "forced stay", [stay], running.seq_ids
            )
        target = Layout(dp=self.world_size // self.target_tp, tp=self.target_tp)
        # alternate migrate / recompute so kv_policy=auto exercises both
        migrate = np.arange(n) % 2 == 0
        # where each sequence runs: the split a planner prices (a verdict's plan is run as is)
        go = Option(target, 0.5, 0.1, np.inf, 0, assign_replicas(running, current, target), migrate)
        return Decision("switch", current, target, 0.5, 0.1, "forced", [stay, go], running.seq_ids)


def _forced(
    rank: int, world_size: int, model_dir: str, at_call: int, kv: str, keep: bool = True
) -> dict[str, Any]:
    groups = GroupCache([1, 2], world_size=world_size, rank=rank)
    reference = Engine(_config(model_dir))  # each rank alone: the uninterrupted run
    prompts, params = _prompts(rank)
    expected = reference.generate(prompts, params)
    planner = ForcedPlanner(at_call, 2, world_size)
    predictor = LengthPredictor()
    config = _config(model_dir, check_every=3, kv_policy=kv)
    engine = AdaptiveEngine(
        config.model_copy(update={"keep_full_weights": keep}),
        groups=groups,
        planner=planner,
        lengths=predictor,
    )
    assert engine.layout.tp_size == 1
    storage = [p.untyped_storage().data_ptr() for p in engine.engine.model.parameters()]
    got = engine.generate(prompts, params, prompt_keys=[f"p{rank}-{i}" for i in range(4)])
    stats = engine.stats()
    names = [f"p{r}-{i}" for r in range(2) for i in range(4)]
    learnt = {k: predictor.expected_length(k) for k in names}, predictor.global_mean()
    owed = engine.layout.tp_size  # the return to tp=1 is deferred...
    # ...to the start of the next rollout (a reconfigure: weights gathered), which starts wide
    # again and switches again,
    again = engine.generate(prompts, params)
    # ...or to a weight sync, which loads into the full tensors the fold kept, with no
    # collective: the parameters are back in the storage they had at tp 1
    created = groups.num_created
    engine.load_weights(iter_checkpoint(model_dir), version=1)
    reloaded = engine.layout.tp_size
    kept = storage == [p.untyped_storage().data_ptr() for p in engine.engine.model.parameters()]
    assert groups.num_created == created
    third = engine.generate(prompts, params)
    # no seed: under a TP>1 opening the submitting rank draws one for the whole group (else the
    # group's ranks would sample differently and the engine would refuse)
    unseeded = engine.generate(
        prompts[:1], [SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)]
    )
    return {
        "unseeded": len(unseeded[0].outputs[0].token_ids),
        "opening_tp": engine.controller.opening_tp,
        "expected": _tokens(expected),
        "got": _tokens(got),
        "again": _tokens(again),
        "lp_expected": _logprobs(expected),
        "lp_got": _logprobs(got),
        "switches": (stats["tp_switches"], engine.stats()["tp_switches"]),
        "decisions": stats["tp_decisions"],
        "timeline_tp": [r["tp_size"] for r in stats["timeline"]],
        "tp_after": (owed, reloaded),
        "kept_storage": kept,
        "third": _tokens(third),
        "learnt": learnt,
    }


@pytest.mark.parametrize(
    "at_call,kv,keep", [(1, "recompute", True), (3, "auto", True), (3, "auto", False)]
)
def test_forced_switch_changes_no_token(llama_dir: Path, at_call: int, kv: str, keep: bool) -> None:
    results = run_ranks(_forced, 2, args=(str(llama_dir), at_call, kv, keep), timeout_s=300)
    for r in results:
        assert r["got"] == r["expected"]
        assert r["again"] == r["expected"]
        np.testing.assert_allclose(r["lp_got"], r["lp_expected"], atol=1e-4)
        if at_call == 1:
            # the first check chose tp 2 for the whole batch, so every later rollout opens at
            # tp 2, the replicas' submissions merged: no switch, and no return to tp 1 owed
            assert r["opening_tp"] == 2
            assert r["switches"] == (1, 1)
            assert r["tp_after"] == (2, 2)
        else:
            assert r["opening_tp"] == 1
            # once per full rollout; the short unseeded one ends before the forced 3rd check
            assert r["switches"] == (1, 3)
            assert r["tp_after"] == (2, 1)  # owed after a rollout, paid by the weight sync
            # ...from the full tensors the folds kept, or else by rebuilding the model
            assert r["kept_storage"] is keep
        assert r["third"] == r["expected"]
        assert r["unseeded"] == 7
        tps = r["timeline_tp"]
        assert tps[0] == (2 if at_call == 1 else 1) and tps[-1] == 2
        assert tps == sorted(tps)  # grows once, never back within the rollout
        switches = [d for d in r["decisions"] if d["action"] == "switch"]
        assert len(switches) == 1 and switches[0]["measured_overhead_s"] > 0
        assert all(d["measured_finish_s"] >= 0 for d in r["decisions"])
    predicted = [
        [
            {k: v for k, v in d.items() if not k.startswith("measured") and k != "t"}
            for d in r["decisions"]
        ]
        for r in results
    ]
    assert predicted[0] == predicted[1]  # rank 0 decided, every rank applied the same

    # the length predictor learnt every replica's lengths online, the same on every rank
    expected, mean = results[0]["learnt"]
    assert results[1]["learnt"] == (expected, mean)
    total = sum(18 + 3 * 16 + 6 + 3 * r + 25 for r in range(2))  # per replica r, 6 samples
    assert mean == pytest.approx(total / 12)
    assert expected["p1-3"] > mean  # one 25-token group: above the mean, shrunk towards it


class DearSwitchPlanner(_TestPlanner):
    """Always stays, but prices tp 2 faster for the batch, with a switch too dear to pay off
    in one rollout: the next rollouts should open at tp 2."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def new_rollout(self) -> None:
        pass

    def decide(self, running: RunningSet, current: Layout) -> Decision:
        n = len(running)
        other = Layout(dp=self.world_size // (3 - current.tp), tp=3 - current.tp)
        run = {1: 1.0, 2: 0.5}
        stay = Option(current, run[current.tp], 0.0, np.inf, 0, running.replica, np.zeros(n, bool))
        go = Option(other, run[other.tp], 10.0, np.inf, 0, running.replica, np.ones(n, bool))
        return Decision("stay", current, current, 0.5, 10.0, "dear", [stay, go], running.seq_ids)


def _opening(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    groups = GroupCache([1, 2], world_size=world_size, rank=rank)
    prompts, params = _prompts(rank)
    expected = Engine(_config(model_dir)).generate(prompts, params)
    engine = AdaptiveEngine(
        _config(model_dir, check_every=3), groups=groups, planner=DearSwitchPlanner(world_size)
    )
    out: dict[str, Any] = {"expected": _tokens(expected)}
    for name in ("first", "second"):
        got = engine.generate(prompts, params)
        stats = engine.stats()
        out[name] = {
            "tokens": _tokens(got),
            "tps": sorted({r["tp_size"] for r in stats["timeline"]}),
            "opening": engine.controller.opening_tp,
        }
    out["switches"] = engine.stats()["tp_switches"]
    return out


def test_a_stay_that_prices_another_layout_faster_opens_the_next_rollout_there(
    llama_dir: Path,
) -> None:
    for r in run_ranks(_opening, 2, args=(str(llama_dir),), timeout_s=300):
        # the first rollout stays at tp 1 (the switch is too dear) but names tp 2 the opening;
        # the second opens at tp 2 (the engine's return, not a planner switch) and keeps it
        assert r["first"] == {"tokens": r["expected"], "tps": [1], "opening": 2}
        assert r["second"] == {"tokens": r["expected"], "tps": [2], "opening": 2}
        assert r["switches"] == 0


class OpenWideThenSplitPlanner(DearSwitchPlanner):
    """First rollout: stays, naming tp 2 the opening (as DearSwitchPlanner). The second, which
    opens at tp 2: splits to tp 1 at its `split_at`-th check and, with `grow_at`, folds back to
    tp 2 at that check. Later ones: stay."""

    def __init__(self, world_size: int, split_at: int, grow_at: int | None) -> None:
        super().__init__(world_size)
        self.split_at, self.grow_at = split_at, grow_at
        self.rollouts = self.calls = 0

    def new_rollout(self) -> None:
        self.rollouts += 1
        self.calls = 0

    def decide(self, running: RunningSet, current: Layout) -> Decision:
        self.calls += 1
        if self.rollouts == 2 and self.calls == self.split_at and current.tp == 2:
            return ForcedPlanner(1, 1, self.world_size).decide(running, current)
        if self.rollouts == 2 and self.calls == self.grow_at and current.tp == 1:
            return ForcedPlanner(1, 2, self.world_size).decide(running, current)
        if self.rollouts == 1:
            return super().decide(running, current)
        n = len(running)
        stay = Option(current, 1.0, 0.0, np.inf, 0, running.replica, np.zeros(n, dtype=bool))
        return Decision("stay", current, current, 0.0, 0.0, "stay", [stay], running.seq_ids)


def _open_then_split(
    rank: int, world_size: int, model_dir: str, split_at: int, grow_at: int | None
) -> dict[str, Any]:
    groups = GroupCache([1, 2], world_size=world_size, rank=rank)
    prompts, params = _prompts(rank)
    expected = Engine(_config(model_dir)).generate(prompts, params)
    engine = AdaptiveEngine(
        _config(model_dir, check_every=2, kv_policy="migrate"),
        groups=groups,
        planner=OpenWideThenSplitPlanner(world_size, split_at, grow_at),
        lengths=LengthPredictor(),
    )
    out: dict[str, Any] = {"expected": _tokens(expected), "tokens": [], "tps": [], "opened": []}
    # the first names tp 2 the opening; the second opens there and is split
    for _ in range(3):
        out["tokens"].append(_tokens(engine.generate(prompts, params)))
        stats = engine.stats()
        out["opened"].append(stats["tp_decisions"][0]["current_tp"])
        out["tps"].append([r["tp_size"] for r in stats["timeline"]])
        if len(out["tps"]) == 2:
            out["reasons"] = [d["reason"] for d in stats["tp_decisions"]]
    out["switches"] = engine.stats()["tp_switches"]
    return out


def test_a_split_at_the_first_check_reopens_the_rollout(llama_dir: Path) -> None:
    # A rollout that opened at tp 2 (named by the rollout before) and whose first check asks
    # for tp 1 (a full batch faster on two replicas) splits before decoding anything; its
    # requests finish on either replica and are handed back to their submitters; the tail may
    # still fold back to tp 2 (here at the 6th check, after some requests finished on each
    # replica); the next rollout opens at tp 1. Every check reports each group once (a rank
    # that kept the merged requests unreported reported them again later: "group 'req-0-1'
    # already started").
    for grow_at in (None, 6):
        results = run_ranks(_open_then_split, 2, args=(str(llama_dir), 1, grow_at), timeout_s=300)
        for r in results:
            assert r["tokens"] == [r["expected"]] * 3
            assert r["opened"] == [1, 2, 1]
            second = r["tps"][1]
            assert second[0] == 1, second
            if grow_at is None:
                assert set(second) == {1} and r["switches"] == 1
            else:
                assert second[-1] == 2 and second == sorted(second) and r["switches"] == 2
            assert set(r["tps"][2]) == {1}


def test_a_split_asked_for_later_is_deferred_to_the_next_rollout(llama_dir: Path) -> None:
    # Later than the first check a rollout only merges replicas: this one keeps tp 2 to its
    # end, and the next opens where the first check said (a later check sees part of a
    # batch, not what a full one wants).
    for r in run_ranks(_open_then_split, 2, args=(str(llama_dir), 2, None), timeout_s=300):
        assert r["tokens"] == [r["expected"]] * 3
        assert r["switches"] == 0
        assert r["opened"] == [1, 2, 2]
        assert [sorted(set(t)) for t in r["tps"]] == [[1], [2], [2]]
        assert r["reasons"][1].startswith("split to tp 1 deferred")


# --- the real planner on synthetic profiles --------------------------------------------------


def _planned(rank: int, world_size: int, model_dir: str, paths: list[str]) -> list[dict[str, Any]]:
    prompts, params = _prompts(rank)
    out = []
    for path in paths:
        engine = AdaptiveEngine(_config(model_dir, check_every=2, profile=path, margin=0.2))
        outs = engine.generate(prompts, params)
        stats = engine.stats()
        out.append(
            {
                "switches": stats["tp_switches"],
                "checks": stats["tp_checks"],
                "tps": [r["tp_size"] for r in stats["timeline"]],
                "tokens": _tokens(outs),
                "actions": [d["action"] for d in stats["tp_decisions"]],
                "reasons": [d["reason"] for d in stats["tp_decisions"]],
                "critical": (stats["tp_critical_control_s"], stats["tp_critical_decode_s"]),
                "own": (stats["tp_control_s"], stats["tp_decode_s"]),
            }
        )
    return out


def test_real_planner_never_or_once(llama_dir: Path, tmp_path: Path) -> None:
    """Switching never pays (tp=2 5x slower at every batch): no switch, and no check but the
    closing one (the planner proves from the profile that nothing can change, so no rank asks
    the others). Always pays (20x faster): one switch, at the first check, before any step (a
    full batch is already better off at tp=2). TP=2 faster only past 20 sequences a replica
    (the profile alone proves nothing): with a few a replica every rank reads at the opening
    check that no switch can pay before their max_tokens, and stays with no verdict sent."""
    paths = []
    for speedup, crossover in ((0.2, 0), (20.0, 0), (1.0, 20)):
        paths.append(str(tmp_path / f"profile-{speedup}-{crossover}.json"))
        synthetic_profile(str(llama_dir), speedup, crossover).save(paths[-1])
    results = run_ranks(_planned, 2, args=(str(llama_dir), paths), timeout_s=300)
    for never, always, bounded in results:
        assert bounded["switches"] == 0 and bounded["checks"] == 2 and set(bounded["tps"]) == {1}
        assert bounded["actions"] == ["stay"]
        assert bounded["tokens"] == never["tokens"]
        assert never["switches"] == 0 and never["actions"].count("switch") == 0
        assert never["checks"] == 1 and set(never["tps"]) == {1} and never["actions"] == []
        assert always["switches"] == 1 and always["actions"][0] == "switch"
        assert always["actions"].count("switch") == 1  # and never back: no oscillation
        assert set(always["tps"]) == {2}
        assert never["tokens"] == always["tokens"]
    assert "decided on every rank" in results[0][2]["reasons"][0]
    assert [r["actions"] for r in results[0]] == [r["actions"] for r in results[1]]
    assert results[0][1]["checks"] > 1
    # The critical path is reduced over the ranks: the same everywhere, the busiest decode.
    # Control on it is positive where there were checks with work ("always"); without any
    # ("never") it may round to nothing, and is never negative.
    for a, b in zip(*results, strict=True):
        assert a["critical"] == b["critical"] and a["critical"][0] >= 0
        assert a["critical"][1] == max(a["own"][1], b["own"][1])
    assert results[0][1]["critical"][0] > 0


def test_checks_are_spaced_to_cost_at_most_their_budget() -> None:
    policy = AdaptiveTP(candidates=(1, 2), check_every=8, check_budget=0.01)
    controller = TPController(policy, ForcedPlanner(0, 2, 2), OracleLengths({}), None)
    assert controller.check_interval() == 8  # nothing timed yet
    controller._check_cost_s, controller._step_s = 0.001, 0.0005  # tiny model: 200 steps
    assert controller.check_interval() == 200
    controller._step_s = 0.05  # a 160M model: check_every already spends under 1%
    assert controller.check_interval() == 8
    exact = TPController(policy.model_copy(update={"check_budget": 0.0}), None, None, None)
    exact._check_cost_s, exact._step_s = 0.001, 0.0005
    assert exact.check_interval() == 8


def test_requests_of_one_prompt_key_in_a_rollout_are_one_length_group() -> None:
    """A GRPO group sent as requests of one sample (TRL's way, the per-sample bench) is one
    group to the predictor, as the n samples of one request are: the first to finish tell
    the others' scale, and the group closes into the prompt's history at its last sample."""
    predictor = LengthPredictor()
    policy = AdaptiveTP(candidates=(1, 2))
    controller = TPController(policy, ForcedPlanner(0, 2, 2), predictor, None)
    controller.begin()
    started = [("a", "k", 1), ("b", "k", 1), ("c", "other", 2)]
    controller._learn(_Summary(True, [], started, []))
    # a later check: one more request of k (it joins the open group), and a finishes
    controller._learn(_Summary(True, [], [("d", "k", 1)], [("a", 0, 30, "length")]))
    groups = predictor.state_dict()["groups"]
    assert groups["k@1"] == {"prompt_id": "k", "size": 3, "finished": [30]}
    assert groups["other@2"]["size"] == 2
    # the running siblings are predicted from k's group (a KeyError if they were not)
    rows = [(0, Row("b", 0, 20, 5, 60, True, 0)), (1, Row("c", 1, 20, 5, 60, True, 0))]
    assert controller._predict(rows, np.full((2, 1), 60.0)).shape == (2, 3)
    finished = [("b", 0, 10, "length"), ("d", 0, 20, "stop"), ("c", 1, 90, "length")]
    controller._learn(_Summary(True, [], [], finished))
    groups = predictor.state_dict()["groups"]
    assert "k@1" not in groups and groups["other@2"]["finished"] == [90]
    # k's history is its group's mean, 20, shrunk towards the global mean (30+10+20+90)/4
    assert predictor.expected_length("k") == pytest.approx((4 * 20 + 1 * 37.5) / 5)
    controller._learn(_Summary(True, [], [], [("c", 0, 7, "abort")]))
    assert controller.length_groups.open == {} and controller.length_groups.of_request == {}
    assert predictor.state_dict()["groups"] == {}
    # the same key in the next rollout is a new group
    controller.begin()
    controller._learn(_Summary(True, [], [("e", "k", 2)], []))
    assert list(predictor.state_dict()["groups"]) == ["k@3"]


def _spaced(rank: int, world_size: int, model_dir: str) -> list[int]:
    groups = GroupCache([1, 2], world_size=world_size, rank=rank)
    prompts, params = _prompts(rank)
    checks = []
    for budget in (0.0, 0.005):
        engine = AdaptiveEngine(
            _config(model_dir, check_every=2, check_budget=budget),
            groups=groups,
            planner=ForcedPlanner(0, 2, world_size),  # always stays, asks for no recheck
        )
        assert engine.controller is not None
        # as if a check had cost a second beside 1 ms steps: rank 0 spaces the next check
        # 200,000 steps away, past the end of the rollout (budget 0: every 2 steps)
        engine.controller._check_cost_s, engine.controller._step_s = 1.0, 0.001
        engine.generate(prompts, params)
        checks.append(engine.stats()["tp_checks"])
    return checks


class CountingPredictor(LengthPredictor):
    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def predict_remaining_many(self, *args: Any, **kwargs: Any) -> np.ndarray:
        self.asked += 1
        return super().predict_remaining_many(*args, **kwargs)


def test_a_check_no_length_could_make_switch_predicts_none(tmp_path: Path) -> None:
    """TP=2 is faster only past 20 sequences a replica (so the profile alone proves nothing
    for max_num_seqs 64): with 4 a replica, bounded by their max_tokens, no switch can pay
    and rank 0 decides without predicting lengths; with 24 on one replica it predicts and
    prices the switch."""
    path = tmp_path / "profile.json"
    synthetic_profile("m", 1.0, crossover=20).save(str(path))
    policy = AdaptiveTP(candidates=(1, 2), profile=str(path))
    planner = make_planner(policy, 2, max_num_seqs=64)
    assert not planner.never_switches_from(Layout(2, 1), max_context=256)
    for per_replica, predicted in ((4, False), (24, True)):
        predictor = CountingPredictor()
        controller = TPController(policy, planner, predictor, None)
        controller.begin()
        summaries: list[_Summary | None] = []
        for rank, size in enumerate((per_replica, 2)):
            ids = [f"r{rank}-{i}" for i in range(size)]
            rows = [Row(rid, 0, 16, 0, 200, False, 0) for rid in ids]
            summaries.append(_Summary(True, rows, [(rid, rid, 1) for rid in ids], []))
        rollout = controller._rollout
        assert rollout is not None
        for s in summaries:
            controller._learn(s)
        verdict = controller._decide(summaries, 1, rollout, True)
        assert predictor.asked == int(predicted)
        assert verdict.record is not None
        assert ("max_tokens" in verdict.record.reason) is not predicted, verdict.record.reason
        assert (verdict.recheck_steps == NEVER) is not predicted


def test_a_bounded_opening_read_on_every_rank_is_rank_0s_verdict(tmp_path: Path) -> None:
    """The first check's stay that every rank reads itself, where no switch could pay before
    every sequence's max_tokens, is the verdict rank 0's planner would broadcast (its twin):
    the same layout, no recheck, the same opening. Where a switch could pay it is left to rank
    0, which then predicts lengths; partial rollouts are always left to rank 0."""
    path = tmp_path / "profile.json"
    synthetic_profile("m", 1.0, crossover=20).save(str(path))
    policy = AdaptiveTP(candidates=(1, 2), profile=str(path))
    rng = np.random.default_rng(0)
    local = 0
    for case in range(60):
        tp = int(rng.choice([1, 2]))
        sizes = rng.integers(1, 30, size=2 // tp)
        summaries: list[_Summary | None] = []
        for rank in range(2):
            if rank % tp:
                summaries.append(None)
                continue
            ids = [f"c{case}-r{rank}-{i}" for i in range(sizes[rank // tp])]
            rows = [
                Row(rid, 0, int(rng.integers(4, 200)), 0, int(rng.integers(8, 400)), False, 0)
                for rid in ids
            ]
            summaries.append(_Summary(True, rows, [(rid, rid, 1) for rid in ids], []))
        controllers = []
        for _ in range(2):  # every rank's, and rank 0's twin
            predictor = CountingPredictor()
            controller = TPController(policy, make_planner(policy, 2, 64), predictor, None)
            controller.begin()
            for s in summaries:
                assert s is not None or tp == 2
                if s is not None:
                    controller._learn(s)
            assert controller._rollout is not None
            controllers.append((controller, predictor))
        (mine, mine_asked), (twin, twin_asked) = controllers
        assert mine._rollout is not None and twin._rollout is not None
        read = mine._bounded_opening(summaries, tp, mine._rollout)
        decided = twin._decide(summaries, tp, twin._rollout, True)
        assert decided.record is not None
        assert mine_asked.asked == 0
        if read is None:
            assert twin_asked.asked == 1 and "no length predicted" not in decided.record.reason
            continue
        local += 1
        assert twin_asked.asked == 0 and "no length predicted" in decided.record.reason
        assert (read.target_tp, read.recheck_steps, read.opening_tp, read.plan) == (
            decided.target_tp,
            decided.recheck_steps,
            decided.opening_tp,
            decided.plan,
        )
        assert read.record is not None and read.record.action == decided.record.action
        mine._rollout.total_quota = 10  # a partial rollout: rank 0 decides
        assert mine._bounded_opening(summaries, tp, mine._rollout) is None
    assert 5 < local < 55, local  # both ways taken


class QuietPlanner(_TestPlanner):
    """Stays, with `quiet` steps in which no switch can gain, or `recheck` steps."""

    def __init__(self, quiet: int, recheck: int | None = None) -> None:
        self.quiet, self.recheck = quiet, recheck

    def new_rollout(self) -> None:
        pass

    def decide(self, running: RunningSet, current: Layout) -> Decision:
        none = np.zeros(len(running), dtype=bool)
        stay = Option(current, 1.0, 0.0, np.inf, 0, running.replica, none)
        decision = Decision("stay", current, current, 0.0, 0.0, "", [stay], running.seq_ids)
        decision.quiet_steps, decision.recheck_steps = self.quiet, self.recheck
        return decision


def test_the_next_check_waits_out_the_planners_quiet_steps() -> None:
    """A stay's quiet steps (no switch can gain before them) push the next check past
    `check_every`, never before it. A "never" proved on predicted lengths (not on the hard
    bounds) asks again once they say the rollout is over: at most max_tokens (200) steps."""
    policy = AdaptiveTP(candidates=(1, 2), check_every=8)
    for quiet, recheck, expected in ((0, None, 8), (5, None, 8), (40, None, 40), (0, NEVER, 0)):
        planner = QuietPlanner(quiet, recheck)
        controller = TPController(policy, planner, LengthPredictor(), None)
        controller.begin()
        rows = [Row(f"r{rank}", 0, 16, 0, 200, False, 0) for rank in range(2)]
        summaries: list[_Summary | None] = [
            _Summary(True, [row], [(row.request_id, row.request_id, 1)], []) for row in rows
        ]
        for summary in summaries:
            controller._learn(summary)
        assert controller._rollout is not None
        verdict = controller._decide(summaries, 1, controller._rollout, True)
        assert verdict.target_tp == 1 and verdict.recheck_steps is not None
        if recheck == NEVER:
            assert 8 <= verdict.recheck_steps <= 200
        else:
            assert verdict.recheck_steps == expected


class FlatLatency:
    """A profile's prices: every decode step `step_s`, every prefill 0.5 s a request."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def step_time(self, tp: int, batch: Any, context: Any) -> float:
        return self.step_s

    def prefill_time(self, tp: int, lengths: list[int]) -> float:
        return 0.5 * len(lengths)


def test_a_window_is_the_slowest_replicas_steps_in_seconds() -> None:
    """Time windows: the slowest replica's recheck steps at its measured pace (the profile's
    before it has one), times the share the planner expects them to cost as the batch drains,
    plus its prefills, one per prompt; counted steps where there is one replica, no latency
    model, or no check before the end."""
    planner = QuietPlanner(0, 3)
    planner.latency = FlatLatency(0.1)
    controller = TPController(AdaptiveTP(candidates=(1, 2)), planner, LengthPredictor(), None)

    def replica(rows: int, step_s: float | None, waiting: int = 0, prompts: int = 0) -> _Summary:
        running = [Row(f"a{i}", 0, 500, 5, 128, True, 0) for i in range(rows)]
        queued = [
            Row(f"w{i // 2}", i % 2, 480, 0, 128, False, (i // 2) % (prompts or waiting))
            for i in range(2 * waiting)
        ]
        return _Summary(True, running + queued, [], [], step_s=step_s)

    fast, slow = replica(8, 0.045), replica(56, 0.2)
    assert controller._window_s([fast, slow], 1, 3) == pytest.approx(0.6)
    assert controller._window_s([fast, slow], 1, 8) == pytest.approx(1.6)
    assert controller._window_s([fast, slow], 1, 8, share=0.25) == pytest.approx(0.4)
    # no step measured yet: the profile's price; two requests of two samples to prefill
    assert controller._window_s([fast, replica(4, None, waiting=2)], 1, 3) == pytest.approx(1.3)
    # four requests of two samples, two of each of two prompts: each prompt prefilled once
    twice = replica(4, None, waiting=4, prompts=2)
    assert controller._window_s([fast, twice], 1, 3) == pytest.approx(1.3)
    assert controller._window_s([fast, _Summary(False, [], [], [])], 1, 3) == pytest.approx(0.135)
    assert controller._window_s([fast, None], 2, 3) is None  # one TP=2 replica
    assert controller._window_s([fast, slow], 1, NEVER) is None
    planner.latency = None
    assert controller._window_s([fast, slow], 1, 3) is None


def _windows(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    groups = GroupCache([1, 2], world_size=world_size, rank=rank)
    planner = QuietPlanner(0, 3)  # stays, checks again 3 steps on
    planner.latency = FlatLatency(0.01)
    engine = AdaptiveEngine(_config(model_dir, check_every=3), groups=groups, planner=planner)
    if rank == 1:  # a replica 30 ms a step slower, as one with a far larger batch would be
        runner = engine.engine.runner
        run = runner.run

        def slow(batch: Any) -> Any:
            time.sleep(0.03)
            return run(batch)

        runner.run = slow  # type: ignore[method-assign]
    length = 60 if rank == 0 else 12
    params = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
    outs = engine.generate([[3, 1, 4, 1, 5]], [params])
    return {"tokens": len(outs[0].outputs[0].token_ids), "checks": engine.stats()["tp_checks"]}


def test_a_fast_replica_steps_at_its_own_pace_between_checks(llama_dir: Path) -> None:
    """Rank 0 has 60 fast steps to run, rank 1 12 slow ones, checks 3 steps apart. Counted in
    steps every rank would run 3 between two checks, rank 0 at rank 1's pace: 20 checks or
    more. In time, rank 0 runs its steps while rank 1 runs 3: a handful of checks."""
    results = run_ranks(_windows, 2, args=(str(llama_dir),), timeout_s=300)
    assert [r["tokens"] for r in results] == [60, 12]
    assert results[0]["checks"] == results[1]["checks"] <= 12, results


def test_rank_zero_spaces_the_checks_for_every_rank(llama_dir: Path) -> None:
    results = run_ranks(_spaced, 2, args=(str(llama_dir),), timeout_s=300)
    assert results[0] == results[1]
    every_two, spaced = results[0]
    assert spaced == 2 and every_two > 5  # the first check and the closing one


def test_control_on_the_critical_path_is_the_wall_time_past_the_busiest_decode() -> None:
    # rank 1 decoded longest (4.0 s); the rollout took 4.6 s less 0.2 s of switching on rank 1
    # and 4.5 s less 0.2 s on rank 0, which started later: 0.3 s went to checks and waits
    control, decode = critical_path([(3.0, 4.3), (4.0, 4.4)])
    assert control == pytest.approx(0.3) and decode == 4.0
    assert critical_path([(3.0, 2.9)]) == (0.0, 3.0)  # clock skew never makes it negative


def test_plot_timeline(tmp_path: Path) -> None:
    timeline = [
        {"t": 0.1 * i, "duration_s": 0.1, "running": 8 - i // 2, "tp_size": 1 if i < 6 else 2}
        for i in range(12)
    ]
    decisions = [
        {"action": "stay", "t": 0.2, "current_tp": 1, "target_tp": 1, "predicted_gain_s": 0.0},
        {"action": "switch", "t": 0.6, "current_tp": 1, "target_tp": 2, "predicted_gain_s": 0.3},
    ]
    path = plot_timeline(timeline, decisions, tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp.png"))


def test_the_next_rollout_opens_where_the_best_plan_starts() -> None:
    """A first check that stays names where the next rollouts open: where the best plan
    (staying, another layout throughout, a delayed switch from here, a round trip from
    there) starts, switch costs of getting there aside, a plan replacing a simpler one only
    when 2% faster. Not where one layout kept throughout is fastest: opening at tp 1 and
    folding for the tail beats tp 2 throughout, which beats tp 1 throughout."""
    tp1, tp2 = Layout(2, 1), Layout(1, 2)
    none = np.zeros(4, dtype=bool)

    def option(layout: Layout, run: float, over: float, later: float, trip: float) -> Option:
        return Option(layout, run, over, later, 8, np.zeros(4, dtype=int), none, trip)

    def first_check(current: Layout, options: list[Option]) -> Decision:
        return Decision("stay", current, current, 0.0, 0.0, "", options, np.arange(4))

    fold_later = option(tp2, 4.6, 0.1, 4.4, np.inf)  # tp 2 throughout 4.6, fold later 4.4
    assert opening_layout(first_check(tp1, [option(tp1, 5.2, 0, np.inf, np.inf), fold_later])) == 1
    # a fold later that only ties with tp 2 throughout: the plan without a switch wins
    tie = option(tp2, 4.6, 0.1, 4.55, np.inf)
    assert opening_layout(first_check(tp1, [option(tp1, 5.2, 0, np.inf, np.inf), tie])) == 2
    no_fold = option(tp2, 4.6, 0.1, np.inf, np.inf)
    assert opening_layout(first_check(tp1, [option(tp1, 5.2, 0, np.inf, np.inf), no_fold])) == 2
    # at tp 2: splitting for good (5.2) loses, a round trip (4.5 with its 0.1 split) wins
    split = option(tp1, 5.2, 0.1, np.inf, 4.5)
    assert opening_layout(first_check(tp2, [option(tp2, 4.6, 0, np.inf, np.inf), split])) == 1
    split = option(tp1, 5.2, 0.1, np.inf, 4.7)  # 4.6 with the split aside: within 2%
    assert opening_layout(first_check(tp2, [option(tp2, 4.6, 0, np.inf, np.inf), split])) == 2
    cannot = option(tp1, 1.0, np.inf, np.inf, np.inf)  # would not hold the batch
    assert opening_layout(first_check(tp2, [option(tp2, 4.6, 0, np.inf, np.inf), cannot])) == 2


def test_oracle_lengths() -> None:
    oracle = OracleLengths({("r", 0): 10, ("r", 1): 4}, num_quantiles=3)
    assert oracle.predict_remaining("r#0", "r", 3).tolist() == [7.0, 7.0, 7.0]
    assert oracle.predict_remaining("r#1", "r", 4).tolist() == [1.0, 1.0, 1.0]


def test_adaptive_config_errors(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="at least two candidate"):
        EngineConfig(model=str(llama_dir), tp_policy={"kind": "adaptive", "candidates": (2,)})
    # one process: nothing to adapt, the engine runs as tp=1 without a planner
    engine = make_engine(_config(str(llama_dir), profile=None))
    assert isinstance(engine, AdaptiveEngine)
    assert engine.controller is None and engine.layout.tp_size == 1
    # the one-layout engine refuses an adaptive policy, naming where to go instead
    with pytest.raises(ValueError, match="make_engine"):
        Engine(_config(str(llama_dir), profile=None))


def test_the_planner_sees_which_samples_share_a_prompt_on_their_replica() -> None:
    """Rows of one prompt (its hash) on one replica: the first holding KV sends the prompt,
    the others share its full blocks, whether they are samples of one request or requests of
    one sample each (TRL's groups); queued, on another replica, or without a prefix cache:
    nothing shared."""
    rows = [
        (0, Row("q", 0, 40, 0, 64, False, 5)),
        (0, Row("a", 0, 43, 3, 64, True, 5)),
        (0, Row("a", 1, 45, 5, 64, True, 5)),
        (0, Row("b", 0, 41, 1, 64, True, 5)),
        (0, Row("c", 0, 20, 2, 64, True, 6)),
        (1, Row("d", 0, 42, 2, 64, True, 5)),
    ]
    for block, expected in ((16, [0, 0, 32, 32, 0, 0]), (0, [0] * 6)):
        controller = TPController(
            AdaptiveTP(candidates=(1, 2)), QuietPlanner(0, None), LengthPredictor(), None,
            prefix_block=block,
        )  # fmt: skip
        running = controller._running_set(rows)
        assert running.shared is not None
        np.testing.assert_array_equal(running.shared, expected)


# --- the plan that is priced is the plan that runs -------------------------------------------


class PlacingPlanner(DearSwitchPlanner):
    """First rollout: stays, naming tp 2 the opening (as DearSwitchPlanner). The second, opened
    at tp 2, splits at its first check with a placement no balancing would pick: a request to
    replica 1 when its prompt is longer than 6 tokens, else to replica 0. Then: stays."""

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self.rollouts = 0

    def new_rollout(self) -> None:
        self.rollouts += 1

    def decide(self, running: RunningSet, current: Layout) -> Decision:
        if self.rollouts != 2 or current.tp != 2:
            return super().decide(running, current)
        decision = ForcedPlanner(1, 1, self.world_size).decide(running, current)
        decision.chosen.assignment = (running.context > 6).astype(int)
        return decision


def _placed(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    prompts, params = _prompts(rank)
    expected = _tokens(Engine(_config(model_dir)).generate(prompts, params))
    config = _config(model_dir, check_every=2, kv_policy="migrate")
    groups = GroupCache([1, 2], world_size=world_size, rank=rank)
    engine = AdaptiveEngine(config, groups=groups, planner=PlacingPlanner(world_size))
    placed: list[list[tuple[str, int]]] = []
    switch = engine.switch

    def recording(verdict: Any) -> None:
        switch(verdict)
        placed.append(
            sorted({(s.request_id, s.num_tokens) for s in engine.engine.unfinished_seqs()})
        )

    engine.switch = recording  # type: ignore[method-assign]
    got = [_tokens(engine.generate(prompts, params)) for _ in range(2)]
    return {"expected": expected, "got": got, "placed": placed}


def test_a_split_places_each_request_where_the_verdicts_plan_says(llama_dir: Path) -> None:
    # The second rollout opens at tp 2 (both ranks' requests on one replica, nothing decoded)
    # and splits: every request lands on the replica the planner's assignment named for its
    # rows (prompts of 11 and 8 tokens on rank 1, of 5 and 3 on rank 0), whatever a balanced
    # split would have done, and finishes with the tokens of an uninterrupted run.
    results = run_ranks(_placed, 2, args=(str(llama_dir),), timeout_s=300)
    requests = set()
    for rank, r in enumerate(results):
        assert r["got"] == [r["expected"]] * 2
        assert len(r["placed"]) == 1, r["placed"]
        here = r["placed"][0]
        assert len({rid for rid, _ in here}) == 4, here  # four of the eight requests
        assert all((tokens > 6) == (rank == 1) for _, tokens in here), here
        requests |= {rid for rid, _ in here}
    assert len(requests) == 8


def test_a_split_verdict_carries_the_planners_assignment_request_by_request(
    tmp_path: Path,
) -> None:
    """The real planner splits one tp-2 replica (tp 2 twice as slow on this profile) at the
    first check; the verdict's plan puts each sample where the planner's assignment put its
    row. The split is computed here by hand (requests whole, most predicted work first, ties
    by request id, dealt 0, 1, 1, 0, 0, 1): a check that the rollout's sample -> row mapping
    is the planner's. Every max_tokens is the same: only the predicted work orders them."""
    path = tmp_path / "profile.json"
    synthetic_profile("m", 0.5).save(str(path))
    policy = AdaptiveTP(candidates=(1, 2), profile=str(path), kv_policy="auto")
    final = {"q": 90, "b": 10, "z": 40, "a": 60, "m": 25, "c": 70}  # each sample's length
    samples = {"q": 1, "b": 3, "z": 2, "a": 1, "m": 2, "c": 1}
    lengths = {(rid, i): final[rid] for rid in final for i in range(samples[rid])}
    rows = [Row(rid, i, 16, 0, 200, False, 0) for rid, i in lengths]  # not in request-id order
    started = [(rid, rid, samples[rid]) for rid in final]
    summaries: list[_Summary | None] = [_Summary(True, rows, started, []), None]
    controller = TPController(policy, make_planner(policy, 2, 64), OracleLengths(lengths), None)
    controller.begin()
    controller._learn(_Summary(True, rows, started, []))
    assert controller._rollout is not None
    verdict = controller._decide(summaries, 2, controller._rollout, True)
    assert verdict.target_tp == 1 and verdict.plan is not None, verdict.record
    work = {rid: samples[rid] * final[rid] for rid in final}
    order = sorted(final, key=lambda rid: (-work[rid], rid))
    snake = [0, 1, 1, 0, 0, 1]
    expected = {(rid, i): snake[k] for k, rid in enumerate(order) for i in range(samples[rid])}
    assert verdict.plan.replica == expected
