"""Partial rollouts: stop once a quota of requests finished, hand back the rest with their
tokens, logprobs and generators, resume them later: the result is the uninterrupted run's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.rollout.adaptive import AdaptiveEngine
from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.sampler import SamplingParams
from patrl_testkit.models import save_hf_model, tiny_hf_model
from patrl_testkit.multirank import run_ranks


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(tiny_hf_model("llama"), tmp_path_factory.mktemp("llama_partial"))


def _config(model_dir: str, **policy: Any) -> EngineConfig:
    extra = {"tp_policy": {"kind": "adaptive", "candidates": (1, 2), **policy}} if policy else {}
    return EngineConfig(model=model_dir, block_size=4, num_kv_blocks=128, max_model_len=96, **extra)


def _workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (5, 9, 7, 4)]
    stops = list(range(0, 250, 10))  # a tenth of the vocabulary stops: samples end unevenly
    params = [
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=0, n=3, max_tokens=30, stop_token_ids=stops),
        SamplingParams(temperature=0, max_tokens=26, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, seed=8, max_tokens=6, ignore_eos=True),
    ]
    return prompts, params


def _by_id(outputs: list[Any]) -> dict[str, Any]:
    return {
        o.request_id: [(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs]
        for o in outputs
    }


def _reference(
    model_dir: str, prompts: list[list[int]], params: list[SamplingParams], ids: list[str]
) -> dict[str, Any]:
    """The uninterrupted run, by request id."""
    outputs = Engine(_config(model_dir)).generate(prompts, params)
    return dict(zip(ids, _by_id(outputs).values(), strict=True))


def test_partial_rollout_resumes_to_the_uninterrupted_result(llama_dir: Path) -> None:
    prompts, params = _workload(0)
    ids = [f"r{i}" for i in range(len(prompts))]
    expected = _reference(str(llama_dir), prompts, params, ids)

    engine = Engine(_config(str(llama_dir)))
    done, rest = engine.generate_partial(prompts, params, quota=2, request_ids=ids)
    assert len(done) >= 2 and not engine.has_unfinished()
    assert {s.request_id for s in rest} == set(ids) - {o.request_id for o in done}
    # the long sampled request stopped part-way: some of its samples had already finished
    sampled = [s for s in rest if s.request_id == "r1"]
    assert len(sampled) == 3
    assert any(s.finish_reason is not None for s in sampled)
    assert any(s.finish_reason is None and s.output_token_ids for s in sampled)
    partial_tokens = {(s.request_id, s.sample_index): list(s.output_token_ids) for s in rest}

    later, left = engine.generate_partial([], [], quota=len(ids), resume=rest)
    assert left == []
    got = _by_id(done) | _by_id(later)
    assert got.keys() == expected.keys()
    for rid, samples in got.items():
        for (tokens, logprobs, reason), (e_tokens, e_logprobs, e_reason) in zip(
            samples, expected[rid], strict=True
        ):
            assert tokens == e_tokens and reason == e_reason
            torch.testing.assert_close(logprobs, e_logprobs, atol=1e-5, rtol=0)
    for (rid, index), tokens in partial_tokens.items():
        assert got[rid][index][0][: len(tokens)] == tokens  # earlier tokens intact


class _NeverSwitch:
    """A planner that always stays (the partial stop is what is tested)."""

    def new_rollout(self) -> None:
        pass

    latency = None

    def may_switch(self, running: Any, current: Any) -> bool:
        return True

    def never_switches_from(self, current: Any, max_context: int) -> bool:
        return False

    def shrinking_share(self, running: Any, current: Any, steps: int) -> float:
        return 1.0

    def decide(self, running: Any, current: Any) -> Any:
        import numpy as np

        from patrl.lenpredict import Decision
        from patrl.lenpredict.planner import Option

        n = len(running)
        stay = Option(current, 1.0, 0.0, np.inf, 0, running.replica, np.zeros(n, dtype=bool))
        return Decision("stay", current, current, 0.0, 0.0, "stay", [stay], running.seq_ids)


def _adaptive_partial(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    prompts, params = _workload(10 + rank)
    ids = [f"rank{rank}-{i}" for i in range(len(prompts))]
    expected = _reference(model_dir, prompts, params, ids)
    engine = AdaptiveEngine(_config(model_dir, check_every=2), planner=_NeverSwitch())
    done, rest = engine.generate_partial(prompts, params, quota=1, request_ids=ids)
    later, left = engine.generate_partial([], [], quota=4, resume=rest)
    return {
        "expected": expected,
        "first": sorted(o.request_id for o in done),
        "got": _by_id(done) | _by_id(later),
        "left": len(left),
        "exported": len({s.request_id for s in rest}),
    }


@pytest.mark.multirank
def test_adaptive_partial_rollout_stops_on_the_worlds_quota(llama_dir: Path) -> None:
    results = run_ranks(_adaptive_partial, 2, args=(str(llama_dir),), timeout_s=300)
    finished_first = sum(len(r["first"]) for r in results)
    assert 2 <= finished_first < 8  # the world's quota (1 + 1), met at a check
    assert sum(r["exported"] for r in results) == 8 - finished_first
    for r in results:
        assert r["left"] == 0
        assert {k: [(t, reason) for t, _, reason in v] for k, v in r["got"].items()} == {
            k: [(t, reason) for t, _, reason in v] for k, v in r["expected"].items()
        }


def test_recompute_prefills_a_shared_prompt_once(llama_dir: Path) -> None:
    """Samples of one request imported without KV (a recompute after a reconfiguration, or a
    resumed partial rollout) compute their prompt once: the others find it in the prefix cache
    a step later. The tokens are the uninterrupted run's."""
    prompt = list(range(10, 50))  # 40 tokens: 10 full blocks of 4
    params = SamplingParams(temperature=1.0, seed=0, n=4, max_tokens=20, ignore_eos=True)
    expected = Engine(_config(str(llama_dir))).generate([prompt], params)[0]
    source = Engine(_config(str(llama_dir)))
    source.add_request(prompt, params, request_id="a")
    for _ in range(6):
        source.step()
    states = source.export_requests(["a"], with_kv=False)
    generated = [len(s.output_token_ids) for s in states]
    assert len(states) == 4 and min(generated) > 0

    engine = Engine(_config(str(llama_dir)))  # an empty cache, as after a reconfiguration
    engine.import_requests(states)
    while any(s.status.name == "WAITING" for s in engine.unfinished_seqs()):
        engine.step()
    # the prompt once, then each sample's own tokens (block-aligned prompt: nothing else shared)
    assert engine.counters.prefill_tokens == len(prompt) + sum(generated)
    assert engine.counters.prefill_steps == 2
    done: list[Any] = []
    while engine.has_unfinished():
        done += engine.step()
    assert [c.token_ids for c in done[0].outputs] == [c.token_ids for c in expected.outputs]


def test_samples_moved_before_their_prefill_still_share_it(llama_dir: Path) -> None:
    """A request exported before its prompt was prefilled (a switch at the first planner check)
    is one prefill and n forks again where it lands, with the tokens of a fresh request."""
    prompt = list(range(10, 47))
    params = SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=8, ignore_eos=True)
    expected = Engine(_config(str(llama_dir))).generate([prompt], params)[0]
    source = Engine(_config(str(llama_dir)))
    source.add_request(prompt, params, request_id="a")
    states = source.export_requests(["a"])
    assert len(states) == 3 and not any(s.output_token_ids for s in states)
    engine = Engine(_config(str(llama_dir)))
    engine.import_requests(states)
    done: list[Any] = []
    while engine.has_unfinished():
        done += engine.step()
    assert engine.counters.prefill_tokens == len(prompt)
    assert engine.counters.prefill_steps == 1
    assert [c.token_ids for c in done[0].outputs] == [c.token_ids for c in expected.outputs]
