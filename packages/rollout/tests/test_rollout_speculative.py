"""Speculative decoding: verified drafts change no output.

Twins: the engine with speculation off (greedy tokens and logprobs, stops, finish reasons); the
one-token sampler (a sequence with no draft); a slow reference of the processed distribution
(chi-square tests of the emitted tokens); a teacher-forced forward of transformers (logprobs).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from rollout_tokenizers import bpe_tokenizer, save_text_model

import patrl.rollout.model_runner as model_runner
from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.model_runner import verify_chunks
from patrl.rollout.outputs import RequestOutput
from patrl.rollout.plot import plot_timeline
from patrl.rollout.sampler import (
    SamplingParams,
    make_generator,
    sample,
    verify_drafts,
    verify_planned,
)
from patrl_testkit.models import FAMILIES, save_hf_model, tiny_hf_model
from patrl_testkit.multirank import run_ranks

TOL = 1e-5  # a verify step's logits come from a multi-token forward: rounding only


def engine(model_dir: Path, spec: bool, **overrides: Any) -> Engine:
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "block_size": 4,
        "num_kv_blocks": 256,
        "max_model_len": 256,
        "speculative": {"enable": spec, "max_num_seqs": 0},
    }
    return Engine(EngineConfig(**{**kwargs, **overrides}))


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in range(5, 5 + count)]


def two_rollouts(
    e: Engine,
    batch: list[list[int]],
    first: SamplingParams,
    second: SamplingParams,
    shift: int = 0,
) -> list[list[RequestOutput]]:
    """Two `generate` calls: the second drafts from the first's responses (history) as well as
    from its own group; with `shift`, prompt i takes prompt i + shift's key there, so its
    history drafts are another prompt's responses (mostly rejected)."""
    n = len(batch)
    keys = [[f"train/{(i + s) % n}" for i in range(n)] for s in (0, shift)]
    return [e.generate(batch, p, prompt_keys=k) for p, k in zip((first, second), keys, strict=True)]


def assert_same(a: list[RequestOutput], b: list[RequestOutput], tol: float = TOL) -> None:
    """Equal tokens, texts and stops; logprobs and top logprobs within `tol`."""
    for x, y in zip(a, b, strict=True):
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert cx.token_ids == cy.token_ids
            assert (cx.text, cx.finish_reason, cx.stop_reason) == (
                cy.text,
                cy.finish_reason,
                cy.stop_reason,
            )
            assert cx.logprobs == pytest.approx(cy.logprobs, abs=tol)
            for tx, ty in zip(cx.top_logprobs or [], cy.top_logprobs or [], strict=True):
                assert tx.keys() == ty.keys()
                assert list(tx.values()) == pytest.approx(list(ty.values()), abs=tol)


# ------------------------------------------------------------------ engine parity


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logprobs_match_without_speculation(family: str, tmp_path: Path) -> None:
    hf = tiny_hf_model(family)
    model = save_hf_model(hf, tmp_path)
    batch = prompts(4, hf.config.vocab_size)
    first = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=4, logprobs=2)
    second = SamplingParams(temperature=0, max_tokens=40, n=3, logprobs=2)  # EOS on
    warm = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, n=4, seed=0)
    off = two_rollouts(engine(model, False), batch, first, second)
    spec = engine(model, True)
    # history from sampled responses (not compared: speculation draws differently), so
    # greedy drafts from it are cut short too
    two_rollouts(spec, batch, warm, warm, shift=1)
    on = two_rollouts(spec, batch, first, second)
    for a, b in zip(off, on, strict=True):
        assert_same(a, b)
    stats = spec.stats()
    # both paths of a verify step ran: whole drafts accepted and drafts cut short
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]
    assert stats["spec_tokens_per_step"] > 1
    assert stats["spec_accepted_share/history"] > 0
    spec.cache.blocks.check_integrity()
    assert spec.cache.blocks.num_used_blocks == 0


@pytest.mark.gpu
def test_on_cuda_greedy_speculation_matches_the_one_token_path(tmp_path: Path) -> None:
    """The parity above on CUDA in fp32: verify steps (multi-token forwards) against decode
    steps replayed from CUDA graphs, on the device's default attention backend. Tolerance
    1e-4: the two paths run different kernels (paged prefill vs paged decode)."""
    hf = tiny_hf_model("qwen2")
    model = save_hf_model(hf, tmp_path)
    cuda = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=64)
    batch = prompts(4, hf.config.vocab_size)
    first = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=4, logprobs=2)
    second = SamplingParams(temperature=0, max_tokens=40, n=3, logprobs=2)
    warm = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, n=4, seed=0)
    off = two_rollouts(engine(model, False, **cuda), batch, first, second)
    spec = engine(model, True, **cuda)
    two_rollouts(spec, batch, warm, warm, shift=1)
    on = two_rollouts(spec, batch, first, second)
    for a, b in zip(off, on, strict=True):
        assert_same(a, b, tol=1e-4)
    stats = spec.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]
    spec.cache.blocks.check_integrity()
    assert spec.cache.blocks.num_used_blocks == 0


def test_a_compute_bound_cost_turns_speculation_off_and_changes_nothing(tmp_path: Path) -> None:
    model = save_hf_model(tiny_hf_model("llama"), tmp_path)
    batch = prompts(3, 250, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
    want = two_rollouts(engine(model, False), batch, greedy, greedy)
    for cost, speculates in ((lambda s, t, c: float(t), False), (lambda s, t, c: 1.0, True)):
        e = engine(model, True)
        assert e.drafter is not None
        e.drafter.step_cost = cost
        for a, b in zip(want, two_rollouts(e, batch, greedy, greedy), strict=True):
            assert_same(a, b)
        assert (e.stats()["spec_drafted_tokens"] > 0) is speculates


def test_verify_rows_sampled_in_chunks_give_what_one_pass_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU a verify step's logits go through `verify_planned` in chunks of whole sequences'
    rows under `sample_chunk_bytes`, as the one-token path's do: chunks of at most 5 rows
    (a sequence of 1 + 4 fits; longer drafts are a chunk of their own) give the tokens of one
    pass, bit for bit for the greedy and seeded requests (each sequence draws from its own
    generator and the same logits rows), and logprobs within TOL (the chunked head is one
    matmul into a kept buffer instead of the layer's forward)."""
    hf = tiny_hf_model("llama")
    model = save_hf_model(hf, tmp_path)
    batch = prompts(4, hf.config.vocab_size, seed=12)
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=3, logprobs=2),
        SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True, n=3),
        SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=30, ignore_eos=True, n=2),
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, n=2),
    ]
    runs, calls = [], []
    for chunked in (False, True):
        e = engine(model, True, speculative={"enable": True, "max_num_seqs": 0,
                                             "num_speculative_tokens": 6})  # fmt: skip
        vocab = e.model.config.vocab_size
        e.runner.sample_chunk_bytes = 4 * 6 * vocab if chunked else None  # 5 rows a chunk
        seen: list[tuple[int, int]] = []  # (logit rows, sequences) of each verify_planned call

        def spy(logits: torch.Tensor, plan: Any, *rest: Any, seen: list = seen) -> Any:
            seen.append((len(logits), len(plan.drafts)))
            return verify_planned(logits, plan, *rest)

        monkeypatch.setattr(model_runner, "verify_planned", spy)
        runs.append(two_rollouts(e, batch, params, params))
        assert e.stats()["spec_accepted_tokens"] > 0
        calls.append(seen)
    whole, parts = calls
    # the same schedule (same tokens, same drafts), each verify step split into several calls
    assert sum(r for r, _ in whole) == sum(r for r, _ in parts) and len(parts) > len(whole)
    assert all(r <= 5 or n == 1 for r, n in parts)  # a longer draft is verified alone
    assert any(r > 5 for r, _ in parts)
    for a, b in zip(runs[0], runs[1], strict=True):
        assert_same(a, b)


def test_verify_chunks_keep_sequences_whole() -> None:
    assert verify_chunks([1, 5, 3, 2, 7, 1], 5) == [(0, 1), (1, 2), (2, 4), (4, 5), (5, 6)]
    assert verify_chunks([2, 2, 1], 5) == [(0, 3)]
    assert verify_chunks([9], 5) == [(0, 1)]


def test_a_latency_profile_turns_speculation_on_or_off_and_is_checked(tmp_path: Path) -> None:
    """`speculative.latency_profile`: a profile of this model whose steps cost the same
    whatever their rows (weight-bound) lets every step draft; one whose steps cost in
    proportion to their rows (compute-bound) lets none; the tokens are the same either way.
    A profile of another model or an unreadable file is refused naming the key."""
    from patrl.lenpredict import ProfileMismatchError
    from patrl.rollout.profile import model_info
    from patrl_testkit.profiles import profile_from

    hf = tiny_hf_model("llama")
    model = save_hf_model(hf, tmp_path / "m")
    batch = prompts(3, hf.config.vocab_size, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
    want = two_rollouts(engine(model, False), batch, greedy, greedy)
    info = model_info(model, engine(model, False))
    for name, step, speculates in (
        ("flat", lambda tp, b, c: 0.01, True),
        ("linear", lambda tp, b, c: 1e-3 * b, False),
    ):
        profile = profile_from(step, tp_sizes=(1,)).model_copy(update={"model": info})
        profile.save(tmp_path / f"{name}.json")
        spec = {
            "enable": True,
            "max_num_seqs": 0,
            "latency_profile": str(tmp_path / f"{name}.json"),
        }
        e = engine(model, True, speculative=spec)
        for a, b in zip(want, two_rollouts(e, batch, greedy, greedy), strict=True):
            assert_same(a, b)
        assert (e.stats()["spec_drafted_tokens"] > 0) is speculates
    other = profile_from(lambda tp, b, c: 0.01, tp_sizes=(1,))  # the kit's TINY shape
    other.save(tmp_path / "other.json")
    with pytest.raises(
        ProfileMismatchError,
        match=r"latency_profile=.*other\.json. is a profile of a model with \w+=\d+, the engine",
    ):
        engine(
            model,
            True,
            speculative={"enable": True, "latency_profile": str(tmp_path / "other.json")},
        )
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match=r"latency_profile=.*bad\.json. is not a readable"):
        engine(
            model, True, speculative={"enable": True, "latency_profile": str(tmp_path / "bad.json")}
        )


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    tokenizer = bpe_tokenizer()
    return save_text_model(tmp_path_factory.mktemp("spec_text"), tokenizer), tokenizer


def test_stops_inside_an_accepted_run_cut_where_the_one_token_path_stops(
    text_model: tuple[Path, Any],
) -> None:
    """The second rollout drafts whole responses from the first's history, so its drafts run
    past every stop: stop strings, stop token ids, EOS and max_tokens must cut them."""
    model, tokenizer = text_model
    texts = ["the cat sat on", "numbers 12 345", "Answer: yes", "while rain fell;"]
    batch = [tokenizer.encode(t) for t in texts]
    first = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2)
    learn = engine(model, False).generate(batch, first)
    cases: list[SamplingParams] = []
    for out in learn:
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        cases.append(SamplingParams(temperature=0, max_tokens=40, stop=[text[20:23]], n=2))
        cases.append(SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ids[17]], n=2))
        cases.append(SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, n=2))
    prompts3 = [p for p in batch for _ in range(3)]
    firsts = [first] * len(prompts3)
    keys = [f"k{i // 3}" for i in range(len(prompts3))]
    results = []
    for spec in (False, True):
        e = engine(model, spec)
        e.generate(prompts3, firsts, prompt_keys=keys)
        results.append(e.generate(prompts3, cases, prompt_keys=keys))
    assert_same(results[0], results[1])
    reasons = {c.stop_reason for o in results[1] for c in o.outputs}
    finishes = {c.finish_reason for o in results[1] for c in o.outputs}
    assert any(isinstance(r, str) for r in reasons) and any(isinstance(r, int) for r in reasons)
    assert finishes == {"stop", "length"}
    assert e.stats()["spec_acceptance"] > 0.5  # the drafts did run through the stops


def test_sampled_runs_stop_at_their_first_stop_token_eos_or_max_tokens(tmp_path: Path) -> None:
    """Sampling, where no twin gives the same tokens: every output ends at its first stop
    token or EOS (none earlier) or at exactly max_tokens, though drafts run past them."""
    hf = tiny_hf_model("llama")
    model = save_hf_model(hf, tmp_path)
    batch = prompts(4, hf.config.vocab_size, seed=8)
    e = engine(model, True)
    learn = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, n=4, seed=1)
    e.generate(batch, learn, prompt_keys=[f"s{i}" for i in range(4)])
    eos = set(e.eos_token_ids)
    common = [t for t, _ in Counter(t for o in e.generate(batch, learn) for c in o.outputs
                                    for t in c.token_ids).most_common(3)]  # fmt: skip
    params = SamplingParams(
        temperature=0.8, max_tokens=17, n=4, seed=2, stop_token_ids=common[:2], logprobs=1
    )
    drafted = e.stats()["spec_drafted_tokens"]
    outs = e.generate(batch, params, prompt_keys=[f"s{i}" for i in range(4)])
    assert e.stats()["spec_drafted_tokens"] > drafted
    stops = set(common[:2]) | eos
    reasons = set()
    for o in outs:
        for c in o.outputs:
            assert not stops & set(c.token_ids[:-1])
            assert len(c.token_ids) <= 17 and len(c.logprobs) == len(c.token_ids)
            if c.finish_reason == "length":
                assert len(c.token_ids) == 17 and c.token_ids[-1] not in stops
            else:
                assert c.token_ids[-1] in stops
            reasons.add(c.finish_reason)
    assert reasons == {"stop", "length"}


def test_kv_blocks_stay_intact_through_preemption_and_rollback(tmp_path: Path) -> None:
    """A cache too small for the batch: preemptions, forks and prefix hits among verify steps;
    every invariant after every step, the same greedy tokens, no block held at the end."""
    hf = tiny_hf_model("qwen2")
    model = save_hf_model(hf, tmp_path)
    batch = prompts(6, hf.config.vocab_size, seed=3)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, n=3)
    outs: list[list[list[int]]] = []
    for spec in (False, True):
        e = engine(model, spec, num_kv_blocks=40, max_model_len=64)
        for _ in range(2):
            ids = [e.add_request(p, params, prompt_key=f"q{i}") for i, p in enumerate(batch)]
            done: dict[str, RequestOutput] = {}
            while e.has_unfinished():
                for out in e.step():
                    done[out.request_id] = out
                e.cache.blocks.check_integrity()
            outs.append([c.token_ids for i in ids for c in done[i].outputs])
        assert e.cache.blocks.num_used_blocks == 0
        assert e.stats()["num_preemptions"] > 0
    assert outs[:2] == outs[2:]


def test_requests_moved_mid_rollout_and_partial_rollouts_finish_as_without_speculation(
    tmp_path: Path,
) -> None:
    """Export with KV (cut-and-migrate, reconfigure) and without (snapshot, recompute) from a
    speculating engine into another, and a partial rollout resumed: a moved sample carries
    no draft state (the next engine indexes its tokens on first sight), and greedy tokens
    and logprobs are those of an engine that never speculates."""
    hf = tiny_hf_model("llama")
    model = save_hf_model(hf, tmp_path)
    batch = prompts(4, hf.config.vocab_size, seed=6)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=3, logprobs=1)
    keys = [f"m{i}" for i in range(len(batch))]
    want = engine(model, False).generate(batch, params, prompt_keys=keys)
    for with_kv in (True, False):
        a, b = engine(model, True), engine(model, True)
        a.generate(batch, params, prompt_keys=keys)  # history to draft from
        ids = [a.add_request(p, params, prompt_key=k) for p, k in zip(batch, keys, strict=True)]
        for _ in range(6):
            a.step()
        b.advance_ids(a.next_seq_id(), a.next_request_number())
        b.import_requests(a.export_requests(ids, with_kv=with_kv))
        assert not a.has_unfinished() and a.drafter is not None and a.drafter.num_groups() == 0
        done: dict[str, RequestOutput] = {}
        while b.has_unfinished():
            for out in b.step():
                done[out.request_id] = out
            b.cache.blocks.check_integrity()
        assert_same(want, [done[i] for i in ids])
    c = engine(model, True)
    finished, rest = c.generate_partial(batch, [params] * len(batch), quota=1)
    later, left = c.generate_partial([], [], quota=len(batch), resume=rest)
    assert not left
    by_prompt = {tuple(o.prompt_token_ids): o for o in finished + later}
    assert_same(want, [by_prompt[tuple(p)] for p in batch])
    assert c.stats()["spec_accepted_tokens"] > 0


def test_seeded_sampling_is_deterministic_and_its_logprobs_are_the_models(
    tmp_path: Path,
) -> None:
    """Sampling with speculation: the same seed gives the same tokens; each logprob is a
    teacher-forced forward's log_softmax(logits / T) at that token (the shared convention)."""
    hf = tiny_hf_model("llama")
    model = save_hf_model(hf, tmp_path)
    batch = prompts(3, hf.config.vocab_size, seed=5)
    plans = [
        SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True, n=4, seed=11),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_tokens=30, n=4, seed=12),
    ]
    runs = []
    for _ in range(2):
        e = engine(model, True)
        runs.append([o for p in plans for o in two_rollouts(e, batch, p, p)[1]])
    assert [[c.token_ids for c in o.outputs] for o in runs[0]] == [
        [c.token_ids for c in o.outputs] for o in runs[1]
    ]
    assert e.stats()["spec_accepted_tokens"] > 0
    for out, p in zip(runs[0], [q for q in plans for _ in batch], strict=True):
        prompt = out.prompt_token_ids
        for c in out.outputs:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
            ref = torch.log_softmax(logits / p.temperature, dim=-1)
            want = ref.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert c.logprobs == pytest.approx(want.tolist(), abs=1e-4)


def test_bad_speculative_values_are_config_errors_naming_them() -> None:
    def config(**spec: Any) -> EngineConfig:
        return EngineConfig(model="unused", speculative=spec)

    with pytest.raises(
        ValidationError, match=r"(?s)speculative.sources.*'group', 'history' or 'prompt'"
    ):
        config(sources=["group", "draft_model"])
    with pytest.raises(ValidationError, match=r"speculative\.num_speculative_tokens"):
        config(num_speculative_tokens=0)
    with pytest.raises(ValidationError, match="prompt_lookup_min=5 must be <= prompt_lookup_max"):
        config(prompt_lookup_min=5)
    with pytest.raises(ValidationError, match=r"speculative\.enable_it"):
        config(enable_it=True)


# ------------------------------------------------------------------ the sampler


V = 6
KINDS = {
    "plain": SamplingParams(temperature=1.0),
    "tempered": SamplingParams(temperature=0.6),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "top_p": SamplingParams(temperature=1.3, top_p=0.8),
}


def processed(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Slow twin of the distribution a request samples from: softmax(logits / T), top-k,
    then top-p (mass before a token < top_p, in descending order), renormalised."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    order = probs.argsort(descending=True, stable=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = p.top_k or len(probs)
    mass = 0.0
    total = probs[order[:k]].sum()
    for t in order[:k].tolist():
        if mass / total < p.top_p:
            keep[t] = True
        mass += probs[t].item()
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells with mass, and its degrees of freedom; a count in
    a cell without mass is an error of its own."""
    assert counts[probs == 0].sum() == 0, f"tokens outside the distribution: {counts}"
    n = counts.sum()
    cells = probs > 0
    expected = probs[cells] * n
    return float(((counts[cells] - expected) ** 2 / expected).sum()), int(cells.sum()) - 1


# upper 0.1% points of chi-square by degrees of freedom: a false alarm rate of 1e-3 per check;
# the seeds are fixed, so the test cannot flake (it passes or fails the same way every run)
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}
TRIALS = 4000


@pytest.mark.parametrize("draft_kind", ["good", "bad", "random"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_emitted_tokens_follow_the_target_distribution(kind: str, draft_kind: str) -> None:
    """Drafts of two tokens over three fixed logit rows, TRIALS seeds: the first emitted token
    follows p_0, and the token after an accepted first draft token follows p_1."""
    p = KINDS[kind]
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(7)) * 0.8
    target = [processed(row, p) for row in logits]
    rng = torch.Generator().manual_seed(8)
    drafts: list[list[int]] = []
    for _ in range(TRIALS):
        if draft_kind == "good":
            drafts.append([int(t.argmax()) for t in target[:2]])
        elif draft_kind == "bad":
            drafts.append([int(logits[j].argmin()) for j in range(2)])
        else:
            drafts.append(torch.randint(0, V, (2,), generator=rng).tolist())
    out = verify_drafts(
        logits.repeat(TRIALS, 1),
        drafts,
        [p] * TRIALS,
        [make_generator(1000 + i) for i in range(TRIALS)],
    )
    assert out.emitted is not None
    tokens = out.tokens.view(TRIALS, 3)
    emitted = out.emitted.view(TRIALS, 3)
    assert emitted[:, 0].all()
    # emitted rows are a prefix, and row j is emitted iff the draft tokens before it were
    accepted = tokens[:, :2] == torch.tensor(drafts)
    assert torch.equal(emitted[:, 1], accepted[:, 0])
    assert torch.equal(emitted[:, 2], accepted[:, 0] & accepted[:, 1])
    first = torch.bincount(tokens[:, 0], minlength=V).double()
    stat, df = chi_square(first, target[0])
    assert stat < CHI2_999[df], (stat, df)
    after = tokens[emitted[:, 1], 1]
    if len(after) >= 500:  # expected counts of at least ~8 in every cell
        stat, df = chi_square(torch.bincount(after, minlength=V).double(), target[1])
        assert stat < CHI2_999[df], (stat, df)
    if draft_kind == "bad" and kind == "top_k":
        assert not emitted[:, 1].any()  # a draft outside the top-k is never accepted


def test_greedy_verification_is_the_argmax_and_a_rejection_emits_it() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    best = logits.argmax(dim=-1).tolist()
    wrong = (best[1] + 1) % V
    out = verify_drafts(
        logits, [[best[0], wrong, best[2]]], [SamplingParams(temperature=0)], [make_generator(0)]
    )
    assert out.emitted is not None
    assert out.emitted.tolist() == [True, True, False, False]
    assert out.tokens[:2].tolist() == best[:2]
    want = torch.log_softmax(logits, dim=-1).gather(1, out.tokens[:, None])[:, 0]
    assert torch.equal(out.logprobs, want)


@pytest.mark.parametrize("kind", ["greedy", *KINDS])
def test_a_sequence_without_a_draft_samples_as_the_one_token_path(kind: str) -> None:
    """Bit-equal: the same logits, the same draw from the same generator, the same search."""
    p = SamplingParams(temperature=0) if kind == "greedy" else KINDS[kind]
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(4))
    params = [p] * 5
    one = sample(logits, params, [make_generator(i) for i in range(5)])
    spec = verify_drafts(logits, [[]] * 5, params, [make_generator(i) for i in range(5)])
    assert torch.equal(one.tokens, spec.tokens)
    assert torch.equal(one.logprobs, spec.logprobs)


# ------------------------------------------------------------------ tensor parallel


def _tp_speculative(rank: int, world_size: int, model_dir: str) -> list[Any]:
    import torch.distributed as dist

    from patrl.tpreshard import ParallelLayout

    group = dist.new_group(list(range(world_size)))
    layout = ParallelLayout(tp_size=world_size, tp_rank=rank, tp_group=group)
    config = EngineConfig(
        model=model_dir,
        block_size=4,
        num_kv_blocks=128,
        max_model_len=128,
        speculative={"enable": True, "max_num_seqs": 0},
    )
    e = Engine(config, layout)
    batch = prompts(3, 250, seed=9)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
    out = [o for run in two_rollouts(e, batch, greedy, greedy) for o in run]
    # unseeded: the group's first rank draws each seed, so the ranks verify the same draws
    unseeded = SamplingParams(temperature=1.0, top_k=50, max_tokens=16, ignore_eos=True, n=2)
    out += [o for run in two_rollouts(e, batch, unseeded, unseeded) for o in run]
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in out] + [
        e.stats()["spec_accepted_tokens"]
    ]


@pytest.mark.multirank
def test_tp2_ranks_draft_and_verify_alike_and_greedy_matches_tp1(tmp_path: Path) -> None:
    model = save_hf_model(tiny_hf_model("llama"), tmp_path)
    per_rank = run_ranks(_tp_speculative, world_size=2, args=(str(model),), timeout_s=180)
    assert per_rank[0] == per_rank[1]  # a rank that drafted apart would fail the TP check
    assert per_rank[0][-1] > 0
    batch = prompts(3, 250, seed=9)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
    tp1 = [o for run in two_rollouts(engine(model, False), batch, greedy, greedy) for o in run]
    for want, got in zip(tp1, per_rank[0][: len(tp1)], strict=True):
        assert [c.token_ids for c in want.outputs] == [ids for ids, _ in got]
        for c, (_, logprobs) in zip(want.outputs, got, strict=True):
            assert logprobs == pytest.approx(c.logprobs, abs=TOL)


def _fold_body(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    """Two TP-1 replicas draft from histories that differ under the same prompt keys (each
    saw other prompts as "k0".."k2"; one sample a prompt, so drafts come from history), then
    fold into one TP-2 group mid-rollout: its ranks must draft alike from there on (else
    their steps differ in size and a collective or the TP check fails)."""
    from patrl.rollout.adaptive import reconfigure
    from patrl.tpreshard import GroupCache

    groups = GroupCache([1, 2], world_size=world_size, rank=rank)
    config = EngineConfig(
        model=model_dir,
        block_size=4,
        num_kv_blocks=256,
        max_model_len=128,
        speculative={"enable": True, "max_num_seqs": 0},
    )
    e = Engine(config, groups.layout(1), groups)
    mine = prompts(3, 250, seed=20 + rank)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)
    keys = [f"k{i}" for i in range(3)]
    e.generate(mine, greedy, prompt_keys=keys)  # history, other on each replica
    ids = [
        e.add_request(p, greedy, request_id=f"r{rank}-{i}", prompt_key=k)
        for i, (p, k) in enumerate(zip(mine, keys, strict=True))
    ]
    done: dict[str, Any] = {}
    for _ in range(4):
        for out in e.step():
            done[out.request_id] = out
    before = e.stats()["spec_accepted_tokens"]
    reconfigure(e, 2)
    assert e.layout.tp_size == 2 and not done and e.drafter is not None
    merged = (e.drafter.state_dict(), e.drafter.acceptance())
    while e.has_unfinished():
        for out in e.step():
            done[out.request_id] = out
    assert set(ids) <= set(done)
    return {
        "outputs": {
            rid: [(c.token_ids, c.logprobs) for c in out.outputs] for rid, out in done.items()
        },
        "merged": merged,
        "accepted_before": before,
        "accepted_after": e.stats()["spec_accepted_tokens"] - before,
    }


@pytest.mark.multirank
def test_greedy_tokens_across_a_fold_match_an_engine_without_speculation(tmp_path: Path) -> None:
    """Adaptive TP with speculation: two speculating replicas fold into one TP-2 group
    mid-rollout (`reconfigure`, KV migrated); both ranks return the same tokens, speculation
    ran before and after the fold, and every greedy output equals one engine's without
    speculation (tokens exactly, logprobs within TOL)."""
    model = save_hf_model(tiny_hf_model("llama"), tmp_path)
    per_rank = run_ranks(_fold_body, world_size=2, args=(str(model),), timeout_s=240)
    assert per_rank[0]["merged"] == per_rank[1]["merged"]  # the drafters were made alike
    assert per_rank[0]["outputs"] == per_rank[1]["outputs"]
    assert len(per_rank[0]["outputs"]) == 3 * 2
    assert all(r["accepted_before"] > 0 and r["accepted_after"] > 0 for r in per_rank)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)
    off = engine(model, False)
    for rank in range(2):
        want = off.generate(prompts(3, 250, seed=20 + rank), greedy)
        for i, w in enumerate(want):
            got = per_rank[0]["outputs"][f"r{rank}-{i}"]
            assert [c.token_ids for c in w.outputs] == [ids for ids, _ in got]
            for c, (_, logprobs) in zip(w.outputs, got, strict=True):
                assert logprobs == pytest.approx(c.logprobs, abs=TOL)


def test_a_verify_step_makes_one_host_sync_plus_one_for_top_k_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-token path's budget (test_rollout_host_syncs): the step's copy-out, plus the
    one copy of the top-k / top-p rows, whose acceptance then runs on host tensors."""
    from test_rollout_host_syncs import CountSyncs

    import patrl.rollout.sampler as sampler

    model = save_hf_model(tiny_hf_model("llama"), tmp_path)
    e = engine(model, True, tune_host_malloc=False)
    batch = prompts(3, 250, seed=2)
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2, logprobs=2),
        SamplingParams(temperature=1.0, seed=1, max_tokens=40, ignore_eos=True, n=2),
        SamplingParams(temperature=0.9, top_k=5, seed=3, max_tokens=40, ignore_eos=True),
    ]
    keys = ["a", "b", "c"]
    e.generate(batch, params, prompt_keys=keys)  # history
    for p, sp, k in zip(batch, params, keys, strict=True):
        e.add_request(p, sp, prompt_key=k)
    while e.counters.decode_steps < 2:
        e.step()
    mode = CountSyncs()

    def paused(f: Any, count: int) -> Any:
        def run(*args: Any) -> Any:
            mode.count += count
            mode.paused = True
            try:
                return f(*args)
            finally:
                mode.paused = False

        return run

    monkeypatch.setattr(sampler.SampleOutput, "to_host", paused(sampler.SampleOutput.to_host, 1))
    monkeypatch.setattr(sampler, "_verify_truncated", paused(sampler._verify_truncated, 0))
    verified = 0
    for _ in range(6):
        drafted = e.stats()["spec_drafted_tokens"]
        mode.count = 0
        with mode:
            e.step()
        if e.stats()["spec_drafted_tokens"] > drafted:
            verified += 1
            assert mode.count <= 2, mode.calls
    assert verified >= 3


def test_the_timeline_marks_verify_steps_with_drafted_and_accepted_tokens(tmp_path: Path) -> None:
    """Each step's record carries the tokens its drafts offered and the ones accepted, as the
    drafter counts them for the metrics: over a fresh engine's one rollout they sum to its
    totals; prefill steps and an engine without speculation mark none. The timeline plot
    draws them."""
    model = save_hf_model(tiny_hf_model("llama"), tmp_path)
    batch = prompts(3, 250, seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=3)
    spec = engine(model, True)
    spec.generate(batch, greedy, prompt_keys=[f"k{i}" for i in range(3)])
    timeline = spec.stats()["timeline"]
    stats = spec.stats()
    assert sum(r["drafted"] for r in timeline) == stats["spec_drafted_tokens"] > 0
    assert sum(r["accepted"] for r in timeline) == stats["spec_accepted_tokens"] > 0
    assert all(0 <= r["accepted"] <= r["drafted"] for r in timeline)
    assert all(r["drafted"] == 0 for r in timeline if r["is_prefill"])
    assert any(r["drafted"] == 0 for r in timeline if not r["is_prefill"])  # the first steps
    plain = engine(model, False)
    plain.generate(batch, greedy)
    assert all(r["drafted"] == r["accepted"] == 0 for r in plain.stats()["timeline"])
    path = plot_timeline(timeline, [], tmp_path / "spec.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
