import json

import numpy as np
import pytest

from patrl.lenpredict import (
    LengthPredictor,
    LongTailSpec,
    PredictorConfig,
    group_by_step,
    long_tail_trace,
)

CHECKPOINTS = (0, 256, 512, 1024, 2048, 4096, 8192)


def replay(predictor: LengthPredictor, steps: int = 4, seed: int = 1) -> dict[str, float]:
    """Replay a long-tail trace the way a rollout reveals it: all samples start together; at each
    checkpoint length l the samples shorter than l have finished (and are learned from), and
    every running sample's remaining length is predicted. Epoch 0 only trains. Returns the
    remaining-length MAE of the predictor's median and of the two baselines."""
    trace = group_by_step(long_tail_trace(LongTailSpec(), 64, 8, steps=steps, seed=seed))
    errors: dict[str, list[float]] = {"predictor": [], "global_mean": [], "prompt_last": []}
    past: list[int] = []
    last: dict[str, int] = {}
    for step, groups in trace.items():
        samples = []
        for g in groups:
            group_id = f"{step}/{g.prompt_id}"
            predictor.start_group(group_id, g.prompt_id, len(g.response_tokens))
            samples += [(group_id, g.prompt_id, i, n) for i, n in enumerate(g.response_tokens)]
        samples.sort(key=lambda s: s[3])
        finished = 0
        mean = float(np.mean(past)) if past else 1024.0
        for level in CHECKPOINTS:
            while finished < len(samples) and samples[finished][3] <= level:
                group_id, _, i, n = samples[finished]
                predictor.observe_finished(f"{group_id}/{i}", group_id, n)
                finished += 1
            for group_id, prompt_id, i, n in samples[finished:]:
                median = predictor.predict_remaining(f"{group_id}/{i}", group_id, level)[1]
                if step == 0:
                    continue
                truth = n - level
                errors["predictor"].append(abs(truth - median))
                errors["global_mean"].append(abs(truth - max(mean - level, 1.0)))
                errors["prompt_last"].append(
                    abs(truth - max(last.get(prompt_id, mean) - level, 1.0))
                )
        for group_id, _, i, n in samples[finished:]:
            predictor.observe_finished(f"{group_id}/{i}", group_id, n)
        for _, prompt_id, _, n in samples:
            last[prompt_id] = n
        past += [s[3] for s in samples]
    return {name: float(np.mean(e)) for name, e in errors.items()}


def test_predictor_beats_global_mean_and_prompt_last_length():
    mae = replay(LengthPredictor(PredictorConfig(max_length=16384)))
    assert mae["predictor"] < 0.9 * mae["global_mean"], mae
    assert mae["predictor"] < 0.9 * mae["prompt_last"], mae


def test_online_error_report_matches_a_recount():
    predictor = LengthPredictor()
    predictor.start_group("g", "p", 3)
    made = {}
    for seq, current in (("a", 0), ("b", 0), ("c", 0), ("c", 50)):
        made.setdefault(seq, []).append((current, predictor.predict_remaining(seq, "g", current)))
    lengths = {"a": 40, "b": 90, "c": 200}
    for seq, n in lengths.items():
        predictor.observe_finished(seq, "g", n)
    outcomes = [(lengths[s] - cur, q) for s, preds in made.items() for cur, q in preds]
    report = predictor.error_report()
    assert report["scored"] == 4
    assert report["mae"] == pytest.approx(np.mean([abs(t - q[1]) for t, q in outcomes]))
    assert report["coverage"]["0.9"] == pytest.approx(np.mean([t <= q[2] for t, q in outcomes]))


def test_cold_start_and_quantiles_are_ordered_and_capped():
    predictor = LengthPredictor(PredictorConfig(max_length=1000, default_length=300))
    predictor.start_group("g", "p", 4)
    cold = predictor.predict_remaining("s", "g", 0)
    assert np.all(np.diff(cold) > 0)
    assert cold[1] == pytest.approx(300 * np.log(2))  # median of an exponential of mean 300
    assert predictor.predict_remaining("s", "g", 990).max() <= 10


def test_siblings_and_history_move_the_prediction():
    predictor = LengthPredictor()
    for epoch in range(3):  # prompt "long" is always ~10x prompt "short"
        for prompt, scale in (("short", 100), ("long", 1000)):
            gid = f"{epoch}/{prompt}"
            predictor.start_group(gid, prompt, 4)
            for i, f in enumerate((0.8, 0.9, 1.1, 1.2)):
                predictor.observe_finished(f"{gid}/{i}", gid, int(scale * f))
    assert predictor.expected_length("long") > 4 * predictor.expected_length("short")
    assert predictor.expected_length("unseen") == pytest.approx(predictor.global_mean())
    predictor.start_group("new", "unseen", 4)
    before = predictor.group_scale("new")
    predictor.observe_finished("new/0", "new", 3000)  # its shortest sibling is already long
    assert predictor.group_scale("new") > 2 * before


def test_a_grown_group_reads_its_first_finished_as_a_shorter_order_statistic():
    predictor = LengthPredictor()
    predictor.start_group("old", "p", 4)
    for i, f in enumerate((0.5, 0.8, 1.2, 1.5)):
        predictor.observe_finished(f"old/{i}", "old", int(100 * f))
    predictor.start_group("g", "q", 2)
    predictor.observe_finished("g/0", "g", 100)
    of_two = predictor.group_scale("g")
    predictor.extend_group("g", 6)  # more requests of q joined: 100 was the first of 8
    assert predictor.state_dict()["groups"]["g"]["size"] == 8
    assert predictor.group_scale("g") > of_two  # not a stale cached scale
    with pytest.raises(ValueError, match="at least one sample"):
        predictor.extend_group("g", 0)
    with pytest.raises(KeyError, match="unknown group 'h'"):
        predictor.extend_group("h", 1)


def test_survival_is_the_empirical_conditional():
    predictor = LengthPredictor()
    predictor.start_group("g", "p", 5)
    for i, n in enumerate((10, 20, 30, 40, 50)):
        predictor.observe_finished(str(i), "g", n)
    assert predictor.survival(25, 10) == pytest.approx(2 / 3)  # of {30,40,50}, 40 and 50 pass 35
    assert predictor.survival(60, 1) == 0.0


def test_state_dict_round_trip():
    predictor = LengthPredictor(PredictorConfig(max_length=16384))
    replay(predictor, steps=2)
    predictor.start_group("open", "p3", 8)
    predictor.observe_finished("open/0", "open", 777)
    predictor.predict_remaining("open/1", "open", 100)
    state = json.loads(json.dumps(predictor.state_dict()))  # survives a JSON checkpoint
    restored = LengthPredictor(PredictorConfig(max_length=16384))
    restored.load_state_dict(state)
    assert restored.error_report() == predictor.error_report()
    for current in (0, 500, 5000):
        np.testing.assert_array_equal(
            restored.predict_remaining("x", "open", current),
            predictor.predict_remaining("x", "open", current),
        )
    assert restored.expected_length("p3") == predictor.expected_length("p3")
    with pytest.raises(ValueError, match="config"):
        LengthPredictor(PredictorConfig(max_length=8)).load_state_dict(state)
    # a checkpoint written before prompts kept their own samples still loads
    del state["prompt_lengths"]
    older = LengthPredictor(PredictorConfig(max_length=16384))
    older.load_state_dict(state)
    assert np.isfinite(older.predict_remaining("x", "open", 500)).all()


def _prompt_history(config: PredictorConfig) -> LengthPredictor:
    """Prompt "fail" answers 16, 16, 16 and once 60 (a failure mode, 3.75x its siblings);
    twenty other prompts always answer 16 (their shape ratios are all 1)."""
    predictor = LengthPredictor(config)
    for epoch in range(3):
        for prompt in ["fail", *(f"same{i}" for i in range(20))]:
            group = f"{prompt}@{epoch}"
            predictor.start_group(group, prompt, 4)
            lengths = (16, 16, 16, 60) if prompt == "fail" else (16, 16, 16, 16)
            for k, length in enumerate(lengths):
                predictor.observe_finished(f"{group}/{k}", group, length)
    return predictor


def test_a_prompts_own_past_samples_predict_its_long_ones():
    """Once its three short siblings have finished, the long sample of "fail" is predicted
    from what this prompt did before (44 more tokens), not from the pooled shape alone, in
    which every other prompt's samples are alike (a few tokens more)."""
    config = PredictorConfig(quantiles=(0.1, 0.5, 0.9))
    pooled_only = _prompt_history(config.model_copy(update={"prompt_samples": 0}))
    own = _prompt_history(config)
    for p in (pooled_only, own):
        p.start_group("now", "fail", 4)
        for k in range(3):
            p.observe_finished(f"now/{k}", "now", 16)
    pooled_median = pooled_only.predict_remaining("a", "now", 20)[1]
    own_median = own.predict_remaining("b", "now", 20)[1]
    assert pooled_median < 10
    # 3 past samples longer than 20 (all 60): weight 3 / (3 + 2) on 40 remaining
    assert own_median == pytest.approx(pooled_median + 0.6 * (40 - pooled_median))


@pytest.mark.parametrize("max_length", [None, 50])
def test_prompt_blend_matches_a_per_sample_recount(max_length):
    """The prompt blend against a recount with np.quantile, sample by sample: the pooled
    prediction (a twin predictor that keeps no prompt samples), each prompt's past samples
    longer than the current length, weight m / (m + prompt_weight). With a cap, the one-sample
    path (predict_remaining) against the batched one."""
    config = PredictorConfig(quantiles=(0.1, 0.25, 0.5, 0.9), max_length=max_length)
    own = _prompt_history(config)
    pooled = _prompt_history(config.model_copy(update={"prompt_samples": 0}))
    past = {
        "fail": np.array([16, 16, 16, 60] * 3, dtype=float),
        "same0": np.full(12, 16.0),
        "mixed": np.array([5.0, 30.0, 90.0]),  # fewer samples, and longer than any other's
    }
    levels = np.asarray(config.quantiles)
    for p in (own, pooled):
        p.start_group("mixed@0", "mixed", 3)
        for k, length in enumerate(past["mixed"]):
            p.observe_finished(f"mixed@0/{k}", "mixed@0", int(length))
        for prompt in past:
            p.start_group(f"{prompt}@now", prompt, 4)
    rng = np.random.default_rng(0)
    prompts = rng.choice(list(past), 40).tolist()
    current = rng.integers(0, 100, 40).astype(float)
    groups = [f"{prompt}@now" for prompt in prompts]
    fast = own.predict_remaining_many([f"s{i}" for i in range(40)], groups, current)
    base = pooled.predict_remaining_many([f"s{i}" for i in range(40)], groups, current)
    blended = 0
    for i, (prompt, t) in enumerate(zip(prompts, current, strict=True)):
        slow = own.predict_remaining(f"slow{i}", groups[i], int(t))
        np.testing.assert_allclose(slow, fast[i], rtol=1e-12, atol=1e-12)
        if max_length is not None:
            continue
        longer = past[prompt][past[prompt] > t]
        expected = base[i]
        if longer.size:
            w = longer.size / (longer.size + config.prompt_weight)
            expected = base[i] + w * (np.quantile(longer, levels) - t - base[i])
            blended += 1
        np.testing.assert_allclose(fast[i], np.maximum(expected, 1.0), rtol=1e-12)
    assert max_length is not None or 0 < blended < 40


@pytest.mark.parametrize("max_length", [None, 16384])
@pytest.mark.parametrize("history", ["none", "lengths only", "trace"])
def test_batched_prediction_equals_one_at_a_time(max_length, history):
    """predict_remaining_many (what the planner's check calls) against predict_remaining, its
    slow twin, on two predictors in the same state; also what they leave to be scored."""
    config = PredictorConfig(max_length=max_length, quantiles=(0.1, 0.25, 0.5, 0.9))
    one, many = LengthPredictor(config), LengthPredictor(config)
    for p in (one, many):
        if history == "trace":
            replay(p, steps=2)
        for g, size in (("a", 4), ("b", 1), ("c", 8)):
            p.start_group(g, f"prompt-{g}", size)
        if history != "none":
            p.observe_finished("c/0", "c", 300)  # a group of one closes without a ratio
    rng = np.random.default_rng(0)
    groups = rng.choice(["a", "b", "c"], 200).tolist()
    # zero, typical, and past anything seen (the cap or Lindy branch)
    current = np.r_[0, 1, rng.integers(0, 3000, 196), 10**6 - 1, 15000]
    seqs = [f"{g}/{i}" for i, g in enumerate(groups)]
    slow = np.stack(
        [one.predict_remaining(s, g, int(c)) for s, g, c in zip(seqs, groups, current, strict=True)]
    )
    fast = many.predict_remaining_many(seqs, groups, current)
    np.testing.assert_allclose(fast, slow, rtol=1e-12, atol=1e-9)
    for p in (one, many):
        for s, c in zip(seqs, current, strict=True):
            p._score(s, int(c) + 50)  # every prediction scored against one outcome
    fast_report, slow_report = many.error_report(), one.error_report()
    assert fast_report["scored"] == slow_report["scored"] > 0
    assert fast_report["mae"] == pytest.approx(slow_report["mae"], rel=1e-12)
    assert fast_report["coverage"] == slow_report["coverage"]
    with pytest.raises(ValueError, match="2 seq ids, 1 group ids, 2 current lengths"):
        many.predict_remaining_many(["x", "y"], ["a"], np.array([1, 2]))


def _apply(predictor: LengthPredictor, event: tuple[str, str, str, int]) -> None:
    """One (kind, group, prompt or sample id, size or length) event of a replay."""
    kind, group, arg, value = event
    if kind == "start":
        predictor.start_group(group, arg, value)
    elif kind == "finish":
        predictor.observe_finished(arg, group, value)
    else:
        predictor.end_group(group)


def test_cached_predictions_equal_a_fresh_replay():
    """Asked at every event (its caches warm: global mean, shape, group scales) a predictor
    predicts what one fed the same events and asked only at the end predicts. Covers groups of
    one (no shape ratio: the global spread stands in and moves with every length), an aborted
    group closed from outside, and two open groups of one prompt."""
    rng = np.random.default_rng(5)
    events = [("start", f"g{i}", f"p{i % 3}", int(rng.integers(1, 4))) for i in range(9)]
    finishes = [
        ("finish", f"g{i}", f"g{i}/{k}", int(rng.integers(5, 400)))
        for i in range(9)
        for k in range(events[i][3])
    ]
    events += [finishes[i] for i in rng.permutation(len(finishes))]  # groups interleaved
    events.insert(12, ("end", "g7", "", 0))  # g7 aborted before any of its samples finished
    events = [e for e in events if not (e[0] == "finish" and e[1] == "g7")]
    # g4 (prompt p1, beside g1 and g7) aborted after its first sample: its prompt's history
    # moves while g1 is open
    first = next(i for i, e in enumerate(events) if e[0] == "finish" and e[1] == "g4")
    events = [e for i, e in enumerate(events) if not (i > first and e[1] == "g4")]
    events.insert(first + 1, ("end", "g4", "", 0))
    warm = LengthPredictor()
    for n, event in enumerate(events):
        _apply(warm, event)
        live = sorted(warm._groups)  # the open groups
        if not live:
            continue
        fresh = LengthPredictor()
        for earlier in events[: n + 1]:
            _apply(fresh, earlier)
        current = np.full(len(live), 30)
        ids = [f"{g}/probe{n}" for g in live]
        np.testing.assert_allclose(
            warm.predict_remaining_many(ids, live, current),
            fresh.predict_remaining_many(ids, live, current),
            rtol=1e-12,
        )
        assert warm.global_mean() == pytest.approx(fresh.global_mean(), rel=1e-12)


def test_window_sorted_shape_and_mean_kept_in_step_with_a_recount():
    """The sorted shape samples and the global mean are kept as samples enter and leave the
    window, not recomputed: against a sort and a mean of the window, read after one to four
    groups closed (the sorted copy takes what entered and left since in one merge), with
    repeated ratios (equal lengths), a group as big as the window (the sorted copy is rebuilt)
    and a checkpoint round trip on the way."""
    config = PredictorConfig(window=24)
    p = LengthPredictor(config)
    rng = np.random.default_rng(3)
    sizes = [4, 2, 8, 5, 3, 30, 6, 4, 7, 1, 5, 8, 4]
    for i, size in enumerate(sizes * 3):
        gid = f"g{i}"
        p.start_group(gid, f"p{i % 5}", size)
        # few distinct lengths: equal ratios enter and leave the window together
        for k, length in enumerate(rng.choice([10, 20, 20, 40, 80], size)):
            p.observe_finished(f"{gid}/{k}", gid, int(length))
        if rng.random() < 0.4:
            np.testing.assert_array_equal(p._shape(), np.sort(np.asarray(p._ratios)))
        assert len(p._ratios) <= 24
        assert p.global_mean() == np.mean(np.asarray(p._lengths, dtype=float))
        if i == len(sizes):
            restored = LengthPredictor(config)
            restored.load_state_dict(json.loads(json.dumps(p.state_dict())))
            assert restored.global_mean() == p.global_mean()
            np.testing.assert_array_equal(restored._shape(), p._shape())
            p = restored
    assert len(p._ratios) == 24
