"""Sampler: greedy, seeded per-request streams, truncation sets and the logprob convention.

Floats compared bit for bit (`torch.equal`) are where the twin runs the same row-wise ops
(log_softmax over the vocabulary, a division by the temperature, a gather, a sort) on the same
tensor as the sampler: each row is computed alone, so its bits depend on that row only."""

from __future__ import annotations

import pytest
import torch

from patrl.rollout.sampler import (
    SampleOutput,
    SamplingParams,
    _inverse_cdf,
    export_generator,
    import_generator,
    make_generator,
    plan_samples,
    sample,
    sample_planned,
    truncated_candidates,
)
from patrl.rollout.staging import Array, StepStaging
from patrl_testkit.sampling import reference_inverse_cdf, reference_sample

V = 50


def _logits(b: int, seed: int = 0, v: int = V) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 2


def allowed_set(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Slow twin of top-k then top-p, written from the definition with Python sorting."""
    probs = torch.softmax(logits.double() / p.effective_temperature, -1).tolist()
    ranked = sorted(range(len(probs)), key=lambda t: -probs[t])
    if 0 < p.top_k < len(probs):
        ranked = ranked[: p.top_k]
    total = sum(probs[t] for t in ranked)
    kept, mass = [], 0.0
    for t in ranked:
        if mass >= p.top_p - 1e-9:
            break
        kept.append(t)
        mass += probs[t] / total
    return set(kept)


def test_greedy_is_argmax_and_scores_with_temperature_one() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=0, top_k=3, top_p=0.5)] * 6
    out = sample(logits, params, [make_generator(i) for i in range(6)])
    assert torch.equal(out.tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(1, out.tokens[:, None])[:, 0]
    assert torch.equal(out.logprobs, expected)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=1.3, top_k=5, seed=3),
        SamplingParams(temperature=1.0, top_p=0.8, seed=3),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.6, seed=3),
    ],
)
def test_logprob_is_full_vocab_tempered_log_softmax(params: SamplingParams) -> None:
    logits = _logits(8).to(torch.bfloat16)
    out = sample(logits, [params] * 8, [make_generator(i) for i in range(8)])
    direct = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    assert torch.equal(out.logprobs, direct[torch.arange(8), out.tokens])


def _run_alone_and_in_batch(target: SamplingParams, steps: int) -> tuple[list, list]:
    alone_gen, batch_gen = make_generator(target.seed), make_generator(target.seed)
    others = [
        SamplingParams(temperature=t, top_k=k, top_p=p, seed=s)
        for s, (t, k, p) in enumerate(
            [(0, 0, 1.0), (1.0, 3, 1.0), (0.5, 0, 0.9), (2.0, 7, 0.5)] * 4
        )
    ][:15]
    other_gens = [make_generator(1000 + i) for i in range(15)]
    alone, batched = [], []
    for step in range(steps):
        row = _logits(1, seed=step)
        a = sample(row, [target], [alone_gen])
        batch = torch.cat([_logits(7, seed=100 + step), row, _logits(8, seed=200 + step)])
        params = [*others[:7], target, *others[7:]]
        b = sample(batch, params, [*other_gens[:7], batch_gen, *other_gens[7:]])
        alone.append((a.tokens[0].item(), a.logprobs[0].item()))
        batched.append((b.tokens[7].item(), b.logprobs[7].item()))
    return alone, batched


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=12),
    ],
)
def test_seeded_tokens_do_not_depend_on_batch_composition(target: SamplingParams) -> None:
    alone, batched = _run_alone_and_in_batch(target, steps=30)
    assert alone == batched
    assert len({t for t, _ in alone}) > 3  # it really sampled, not a constant


def test_same_seed_same_stream_different_seed_different_stream() -> None:
    logits = _logits(1).expand(40, V)
    p = SamplingParams(temperature=1.0)
    a = [sample(logits[:1], [p], [g]).tokens.item() for g in [make_generator(5)] for _ in range(40)]
    g5, g6 = make_generator(5), make_generator(6)
    b = [sample(logits[:1], [p], [g5]).tokens.item() for _ in range(40)]
    c = [sample(logits[:1], [p], [g6]).tokens.item() for _ in range(40)]
    assert a == b
    assert b != c


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.5, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.3),
        SamplingParams(temperature=2.0, top_p=0.9),
        SamplingParams(temperature=1.2, top_k=6, top_p=0.7),
    ],
)
def test_truncation_never_samples_outside_the_allowed_set(params: SamplingParams) -> None:
    n = 400
    logits = _logits(8, seed=7).repeat(n // 8, 1)
    out = sample(logits, [params] * n, [make_generator(i) for i in range(n)])
    allowed = [allowed_set(logits[i], params) for i in range(8)]
    for i, t in enumerate(out.tokens.tolist()):
        assert t in allowed[i % 8], (i, t, allowed[i % 8])
    # and it does use more than one of the allowed tokens where more than one is allowed
    for r in range(8):
        seen = set(out.tokens[r::8].tolist())
        assert len(seen) > 1 or len(allowed[r]) == 1


def test_sampled_frequencies_follow_the_tempered_distribution() -> None:
    n, v, temperature = 6000, 6, 0.8
    row = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0]])
    out = sample(
        row.expand(n, v), [SamplingParams(temperature)] * n, [make_generator(i) for i in range(n)]
    )
    freq = torch.bincount(out.tokens, minlength=v).double() / n
    target = torch.softmax(row[0].double() / temperature, -1)
    # 5 standard errors of a binomial proportion: fails only if the sampler is biased.
    se = (target * (1 - target) / n).sqrt()
    assert ((freq - target).abs() <= 5 * se).all(), (freq, target)


def test_top_logprobs_are_the_largest_of_the_same_distribution() -> None:
    logits = _logits(4)
    params = [SamplingParams(temperature=0.5, logprobs=3), SamplingParams(logprobs=5)] * 2
    out = sample(logits, params, [make_generator(i) for i in range(4)])
    assert out.top_ids is not None and out.top_logprobs is not None
    assert out.top_ids.shape == (4, 5)
    for i, p in enumerate(params):
        direct = torch.log_softmax(logits[i] / p.effective_temperature, -1)
        values, ids = direct.topk(5)
        assert torch.equal(out.top_ids[i], ids)
        assert torch.equal(out.top_logprobs[i], values)
    assert sample(logits, [SamplingParams()] * 4, [make_generator(0)] * 4).top_ids is None


def test_top_k_minus_one_is_off_as_zero_is() -> None:
    """vLLM's -1 (and 0) keep every token: -1 is stored as 0, so it samples as top_k=0."""
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    assert SamplingParams(top_k=-1).top_k == 0
    with pytest.raises(ValueError, match=r"top_k must be .*, got -5"):
        SamplingParams(top_k=-5)


def test_stop_is_a_tuple_of_strings() -> None:
    assert SamplingParams(stop="</s>").stop == ("</s>",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()  # type: ignore[arg-type]  # vLLM's default
    assert SamplingParams(stop_token_ids=None).stop_token_ids == frozenset()  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == frozenset({3, 4})  # type: ignore[arg-type]


def test_logprobs_none_zero_and_k_as_vllm_returns_them() -> None:
    """None: no per-position dicts; 0: the sampled token's alone; k: the k most likely tokens
    and the sampled one (k + 1 entries where it is not among them)."""
    logits = _logits(6)
    params = [SamplingParams(temperature=1.0, logprobs=k) for k in (None, 0, 1, 2, None, 3)]
    out = sample(logits, params, [make_generator(i) for i in range(6)])
    host = out.to_host()
    assert out.top_ids is not None and out.top_ids.shape == (6, 3)  # the batch's widest ask
    for row, p in enumerate(params):
        top = host.top(row, p.logprobs)
        if p.logprobs is None:
            assert top is None
            continue
        direct = torch.log_softmax(logits[row], -1)
        token = host.tokens[row]
        best = direct.topk(p.logprobs).indices.tolist() if p.logprobs else []
        assert list(top) == best + ([token] if token not in best else [])
        for t, value in top.items():
            assert value == pytest.approx(float(direct[t]), abs=1e-6)
        assert top[token] == host.logprobs[row]


def test_exported_generator_continues_the_same_stream() -> None:
    logits, p = _logits(1), SamplingParams(temperature=1.0)
    g = make_generator(42)
    _ = [sample(logits, [p], [g]) for _ in range(5)]
    moved = import_generator(export_generator(g))
    here = [sample(logits, [p], [g]).tokens.item() for _ in range(20)]
    there = [sample(logits, [p], [moved]).tokens.item() for _ in range(20)]
    assert here == there


def test_bad_sampling_params_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"temperature must be >= 0 \(0 = greedy\), got -0.5"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match=r"top_k must be >= 0, or -1 \(0 and -1 = off\), got -2"):
        SamplingParams(top_k=-2)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\] \(1 = off\), got 0.0"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match=r"logprobs must be None .* or >= 0 .*, got -2"):
        SamplingParams(logprobs=-2)
    with pytest.raises(ValueError, match=r"stop must hold non-empty strings, got ''"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValueError, match=r"2 logit rows, 1 sampling params, 2 generators"):
        sample(_logits(2), [SamplingParams()], [make_generator(0), make_generator(1)])


def slow_truncated(probs: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow twin: sort the WHOLE vocabulary, keep the top-k, then top-p of their mass."""
    v = probs.shape[0]
    k = p.top_k if 0 < p.top_k < v else v
    sorted_probs, order = probs.sort(descending=True, stable=True)
    sorted_probs, order = sorted_probs[:k], order[:k]
    # The same arithmetic as the fast path, so only the choice of candidates is compared.
    total = sorted_probs.sum() if k < v else probs.sum()
    n = int(((sorted_probs.cumsum(0) - sorted_probs) / total < p.top_p).sum())
    return order[:n], sorted_probs[:n]


def slow_truncated_token(probs: torch.Tensor, p: SamplingParams, draw: float) -> int:
    ids, kept = slow_truncated(probs, p)
    cdf = kept.cumsum(0)
    pos = int(torch.searchsorted(cdf, torch.tensor([draw]) * cdf[-1], right=True)[0])
    return int(ids[min(pos, len(ids) - 1)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: many exact ties
def test_truncated_fast_path_equals_the_full_sort_twin(dtype: torch.dtype) -> None:
    v, n = 3000, 64
    g = torch.Generator().manual_seed(9)
    # Peaked rows (like a trained LM) and flat rows (like a random one).
    logits = torch.randn(n, v, generator=g) * torch.linspace(0.5, 8.0, n)[:, None]
    logits = logits.to(dtype)
    grid = [(1.0, 20, 1.0), (0.7, 0, 0.9), (1.3, 200, 0.5), (1.0, 0, 0.999), (0.5, 1, 1.0)]
    params = [SamplingParams(t, k, p) for t, k, p in grid] * (n // len(grid) + 1)
    params = params[:n]
    out = sample(logits, params, [make_generator(100 + i) for i in range(n)])
    for i, p in enumerate(params):
        draw = torch.rand((), generator=make_generator(100 + i)).item()
        probs = torch.softmax(logits[i].float() / p.temperature, -1)
        ids, kept = truncated_candidates(probs, p)
        slow_ids, slow_kept = slow_truncated(probs, p)
        assert torch.equal(ids, slow_ids), (i, p, len(ids), len(slow_ids))
        torch.testing.assert_close(kept, slow_kept, rtol=0, atol=0)
        assert out.tokens[i].item() == slow_truncated_token(probs, p, draw), (i, p)


@pytest.mark.parametrize("v", [V, 4096])
def test_fast_paths_equal_the_slow_twin(v: int) -> None:
    """Untempered batches skip the division, only greedy rows take an argmax, an all-sampled
    batch is not copied, and only rows that searched past the end look for their last entry
    with mass: none of it may change a token or a logprob."""
    kinds = [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=2),
        SamplingParams(temperature=1.0, top_k=5, seed=3),
        SamplingParams(temperature=1.3, top_p=0.8, seed=4),
    ]
    batches = [kinds, [kinds[0]] * 6, [kinds[2], kinds[0]] * 3, [kinds[1]] * 3, kinds[::-1]]
    for step, params in enumerate(batches * 4):
        logits = _logits(len(params), seed=step, v=v)
        logits[0, v // 2 :] = -float("inf")  # a row whose upper half has no mass
        fast_gens = [make_generator(100 * step + i) for i in range(len(params))]
        slow_gens = [make_generator(100 * step + i) for i in range(len(params))]
        fast = sample(logits, params, fast_gens)
        tokens, chosen = reference_sample(logits, params, slow_gens)
        assert torch.equal(fast.tokens, tokens)
        assert torch.equal(fast.logprobs, chosen)


def test_a_draw_that_rounds_past_the_total_takes_the_last_entry_with_mass() -> None:
    probs = torch.tensor([[0.25, 0.5, 0.25, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    # a draw of 1 stands for draw * total rounding up to the total
    for draw in (0.0, 0.3, 0.99, 1.0):
        draws = torch.full((2,), draw)
        got = _inverse_cdf(probs, draws)
        assert torch.equal(got, reference_inverse_cdf(probs, draws))
    assert _inverse_cdf(probs, torch.ones(2)).tolist() == [2, 4]


def _host_values(out: SampleOutput) -> tuple[list[int], list[float], list[list[float]] | None]:
    host = out.to_host()
    return host.tokens, host.logprobs, host.top_logprobs


@pytest.mark.parametrize("v", [V, 4096])
def test_the_step_path_equals_sample_and_the_slow_twin(v: int) -> None:
    """The engine's path: the plan made first, its arrays staged behind other arrays of a
    step in one copy, `sample_planned` reading those views, the top-k / top-p rows left on
    the host and written in by `to_host`. Its tokens, logprobs and top logprobs equal
    `sample`'s (every row on the device) and the slow twin's, bit for bit: the same row-wise
    ops on the same values (the staged temperatures and uniforms are the float32 the sampler
    made on the host; a host row's logprob is read from an exact copy of its row)."""
    kinds = [
        SamplingParams(temperature=1.0, seed=1, logprobs=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=2),
        SamplingParams(temperature=1.0, top_k=5, seed=3, logprobs=1),
        SamplingParams(temperature=1.3, top_p=0.8, seed=4),
        SamplingParams(temperature=0.6, top_k=9, top_p=0.7, seed=5),
    ]
    batches = [
        kinds,
        kinds[::-1],
        [kinds[0]] * 5,
        [kinds[1]] * 3,
        [kinds[3], kinds[4]] * 2,
        [kinds[2], kinds[1], kinds[5]],
        [kinds[1], kinds[3]],
    ]
    staging = StepStaging("cpu")
    for step, params in enumerate(batches * 3):
        logits = _logits(len(params), seed=step, v=v)
        logits[0, v // 2 :] = -float("inf")  # a row whose upper half has no mass
        gens = [[make_generator(100 * step + i) for i in range(len(params))] for _ in range(3)]
        plan = plan_samples(params, gens[0], v)
        arrays = plan.arrays()
        before = [Array([7, 8, 9], torch.int64), Array([[1, 2]], torch.int32, (1, 2))]
        tensors = staging.stage([*before, *arrays]).tensors[len(before) :]
        stepped = sample_planned(logits, plan, tensors)
        assert (stepped.host_rows is None) == (plan.truncated == [])
        whole = sample(logits, params, gens[1])
        assert whole.host_rows is None
        tokens, chosen = reference_sample(logits, params, gens[2])
        assert _host_values(stepped) == _host_values(whole)
        assert torch.equal(whole.tokens, tokens)
        assert torch.equal(whole.logprobs, chosen)
        if plan.temperatures is None:
            assert all(p.effective_temperature == 1.0 for p in params)


def test_a_plan_stages_only_what_the_device_needs() -> None:
    """Temperatures only when some row is tempered; a path's rows only when it is neither
    empty nor every row; uniforms only for the rows sampled on the device (top-k / top-p
    rows draw theirs on the host)."""
    g = [make_generator(i) for i in range(3)]
    greedy, plain = SamplingParams(temperature=0), SamplingParams(seed=1)
    top_k = SamplingParams(temperature=0.5, top_k=3, seed=2)
    assert plan_samples([greedy] * 3, g, V).arrays() == []
    assert [a.dtype for a in plan_samples([plain] * 3, g, V).arrays()] == [torch.float32]
    mixed = plan_samples([greedy, plain, top_k], g, V)
    kinds = [(a.dtype, a.resolved_shape()) for a in mixed.arrays()]
    assert kinds == [
        (torch.float32, (3,)),  # temperatures
        (torch.int64, (1,)),  # greedy rows
        (torch.int64, (1,)),  # plain rows
        (torch.int64, (1,)),  # truncated rows
        (torch.float32, (1,)),  # the plain row's uniform
    ]
    assert len(mixed.truncated_draws) == 1
    with pytest.raises(ValueError, match=r"logits of shape \(2, 50\) for a plan of 3 rows"):
        sample_planned(_logits(2), mixed)
