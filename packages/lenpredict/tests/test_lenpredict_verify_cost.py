"""The latency model's price of a speculative verify step (query tokens beyond one a sequence):
fitted from verify rows, else derived from the decode fit. Synthetic rows, no clock."""

import numpy as np
import pytest

from patrl.lenpredict import LatencyModel, Profile, VerifyRow
from patrl_testkit.profiles import profile_from


def gpu_like(tp: int, batch: int, context: int) -> float:
    """A weight read of 10 ms, then 0.1 ms a sequence past a knee at 64; 1 ns a context token."""
    return 0.01 + 1e-4 * max(0, batch - 64) + 1e-9 * context


def with_verify(profile: Profile, per_token_s: float, fixed_s: float = 0.0) -> Profile:
    """`profile` plus verify rows that cost the decode step plus `fixed_s` plus `per_token_s` a
    query token past each sequence's first."""
    rows = [
        VerifyRow(
            tp=1,
            batch=b,
            query_len=q,
            context_tokens=c,
            seconds=gpu_like(1, b, c) + fixed_s + per_token_s * b * (q - 1),
        )
        for b in (1, 4, 16)
        for q in (2, 5)
        for c in (64 * b, 512 * b)
    ]
    return profile.model_copy(update={"verify": rows})


def test_verify_rows_price_verifying_and_each_extra_query_token() -> None:
    latency = LatencyModel.fit(with_verify(profile_from(gpu_like, tp_sizes=(1,)), 2e-5, 3e-4))
    assert latency.verify_s[1] == pytest.approx((3e-4, 2e-5), rel=1e-3)
    want = float(latency.step_time(1, 4, 2048)) + 3e-4 + 2e-5 * 12
    assert latency.verify_time(1, 4, 16, 2048) == pytest.approx(want, rel=1e-3)
    assert latency.verify_time(1, 4, 4, 2048) == pytest.approx(float(latency.step_time(1, 4, 2048)))


def test_verify_rows_cheaper_than_the_decode_fit_price_nothing_below_zero() -> None:
    latency = LatencyModel.fit(with_verify(profile_from(gpu_like, tp_sizes=(1,)), -1e-4))
    assert latency.verify_s[1] == (0.0, 0.0)
    latency = LatencyModel.fit(with_verify(profile_from(gpu_like, tp_sizes=(1,)), -1e-5, 1e-3))
    fixed, per_token = latency.verify_s[1]
    assert per_token == 0.0 and fixed > 0.0


def test_without_verify_rows_extra_tokens_are_priced_as_sequences() -> None:
    latency = LatencyModel.fit(profile_from(gpu_like, tp_sizes=(1, 2)))
    assert latency.verify_s == {}
    for batch, tokens in ((2, 10), (128, 640)):
        want = float(latency.step_time(1, tokens, 4096))
        assert latency.verify_time(1, batch, tokens, 4096) == pytest.approx(want)
    # weight-bound at batch 2: ten query tokens cost what two do; compute-bound at 128: not
    np.testing.assert_allclose(latency.verify_time(1, 2, 10, 0), latency.verify_time(1, 2, 2, 0))
    assert latency.verify_time(1, 128, 640, 0) > 4 * latency.verify_time(1, 128, 128, 0)
    with pytest.raises(ValueError, match="query_tokens=3 < batch=4"):
        latency.verify_time(1, 4, 3, 0)


def test_verify_rows_round_trip_and_refuse_a_query_of_one(tmp_path) -> None:
    profile = with_verify(profile_from(gpu_like, tp_sizes=(1,)), 2e-5)
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile
    with pytest.raises(ValueError, match="query_len"):
        VerifyRow(tp=1, batch=1, query_len=1, context_tokens=0, seconds=1.0)
