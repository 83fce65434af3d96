"""The planner and the simulator price a speculating tail (patrl.lenpredict.speculation):
closed forms against token-step loops, today's prices exactly without speculation or at
acceptance 0, a faster tail a lower price and, where the margin is close, another verdict.
Synthetic step shapes (lenpredict_testkit), no clock."""

import itertools
import json

import numpy as np
import pytest
from lenpredict_testkit import compute_bound, cpu_knee, sdpa_like, tp_speeds_up

from patrl.lenpredict import (
    H100_SXM_NODE,
    LLAMA31_8B,
    LatencyModel,
    Layout,
    PlannerConfig,
    PromptGroup,
    ReconfigPlanner,
    RolloutSimulator,
    RunningSet,
    SimConfig,
    SpeculativeTail,
    StaticPolicy,
    TailStep,
    VerifyRow,
    effective_step_time,
    roofline_profile,
)
from patrl.lenpredict.finish_time import Questions
from patrl.lenpredict.rollout_sim import AdaptivePolicy
from patrl.lenpredict.roofline import StepModel
from patrl.lenpredict.speculation import tail_steps
from patrl_testkit.profiles import profile_from


def latency(step, **kwargs) -> LatencyModel:
    return LatencyModel.fit(profile_from(step, **kwargs))


def naive_tail_finish(pricer, layout: Layout, replica, context, remaining) -> float:
    """Slow twin of a speculating finish time: one token-step at a time, every replica, each
    priced by the pricer's `step_time` (the effective, per-token price)."""
    per_scenario = []
    for column in remaining.T:
        worst = 0.0
        for r in range(layout.dp):
            mine = replica == r
            rem, ctx = column[mine].astype(int), context[mine].astype(float)
            t, step = 0.0, 0
            while (alive := rem > step).any():
                now = ctx[alive] + step
                t += float(pricer.step_time(layout.tp, alive.sum(), now.sum(), now.max()))
                step += 1
            worst = max(worst, t)
        per_scenario.append(worst)
    return float(np.mean(per_scenario))


def running_set(rng, n: int, dp: int, q: int = 3) -> RunningSet:
    return RunningSet(
        seq_ids=np.arange(n),
        replica=rng.integers(0, dp, n),
        context=rng.integers(50, 2000, n),
        remaining=np.sort(rng.integers(1, 400, (n, q)), axis=1).astype(float),
    )


@pytest.mark.parametrize(
    ("step", "padded", "acceptance"),
    [
        (tp_speeds_up, None, 0.6),
        (tp_speeds_up, None, 0.95),
        (cpu_knee, None, 0.9),  # knees: only batches up to 4-5 speculate
        (tp_speeds_up, sdpa_like, 0.8),  # padded context and a knee at 32
    ],
)
def test_speculating_finish_time_matches_token_step_twin(step, padded, acceptance):
    model = latency(step, padded=padded)
    tail = SpeculativeTail.from_acceptance(acceptance, 4)
    planner = ReconfigPlanner(model, 8, speculation=tail)
    assert planner.pricer.tail, "the tail must speculate somewhere for this test to mean much"
    rng = np.random.default_rng(3)
    for layout in (Layout(8, 1), Layout(2, 4), Layout(1, 8)):
        for n in (3, 20, 60):
            rs = running_set(rng, n, layout.dp)
            fast = planner.finish_time(layout.tp, layout.dp, rs.replica, rs)
            slow = naive_tail_finish(planner.pricer, layout, rs.replica, rs.context, rs.remaining)
            assert fast == pytest.approx(slow, rel=1e-9)


def test_speculating_clipped_and_shifted_questions_match_the_twin():
    """A delayed switch's rows: the first `delay` token-steps, and the rest after them."""
    model = latency(tp_speeds_up)
    planner = ReconfigPlanner(model, 8, speculation=SpeculativeTail.from_acceptance(0.8, 4))
    rs = running_set(np.random.default_rng(5), 40, 4, q=1)
    layout, delay = Layout(4, 2), 120.0
    rows = Questions()
    rows.add(0, 0, False, delay, layout)
    rows.add(0, 0, True, delay, layout)
    first, rest = planner.pricer.times(rows, rs.replica[None, :], rs)
    column = rs.remaining[:, 0]
    twin_first = _naive_clipped(planner.pricer, layout, rs.replica, rs.context, column, delay)
    twin_rest = naive_tail_finish(
        planner.pricer,
        layout,
        rs.replica,
        rs.context + np.minimum(column, delay),
        np.maximum(column - delay, 0)[:, None],
    )
    assert first == pytest.approx(twin_first, rel=1e-9)
    assert rest == pytest.approx(twin_rest, rel=1e-9)


def _naive_clipped(pricer, layout, replica, context, remaining, delay) -> float:
    worst = 0.0
    for r in range(layout.dp):
        mine = replica == r
        rem, ctx = remaining[mine].astype(int), context[mine].astype(float)
        t = 0.0
        for step in range(int(delay)):
            alive = rem > step
            if not alive.any():
                break
            now = ctx[alive] + step
            t += float(pricer.step_time(layout.tp, alive.sum(), now.sum(), now.max()))
        worst = max(worst, t)
    return worst


def test_effective_step_is_the_verify_step_over_its_tokens():
    """By hand: at batch 3, a step that costs t plus the verify price, emitting 2 tokens a
    sequence, costs (t + f + v·d·3) / 2 a token-step; past max_batch, t."""
    model = latency(tp_speeds_up)
    step = TailStep(max_batch=4, tokens_per_step=2.0, fixed=1e-3, per_seq=2e-4)
    plain = float(model.step_time(2, 3, 900))
    got = float(effective_step_time(model, step, 2, 3, 900))
    assert got == pytest.approx((plain + 1e-3 + 3 * 2e-4) / 2, rel=1e-12)
    assert float(effective_step_time(model, step, 2, 5, 900)) == float(model.step_time(2, 5, 900))
    assert float(effective_step_time(model, None, 2, 3, 900)) == plain


def test_a_step_speculates_only_where_its_verify_price_pays():
    """Verify rows at tp 1 (f = 2 ms, v = 0.5 ms a token) on the compute-bound shape: the
    largest batch that speculates is the last where f + v·d·B < (τ − 1)·t(B, 0), by hand."""
    profile = profile_from(compute_bound, tp_sizes=(1, 2))
    rows = [
        VerifyRow(
            tp=1,
            batch=b,
            query_len=q,
            context_tokens=c,
            seconds=compute_bound(1, b, c) + 2e-3 + 5e-4 * b * (q - 1),
        )
        for b in (1, 4, 16)
        for q in (2, 5)
        for c in (64 * b, 512 * b)
    ]
    model = LatencyModel.fit(profile.model_copy(update={"verify": rows}))
    tail = SpeculativeTail(tokens_per_step=2.0, draft_tokens=1.5, max_num_seqs=64)
    steps = tail_steps(model, tail, (1, 2), batch_cap=256)
    f, v = model.verify_s[1]
    pays = [f + v * 1.5 * b < 1.0 * float(model.step_time(1, b, 0)) for b in range(1, 65)]
    want = pays.index(False) if False in pays else 64
    assert want > 0 and steps[1].max_batch == want
    assert steps[1].fixed == f and steps[1].per_seq == pytest.approx(v * 1.5)
    # tp 2 has no verify rows: each extra token at the decode fit's per-sequence slope
    assert steps[2].fixed == 0.0
    assert steps[2].per_seq == pytest.approx(model.step_coefficients(2).per_seq * 1.5)


@pytest.mark.parametrize("step", [tp_speeds_up, cpu_knee])
def test_no_speculation_or_acceptance_zero_prices_exactly_as_today(step):
    """Bit-equal (the same code path: no TP size speculates, so no term is added)."""
    model = latency(step)
    rng = np.random.default_rng(7)
    zero_logged = SpeculativeTail.from_metrics(
        [{"rollout/spec_acceptance": 0.0, "rollout/spec_tokens_per_step": 1.0}]
    )
    tails = [SpeculativeTail.from_acceptance(0.0, 4), zero_logged]
    for current in (Layout(8, 1), Layout(2, 4)):
        rs = running_set(rng, 30, current.dp)
        today = ReconfigPlanner(model, 8).decide(rs, current)
        for tail in tails:
            planner = ReconfigPlanner(model, 8, speculation=tail)
            assert planner.pricer.tail == {}
            decision = planner.decide(rs, current)
            assert decision.record() == today.record()


def test_a_faster_tail_lowers_the_price_and_turns_a_fold_down():
    """16 sequences left, one per replica pair at tp 1 (weight-bound: tp 8 is faster).
    The better the acceptance, the cheaper staying and every fold; the fold's gain shrinks
    with the tail's time, so a fold that clears `min_gain_s` for a plain tail does not for a
    tail accepting 90% of its drafts."""
    model = latency(tp_speeds_up)
    n = 16
    rs = RunningSet(np.arange(n), np.arange(n) % 8, np.full(n, 500), np.full((n, 1), 300.0))
    config = PlannerConfig(min_gain_s=1.0)
    stays, gains, verdicts = [], [], []
    for acceptance in (None, 0.3, 0.6, 0.9):
        tail = None if acceptance is None else SpeculativeTail.from_acceptance(acceptance, 4)
        decision = ReconfigPlanner(model, 8, config, tail).decide(rs, Layout(8, 1))
        stays.append(decision.options[0].run_s)
        gains.append(decision.gain_s)
        verdicts.append(decision.action)
    assert all(a > b for a, b in itertools.pairwise(stays))
    assert all(a > b for a, b in itertools.pairwise(gains))
    assert verdicts[0] == "switch" and verdicts[-1] == "stay"
    # the plain tail's price is the decode steps': 300 steps of 2 sequences at tp 1
    assert stays[0] == pytest.approx(300 * float(model.step_time(1, 2, 2 * 500 + 2 * 149.5)))


def test_from_acceptance_matches_a_simulated_adaptive_drafter():
    """Drafts whose tokens are each accepted with p = 0.7 until the first rejection, drafted
    by the drafter's adaptive rule for 200k steps: given their measured accepted / drafted,
    the stationary chain's tokens and drafts per step match (tolerance 1%, > 10 standard
    errors)."""
    p, k = 0.7, 4
    rng = np.random.default_rng(0)
    d, emitted, drafted, steps = k, 0, 0, 200_000
    for u in rng.random((steps, k)):
        rejected = np.flatnonzero(u[:d] >= p)
        accepted = int(rejected[0]) if len(rejected) else d
        emitted += 1 + accepted
        drafted += d
        d = min(k, d + 1) if accepted == d else accepted + 1
    measured = (emitted - steps) / drafted
    tail = SpeculativeTail.from_acceptance(measured, k)
    assert measured < 0.6  # a rejection ends a draft: accepted / drafted is well below p
    assert tail.acceptance == pytest.approx(measured, rel=1e-9)
    assert tail.tokens_per_step == pytest.approx(emitted / steps, rel=0.01)
    assert tail.draft_tokens == pytest.approx(drafted / steps, rel=0.01)
    full = SpeculativeTail.from_acceptance(1.0, k)
    assert (full.tokens_per_step, full.draft_tokens) == pytest.approx((1 + k, k))
    none = SpeculativeTail.from_acceptance(0.0, k)
    assert (none.tokens_per_step, none.draft_tokens) == pytest.approx((1, 1))
    # fixed drafts of 3 at p = 0.5: 1 + 0.5 + 0.25 + 0.125 tokens, 0.875 / 3 accepted
    fixed = SpeculativeTail.from_acceptance(0.875 / 3, 3, adaptive=False)
    assert (fixed.tokens_per_step, fixed.draft_tokens) == pytest.approx((1.875, 3))


def test_from_metrics_reads_a_run_log(tmp_path):
    rows = [
        {"step": 1.0, "rollout/spec_acceptance": 0.4, "rollout/spec_tokens_per_step": 1.2},
        {"step": 2.0, "rollout/spec_acceptance": 0.6, "rollout/spec_tokens_per_step": 1.4},
        {"step": 3.0, "rollout/spec_acceptance": 0.0, "rollout/spec_tokens_per_step": 0.0},
        {"step": 4.0, "critic/score/mean": 1.0},
    ]
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tail = SpeculativeTail.from_metrics_log(log, max_num_seqs=8)
    assert tail is not None
    assert tail.tokens_per_step == pytest.approx(1.3)
    assert tail.acceptance == pytest.approx(0.5)
    assert tail.draft_tokens == pytest.approx(0.6)
    assert tail.max_num_seqs == 8
    assert SpeculativeTail.from_metrics(rows[3:]) is None
    log.write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        SpeculativeTail.from_metrics_log(log)
    with pytest.raises(ValueError, match=r"tokens_per_step=3\.0"):
        SpeculativeTail(tokens_per_step=3.0, draft_tokens=1.0)


def test_simulator_runs_the_tail_at_its_speed_and_its_planner_must_agree():
    """One replica (tp 8) and one group: the simulated rollout is its prefill plus every
    token-step at the effective price (the token-step twin), and faster than a plain tail."""
    model = latency(tp_speeds_up)
    lengths = (20, 35, 60, 90, 150, 200, 320, 400)
    groups = [PromptGroup("p", 64, lengths)]
    tail = SpeculativeTail.from_acceptance(0.8, 4)
    static = StaticPolicy(Layout(1, 8))
    plain = RolloutSimulator(model, 8).run(groups, static)
    fast = RolloutSimulator(model, 8, speculation=tail).run(groups, static)
    assert fast.total_s < plain.total_s
    pricer = ReconfigPlanner(model, 8, speculation=tail).pricer
    remaining = np.array(lengths, dtype=float)[:, None] - 1  # the prefill gave the first token
    twin = model.prefill_time(8, [64]) + naive_tail_finish(
        pricer, Layout(1, 8), np.zeros(8, dtype=int), np.full(8, 65), remaining
    )
    assert fast.total_s == pytest.approx(twin, rel=1e-9)
    with pytest.raises(ValueError, match="give both the same SpeculativeTail"):
        RolloutSimulator(model, 8, SimConfig(), tail).run(
            groups, AdaptivePolicy(ReconfigPlanner(model, 8), Layout(8, 1))
        )
    adaptive = RolloutSimulator(model, 8, SimConfig(), tail).run(
        groups, AdaptivePolicy(ReconfigPlanner(model, 8, speculation=tail), Layout(8, 1))
    )
    assert adaptive.total_s > 0


def test_roofline_verify_rows_price_extra_query_tokens_as_more_gemm_rows():
    """A verify step of one query token a sequence is the decode step; the profile carries
    verify rows only when asked, and on the 8xH100 model an extra token at batch 4 costs far
    less than a step (weight-bound), so the tail speculates up to the drafter's cap."""
    model = StepModel(H100_SXM_NODE, LLAMA31_8B, "bfloat16")
    for tp, batch, context in ((1, 1, 300), (2, 16, 40_000), (8, 64, 500_000)):
        assert model.verify_step(tp, batch, 1, context) == model.decode_step(tp, batch, context)
        assert model.verify_step(tp, batch, 5, context) > model.decode_step(tp, batch, context)
    assert roofline_profile(LLAMA31_8B).verify == []
    fitted = LatencyModel.fit(roofline_profile(LLAMA31_8B, query_lens=(2, 3, 5)))
    assert sorted(fitted.verify_s) == [1, 2, 4, 8]
    extra = fitted.verify_time(1, 4, 8, 4 * 2000) - fitted.verify_time(1, 4, 4, 4 * 2000)
    assert 0 < extra < 0.05 * fitted.verify_time(1, 4, 4, 4 * 2000)
    tail = SpeculativeTail.from_acceptance(0.5, 4)
    assert {s.max_batch for s in tail_steps(fitted, tail, (1, 2, 4, 8), 256).values()} == {16}
