from collections import deque

import numpy as np
import pytest
from lenpredict_testkit import compute_bound, flat, sdpa_like, tp_speeds_up

from patrl.lenpredict import (
    AdaptivePolicy,
    LatencyModel,
    Layout,
    LengthPredictor,
    LongTailSpec,
    PlannerConfig,
    PromptGroup,
    ReconfigPlanner,
    RolloutSimulator,
    SimConfig,
    StaticPolicy,
    assign_prompts,
    group_by_step,
    long_tail_trace,
    round_robin,
)
from patrl.lenpredict.rollout_sim import SimSeq
from patrl_testkit.profiles import profile_from


def model(step=tp_speeds_up) -> LatencyModel:
    return LatencyModel.fit(profile_from(step))


def small_trace(num_prompts: int = 12, seed: int = 0) -> list[PromptGroup]:
    spec = LongTailSpec(median=60, max_length=600)
    return group_by_step(long_tail_trace(spec, num_prompts, 4, seed=seed))[0]


def naive_static(latency, groups, layout, config, replica_of) -> float:
    """Slow twin of the simulator for a static layout without KV pressure: one step at a time,
    the same rules (prefill first, admission by max_num_seqs and the token budget)."""
    finish = 0.0
    for r in range(layout.dp):
        waiting = deque(
            [
                [g.prompt_tokens, list(g.response_tokens)]
                for g, home in zip(groups, replica_of, strict=True)
                if home == r
            ]
        )
        running: list[list[int]] = []  # [prompt, generated, target]
        clock = 0.0
        while waiting or running:
            admitted, tokens = [], 0
            while waiting:
                prompt, targets = waiting[0]
                if (
                    len(running) + len(targets) > config.max_num_seqs
                    or tokens + prompt > config.max_num_batched_tokens
                ):
                    break
                waiting.popleft()
                admitted.append(prompt)
                tokens += prompt
                running += [[prompt, 0, t] for t in targets]
            if admitted:
                clock += latency.prefill_time(layout.tp, admitted)
                for s in running:  # the prefill samples each admitted sequence's first token
                    if s[1] == 0:
                        s[1] = 1
            else:
                context = sum(p + g for p, g, _ in running)
                longest = max(p + g for p, g, _ in running)
                clock += float(latency.step_time(layout.tp, len(running), context, longest))
                for s in running:
                    s[1] += 1
            running = [s for s in running if s[1] < s[2]]
        finish = max(finish, clock)
    return finish


@pytest.mark.parametrize("padded", [None, sdpa_like])
@pytest.mark.parametrize("max_num_seqs", [256, 6])
@pytest.mark.parametrize("layout", [Layout(8, 1), Layout(2, 4)])
def test_static_simulation_matches_step_by_step_twin(layout, max_num_seqs, padded):
    latency = LatencyModel.fit(profile_from(tp_speeds_up, padded=padded))
    groups = small_trace()
    config = SimConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, assignment="round_robin"
    )
    result = RolloutSimulator(latency, 8, config).run(groups, StaticPolicy(layout))
    replica_of = round_robin(len(groups), layout.dp)
    assert result.total_s == pytest.approx(
        naive_static(latency, groups, layout, config, replica_of), rel=1e-9
    )
    assert max(s.batch for s in result.segments) <= max_num_seqs
    timeline = result.step_timeline()
    for r in range(layout.dp):  # every replica's steps tile its busy time
        mine = timeline["replica"] == r
        ends = timeline["start_s"][mine] + timeline["seconds"][mine]
        assert ends.max() <= result.total_s * (1 + 1e-12)
        np.testing.assert_allclose(timeline["start_s"][mine][1:], ends[:-1], rtol=1e-9, atol=1e-12)


def test_kv_budget_is_respected_by_preempting():
    latency = model()
    groups = small_trace()
    roomy = RolloutSimulator(latency, 8, SimConfig(max_num_batched_tokens=2048))
    tight_config = SimConfig(max_num_batched_tokens=2048, kv_capacity_tokens=3000, block_size=16)
    tight = RolloutSimulator(latency, 8, tight_config)
    peaks: list[int] = []
    decode = tight._decode

    def checked(replica, layout, budget):  # the block budget holds after every run of steps
        steps = decode(replica, layout, budget)
        peaks.append(tight._used_blocks(replica))
        assert peaks[-1] <= replica.capacity_blocks
        return steps

    tight._decode = checked  # type: ignore[method-assign]
    layout = Layout(1, 8)  # every group on one replica
    squeezed = tight.run(groups, StaticPolicy(layout))
    free = roomy.run(groups, StaticPolicy(layout))
    assert squeezed.preemptions > 0 and free.preemptions == 0
    assert squeezed.total_s > free.total_s
    assert max(peaks) > 0.8 * 3000 // 16


def test_every_sequence_finishes_with_its_length():
    groups = small_trace()
    simulator = RolloutSimulator(model(), 8, SimConfig(max_num_batched_tokens=2048))
    seqs: list[SimSeq] = []
    make = simulator._make_seqs

    def keep(gs):
        seqs.extend(make(gs))
        return seqs

    simulator._make_seqs = keep  # type: ignore[method-assign]
    result = simulator.run(groups, AdaptivePolicy(ReconfigPlanner(model(), 8), Layout(8, 1)))
    assert len(seqs) == sum(len(g.response_tokens) for g in groups)
    assert all(s.generated == s.target and 0 < s.finished_at <= result.total_s for s in seqs)


def test_adaptive_with_flat_model_equals_static():
    latency = model(flat)
    groups = small_trace()
    simulator = RolloutSimulator(latency, 8, SimConfig(max_num_batched_tokens=2048))
    static = simulator.run(groups, StaticPolicy(Layout(8, 1)))
    adaptive = simulator.run(groups, AdaptivePolicy(ReconfigPlanner(latency, 8), Layout(8, 1)))
    assert adaptive.switches == [] and adaptive.total_s == pytest.approx(static.total_s)
    assert all(d["action"] == "stay" for d in adaptive.decisions)


def test_adaptive_is_not_slower_than_any_static_layout_on_a_long_tail():
    latency = model()
    groups = small_trace(num_prompts=16, seed=3)
    simulator = RolloutSimulator(latency, 8, SimConfig(max_num_batched_tokens=2048))
    statics = [
        simulator.run(groups, StaticPolicy(Layout(8 // tp, tp))).total_s for tp in (1, 2, 4, 8)
    ]
    adaptive = simulator.run(groups, AdaptivePolicy(ReconfigPlanner(latency, 8), Layout(8, 1)))
    assert adaptive.total_s <= 1.001 * min(statics), (adaptive.summary(), statics)
    tps = [Layout.parse(to).tp for _, _, to in adaptive.switches]
    assert tps == sorted(tps)  # TP only grows within a rollout: no oscillation


def test_a_split_before_the_prefill_sends_whole_queued_groups_to_both_halves():
    """Opened at TP 2, a batch that two TP-1 replicas run faster splits at the first check:
    its queued groups (equal lengths within each) go whole to the lighter half, so the rest
    of the rollout takes what static (dp 2, tp 1) takes. The planner splits per sequence,
    and every group's first sample, which a queued group moves with, fell on one half."""
    latency = model(compute_bound)
    groups = [PromptGroup(f"p{i}", 16, (200,) * 4) for i in range(8)]
    simulator = RolloutSimulator(latency, 2, SimConfig(max_num_batched_tokens=2048))
    static = simulator.run(groups, StaticPolicy(Layout(2, 1)))
    planner = ReconfigPlanner(latency, 2, PlannerConfig(candidate_tp=(1, 2)))
    adaptive = simulator.run(groups, AdaptivePolicy(planner, Layout(1, 2)))
    assert [(a, b) for _, a, b in adaptive.switches] == [("dp1xtp2", "dp2xtp1")]
    split_s = planner.decisions[0].overhead_s
    assert adaptive.total_s == pytest.approx(static.total_s + split_s, rel=1e-6)


def test_predicted_remaining_lengths_drive_the_planner():
    latency = model()
    groups = small_trace()
    predictor = LengthPredictor()
    for g in groups:  # one earlier epoch of the same prompts
        predictor.start_group(f"old/{g.prompt_id}", g.prompt_id, len(g.response_tokens))
        for i, n in enumerate(g.response_tokens):
            predictor.observe_finished(f"old/{g.prompt_id}/{i}", f"old/{g.prompt_id}", n)
    for g in groups:
        predictor.start_group(g.prompt_id, g.prompt_id, len(g.response_tokens))
    prompt_of = {i: g.prompt_id for i, g in enumerate(groups)}

    def remaining(seqs: list[SimSeq]) -> np.ndarray:
        return np.stack(
            [
                predictor.predict_remaining(str(s.seq_id), prompt_of[s.group], s.generated)
                for s in seqs
            ]
        )

    simulator = RolloutSimulator(latency, 8, SimConfig(max_num_batched_tokens=2048))
    predicted = [predictor.expected_length(g.prompt_id) for g in groups]
    result = simulator.run(
        groups, AdaptivePolicy(ReconfigPlanner(latency, 8), Layout(8, 1), remaining), predicted
    )
    oracle = simulator.run(groups, AdaptivePolicy(ReconfigPlanner(latency, 8), Layout(8, 1)))
    assert result.decisions and result.total_s > 0
    assert result.total_s <= 1.25 * oracle.total_s


def test_length_aware_assignment_keeps_groups_and_balances():
    rng = np.random.default_rng(0)
    lengths = rng.lognormal(7, 1, 64)
    lpt = assign_prompts(lengths, [8] * 64, 8, "lpt")
    rr = assign_prompts(lengths, [8] * 64, 8, "round_robin")
    load = lambda replica_of: np.bincount(replica_of, weights=lengths * 8, minlength=8).max()  # noqa: E731
    assert load(lpt) < load(rr)
    assert load(lpt) <= (lengths * 8).sum() / 8 + (lengths * 8).max()  # Graham's LPT bound
    with pytest.raises(ValueError, match="unknown assignment policy 'best'"):
        assign_prompts(lengths, [8] * 64, 8, "best")  # type: ignore[arg-type]


def test_simulator_refuses_inconsistent_setups():
    latency = model()
    groups = small_trace()
    with pytest.raises(ValueError, match="max_num_batched_tokens=64"):
        RolloutSimulator(latency, 8, SimConfig(max_num_batched_tokens=64)).run(
            groups, StaticPolicy(Layout(8, 1))
        )
    simulator = RolloutSimulator(
        latency, 8, SimConfig(max_num_seqs=32, max_num_batched_tokens=2048)
    )
    planner = ReconfigPlanner(latency, 8, PlannerConfig(max_num_seqs=256))
    with pytest.raises(ValueError, match="max_num_seqs=256 but the simulator's is 32"):
        simulator.run(groups, AdaptivePolicy(planner, Layout(8, 1)))
    with pytest.raises(ValueError, match="does not cover world_size=8"):
        simulator.run(groups, StaticPolicy(Layout(2, 2)))


def test_runaway_samples_run_to_the_cap_and_leave_the_rest_unchanged():
    base = LongTailSpec(median=60, max_length=600)
    plain = long_tail_trace(base, 256, 8, steps=2, seed=3)
    looped = long_tail_trace(
        LongTailSpec(median=60, max_length=600, runaway_rate=0.05), 256, 8, steps=2, seed=3
    )
    changed = [b for a, b in zip(plain, looped, strict=True) if a != b]
    assert all(r.response_tokens == 600 for r in changed)
    capped = sum(r.response_tokens == 600 for r in looped) / len(looped)
    assert 0.035 < len(changed) / len(looped) <= capped < 0.07
