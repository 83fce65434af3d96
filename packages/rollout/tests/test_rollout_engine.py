"""The engine end to end on tiny random models: parity with transformers, batching, sharing,
preemption, moving requests, weights, bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.host_memory import MMAP_THRESHOLD_BYTES
from patrl.rollout.sampler import SamplingParams
from patrl_testkit.models import save_hf_model, tiny_hf_model
from patrl_testkit.multirank import run_ranks

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(tiny_hf_model("llama"), tmp_path_factory.mktemp("llama"))


def prompts(
    count: int, seed: int = 0, low: int = 3, high: int = 24, vocab: int = 250
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def engine(model_dir: Path, **overrides: Any) -> Engine:
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "block_size": 4,
        "num_kv_blocks": 256,
        "max_model_len": 256,
    }
    return Engine(EngineConfig(**{**kwargs, **overrides}))


def tokens(outputs: list[Any]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_generation_matches_transformers(family: str, tmp_path: Path) -> None:
    hf = tiny_hf_model(family)
    vocab = hf.config.vocab_size
    batch = prompts(8, seed=1, vocab=vocab)
    out = engine(save_hf_model(hf, tmp_path)).generate(batch, GREEDY)
    for prompt, result in zip(batch, out, strict=True):
        ids = torch.tensor([prompt])
        # An explicit mask: otherwise HF infers one from pad_token_id and hides prompt tokens 0.
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
        )
        assert result.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
        assert result.outputs[0].finish_reason == "length"


def test_sampled_request_is_the_same_alone_and_in_a_batch_of_16(llama_dir: Path) -> None:
    params = SamplingParams(
        temperature=0.9, top_p=0.9, top_k=50, seed=11, max_tokens=24, ignore_eos=True
    )
    target = prompts(1, seed=5)[0]
    alone = engine(llama_dir).generate([target], params)[0].outputs[0]
    others = prompts(15, seed=6)
    batch = (
        engine(llama_dir)
        .generate(
            [*others[:7], target, *others[7:]],
            [
                SamplingParams(temperature=1.0, seed=i, max_tokens=24 + i, ignore_eos=True)
                for i in range(7)
            ]
            + [params]
            + [SamplingParams(temperature=0.7, seed=100 + i, max_tokens=30) for i in range(8)],
        )[7]
        .outputs[0]
    )
    assert batch.token_ids == alone.token_ids
    torch.testing.assert_close(
        torch.tensor(batch.logprobs), torch.tensor(alone.logprobs), rtol=0, atol=1e-5
    )


def test_logits_sampled_in_chunks_of_rows_give_what_one_pass_gives(llama_dir: Path) -> None:
    """On CPU a step's full-vocabulary logits go through the sampler in chunks of rows that
    keep their temporaries under glibc's mmap ceiling (`ModelRunner.sample_chunk_bytes`, on by
    default there), from one matmul into a buffer kept across steps. Chunks of 3 rows,
    splitting prompts' forked samples and mixing greedy, sampled, truncated and top-logprob
    requests of different K, give the tokens and logprobs of one pass."""
    requests = prompts(8, seed=8)
    params = [
        GREEDY,
        SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=2, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=5),
        SamplingParams(temperature=1.2, top_k=20, seed=5, n=2, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=6, max_tokens=24, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.7, seed=7, max_tokens=7, ignore_eos=True),
    ]
    whole = engine(llama_dir)
    assert whole.runner.sample_chunk_bytes == MMAP_THRESHOLD_BYTES  # a CPU engine chunks by default
    whole.runner.sample_chunk_bytes = None
    chunked = engine(llama_dir)
    chunked.runner.sample_chunk_bytes = 4 * 4 * whole.model.config.vocab_size  # 3 rows a chunk
    chunks: list[int] = []
    gather = chunked.model.lm_head.gather
    chunked.model.lm_head.gather = lambda local: chunks.append(len(local)) or gather(local)  # type: ignore[method-assign]
    ones, parts = whole.generate(requests, params), chunked.generate(requests, params)
    assert max(chunks) <= 3 and len(chunks) > chunked.counters.steps  # steps were split
    for one, part in zip(ones, parts, strict=True):
        for a, b in zip(one.outputs, part.outputs, strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5
            )
            assert (a.top_logprobs is None) == (b.top_logprobs is None)
            for x, y in zip(a.top_logprobs or [], b.top_logprobs or [], strict=True):
                assert list(x) == list(y)
                torch.testing.assert_close(
                    torch.tensor(list(x.values())),
                    torch.tensor(list(y.values())),
                    rtol=0,
                    atol=1e-5,
                )


def test_n_samples_prefill_the_prompt_once_and_equal_separate_requests(llama_dir: Path) -> None:
    prompt = prompts(1, seed=7, low=40, high=41)[0]
    grouped_engine = engine(llama_dir, enable_prefix_caching=False)
    grouped = grouped_engine.generate(
        [prompt], SamplingParams(n=8, seed=21, max_tokens=12, ignore_eos=True)
    )
    assert grouped_engine.counters.prefill_tokens == len(prompt)
    separate = engine(llama_dir, enable_prefix_caching=False).generate(
        [prompt] * 8,
        [SamplingParams(seed=21 + i, max_tokens=12, ignore_eos=True) for i in range(8)],
    )
    assert [c.token_ids for c in grouped[0].outputs] == [o.outputs[0].token_ids for o in separate]
    assert len({tuple(c.token_ids) for c in grouped[0].outputs}) > 1  # the samples do differ


def test_requests_repeating_a_prompt_compute_its_full_blocks_once(llama_dir: Path) -> None:
    # a GRPO group sent as 8 requests of one sample (TRL's way), between two other prompts
    group = prompts(1, seed=7, low=42, high=43)[0]  # 10 full blocks of 4 and 2 tokens
    other = prompts(2, seed=8, low=9, high=10)
    batch = [other[0], *[group] * 8, other[1]]
    params = [SamplingParams(seed=21 + i, max_tokens=12, ignore_eos=True) for i in range(10)]
    shared_engine = engine(llama_dir)
    shared = shared_engine.generate(batch, params)
    plain = engine(llama_dir, enable_prefix_caching=False).generate(batch, params)
    assert tokens(shared) == tokens(plain)
    # the prompt once: the other copies take its logits and blocks, as a request's samples do
    assert shared_engine.counters.prefill_tokens == 9 + 42 + 9
    assert shared_engine.counters.prefill_steps == 1
    shared_engine.cache.blocks.check_integrity()
    assert shared_engine.cache.blocks.num_used_blocks == 0


@pytest.mark.parametrize("max_num_seqs", [256, 5])
def test_repeated_prompts_with_mixed_params_and_a_seq_cap_give_the_same_tokens(
    llama_dir: Path, max_num_seqs: int
) -> None:
    # requests of n 3, greedy, with top logprobs, another prompt, n 2 again: under a cap of 5
    # sequences some copies cannot join the first prefill and find the prompt cached later
    p, q = prompts(2, seed=9, low=21, high=22)
    batch = [p, p, p, q, p]
    params = [
        SamplingParams(n=3, seed=1, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, seed=2, logprobs=2, max_tokens=9),
        SamplingParams(seed=3, max_tokens=6, ignore_eos=True),
        SamplingParams(n=2, top_p=0.8, seed=4, max_tokens=8, ignore_eos=True),
    ]
    shared_engine = engine(llama_dir, max_num_seqs=max_num_seqs)
    shared = shared_engine.generate(batch, params)
    plain = engine(llama_dir, enable_prefix_caching=False, max_num_seqs=max_num_seqs).generate(
        batch, params
    )
    assert tokens(shared) == tokens(plain)
    for a, b in zip(shared, plain, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            torch.testing.assert_close(
                torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-5
            )
            assert [sorted(t) for t in x.top_logprobs or []] == [
                sorted(t) for t in y.top_logprobs or []
            ]
    assert shared[2].outputs[0].top_logprobs  # the request that asked for them got them
    counters = shared_engine.counters
    if max_num_seqs == 256:  # p once, q once, in one step
        assert (counters.prefill_steps, counters.prefill_tokens) == (1, 2 * 21)
    else:  # p's 5 samples, then q, then p's last request: its 5 full blocks cached
        assert (counters.prefill_steps, counters.prefill_tokens) == (3, 2 * 21 + 1)
    shared_engine.cache.blocks.check_integrity()
    assert shared_engine.cache.blocks.num_used_blocks == 0


def test_a_kv_budget_too_small_for_the_batch_preempts_and_gives_the_same_tokens(
    llama_dir: Path,
) -> None:
    batch = prompts(8, seed=2)
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=40, ignore_eos=True)
    roomy = engine(llama_dir).generate(batch, params)
    tight_engine = engine(
        llama_dir, num_kv_blocks=20, max_model_len=80
    )  # 80 slots for ~1000 tokens
    tight = tight_engine.generate(batch, params)
    assert tight_engine.scheduler.num_preemptions > 0
    assert tokens(tight) == tokens(roomy)
    tight_engine.cache.blocks.check_integrity()
    assert tight_engine.cache.blocks.num_used_blocks == 0


def test_chunked_prefill_keeps_every_step_within_the_token_budget(llama_dir: Path) -> None:
    batch = prompts(4, seed=8, low=30, high=60)
    whole = engine(llama_dir).generate(batch, GREEDY)
    chunked_engine = engine(llama_dir, max_num_batched_tokens=16)
    seen: list[int] = []
    original = chunked_engine.scheduler.schedule

    def spy() -> Any:
        scheduled = original()
        if scheduled is not None:
            seen.append(scheduled.num_tokens)
        return scheduled

    chunked_engine.scheduler.schedule = spy  # type: ignore[method-assign]
    assert tokens(chunked_engine.generate(batch, GREEDY)) == tokens(whole)
    assert max(seen) <= 16


@pytest.mark.parametrize("with_kv", [True, False])
def test_a_request_moved_after_10_tokens_finishes_as_if_it_never_moved(
    llama_dir: Path, with_kv: bool
) -> None:
    prompt = prompts(1, seed=9)[0]
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=30, ignore_eos=True)
    unmoved = engine(llama_dir).generate([prompt], params)
    src, dst = engine(llama_dir), engine(llama_dir, block_size=8)
    request = src.add_request(prompt, params)
    while min(len(s.output_token_ids) for s in src._requests[request].seqs.values()) < 10:
        assert src.step() == []
    states = src.export_requests([request], with_kv=with_kv)
    assert all((s.kv is not None) == with_kv for s in states)
    assert src.cache.blocks.num_used_blocks == 0 and not src.has_unfinished()
    prefill_before = dst.counters.prefill_tokens
    dst.import_requests(states)
    moved: list[Any] = []
    while dst.has_unfinished():
        moved += dst.step()
    assert tokens(moved) == tokens(unmoved)
    recomputed = dst.counters.prefill_tokens - prefill_before
    assert (recomputed == 0) if with_kv else (recomputed > 0)


def test_an_overlong_prompt_is_rejected_alone(llama_dir: Path) -> None:
    eng = engine(llama_dir, max_model_len=64)
    ok, too_long = prompts(1, seed=1)[0], list(range(64))
    out = eng.generate([ok, too_long, [300]], GREEDY)
    assert out[0].error is None and len(out[0].outputs[0].token_ids) == 32
    assert out[1].outputs[0].finish_reason == "rejected"
    assert "prompt of 64 tokens" in (out[1].error or "")
    assert "outside the vocabulary [0, 250)" in (out[2].error or "")


def test_abort_returns_the_partial_request(llama_dir: Path) -> None:
    eng = engine(llama_dir)
    rid = eng.add_request(
        prompts(1)[0], SamplingParams(n=2, max_tokens=100, ignore_eos=True, seed=0)
    )
    for _ in range(5):
        eng.step()
    eng.abort(rid)
    (out,) = eng.step()
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert all(0 < len(c.token_ids) < 100 for c in out.outputs)
    assert eng.cache.blocks.num_used_blocks == 0


def test_stop_tokens_and_eos(llama_dir: Path) -> None:
    eng = engine(llama_dir)
    prompt = prompts(1, seed=4)[0]
    free_run = eng.generate([prompt], GREEDY)[0].outputs[0].token_ids
    stop = free_run[5]
    first = free_run.index(stop)
    out = eng.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop])
    )[0]
    assert out.outputs[0].token_ids == free_run[: first + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_logprobs_none_zero_and_k_come_back_as_vllm_returns_them(llama_dir: Path) -> None:
    """The sampled tokens' logprobs always come back; `logprobs` adds per-position dicts:
    none for None, the sampled token's for 0, the top k and the sampled one's for k. The
    same seed samples the same tokens whatever is asked; asking more than the vocabulary
    holds is refused before anything is queued."""
    eng = engine(llama_dir)
    prompt = prompts(1, seed=12)[0]
    asks = [None, 0, 2, 5]
    outs = eng.generate(
        [prompt] * 4,
        [SamplingParams(seed=3, max_tokens=10, ignore_eos=True, logprobs=k) for k in asks],
    )
    first = outs[0].outputs[0]
    assert first.top_logprobs is None
    for k, out in zip(asks[1:], outs[1:], strict=True):
        c = out.outputs[0]
        # Other rows of the same batch: tokens exactly; logprobs within 1e-5, since a row's
        # result need not be bit-equal to another row's in a GEMM (tiles, tails).
        assert c.token_ids == first.token_ids
        assert c.logprobs == pytest.approx(first.logprobs, rel=1e-5, abs=1e-5)
        assert c.top_logprobs is not None and len(c.top_logprobs) == len(c.token_ids)
        for token, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
            assert top[token] == lp  # bit-equal: both read from the same row's logprobs
            assert len(top) in (k, k + 1) and (len(top) == k) == (token in list(top)[:k])
            best = list(top.values())[:k]
            assert best == sorted(best, reverse=True)
            assert token in list(top)[:k] or all(v >= lp for v in best)
    vocab = eng.model.config.vocab_size
    with pytest.raises(
        ValueError, match=rf"logprobs={vocab + 1} exceeds the vocabulary of {vocab}"
    ):
        eng.generate([prompt, prompt], [GREEDY, SamplingParams(logprobs=vocab + 1)])
    assert not eng.has_unfinished()


def test_load_weights_changes_outputs_and_drops_cached_prefixes(
    llama_dir: Path, tmp_path: Path
) -> None:
    eng = engine(llama_dir)
    prompt = prompts(1, seed=12, low=20, high=21)[0]
    before = eng.generate([prompt], GREEDY)[0].outputs[0].token_ids
    other = tiny_hf_model("llama", seed=1)
    eng.load_weights(other.state_dict().items(), version=1)
    after = eng.generate([prompt], GREEDY)[0].outputs[0].token_ids
    fresh = (
        engine(save_hf_model(other, tmp_path)).generate([prompt], GREEDY)[0].outputs[0].token_ids
    )
    assert after == fresh and after != before
    assert eng.stats()["weight_version"] == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"block_size": 0}, "block_size"),
        ({"attention_backend": "xformers"}, "unknown attention backend 'xformers'"),
        (
            {"attention_backend": "flash", "block_size": 4},
            r"attention_backend='flash' cannot use block_size=4: it takes a positive multiple "
            r"of 256 .* \['sdpa', 'triton'\]",
        ),
        ({"num_kv_blocks": 4, "max_model_len": 64}, "cannot hold one max_model_len=64"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"max_model_len": 100_000}, "exceeds the model's max_position_embeddings=256"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_config_names_the_key(llama_dir: Path, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine(llama_dir, **overrides)


def _tp_generate(
    rank: int, world_size: int, model_dir: str, comm: str
) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    import torch.distributed as dist

    from patrl.tpreshard import GroupCache, ParallelLayout

    if comm == "shm":  # GroupCache's default: the TP collectives through shared memory
        layout = GroupCache([world_size], world_size=world_size, rank=rank).layout(world_size)
        assert layout.tp_comm is not None
    else:
        group = dist.new_group(list(range(world_size)))
        layout = ParallelLayout(tp_size=world_size, tp_rank=rank, tp_group=group)
    eng = Engine(
        EngineConfig(model=model_dir, block_size=4, num_kv_blocks=128, max_model_len=128), layout
    )
    if comm == "shm":  # and the logits gathered and sampled in chunks of 3 rows
        eng.runner.sample_chunk_bytes = 4 * 4 * eng.model.config.vocab_size
    batch = prompts(4, seed=3)
    out = (
        eng.generate(batch, GREEDY)
        + eng.generate(batch, SamplingParams(seed=1, n=2, max_tokens=16))
        + eng.generate(batch, TOP_K)  # sampled on the host, compared across the ranks
    )
    # no seed: the group's first rank draws it for all (else the ranks would sample apart)
    unseeded = eng.generate(
        batch, SamplingParams(temperature=1.0, n=2, max_tokens=9, ignore_eos=True)
    )
    return tokens(out), tokens(unseeded)


TOP_K = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3, max_tokens=10)


@pytest.mark.multirank
@pytest.mark.parametrize("comm", ["process_group", "shm"])
def test_tp2_engine_generates_what_tp1_generates(llama_dir: Path, comm: str) -> None:
    batch = prompts(4, seed=3)
    eng = engine(llama_dir, num_kv_blocks=128, max_model_len=128)
    expected = tokens(
        eng.generate(batch, GREEDY)
        + eng.generate(batch, SamplingParams(seed=1, n=2, max_tokens=16))
        + eng.generate(batch, TOP_K)
    )
    per_rank = run_ranks(_tp_generate, world_size=2, args=(str(llama_dir), comm), timeout_s=180)
    assert per_rank[0][0] == per_rank[1][0] == expected
    assert per_rank[0][1] == per_rank[1][1]
    assert all(len(sample) == 9 for request in per_rank[0][1] for sample in request)


def test_auto_dtype_is_the_checkpoints_except_float32_on_cuda() -> None:
    on_cpu = EngineConfig(model="m", device="cpu")
    on_cuda = EngineConfig(model="m", device="cuda")
    assert on_cpu.torch_dtype(torch.float32) == torch.float32
    assert on_cuda.torch_dtype(torch.float32) == torch.bfloat16
    assert on_cuda.torch_dtype(torch.float16) == torch.float16
    assert (
        EngineConfig(model="m", device="cuda", dtype="float32").torch_dtype(torch.bfloat16)
        == torch.float32
    )
