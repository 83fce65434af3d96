import dataclasses
import itertools
import json

import numpy as np
import pytest
from lenpredict_testkit import (
    compute_bound,
    cpu_knee,
    cpu_two_knees,
    flat,
    gloo_like,
    padded_no_knee,
    ragged_like,
    sdpa_like,
    tp_speeds_up,
)

from patrl.lenpredict import (
    AdaptivePolicy,
    LatencyModel,
    Layout,
    PlannerConfig,
    PromptGroup,
    ReconfigPlanner,
    RolloutSimulator,
    RunningSet,
    SimConfig,
    StaticPolicy,
    SwitchRow,
    shared_prefix,
)
from patrl.lenpredict.planner import NEVER
from patrl.lenpredict.plans import assign_replicas
from patrl_testkit.profiles import profile_from

LAYOUTS = [Layout(8, 1), Layout(4, 2), Layout(2, 4), Layout(1, 8)]


def latency(step, **kwargs) -> LatencyModel:
    return LatencyModel.fit(profile_from(step, **kwargs))


def running_set(rng, n: int, dp: int, q: int = 3, max_remaining: int = 3000) -> RunningSet:
    return RunningSet(
        seq_ids=np.arange(n),
        replica=rng.integers(0, dp, n),
        context=rng.integers(50, 4000, n),
        remaining=np.sort(rng.integers(1, max_remaining, (n, q)), axis=1).astype(float),
    )


def naive_finish(model: LatencyModel, layout: Layout, replica, context, remaining) -> float:
    """Slow twin of ReconfigPlanner.finish_time: one step at a time, every replica."""
    per_scenario = []
    for column in remaining.T:
        worst = 0.0
        for r in range(layout.dp):
            mine = replica == r
            rem, ctx = column[mine].astype(int), context[mine].astype(float)
            t, step = 0.0, 0
            while (alive := rem > step).any():
                now = ctx[alive] + step
                t += float(model.step_time(layout.tp, alive.sum(), now.sum(), now.max()))
                step += 1
            worst = max(worst, t)
        per_scenario.append(worst)
    return float(np.mean(per_scenario))


def naive_overhead(
    model: LatencyModel, world: int, src: Layout, dst: Layout, assignment, context, shared=None
):
    """Slow twin of ReconfigPlanner.switch_overhead: a loop over sequences. A fold sends each
    sequence's context less its `shared` tokens; a split all of it."""
    lo, hi = sorted((src.tp, dst.tp))
    per_replica = [0.0] * dst.dp
    kinds: list[set[str]] = [set() for _ in range(dst.dp)]
    migrate = []
    if shared is None or dst.tp < src.tp:
        shared = np.zeros(len(context), dtype=int)
    for r, c, sh in zip(assignment, context, shared, strict=True):
        move = float(model.send_marginal(model.kv_bytes(c - min(sh, c)) * (1 - lo / hi))) / hi
        redo = float(model.prefill_marginal(dst.tp, c))
        migrate.append(move <= redo)
        per_replica[r] += min(move, redo)
        kinds[r].add("send" if move <= redo else "prefill")
    for r in range(dst.dp):
        per_replica[r] += model.send_fixed() * ("send" in kinds[r])
        per_replica[r] += model.prefill_fixed(dst.tp) * ("prefill" in kinds[r])
    fixed = model.switch_time(src.tp, dst.tp, world)
    in_flight = model.switch_per_seq_time(src.tp, dst.tp) * len(context)
    in_flight += model.switch_per_token_time(src.tp, dst.tp) * float(np.sum(context))
    return fixed + in_flight + max(per_replica), np.array(migrate)


@pytest.mark.parametrize(
    ("step", "padded"),
    [
        (tp_speeds_up, None),
        (gloo_like, None),
        (compute_bound, None),
        (cpu_knee, None),  # a knee past which the slope drops
        (cpu_two_knees, None),  # the slope drops past 4, rises past 16
        (tp_speeds_up, sdpa_like),  # padded context and a knee at 32 sequences
        (tp_speeds_up, padded_no_knee),  # padded context, no knee at some tp
        (tp_speeds_up, ragged_like),
    ],
)
def test_finish_time_matches_step_by_step_twin(step, padded):
    model = latency(step, padded=padded)
    planner = ReconfigPlanner(model, 8)
    rng = np.random.default_rng(0)
    for layout in LAYOUTS:
        for n in (12, 90):  # 90 puts more than the knee on a replica of dp <= 2
            rs = running_set(rng, n, layout.dp, max_remaining=60)
            rs.remaining[:3] = 0.0  # finished in some scenarios: ties and empty segments
            fast = planner.finish_time(layout.tp, layout.dp, rs.replica, rs)
            slow = naive_finish(model, layout, rs.replica, rs.context, rs.remaining)
            assert fast == pytest.approx(slow, rel=1e-9)


def test_the_steps_to_a_check_cost_their_share_as_the_batch_drains():
    """`shrinking_share`: the next k steps, sequences finishing at their median remaining
    length, stepped one at a time (slowest replica), over k steps at today's batch and
    context (slowest replica); 1 where nothing finishes within k steps."""
    model = latency(tp_speeds_up)
    planner = ReconfigPlanner(model, 8)
    rng = np.random.default_rng(3)
    for layout in LAYOUTS:
        rs = running_set(rng, 40, layout.dp, max_remaining=60)
        for k in (1, 10, 50):
            med = rs.remaining[:, rs.remaining.shape[1] // 2]
            drained, full = 0.0, 0.0
            for r in range(layout.dp):
                mine = rs.replica == r
                ctx, rem = rs.context[mine].astype(float), med[mine]
                t = 0.0
                for step in range(k):
                    alive = rem > step
                    if alive.any():
                        now = ctx[alive] + step
                        t += float(model.step_time(layout.tp, alive.sum(), now.sum(), now.max()))
                drained = max(drained, t)
                if mine.any():
                    step_s = float(model.step_time(layout.tp, mine.sum(), ctx.sum()))
                    full = max(full, k * step_s)
            expected = min(1.0, drained / full)
            assert planner.shrinking_share(rs, layout, k) == pytest.approx(expected, rel=1e-9)
        rs.remaining[:] = 1000.0  # nothing finishes: the contexts grow, the share stays 1
        assert planner.shrinking_share(rs, layout, 50) == 1.0
        rs.remaining[:] = 1.0  # everything finishes after one step
        assert planner.shrinking_share(rs, layout, 50) == pytest.approx(1 / 50, rel=0.05)


def test_decide_prices_its_plans_as_their_step_by_step_twins():
    """Staying and switching now, averaged over the quantile scenarios; a delayed switch in
    the median scenario, carried over to all scenarios by what switching now takes there
    beyond the median one."""
    model = latency(tp_speeds_up)
    rng = np.random.default_rng(5)
    current = Layout(4, 1)
    planner = ReconfigPlanner(model, 4, PlannerConfig(candidate_tp=(1, 2, 4)))
    rs = running_set(rng, 24, current.dp, max_remaining=120)
    decision = planner.decide(rs, current)
    median = rs.remaining[:, 1:2]
    for option in decision.options:
        assert option.run_s == pytest.approx(
            naive_finish(model, option.layout, option.assignment, rs.context, rs.remaining),
            rel=1e-9,
        )
    delayed = [o for o in decision.options[1:] if np.isfinite(o.later_s)]
    assert delayed  # the twin below has something to check
    for option in delayed:
        d = option.later_steps
        alive = median[:, 0] > d
        before = naive_finish(model, current, rs.replica, rs.context, np.minimum(median, d))
        overhead, _ = naive_overhead(
            model, 4, current, option.layout, option.assignment[alive], rs.context[alive] + d
        )
        after = naive_finish(
            model, option.layout, option.assignment, rs.context + d, np.maximum(median - d, 0)
        )
        now = naive_finish(model, option.layout, option.assignment, rs.context, median)
        assert option.later_s == pytest.approx(
            before + overhead + after + option.run_s - now, rel=1e-9
        )


def test_padded_attention_prices_a_long_sequence_beside_short_ones():
    """One long sequence among short ones: a padded backend pays batch x longest per step, so
    the same tokens take longer than with a ragged one, and the twin agrees."""
    padded, ragged = (
        latency(tp_speeds_up, padded=sdpa_like),
        latency(tp_speeds_up, padded=ragged_like),
    )
    assert {fit.form for fit in padded.step_fits.values()} == {"padded"}
    assert {fit.form for fit in ragged.step_fits.values()} == {"total"}
    context = np.array([8000] + [100] * 15)
    rs = RunningSet(np.arange(16), np.zeros(16, dtype=int), context, np.full((16, 1), 200.0))
    times = {}
    for name, model in (("padded", padded), ("ragged", ragged)):
        fast = ReconfigPlanner(model, 8).finish_time(1, 8, rs.replica, rs)
        assert fast == pytest.approx(
            naive_finish(model, Layout(8, 1), rs.replica, rs.context, rs.remaining), rel=1e-9
        )
        times[name] = fast
    step = tp_speeds_up(1, 16, 0)
    assert times["padded"] == pytest.approx(200 * (step + 4e-8 * 16 * (8000 + 99.5)), rel=1e-6)
    assert times["ragged"] == pytest.approx(
        200 * (step + 4e-8 * (context.sum() + 16 * 99.5)), rel=1e-6
    )


def with_loaded_switches(model: LatencyModel, per_seq_s: float, per_token_s: float) -> LatencyModel:
    """`model` with measured switches: 0.05 s empty, plus `per_seq_s` per sequence and
    `per_token_s` per context token in flight beyond the KV transfer the planner prices, for
    every pair of TP sizes (three loads: two counts, two context lengths)."""
    loaded = dataclasses.replace(model, switch_s={}, switch_per_seq_s={}, switch_per_token_s={})
    for a, b in itertools.permutations(model.tp_sizes, 2):
        rows = [SwitchRow(src_tp=a, dst_tp=b, seconds=0.05)]
        for n, tokens in ((50, 5_000), (200, 20_000), (50, 20_000)):
            kv = model.switch_kv_time(a, b, tokens)
            seconds = 0.05 + kv + n * per_seq_s + tokens * per_token_s
            rows.append(
                SwitchRow(src_tp=a, dst_tp=b, seconds=seconds, num_seqs=n, context_tokens=tokens)
            )
        fit = loaded._fit_switch(rows)
        loaded.switch_s[(a, b)], loaded.switch_per_seq_s[(a, b)] = fit[:2]
        loaded.switch_per_token_s[(a, b)] = fit[2]
    return loaded


@pytest.mark.parametrize(
    ("per_seq_s", "per_token_s", "prefill_per_seq_s"),
    [(0.0, 0.0, None), (2e-3, 0.0, None), (1e-3, 3e-6, None), (0.0, 0.0, 1e-5)],
)
def test_switch_overhead_matches_per_sequence_twin(per_seq_s, per_token_s, prefill_per_seq_s):
    # quadratic prefill: recompute is cheaper for short contexts, migration for long ones
    model = latency(
        tp_speeds_up,
        prefill_per_token_s=1e-7,
        prefill_quadratic_s=1e-9,
        send_per_byte_s=1e-8,
        prefill_per_seq_s=prefill_per_seq_s,
    )
    assert model.prefill_coefficients(8).per_seq == pytest.approx((prefill_per_seq_s or 0) / 8)
    if per_seq_s or per_token_s:
        model = with_loaded_switches(model, per_seq_s, per_token_s)
        assert model.switch_time(1, 8, 8) == pytest.approx(0.05)
        assert model.switch_per_seq_time(1, 8) == pytest.approx(per_seq_s, abs=1e-12)
        assert model.switch_per_token_time(1, 8) == pytest.approx(per_token_s, abs=1e-12)
    planner = ReconfigPlanner(model, 8)
    rng = np.random.default_rng(1)
    for src, dst in [
        (Layout(8, 1), Layout(2, 4)),
        (Layout(2, 4), Layout(8, 1)),
        (Layout(4, 2), Layout(1, 8)),
    ]:
        rs = running_set(rng, 40, src.dp)
        rs.context[:20] = rng.integers(8000, 20000, 20)
        assignment = assign_replicas(rs, src, dst)
        fast, fast_migrate = planner.switch_overhead(rs, src, dst, assignment)
        slow, slow_migrate = naive_overhead(model, 8, src, dst, assignment, rs.context)
        assert fast == pytest.approx(slow, rel=1e-9)
        np.testing.assert_array_equal(fast_migrate, slow_migrate)
        assert 0 < slow_migrate.sum() < len(slow_migrate)
        # samples of 6 prompts of up to 4000 tokens (contexts 50..20000): a fold sends each
        # prompt's full blocks once a replica
        prompt = rng.integers(0, 6, len(rs))
        rs.shared = shared_prefix(rs.replica, prompt, np.minimum(rs.context, 4000), 16)
        assert rs.shared.any()
        fast_shared, migrate_shared = planner.switch_overhead(rs, src, dst, assignment)
        slow_shared, slow_migrate_shared = naive_overhead(
            model, 8, src, dst, assignment, rs.context, rs.shared
        )
        assert fast_shared == pytest.approx(slow_shared, rel=1e-9)
        np.testing.assert_array_equal(migrate_shared, slow_migrate_shared)
        if dst.tp > src.tp:
            assert fast_shared < fast
        else:
            assert fast_shared == fast
        rs.shared = None


def test_the_first_sample_of_a_prompt_on_a_replica_shares_nothing():
    """`shared_prefix`: per (replica, prompt) the first sequence holds its prompt alone, each
    later one shares the prompt's full blocks; no prefix cache (block 0), nothing shared."""
    replica = np.array([0, 0, 1, 0, 1, 1])
    prompt = np.array([7, 7, 7, 9, 7, 9])
    tokens = np.array([40, 40, 40, 15, 40, 33])
    np.testing.assert_array_equal(shared_prefix(replica, prompt, tokens, 16), [0, 32, 0, 0, 32, 0])
    np.testing.assert_array_equal(shared_prefix(replica, prompt, tokens, 0), np.zeros(6))
    assert len(shared_prefix(np.zeros(0, int), np.zeros(0, int), np.zeros(0, int), 16)) == 0


def crosses_at_20(tp: int, batch: int, context: int) -> float:
    """TP=2 pays a fixed 4 ms more a step and 0.2 ms less per sequence: one tp-2 replica beats
    one tp-1 replica holding the same batch past 20 sequences."""
    return (0.005 + 0.0008 * batch if tp > 1 else 0.001 + 0.001 * batch) + 1e-9 * context


def test_the_shortcut_bounds_the_batch_by_the_busiest_replica():
    """Two tp-1 replicas of 16 can never be beaten by merging them: whatever finishes first,
    a merged step of x + y sequences costs more than the slower replica's step of max(x, y)
    (checked over every x, y <= 16, step by step); with 24 on one replica it can (a tp-2
    step of 24 beats a tp-1 step of 24), so the planner prices the switch."""
    model = LatencyModel.fit(profile_from(crosses_at_20, tp_sizes=(1, 2), num_devices=2))
    step = lambda tp, b: float(model.step_time(tp, b, b * 60))  # noqa: E731
    assert all(
        step(2, x + y) >= max(step(1, x), step(1, y)) for x in range(17) for y in range(17) if x + y
    )
    assert step(2, 24) < step(1, 24)
    planner = ReconfigPlanner(model, 2, PlannerConfig(candidate_tp=(1, 2)))
    for split, never in (((16, 16), True), ((24, 8), False)):
        replica = np.repeat([0, 1], split)
        rs = RunningSet(np.arange(32), replica, np.full(32, 50), np.full((32, 1), 10.0))
        planner.new_rollout()
        decision = planner.decide(rs, Layout(2, 1))
        assert (decision.recheck_steps == NEVER) is never, (split, decision.reason)


def long_contexts_pay(tp: int, batch: int, context: int) -> float:
    """TP=2 pays a fixed 4 ms more a step and half the per-token cost: it wins past 4000
    context tokens in the batch."""
    return (0.005 + 1e-6 * context if tp > 1 else 0.001 + 2e-6 * context) + 0.001 * batch


def test_may_switch_from_hard_bounds_agrees_with_decide_on_any_lengths_within_them():
    """Bounded by max_tokens: where even the longest possible sequences leave TP=2 slower at
    every batch the busiest replica can have, `decide` stays to the end for every prediction
    within the bounds (so the controller need not predict); where they do not, may_switch
    says so."""
    model = LatencyModel.fit(profile_from(long_contexts_pay, tp_sizes=(1, 2), num_devices=2))
    planner = ReconfigPlanner(model, 2, PlannerConfig(candidate_tp=(1, 2)))
    rng = np.random.default_rng(4)
    replica = np.repeat([0, 1], 16)
    for room, may in ((10.0, False), (1000.0, True)):
        bound = RunningSet(np.arange(32), replica, np.full(32, 50), np.full((32, 1), room))
        assert planner.may_switch(bound, Layout(2, 1)) is may
        planner.new_rollout()
        at_bound = planner.decide(bound, Layout(2, 1))
        assert (at_bound.recheck_steps == NEVER) is not may, at_bound.reason
        for _ in range(5):
            remaining = np.sort(rng.uniform(1, room, (32, 3)), axis=1)
            planner.new_rollout()
            rs = RunningSet(np.arange(32), replica, np.full(32, 50), remaining)
            decision = planner.decide(rs, Layout(2, 1))
            if not may:
                assert decision.action == "stay" and decision.recheck_steps == NEVER


def folds_below_20(tp: int, batch: int, context: int) -> float:
    """One tp-2 group of T sequences beats two tp-1 replicas of T/2 below T = 20 (2 ms + 1.1
    ms a sequence against 4 ms + 2 ms a sequence of half as many)."""
    return (0.002 + 0.0011 * batch if tp > 1 else 0.004 + 0.002 * batch) + 1e-9 * context


def naive_quiet(model, current, target, running, assignment) -> float:
    """Slow twin of PlanPricer.quiet_steps: step by step, in the lowest-quantile scenario,
    the first step at which a target group's step beats its busiest replica's."""
    contexts = (running.context.min(), running.context.max() + running.remaining.max())
    earliest = running.remaining[:, 0]
    for step in range(int(earliest.max()) + 1):
        for group in set(assignment.tolist()):
            alive = (assignment == group) & (earliest > step)
            if not alive.any():
                continue
            total = int(alive.sum())
            busiest = max(int((alive & (running.replica == r)).sum()) for r in range(current.dp))
            for c in contexts:
                then = float(model.step_time(target.tp, total, total * c))
                if then < float(model.step_time(current.tp, busiest, busiest * c)):
                    return step
    return 0  # never faster: nothing to wait for


def test_a_stay_is_quiet_until_a_target_group_could_run_faster():
    """Two replicas of 16 on a profile where folding pays below 20 sequences: a stay says
    how many steps pass before (if every sequence finished at its lowest quantile) the
    merged group could first step faster than its busiest replica; the same as a step-by-step
    count, over random remaining lengths. The engine does not ask again before then."""
    model = LatencyModel.fit(profile_from(folds_below_20, tp_sizes=(1, 2), num_devices=2))
    # a switch must gain 100 s: every decision stays, its quiet steps are what is tested
    config = PlannerConfig(candidate_tp=(1, 2), max_num_seqs=64, min_gain_s=100.0)
    planner = ReconfigPlanner(model, 2, config)
    rng = np.random.default_rng(6)
    quiet = []
    for _ in range(6):
        remaining = np.sort(rng.integers(20, 400, (32, 3)), axis=1).astype(float)
        rs = RunningSet(np.arange(32), np.repeat([0, 1], 16), rng.integers(10, 50, 32), remaining)
        planner.new_rollout()
        decision = planner.decide(rs, Layout(2, 1))
        assert decision.action == "stay" and decision.recheck_steps is None, decision.reason
        expected = naive_quiet(model, Layout(2, 1), Layout(1, 2), rs, np.zeros(32, dtype=int))
        assert decision.quiet_steps == expected > 0
        quiet.append(decision.quiet_steps)
        # never later than the step where the merged group holds fewer than 20: from there
        # it beats even two balanced replicas, whichever one is the busier
        under_20 = np.sort(remaining[:, 0])[32 - 20]
        assert expected <= under_20
    assert len(set(quiet)) > 1
    # the batch already small enough: nothing to wait for
    rs = RunningSet(np.arange(8), np.repeat([0, 1], 4), np.full(8, 20), np.full((8, 3), 300.0))
    planner.new_rollout()
    assert planner.decide(rs, Layout(2, 1)).quiet_steps == 0


def test_never_switches_from_a_layout_no_candidate_beats_at_any_batch_or_context():
    # gloo_like: TP=2+ dearer than TP=1 at every batch, and splitting the batch over more
    # replicas always pays; compute_bound crosses over
    config = PlannerConfig(candidate_tp=(1, 2), max_num_seqs=64)
    gloo = ReconfigPlanner(latency(gloo_like), 2, config)
    assert gloo.never_switches_from(Layout(2, 1), max_context=4096)
    assert not gloo.never_switches_from(Layout(1, 2), max_context=4096)
    crossing = ReconfigPlanner(latency(compute_bound), 2, config)
    assert not crossing.never_switches_from(Layout(2, 1), max_context=4096)
    # flat: no layout is ever faster than another, from anywhere
    flat_planner = ReconfigPlanner(latency(flat), 8)
    assert all(flat_planner.never_switches_from(layout, 8192) for layout in LAYOUTS)


def padded_at_tp1(tp: int, batch: int, context: int, longest: int) -> float:
    """tp 1 pads every sequence to the longest (batch x longest), tp 2 reads the total
    context and pays 1 ms more a step: equal at equal contexts, tp 2 faster when one long
    sequence sits among short ones."""
    read = batch * longest if tp == 1 else context
    return 0.002 + 0.0005 * batch + 4e-6 * read + (0.001 if tp > 1 else 0.0)


def test_the_proof_checks_one_long_sequence_among_short_ones():
    """All short or all long, tp 2 is slower at every batch; one long sequence among short
    ones makes it faster (tp 1 pads them all): the profile proves nothing, and a running
    set of such a mix can switch."""
    profile = profile_from(flat, padded=padded_at_tp1, tp_sizes=(1, 2), num_devices=2)
    model = LatencyModel.fit(profile)
    for b in (4, 16):
        for c in (64.0, 2048.0):
            assert model.step_time(2, b, b * c, c) > model.step_time(1, b, b * c, c)
    assert model.step_time(2, 16, 15 * 64 + 2048, 2048) < model.step_time(
        1, 16, 15 * 64 + 2048, 2048
    )
    planner = ReconfigPlanner(model, 2, PlannerConfig(candidate_tp=(1, 2), max_num_seqs=16))
    assert not planner.never_switches_from(Layout(2, 1), max_context=2048)
    context = np.r_[np.full(15, 64), 2048]
    rs = RunningSet(np.arange(16), np.zeros(16, dtype=int), context, np.full((16, 1), 50.0))
    assert planner.may_switch(rs, Layout(2, 1))


def test_flat_latency_model_never_switches():
    planner = ReconfigPlanner(latency(flat), 8)
    rng = np.random.default_rng(2)
    for layout in LAYOUTS:
        for n in (1, 5, 200):
            planner.new_rollout()
            assert planner.decide(running_set(rng, n, layout.dp), layout).action == "stay"


def test_tail_of_one_sequence_with_cheap_reconfig_switches_to_largest_tp():
    planner = ReconfigPlanner(latency(tp_speeds_up), 8)
    tail = RunningSet(
        np.array([7]), np.array([3]), np.array([2000]), np.array([[3000.0, 4000, 6000]])
    )
    decision = planner.decide(tail, Layout(8, 1))
    assert decision.action == "switch" and decision.target == Layout(1, 8)
    assert decision.gain_s > decision.overhead_s


def test_never_switches_when_overhead_exceeds_gain():
    # both ways of moving KV cost far more than the tail could save
    model = latency(tp_speeds_up, prefill_per_token_s=10.0, send_per_byte_s=1e-3)
    planner = ReconfigPlanner(model, 8)
    tail = RunningSet(
        np.array([0]), np.array([0]), np.array([4000]), np.array([[3000.0, 4000, 6000]])
    )
    decision = planner.decide(tail, Layout(8, 1))
    assert decision.action == "stay"
    assert 0 < decision.gain_s <= decision.overhead_s
    # and whenever it does switch, the gain cleared the margin over the overhead
    planner = ReconfigPlanner(latency(tp_speeds_up), 8, PlannerConfig(margin=0.5, min_gain_s=0.01))
    rng = np.random.default_rng(3)
    for _ in range(30):
        planner.new_rollout()
        decision = planner.decide(running_set(rng, int(rng.integers(1, 60)), 8), Layout(8, 1))
        if decision.action == "switch":
            assert decision.gain_s > 1.5 * decision.overhead_s + 0.01


def test_a_measured_switch_price_replaces_the_traffic_estimate():
    """Growing TP moves no weights over the wire, so the traffic estimate prices it at the
    barrier alone; a profile's measured switch (copies, KV cache re-made) is what it costs."""
    tail = RunningSet(
        np.array([7]), np.array([3]), np.array([2000]), np.array([[3000.0, 4000, 6000]])
    )
    cheap = ReconfigPlanner(latency(tp_speeds_up), 8).decide(tail, Layout(8, 1))
    assert cheap.action == "switch"
    profile = profile_from(tp_speeds_up)
    measured = [
        SwitchRow(src_tp=a, dst_tp=b, seconds=10 * cheap.gain_s)
        for a in (1, 2, 4, 8)
        for b in (1, 2, 4, 8)
        if a != b
    ]
    model = LatencyModel.fit(profile.model_copy(update={"switches": measured}))
    assert model.switch_time(1, 8, 8) == pytest.approx(10 * cheap.gain_s)
    assert model.switch_time(8, 8, 8) == latency(tp_speeds_up).switch_time(8, 8, 8)
    dear = ReconfigPlanner(model, 8).decide(tail, Layout(8, 1))
    assert dear.action == "stay" and dear.overhead_s >= 10 * cheap.gain_s


def test_loaded_switch_rows_price_each_sequence_in_flight():
    """A profile's switches with sequences in flight price what each one adds beyond its KV
    bytes (median over rows, never below 0); the planner charges it for every sequence in
    flight, so a switch that pays for a lone straggler does not pay for a crowd."""
    profile = profile_from(tp_speeds_up)
    base = LatencyModel.fit(profile)
    kv = base.switch_kv_time(1, 8, 10_000)
    assert kv > 0
    rows = [
        SwitchRow(src_tp=1, dst_tp=8, seconds=0.05),
        SwitchRow(src_tp=1, dst_tp=8, seconds=0.07),
        SwitchRow(
            src_tp=1, dst_tp=8, seconds=0.06 + kv + 100 * 2e-3, num_seqs=100, context_tokens=10_000
        ),
        SwitchRow(
            src_tp=1, dst_tp=8, seconds=0.06 + kv + 100 * 4e-3, num_seqs=100, context_tokens=10_000
        ),
        SwitchRow(
            src_tp=1, dst_tp=8, seconds=0.06 + kv + 100 * 9e-3, num_seqs=100, context_tokens=10_000
        ),
        # faster than the empty switch (noise): priced at 0, not as a discount
        SwitchRow(src_tp=8, dst_tp=1, seconds=0.5),
        SwitchRow(src_tp=8, dst_tp=1, seconds=0.2, num_seqs=10, context_tokens=100),
        # at two counts a line through them decides, whatever the empty switch took
        SwitchRow(src_tp=2, dst_tp=8, seconds=9.0),
        SwitchRow(src_tp=2, dst_tp=8, seconds=0.3 + 10 * 1e-3, num_seqs=10),
        SwitchRow(src_tp=2, dst_tp=8, seconds=0.3 + 30 * 1e-3, num_seqs=30),
        # at one count with none empty: their median is the fixed price
        SwitchRow(src_tp=8, dst_tp=2, seconds=0.4, num_seqs=10),
        SwitchRow(src_tp=8, dst_tp=2, seconds=0.2, num_seqs=10),
    ]
    model = LatencyModel.fit(profile.model_copy(update={"switches": rows}))
    assert model.switch_time(1, 8, 8) == pytest.approx(0.06)
    assert model.switch_per_seq_time(1, 8) == pytest.approx(4e-3)
    assert model.switch_per_seq_time(8, 1) == 0.0
    assert model.switch_time(2, 8, 8) == pytest.approx(0.3)
    assert model.switch_per_seq_time(2, 8) == pytest.approx(1e-3)
    assert model.switch_time(8, 2, 8) == pytest.approx(0.3)
    assert model.switch_per_seq_time(8, 2) == 0.0

    rng = np.random.default_rng(3)
    crowd = running_set(rng, 40, 8)
    src, dst = Layout(8, 1), Layout(1, 8)
    assignment = assign_replicas(crowd, src, dst)
    empty_only = LatencyModel.fit(profile.model_copy(update={"switches": rows[:2]}))
    loaded_s, _ = ReconfigPlanner(model, 8).switch_overhead(crowd, src, dst, assignment)
    empty_s, _ = ReconfigPlanner(empty_only, 8).switch_overhead(crowd, src, dst, assignment)
    assert loaded_s - empty_s == pytest.approx(40 * 4e-3)

    # one straggler: the fold pays at the empty price; when each sequence in flight adds ten
    # times the fold's gain it does not (the decision weighs the gain against all of it)
    tail = RunningSet(
        np.array([7]), np.array([3]), np.array([2000]), np.array([[3000.0, 4000, 6000]])
    )
    cheap = ReconfigPlanner(empty_only, 8).decide(tail, Layout(8, 1))
    assert cheap.action == "switch"
    dear_rows = []
    for b in (2, 4, 8):  # every fold from tp 1: none of them stays cheap
        extra = base.switch_kv_time(1, b, 2_000) + 10 * cheap.gain_s
        dear_rows += [
            SwitchRow(src_tp=1, dst_tp=b, seconds=0.06),
            SwitchRow(src_tp=1, dst_tp=b, seconds=0.06 + extra, num_seqs=1, context_tokens=2_000),
        ]
    dear = LatencyModel.fit(profile.model_copy(update={"switches": dear_rows}))
    decision = ReconfigPlanner(dear, 8).decide(tail, Layout(8, 1))
    assert decision.action == "stay" and decision.overhead_s >= 10 * cheap.gain_s


def test_no_oscillation_and_cooldown():
    model = latency(compute_bound)  # a lone tail wants TP 8, a crowd wants TP 1
    tail = RunningSet(
        np.array([0]), np.array([0]), np.array([100]), np.array([[5000.0, 5000, 5000]])
    )
    crowd = running_set(np.random.default_rng(4), 200, 2, q=1)
    down = ReconfigPlanner(model, 8).decide(crowd, Layout(2, 4))
    assert down.action == "switch" and down.target.tp < 4  # what the crowd alone would do

    planner = ReconfigPlanner(model, 8, PlannerConfig(cooldown_calls=2))
    assert planner.decide(tail, Layout(4, 2)).target.tp > 2
    # going back down is refused: first by the cooldown, then by the rollout's direction
    decisions = [planner.decide(crowd, Layout(2, 4)) for _ in range(4)]
    assert all(d.action == "stay" for d in decisions)
    assert [d.reason.startswith("cooldown") for d in decisions] == [True, True, False, False]
    assert all(o.layout.tp >= 4 for d in decisions for o in d.options)
    planner.new_rollout()  # a new batch may start anywhere
    assert planner.decide(crowd, Layout(2, 4)).action == "switch"


def test_a_split_at_the_first_call_reopens_the_rollout():
    """A rollout that opened at a larger TP than its full batch wants splits at its first
    call and may still fold for its tail; a split at a later call locks the direction."""
    model = latency(compute_bound)
    tail = RunningSet(
        np.array([0]), np.array([0]), np.array([100]), np.array([[5000.0, 5000, 5000]])
    )
    crowd = running_set(np.random.default_rng(4), 200, 2, q=1)
    planner = ReconfigPlanner(model, 8)
    first = planner.decide(crowd, Layout(2, 4))
    assert first.action == "switch" and first.target.tp < 4
    opened = first.target
    assert planner.decide(tail, opened).reason.startswith("cooldown")
    grow = planner.decide(tail, opened)
    assert grow.action == "switch" and grow.target.tp > opened.tp

    planner.new_rollout()
    assert planner.decide(tail, Layout(1, 8)).action == "stay"  # the tail wants TP 8
    one_replica = RunningSet(
        crowd.seq_ids, np.zeros_like(crowd.replica), crowd.context, crowd.remaining
    )
    late = planner.decide(one_replica, Layout(1, 8))
    assert late.action == "switch" and late.target.tp < 8
    decisions = [planner.decide(tail, late.target) for _ in range(2)]
    assert [d.action for d in decisions] == ["stay", "stay"]
    assert all(o.layout.tp <= late.target.tp for o in decisions[1].options)


def test_a_rollout_opened_for_its_tail_splits_for_its_bulk_and_folds_back():
    """Opened at TP 2 (dp 1), where one long sequence's tail is fastest, with 63 short ones
    that two TP-1 replicas run faster: staying beats splitting for good (the tail at TP 1),
    but splitting now and folding back once the short ones are done beats both. Only at the
    rollout's first call, as any split; priced as its step-by-step twin prices it."""
    model = latency(compute_bound)
    n = 64
    remaining = np.full((n, 1), 100.0)
    remaining[0] = 3000.0
    rs = RunningSet(np.arange(n), np.zeros(n, dtype=int), np.full(n, 40), remaining)
    tp2, dp2 = Layout(1, 2), Layout(2, 1)
    planner = ReconfigPlanner(model, 2, PlannerConfig(candidate_tp=(1, 2)))
    first = planner.decide(rs, tp2)
    stay, split = first.options
    assert split.layout == dp2 and split.now_s > stay.run_s  # splitting for good loses
    assert first.action == "switch" and first.target == dp2 and "fold back" in first.reason
    assert split.round_trip_steps == 100 and split.round_trip_s < stay.run_s
    # the twin: the split's overhead, 100 steps split, the fold back's overhead (the long
    # sequence alone is alive), the rest at TP 2
    context, rem = rs.context, rs.remaining
    there, _ = naive_overhead(model, 2, tp2, dp2, split.assignment, context)
    back, _ = naive_overhead(model, 2, dp2, tp2, [0], context[:1] + 100)
    before = naive_finish(model, dp2, split.assignment, context, np.minimum(rem, 100))
    after = naive_finish(model, tp2, rs.replica, context + 100, np.maximum(rem - 100, 0))
    assert split.round_trip_s == pytest.approx(there + before + back + after, rel=1e-9)
    assert json.loads(json.dumps(first.record()))["predicted"][str(dp2)]["round_trip_s"] > 0
    # the rollout goes on split; the tail folds back
    tail = RunningSet(np.array([0]), np.array([0]), np.array([140]), np.array([[2900.0]]))
    assert planner.decide(tail, dp2).reason.startswith("cooldown")
    assert planner.decide(tail, dp2).target == tp2
    # past the first call a split is not priced as a round trip
    patient = ReconfigPlanner(model, 2, PlannerConfig(candidate_tp=(1, 2), min_gain_s=100.0))
    assert patient.decide(rs, tp2).action == "stay"
    assert all(o.round_trip_s == np.inf for o in patient.decide(rs, tp2).options)


def test_a_split_moves_requests_whole_and_balances_their_work():
    """Two replicas of TP 4 split into four of TP 2: each request (group) goes whole to one
    child of its replica, and the children's predicted work is near-balanced (LPT-like)."""
    rng = np.random.default_rng(9)
    n = 96
    group = np.repeat(np.arange(24), 4)  # 24 requests of 4 samples
    replica = (group % 2).astype(int)
    work = np.repeat(rng.integers(10, 400, 24), 4).astype(float) + rng.integers(0, 5, n)
    rs = RunningSet(np.arange(n), replica, np.full(n, 50), work[:, None], group=group)
    child = assign_replicas(rs, Layout(2, 4), Layout(4, 2))
    assert (child // 2 == replica).all()  # children of the replica that held them
    for g in range(24):
        assert len(set(child[group == g].tolist())) == 1
    loads = np.bincount(child, weights=work, minlength=4)
    for r in range(2):
        pair = loads[2 * r : 2 * r + 2]
        assert abs(pair[0] - pair[1]) <= work.max() * 4  # within one request's work
    # without groups, sequences are split one by one (the old, finer split)
    alone = assign_replicas(dataclasses.replace(rs, group=None), Layout(2, 4), Layout(4, 2))
    assert any(len(set(alone[group == g].tolist())) > 1 for g in range(24))
    with pytest.raises(ValueError, match="group has 3 entries for 96 sequences"):
        dataclasses.replace(rs, group=np.arange(3))


def test_decisions_are_auditable_records():
    planner = ReconfigPlanner(latency(tp_speeds_up), 8)
    rs = running_set(np.random.default_rng(5), 30, 8)
    planner.decide(rs, Layout(8, 1))
    record = json.loads(json.dumps(planner.decisions[-1].record(), allow_nan=False))
    assert set(record["predicted"]) == {str(layout) for layout in LAYOUTS}
    assert record["action"] in ("stay", "switch") and record["reason"]


GROUPS_TAIL = [PromptGroup("p0", 32, (4000, 40, 40, 40, 40, 40, 40, 40))] + [
    PromptGroup(f"p{i}", 32, (30,) * 8) for i in range(1, 8)
]
GROUPS_CROWD = [PromptGroup(f"p{i}", 32, (600,) * 8) for i in range(16)]


@pytest.mark.parametrize(
    ("step", "groups"),
    [
        (tp_speeds_up, GROUPS_TAIL),
        (flat, GROUPS_CROWD),
        (gloo_like, GROUPS_CROWD),
        (compute_bound, GROUPS_CROWD),
        (compute_bound, GROUPS_TAIL),
    ],
)
def test_planner_picks_what_the_oracle_simulator_says_is_fastest(step, groups):
    """At the start of a rollout, switching costs almost nothing, so the planner's best option
    must be the static layout the simulator (oracle lengths) finishes first; where every layout
    ties (the flat model) it must stay."""
    model = latency(step, prefill_per_token_s=1e-7)
    simulator = RolloutSimulator(model, 8, SimConfig())
    simulated = {layout: simulator.run(groups, StaticPolicy(layout)).total_s for layout in LAYOUTS}
    ranked = sorted(simulated, key=simulated.__getitem__)
    tie = simulated[ranked[-1]] < 1.001 * simulated[ranked[0]]
    assert tie or simulated[ranked[1]] > 1.03 * simulated[ranked[0]], simulated  # clear answers

    # the running set right after every prompt's prefill in dp8xtp1
    sizes = [len(g.response_tokens) for g in groups]
    replica = np.repeat(np.arange(len(groups)) % 8, sizes)
    context = np.repeat([g.prompt_tokens + 1 for g in groups], sizes)
    remaining = np.concatenate([np.array(g.response_tokens) - 1 for g in groups]).astype(float)
    rs = RunningSet(np.arange(len(context)), replica, context, remaining[:, None])
    # which layout now (delayed switches are the next test's business)
    config = PlannerConfig(margin=0.0, delay_levels=())
    decision = ReconfigPlanner(model, 8, config).decide(rs, Layout(8, 1))
    expected = Layout(8, 1) if tie else ranked[0]
    assert decision.target == expected, (decision.record(), simulated)

    # and run adaptively from the same start, it is never slower than the best static layout
    policy = AdaptivePolicy(ReconfigPlanner(model, 8), Layout(8, 1))
    adaptive = simulator.run(groups, policy)
    assert adaptive.total_s <= 1.001 * simulated[ranked[0]], (adaptive.summary(), simulated)


def test_a_target_slower_at_every_batch_is_never_priced_and_never_rechecked():
    """The shortcut: TP=2 over gloo (gloo_like) is slower than TP=1 at every batch, so
    growing can never pay and the planner says so at once, pricing only staying; where TP
    wins at small batches (compute_bound), the full pricing runs."""
    rng = np.random.default_rng(3)
    rs = running_set(rng, 40, 8, max_remaining=400)
    slow = ReconfigPlanner(latency(gloo_like), 8, PlannerConfig(candidate_tp=(1, 2)))
    decision = slow.decide(rs, Layout(8, 1))
    assert decision.action == "stay" and decision.recheck_steps == NEVER
    assert decision.reason.startswith("no switch can pay") and len(decision.options) == 1
    assert decision.options[0].run_s == pytest.approx(
        naive_finish(slow.latency, Layout(8, 1), rs.replica, rs.context, rs.remaining)
    )
    mixed = ReconfigPlanner(latency(compute_bound), 8, PlannerConfig(candidate_tp=(1, 2)))
    decision = mixed.decide(rs, Layout(8, 1))
    assert decision.recheck_steps != NEVER and len(decision.options) == 2


def test_usable_tp_sizes_keeps_the_sizes_that_divide_the_world() -> None:
    from patrl.lenpredict import usable_tp_sizes

    assert usable_tp_sizes([4, 1, 2, 3, 2, 8], 4) == (1, 2, 4)
    assert usable_tp_sizes([3], 4) == ()
    assert usable_tp_sizes([1, 2], 1) == (1,)


def test_usable_tp_sizes_keeps_every_group_inside_a_node() -> None:
    from patrl.lenpredict import usable_tp_sizes

    # 2 nodes of 4: a fold of 8 would span both nodes, one of 3 or 6 does not divide a node
    assert usable_tp_sizes([1, 2, 4, 8], 8, node_size=4) == (1, 2, 4)
    assert usable_tp_sizes([1, 2], 2, node_size=1) == (1,)
    assert usable_tp_sizes([1, 2, 3, 6], 6, node_size=3) == (1, 3)
    assert usable_tp_sizes([1, 2, 4, 8], 8, node_size=8) == (1, 2, 4, 8)  # one node
    assert usable_tp_sizes([1, 2, 4], 4, node_size=None) == (1, 2, 4)
