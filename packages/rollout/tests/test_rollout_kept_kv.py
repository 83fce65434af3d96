"""Kept KV between turns (issue 46): a finished sample added with keep=True holds its blocks,
and `continue_request` prefills exactly the appended tokens plus its last sampled token (whose
KV no step wrote) over them, at any block size; the tokens and logprobs equal a slow twin that
re-prefills the whole conversation every turn on an engine without prefix caching. Kept
samples hold no decode slot, are evicted before running samples are preempted (their
continuation then re-prefills, correctly), and leave no block behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.outputs import RequestOutput
from patrl.rollout.sampler import SamplingParams
from patrl_testkit.models import save_hf_model, tiny_hf_model

VOCAB = 250


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(tiny_hf_model("llama"), tmp_path_factory.mktemp("llama_kept"))


def engine(model_dir: Path, block_size: int, **overrides: Any) -> Engine:
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": "float32",
        "device": "cpu",
        "block_size": block_size,
        "num_kv_blocks": 2048 // block_size,
        "max_model_len": 256,
        "enable_prefix_caching": False,
    }
    return Engine(EngineConfig(**{**kwargs, **overrides}))


def ids(count: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (count,), generator=g).tolist()


def params(turn: int, n: int = 1) -> SamplingParams:
    """Greedy turns of differing lengths, so turns end at every offset inside a block."""
    return SamplingParams(temperature=0, max_tokens=3 + 2 * turn, ignore_eos=True, n=n)


def run(eng: Engine, request_ids: list[str]) -> dict[str, RequestOutput]:
    """Step until every one of `request_ids` has finished."""
    done: dict[str, RequestOutput] = {}
    while any(r not in done for r in request_ids):
        for out in eng.step():
            done[out.request_id] = out
    return done


def twin(
    model_dir: Path, prompt: list[int], tools: list[list[int]], **overrides: Any
) -> list[tuple[Any, Any]]:
    """The slow twin: each turn submitted whole (the conversation so far, then the tool
    turn) to an engine without prefix caching. Per turn (token ids, logprobs)."""
    eng = engine(model_dir, overrides.pop("block_size", 4), **overrides)
    conversation, turns = list(prompt), []
    for t in range(len(tools) + 1):
        before = eng.counters.prefill_tokens
        out = eng.generate([conversation], params(t))[0].outputs[0]
        assert eng.counters.prefill_tokens - before == len(conversation)  # all of it
        turns.append((list(out.token_ids), list(out.logprobs)))
        if t < len(tools):
            conversation += list(out.token_ids) + tools[t]
    return turns


def baseline(eng: Engine) -> None:
    """Every block free, no reference left, the bookkeeping consistent."""
    blocks = eng.cache.blocks
    blocks.check_integrity()
    assert blocks.num_free_blocks == blocks.num_blocks
    assert all(blocks.ref_count(b) == 0 for b in range(blocks.num_blocks))
    assert eng.kept_request_ids() == []


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_each_continuation_prefills_exactly_the_appended_tokens_and_equals_the_twin(
    llama_dir: Path, block_size: int
) -> None:
    """Prefix caching is off: only the kept KV can spare the conversation's prefill."""
    prompt = ids(13, seed=1)
    tools = [ids(n, seed=10 + n) for n in (5, 1, 9, 0)]
    eng = engine(llama_dir, block_size)
    rid = eng.add_request(prompt, params(0), keep=True)
    before = eng.counters.prefill_tokens
    turns = [run(eng, [rid])[rid].outputs[0]]
    assert eng.counters.prefill_tokens - before == len(prompt)
    for t, tool in enumerate(tools, 1):
        assert eng.kept_request_ids() == [rid]
        before = eng.counters.prefill_tokens
        rid = eng.continue_request(rid, tool, params(t), keep=True)
        turns.append(run(eng, [rid])[rid].outputs[0])
        # the tool's tokens and the previous turn's last sampled token, nothing else
        assert eng.counters.prefill_tokens - before == len(tool) + 1
    eng.release(rid)
    baseline(eng)
    for got, (want_ids, want_logprobs) in zip(turns, twin(llama_dir, prompt, tools), strict=True):
        assert list(got.token_ids) == want_ids  # tokens exactly
        # kept KV vs one full prefill: float32 sums in other orders
        assert list(got.logprobs) == pytest.approx(want_logprobs, abs=1e-5)


@pytest.mark.gpu
def test_on_cuda_continuations_prefill_the_appended_tokens_and_equal_the_twin(
    llama_dir: Path,
) -> None:
    """The test above on CUDA in fp32 with CUDA graphs (the default): each turn's decode steps
    replay captured graphs over the kept blocks. Tolerance 1e-4: chunked vs whole prefill."""
    cuda: dict[str, Any] = dict(device="cuda", num_kv_blocks=128)
    prompt = ids(13, seed=1)
    tools = [ids(n, seed=10 + n) for n in (5, 1, 9, 0)]
    eng = engine(llama_dir, 16, **cuda)
    rid = eng.add_request(prompt, params(0), keep=True)
    turns = [run(eng, [rid])[rid].outputs[0]]
    for t, tool in enumerate(tools, 1):
        before = eng.counters.prefill_tokens
        rid = eng.continue_request(rid, tool, params(t), keep=True)
        turns.append(run(eng, [rid])[rid].outputs[0])
        assert eng.counters.prefill_tokens - before == len(tool) + 1
    eng.release(rid)
    baseline(eng)
    want = twin(llama_dir, prompt, tools, block_size=16, **cuda)
    for got, (want_ids, want_logprobs) in zip(turns, want, strict=True):
        assert list(got.token_ids) == want_ids
        assert list(got.logprobs) == pytest.approx(want_logprobs, abs=1e-4)


def test_a_group_keeps_its_prompt_blocks_shared_and_frees_everything(llama_dir: Path) -> None:
    """Four samples of one prompt (n=4) are kept and continued turn after turn, one of them
    abandoned each turn (released, or left kept), beside another conversation; the
    prompt's full blocks stay shared by exactly the conversations still holding them, and at
    the end (`release_kept`) every block is free and unreferenced."""
    eng = engine(llama_dir, 4)
    blocks = eng.cache.blocks
    prompt = ids(10, seed=2)  # two full blocks and a partial one
    group = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True, n=4)
    rid = eng.add_request(prompt, group, keep=True)
    other = eng.add_request(ids(7, seed=3), params(2), keep=True)
    run(eng, [rid, other])
    assert sorted(eng.kept_request_ids()) == sorted([rid, other])
    kept0 = eng.scheduler.kept.get((rid, 0))
    assert kept0 is not None
    shared = blocks.block_table(kept0.seq_id)[:2]
    assert [blocks.ref_count(b) for b in shared] == [4, 4]
    live = [
        eng.continue_request(rid, ids(3 + k, seed=20 + k), params(k), sample_index=k, keep=True)
        for k in range(4)
    ]
    assert [blocks.ref_count(b) for b in shared] == [4, 4]  # the continuations share them
    holders = 4
    for turn in range(3):
        done = run(eng, live)
        assert [blocks.ref_count(b) for b in shared] == [holders] * 2
        next_live = []
        for k, r in enumerate(live):
            assert done[r].outputs[0].finish_reason == "length"
            if k == 0:  # abandon one conversation per turn
                if turn == 0:
                    eng.release(r)
                    holders -= 1
                continue
            next_live.append(
                eng.continue_request(r, ids(2 * turn + 1, seed=turn), params(1), keep=True)
            )
        live = next_live
        assert [blocks.ref_count(b) for b in shared] == [holders] * 2
        other = eng.continue_request(other, ids(4, seed=9), params(0), f"o{turn}", keep=True)
        run(eng, [other])
        blocks.check_integrity()
    run(eng, live)
    assert len(eng.kept_request_ids()) == 2 + 1 + 1  # the two left, the last live, other
    eng.release_kept()  # the end of a rollout: every conversation left is released
    baseline(eng)


def test_a_kept_sample_holds_no_decode_slot(llama_dir: Path) -> None:
    """With one decode slot, a new request runs while a conversation waits on its tool."""
    eng = engine(llama_dir, 4, max_num_seqs=1)
    rid = eng.add_request(ids(9, seed=4), params(1), keep=True)
    run(eng, [rid])
    new = eng.add_request(ids(6, seed=5), params(3))
    assert run(eng, [new])[new].outputs[0].finish_reason == "length"
    assert eng.kept_request_ids() == [rid]
    nxt = eng.continue_request(rid, ids(2, seed=6), params(0))
    run(eng, [nxt])
    baseline(eng)  # not kept: freed as it finished


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_under_memory_pressure_kept_samples_are_evicted_and_continue_by_re_prefill(
    llama_dir: Path, prefix_caching: bool
) -> None:
    """A cache too small for the kept conversations and a new batch: the kept ones lose
    their KV (oldest first) before any running sample is preempted; their continuations
    re-prefill (finding what the prefix cache still has) and equal the twin."""
    block = 4
    eng = engine(
        llama_dir,
        block,
        num_kv_blocks=24,
        max_model_len=96,
        enable_prefix_caching=prefix_caching,
    )
    prompts = [ids(11, seed=30 + i) for i in range(3)]
    tools = [[ids(3, seed=40 + i)] for i in range(3)]
    first = {i: eng.add_request(p, params(0), keep=True) for i, p in enumerate(prompts)}
    out0 = run(eng, list(first.values()))
    assert eng.scheduler.kept.num_holding(eng.cache.blocks) == 3
    # a batch that needs most of the cache: the kept samples must give their blocks up
    flood = [eng.add_request(ids(30, seed=50 + i), params(4)) for i in range(2)]
    run(eng, flood)
    assert eng.stats()["num_preemptions"] == 0
    assert eng.stats()["kept_evicted"] >= 1
    evicted = 3 - eng.scheduler.kept.num_holding(eng.cache.blocks)
    prefilled, turns = [], {}
    for i in range(3):
        before = eng.counters.prefill_tokens
        r = eng.continue_request(first[i], tools[i][0], params(1))
        turns[i] = run(eng, [r])[r].outputs[0]
        prefilled.append(eng.counters.prefill_tokens - before)
    full = [len(p) + len(out0[first[i]].outputs[0].token_ids) + 3 for i, p in enumerate(prompts)]
    assert sum(p > len(tools[0][0]) + 1 for p in prefilled) == evicted  # re-prefilled ones
    assert all(p <= f for p, f in zip(prefilled, full, strict=True))
    if not prefix_caching:
        assert sum(p == f for p, f in zip(prefilled, full, strict=True)) == evicted
    for i in range(3):
        want = twin(llama_dir, prompts[i], tools[i])
        assert list(out0[first[i]].outputs[0].token_ids) == want[0][0]
        assert list(turns[i].token_ids) == want[1][0]
        assert list(turns[i].logprobs) == pytest.approx(want[1][1], abs=1e-5)
    baseline(eng)


def test_bad_continuations_are_clear_errors(llama_dir: Path) -> None:
    eng = engine(llama_dir, 4)
    with pytest.raises(KeyError, match="no kept sample 0 of request 'nope'"):
        eng.continue_request("nope", [1])
    with pytest.raises(KeyError, match="no kept sample of request 'nope'"):
        eng.release("nope")
    rid = eng.add_request(ids(5, seed=8), params(0), keep=True)
    run(eng, [rid])
    with pytest.raises(ValueError, match="n must be 1"):
        eng.continue_request(rid, [1], params(0, n=2))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([1, 2], params(0), request_id=rid)
    r = eng.continue_request(rid, [VOCAB * 100])  # outside the vocabulary: rejected, freed
    assert run(eng, [r])[r].outputs[0].finish_reason == "rejected"
    baseline(eng)


def test_a_turn_that_stops_inside_an_accepted_draft_is_kept_without_its_draft_slots(
    llama_dir: Path,
) -> None:
    """With speculation, a turn drafted from an earlier rollout's response stops at a stop
    token inside a verified draft: the slots of the draft tokens after it are dropped before
    the turn is kept, so the continuation still prefills exactly tool + 1 tokens and equals
    the twin without speculation."""
    spec = {"enable": True, "max_num_seqs": 0, "num_speculative_tokens": 6}
    eng = engine(llama_dir, 4, speculative=spec)
    prompt, tool = ids(9, seed=60), ids(4, seed=61)
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    history = eng.generate([prompt], long, prompt_keys=["k"])[0].outputs[0].token_ids
    stop = history[10]
    first = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop])
    extra: list[int] = []  # slots past the last sampled token when the turn is kept
    keep = eng.scheduler.kept.keep

    def spy(seq: Any, blocks: Any) -> None:
        extra.append(blocks.num_tokens(seq.seq_id) - (seq.num_tokens - 1))
        keep(seq, blocks)

    eng.scheduler.kept.keep = spy  # type: ignore[method-assign]
    rid = eng.add_request(prompt, first, prompt_key="k", keep=True)
    got1 = run(eng, [rid])[rid].outputs[0]
    assert extra and extra[0] > 0  # it stopped inside a draft
    assert eng.stats()["spec_accepted_tokens"] > 0
    assert got1.finish_reason == "stop" and got1.token_ids[-1] == stop
    before = eng.counters.prefill_tokens
    nxt = eng.continue_request(rid, tool, params(2))
    got2 = run(eng, [nxt])[nxt].outputs[0]
    assert eng.counters.prefill_tokens - before == len(tool) + 1
    baseline(eng)
    plain = engine(llama_dir, 4)
    want1 = plain.generate([prompt], first)[0].outputs[0]
    want2 = plain.generate([prompt + list(want1.token_ids) + tool], params(2))[0].outputs[0]
    assert list(got1.token_ids) == list(want1.token_ids)
    assert list(got2.token_ids) == list(want2.token_ids)
    assert list(got2.logprobs) == pytest.approx(list(want2.logprobs), abs=1e-5)


@pytest.mark.parametrize("num_kv_blocks", [512, 40])
def test_a_long_interleaved_run_equals_the_twin_and_leaves_no_block(
    llama_dir: Path, num_kv_blocks: int
) -> None:
    """Eight conversations of 1 to 4 turns, continued in batches (each round every live one
    continues at once), some abandoned mid-way, beside plain requests; with 40 blocks the
    kept samples are evicted and running ones preempted along the way. Every turn equals
    the twin; every block is free at the end; the bookkeeping is sound after every round."""
    g = torch.Generator().manual_seed(7)
    eng = engine(llama_dir, 4, num_kv_blocks=num_kv_blocks, max_model_len=160,
                 enable_prefix_caching=True)  # fmt: skip
    prompts = [ids(5 + 3 * i, seed=70 + i) for i in range(8)]
    turns = [1 + int(torch.randint(0, 4, (1,), generator=g)) for _ in prompts]
    tools = [[ids(1 + 2 * t + i % 3, seed=80 + 10 * i + t) for t in range(n - 1)]
             for i, n in enumerate(turns)]  # fmt: skip
    abandon = {1: 1, 4: 0}  # conversation: after which turn it is dropped (kept, never continued)
    got: dict[int, list[Any]] = {i: [] for i in range(8)}
    live = {i: eng.add_request(p, params(0), keep=True) for i, p in enumerate(prompts)}
    t = 0
    while live:
        plain = eng.add_request(ids(12, seed=90 + t), params(3))
        done = run(eng, [*live.values(), plain])
        eng.cache.blocks.check_integrity()
        t += 1
        for i, rid in list(live.items()):
            got[i].append(done[rid].outputs[0])
            if len(got[i]) == turns[i] or abandon.get(i) == len(got[i]) - 1:
                del live[i]
                if i == 1:
                    eng.release(rid)
                continue  # the others stay kept until release_kept
            live[i] = eng.continue_request(rid, tools[i][t - 1], params(t), keep=True)
    if num_kv_blocks == 40:
        assert eng.stats()["kept_evicted"] > 0 and eng.stats()["num_preemptions"] > 0
    eng.release_kept()
    baseline(eng)
    for i, p in enumerate(prompts):
        want = twin(llama_dir, p, tools[i][: len(got[i]) - 1])
        for out, (want_ids, want_logprobs) in zip(got[i], want, strict=True):
            assert list(out.token_ids) == want_ids
            assert list(out.logprobs) == pytest.approx(want_logprobs, abs=1e-5)
