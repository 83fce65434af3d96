"""Engine.snapshot_requests: a report of requests in flight that changes nothing in the engine,
and from which another engine continues them, by recompute, to the uninterrupted result."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.outputs import RequestOutput
from patrl.rollout.sampler import SamplingParams
from patrl_testkit.models import save_hf_model, tiny_hf_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(tiny_hf_model("llama"), tmp_path_factory.mktemp("llama_snapshot"))


def _engine(model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=128))


def _add_workload(engine: Engine) -> list[str]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (6, 9, 5)]
    stops = list(range(0, 250, 12))  # some samples stop early: finished ones are reported too
    params = [
        SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=20, stop_token_ids=stops),
        SamplingParams(temperature=0.8, top_k=20, seed=2, n=2, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    ]
    return [
        engine.add_request(p, sp, request_id=f"r{i}")
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]


def _run(engine: Engine) -> dict[str, Any]:
    """Step to the end; (tokens, logprobs, finish reason) per sample, by request id."""
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        outputs += engine.step()
    return {
        o.request_id: [(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs]
        for o in outputs
    }


def _assert_same(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got.keys() == expected.keys()
    for rid, samples in got.items():
        assert len(samples) == len(expected[rid])
        for (tokens, logprobs, reason), (e_tokens, e_logprobs, e_reason) in zip(
            samples, expected[rid], strict=True
        ):
            assert (tokens, reason) == (e_tokens, e_reason), rid
            torch.testing.assert_close(logprobs, e_logprobs, atol=1e-5, rtol=0)


def test_snapshot_changes_nothing_and_continues_elsewhere_to_the_same_result(
    llama_dir: Path,
) -> None:
    reference = _engine(llama_dir)
    _add_workload(reference)
    expected = _run(reference)

    engine = _engine(llama_dir)
    ids = _add_workload(engine)
    before = engine.snapshot_requests(ids)  # before any prefill: samples not started
    assert [(s.request_id, s.sample_index) for s in before] == [
        ("r0", 0),
        ("r0", 1),
        ("r0", 2),
        ("r1", 0),
        ("r1", 1),
        ("r2", 0),
    ]
    assert all(s.output_token_ids == [] and s.kv is None for s in before)
    for _ in range(7):
        assert engine.step() == []  # no request is done yet at 7 steps
    snapshot = pickle.loads(pickle.dumps(engine.snapshot_requests(ids)))  # as sent through a store
    assert all(s.kv is None for s in snapshot)
    assert any(s.finish_reason is not None for s in snapshot)  # a stopped sample rides along
    assert any(s.finish_reason is None and s.output_token_ids for s in snapshot)

    # The snapshotted engine goes on exactly as if nobody had looked.
    _assert_same(_run(engine), expected)

    # Another engine continues the snapshot (recompute, the same generator states) to the same
    # tokens; the samples' earlier tokens are kept, not regenerated.
    adopter = _engine(llama_dir)
    adopter.import_requests(snapshot)
    continued = _run(adopter)
    _assert_same(continued, expected)
    for s in snapshot:
        assert continued[s.request_id][s.sample_index][0][: len(s.output_token_ids)] == list(
            s.output_token_ids
        )

    # And from the snapshot taken before any prefill: a fresh start, the same result.
    fresh = _engine(llama_dir)
    fresh.import_requests(before)
    _assert_same(_run(fresh), expected)


def test_snapshot_of_an_unknown_request_names_it(llama_dir: Path) -> None:
    engine = _engine(llama_dir)
    with pytest.raises(KeyError, match="no request 'nope'"):
        engine.snapshot_requests(["nope"])
