import json

import numpy as np
import pytest
from lenpredict_testkit import (
    cpu_two_knees,
    flat,
    gloo_like,
    ragged_like,
    sdpa_like,
    tp_speeds_up,
)
from pydantic import ValidationError

from patrl.lenpredict import (
    H100_SXM_NODE,
    LLAMA31_8B,
    QWEN3_14B,
    LatencyModel,
    Profile,
    ProfileMismatchError,
    held_out_error,
    latency_model,
    roofline_profile,
)
from patrl.lenpredict.latency_model import fit_step
from patrl.lenpredict.profile_schema import DecodeRow
from patrl_testkit.profiles import TINY, profile_from


def test_profile_json_round_trip(tmp_path):
    profile = profile_from(tp_speeds_up)
    path = tmp_path / "profile.json"
    profile.save(path)
    assert Profile.load(path) == profile
    assert json.loads(path.read_text())["model"]["num_layers"] == TINY.num_layers


def test_profile_refuses_other_model_naming_the_field():
    profile = profile_from(flat)
    profile.check_matches(TINY.model_copy(update={"name": "fine-tuned"}), "float32")
    with pytest.raises(ProfileMismatchError, match=r"model\.num_kv_heads=2.*num_kv_heads=8"):
        profile.check_matches(TINY.model_copy(update={"num_kv_heads": 8}), "float32")
    with pytest.raises(ProfileMismatchError, match=r"dtype=.float32.*dtype=.bfloat16."):
        profile.check_matches(TINY, "bfloat16")


def test_profile_rejects_unknown_keys_and_impossible_tp(tmp_path):
    data = json.loads(profile_from(flat).model_dump_json())
    data["decode"][0]["batch_size"] = 3
    with pytest.raises(ValidationError, match="batch_size"):
        Profile.model_validate(data)
    data = json.loads(profile_from(flat).model_dump_json())
    data["decode"][0]["tp"] = 3
    with pytest.raises(ValidationError, match="tp=3"):
        Profile.model_validate(data)


def test_step_fit_recovers_linear_coefficients():
    fit = fit_step(
        [
            DecodeRow(tp=1, batch=b, context_tokens=c, seconds=0.004 + 3e-5 * b + 2e-8 * c)
            for b in (1, 4, 16, 64, 256)
            for c in (100, 10_000, 1_000_000)
        ]
    )
    assert fit.knees == ()  # no knee in the data: the simpler form wins
    np.testing.assert_allclose(fit.coef[:3], [0.004, 3e-5, 2e-8], rtol=1e-6)


def test_step_fit_finds_the_roofline_knee():
    def step(b: int, c: int) -> float:
        return max(0.006, 4e-5 * b) + 1e-8 * c

    rows = [
        DecodeRow(tp=1, batch=b, context_tokens=b * c, seconds=step(b, b * c))
        for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
        for c in (256, 2048)
    ]
    fit = fit_step(rows)
    # the bend is at 150 sequences, between two profiled batch sizes: knees there, no other
    assert fit.knees and set(fit.knees) <= {128.0, 256.0}
    assert fit.cv_mape < 0.05


def test_step_fit_follows_a_slope_that_drops_past_a_knee():
    # the CPU box's decode steps (wide_2l, tp 1): batch 4 costs ~4x batch 1 (small-batch
    # sgemm is slow), batch 32 only 2x batch 4; a knee that steepens cannot follow that
    def step(b: int, c: int) -> float:
        return 0.038 * min(b, 4) + 0.005 * max(0, b - 4) + 2e-5 * c

    rows = [
        DecodeRow(tp=1, batch=b, context_tokens=b * c, seconds=step(b, b * c))
        for b in (1, 4, 16, 32)
        for c in (16, 112)
    ]
    fit = fit_step(rows)
    assert fit.knees == (4.0,) and fit.slope_changes[0] < 0  # the slope drops past the knee
    assert fit.coef[1] + fit.slope_changes[0] >= 0  # and never below flat
    assert fit.cv_mape < 0.01
    for b in (2, 8, 24):
        predicted = fit.predict(np.array([b]), np.array([b * 50]))[0]
        assert predicted == pytest.approx(step(b, b * 50), rel=0.01)


def test_step_fit_follows_a_slope_that_drops_then_rises(monkeypatch):
    # this box's vocab_2l profile (tp 1, 2026-11-24): measured 0.027 / 0.071 / 0.116 / 0.206 /
    # 0.428 s at batch 1 / 4 / 16 / 32 / 64. One knee missed batch 4 by 30% (a median error
    # hid it: 2 rows of 9), and batches 4-8 are where a long tail runs on a replica
    def step(b: int, c: int) -> float:
        return cpu_two_knees(1, b, c)

    rows = [
        DecodeRow(tp=1, batch=b, context_tokens=b * c, seconds=step(b, b * c))
        for b in (1, 4, 16, 32, 64)
        for c in (16, 112)
    ]
    fit = fit_step(rows)
    assert fit.knees == (4.0, 16.0)
    assert fit.slope_changes[0] < 0 < fit.slope_changes[1]
    report = LatencyModel.fit(profile_from(cpu_two_knees, tp_sizes=(1, 2))).describe()
    assert report[1]["knees"] == [4.0, 16.0] and len(report[1]["d"]) == 2
    assert json.loads(json.dumps(report))["1"]["form"] == "total"
    for b in (2, 4, 8, 12, 24, 48):
        predicted = fit.predict(np.array([b]), np.array([b * 50]))[0]
        assert predicted == pytest.approx(step(b, b * 50), rel=0.01)
    # limited to one knee, the fit of the same rows misses one of them by over 10%
    monkeypatch.setattr(latency_model, "MAX_KNEES", 1)
    one = fit_step(rows)
    batch, context, _, seconds = latency_model._row_arrays(rows)
    assert len(one.knees) <= 1
    assert np.max(np.abs(one.predict(batch, context) / seconds - 1)) > 0.10


def test_step_fit_is_scored_as_used_when_batch_3_is_slower_than_batch_4():
    # this box's vocab_2l_h512 profile (tp 1, 2026-11-24, two contexts): single-threaded
    # sgemm makes batch 3 slower than batch 4. The best least-squares fit put knees at 3 and
    # 4 with a falling slope between them; cut at flat (a step never gets cheaper with more
    # work) its line past 4 rose 4x too steeply and priced batch 64 at 3.6x its measure.
    measured = {1: 0.0188, 2: 0.0362, 3: 0.0501, 4: 0.0434, 8: 0.0523, 16: 0.0697, 32: 0.1081}
    measured[64] = 0.2184
    rows = [
        DecodeRow(tp=1, batch=b, context_tokens=b * c, seconds=t * (1 + 0.02 * (c > 50)))
        for b, t in measured.items()
        for c in (18, 114)
    ]
    fit = fit_step(rows)
    batch, context, _, seconds = latency_model._row_arrays(rows)
    error = np.abs(fit.predict(batch, context) / seconds - 1)
    assert error.max() < 0.2  # batch 3 (above its neighbours) is the worst row
    assert np.median(error) < 0.06
    assert fit.cv_mape < 0.2


def test_a_knee_must_cut_the_held_out_error_by_a_tenth(monkeypatch):
    # a second knee that improves the held-out error by 6% is not worth an ordered pass in
    # every planner call; one that halves it is
    candidates = [
        ("total", (), ()),
        ("total", (64.0,), (1.0,)),
        ("total", (64.0, 256.0), (1.0, 1.0)),
    ]
    assert latency_model._simplest_good_enough([0.10, 0.05, 0.047], candidates)[1][1] == (64.0,)
    assert latency_model._simplest_good_enough([0.10, 0.05, 0.025], candidates)[1][1] == (
        64.0,
        256.0,
    )
    monkeypatch.setattr(latency_model, "KNEE_GAIN", 0.0)
    assert len(latency_model._simplest_good_enough([0.10, 0.05, 0.047], candidates)[1][1]) == 2


def test_latency_model_prefill_collectives_and_reshard():
    model = LatencyModel.fit(profile_from(tp_speeds_up, prefill_per_token_s=1e-4, alpha_s=1e-3))
    assert model.prefill_time(2, [1000]) == pytest.approx(1e-3 + 1e-4 * 1000 / 2, rel=1e-6)
    # one batch pays the fixed cost once
    assert model.prefill_time(2, [500, 500]) == pytest.approx(1e-3 + 1e-4 * 1000 / 2, rel=1e-6)
    assert model.prefill_time(2, []) == 0.0
    assert model.collective_time("send", 1 << 20, 2) == pytest.approx(1e-3 + 1e-9 * (1 << 20))
    assert model.collective_time("all_reduce", 10, 1) == 0.0
    assert model.weight_reshard_time(2, 8) == 0.0  # narrowing in place moves nothing
    per_rank = TINY.weight_bytes("float32") / 2
    assert model.weight_reshard_time(8, 2) == pytest.approx(model.reshard_time(per_rank, 4))
    assert model.reshard_time(per_rank, 4) == pytest.approx(1e-3 + 1e-9 * per_rank)
    assert model.kv_migrate_time(4096) == pytest.approx(1e-3 + 1e-9 * 4096)
    assert model.kv_recompute_time(2, [300, 700]) == model.prefill_time(2, [300, 700])
    with pytest.raises(KeyError, match="tp=3"):
        model.step_time(3, 1, 1)


def test_prefill_prices_each_sequence_when_rows_of_several_tell_it_apart():
    """A prefill step runs the LM head and the sampler once per sequence: rows of 4 and 16
    sequences price it; from rows of one sequence it is folded into the fixed cost."""
    model = LatencyModel.fit(
        profile_from(tp_speeds_up, prefill_per_token_s=1e-4, prefill_per_seq_s=4e-3, alpha_s=1e-3)
    )
    coef = model.prefill_coefficients(2)
    assert coef.per_seq == pytest.approx(2e-3, rel=1e-6)  # the rows' per-sequence cost / tp
    assert coef.fixed == pytest.approx(1e-3, rel=1e-6)
    assert model.prefill_time(2, [500, 500]) == pytest.approx(1e-3 + 2 * 2e-3 + 1e-4 * 1000 / 2)
    assert model.kv_recompute_time(2, [300]) == pytest.approx(1e-3 + 2e-3 + 1e-4 * 300 / 2)
    assert float(model.prefill_marginal(2, np.array(100))) == pytest.approx(2e-3 + 1e-4 * 50)
    single = LatencyModel.fit(profile_from(tp_speeds_up, prefill_per_token_s=1e-4, alpha_s=1e-3))
    assert single.prefill_coefficients(2).per_seq == 0.0
    assert single.prefill_time(2, [1000]) == pytest.approx(1e-3 + 1e-4 * 1000 / 2, rel=1e-6)


def test_noisy_profile_held_out_error_within_target():
    rng = np.random.default_rng(0)

    def noisy(tp: int, b: int, c: int) -> float:
        return gloo_like(tp, b, c) * float(np.exp(rng.normal(0, 0.05)))

    errors = held_out_error(profile_from(noisy, tp_sizes=(1, 2)))
    assert all(err < 0.10 for err in errors.values()), errors


@pytest.mark.parametrize("model", [LLAMA31_8B, QWEN3_14B])
def test_roofline_profile_fits_and_behaves_like_a_gpu(model):
    profile = roofline_profile(model)
    assert profile.source == "roofline" and "SIMULATED" in profile.notes["label"]
    assert profile.hardware.device == H100_SXM_NODE.gpu.name
    latency = LatencyModel.fit(profile)
    assert max(held_out_error(profile).values()) < 0.02
    # at batch 1 more TP ranks read a smaller weight shard each, up to TP 4; past it the
    # kernel floors and all-reduce latency take the rest (test_lenpredict_calibration)
    single = [float(latency.step_time(tp, 1, 1000)) for tp in (1, 2, 4)]
    assert single == sorted(single, reverse=True)
    # and a replica holds more KV the more ranks it spans
    capacity = [latency.kv_capacity_tokens(tp, 0.9) for tp in (1, 2, 4, 8)]
    assert capacity == sorted(capacity) and capacity[0] > 0


def test_decode_row_refuses_an_impossible_longest_context():
    DecodeRow(tp=1, batch=4, context_tokens=400, max_context=100, seconds=1.0)
    DecodeRow(tp=1, batch=4, context_tokens=400, max_context=397, seconds=1.0)
    with pytest.raises(ValidationError, match=r"max_context=99 impossible for 4 sequences"):
        DecodeRow(tp=1, batch=4, context_tokens=400, max_context=99, seconds=1.0)
    with pytest.raises(ValidationError, match=r"max_context=401"):
        DecodeRow(tp=1, batch=4, context_tokens=400, max_context=401, seconds=1.0)


@pytest.mark.parametrize(("backend", "wrong"), [(sdpa_like, "total"), (ragged_like, "padded")])
def test_skewed_rows_tell_a_padded_backend_from_a_ragged_one(backend, wrong):
    """Equal-length rows cannot separate total from padded context (B·M = C); skewed rows can,
    and the form that predicts held-out rows better is kept."""
    rng = np.random.default_rng(0)

    def noisy(tp: int, b: int, c: int, m: int) -> float:
        return backend(tp, b, c, m) * float(np.exp(rng.normal(0, 0.03)))

    profile = profile_from(tp_speeds_up, padded=noisy)
    model = LatencyModel.fit(profile)
    assert wrong not in {fit.form for fit in model.step_fits.values()}
    assert max(held_out_error(profile).values()) < 0.10
    # a skewed step: one 8000-token sequence beside 31 of 100
    truth = backend(1, 32, 8000 + 31 * 100, 8000)
    assert float(model.step_time(1, 32, 8000 + 31 * 100, 8000)) == pytest.approx(truth, rel=0.1)
    uniform = profile.model_copy(
        update={
            "decode": [r for r in profile.decode if r.max_context * r.batch == r.context_tokens]
        }
    )
    assert {fit.form for fit in LatencyModel.fit(uniform).step_fits.values()} == {"total"}


def test_a_fit_from_equal_lengths_misprices_skewed_sdpa_steps():
    """Why the padded term exists: fitted on equal-length rows only, a padded backend's
    one-long-many-short step is predicted far too cheap."""
    profile = profile_from(tp_speeds_up, padded=sdpa_like)
    uniform = profile.model_copy(
        update={
            "decode": [r for r in profile.decode if r.max_context * r.batch == r.context_tokens]
        }
    )
    blind = LatencyModel.fit(uniform)
    truth = sdpa_like(1, 32, 8000 + 31 * 100, 8000)
    assert float(blind.step_time(1, 32, 8000 + 31 * 100, 8000)) < 0.5 * truth
    assert float(LatencyModel.fit(profile).step_time(1, 32, 8000 + 31 * 100, 8000)) == (
        pytest.approx(truth, rel=1e-6)
    )
    # an engine that knows its backend pads can say so, and equal-length rows then suffice
    told = LatencyModel.fit(uniform, context_form="padded")
    assert {fit.form for fit in told.step_fits.values()} == {"padded"}
    assert float(told.step_time(1, 32, 8000 + 31 * 100, 8000)) == pytest.approx(truth, rel=1e-6)
