"""CUDA-graph decode: the bucket list, the eager twin of the static buffers and padding (CPU),
the capture code itself on CPU with only torch.cuda's stream and graph calls stood in for, and
graphs against eager on CUDA (`gpu`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.rollout.config import EngineConfig
from patrl.rollout.cuda_graphs import CudaRuntime, DecodeGraphs, batch_buckets
from patrl.rollout.engine import Engine
from patrl.rollout.sampler import SamplingParams
from patrl_testkit.models import save_hf_model, tiny_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(tiny_hf_model("qwen2"), tmp_path_factory.mktemp("qwen2"))


def test_buckets_cover_every_batch_size_with_the_smallest_fitting_bucket() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert batch_buckets(256)[-1] == 256
    for m in (1, 3, 9, 40):
        buckets = batch_buckets(m)
        assert buckets == sorted(set(buckets)) and buckets[-1] == m


def run(engine: Engine) -> tuple[list[list[int]], torch.Tensor]:
    """Tokens and logprobs of eleven requests of different lengths (greedy and seeded
    sampling, n > 1), so the decode batch shrinks through several buckets and most steps are
    padded. Logprobs are compared too: a tiny model's greedy tokens survive small errors."""
    prompts = [[5 + i, 17, 42, 9 + i, 3][: 2 + i % 4] for i in range(11)]
    params = [
        SamplingParams(
            temperature=0 if i % 2 else 0.8,
            seed=i,
            n=2 if i == 3 else 1,
            max_tokens=3 + 2 * i,
            ignore_eos=True,
        )
        for i in range(11)
    ]
    samples = [c for out in engine.generate(prompts, params) for c in out.outputs]
    logprobs = torch.tensor([lp for c in samples for lp in c.logprobs])
    return [list(c.token_ids) for c in samples], logprobs


def assert_same(got: tuple[list[list[int]], torch.Tensor], want: Any) -> None:
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)


def triton_interpreted() -> bool:
    try:
        from patrl.rollout.layers.attention import triton_kernels
    except ImportError:
        return False
    return bool(triton_kernels.INTERPRETED)


def engine(model_dir: Path, **overrides: Any) -> Engine:
    config = EngineConfig(
        model=str(model_dir), block_size=4, num_kv_blocks=128, max_model_len=64,
        max_num_seqs=12, tune_host_malloc=False, **overrides,
    )  # fmt: skip
    return Engine(config)


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_eager_twin_of_the_graph_buffers_gives_the_eager_tokens(
    model_dir: Path, backend: str
) -> None:
    if backend == "triton" and not triton_interpreted():
        pytest.skip("triton is not installed, or runs compiled (CUDA): the gpu test covers it")
    expected = run(engine(model_dir, attention_backend=backend))
    twin = engine(model_dir, attention_backend=backend)
    graphs = twin.runner.graphs = twin.runner._decode_graphs(capture=False)
    assert graphs is not None and not graphs.capture
    calls: list[int] = []
    forward = graphs.forward
    graphs.forward = lambda staged, n: calls.append(n) or forward(staged, n)  # type: ignore[method-assign]
    assert_same(run(twin), expected)
    assert len(calls) >= 10 and {1, 12} <= set(calls)  # every decode step, full to one row
    assert set(graphs.graphs) >= {1, 2, 4, 8, 12}  # shrinking batches padded into buckets


class _Stream:
    def wait_stream(self, other: object) -> None:
        pass


class _Graph:
    def replay(self) -> None:
        # a stand-in cannot replay recorded kernels; the test below captures every step
        raise AssertionError("the stand-in graph was replayed")


@contextlib.contextmanager
def _run_body(*args: object, **kwargs: object) -> Iterator[None]:
    yield  # the body runs for real, as on a GPU it runs once to be recorded


def test_the_capture_code_gives_the_eager_tokens_with_cuda_calls_stood_in(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CudaRuntime's warm-up and capture, on CPU: torch.cuda's streams and graphs are stand-ins
    that run the body (a capture's writes are those of a real run: idempotent KV writes, the
    output copy). Every decode step captures anew (the graphs are reset before each), so every
    step goes through the tensor path a capture takes, including the writes into the static
    output outside inference mode that a first CUDA decode step makes."""
    expected = run(engine(model_dir))
    for name, stand_in in {
        "Stream": _Stream,
        "current_stream": _Stream,
        "stream": _run_body,
        "graph": _run_body,
        "graph_pool_handle": object,
        "CUDAGraph": _Graph,
        "device": _run_body,  # the engine's device made current around warm-up and capture
    }.items():
        monkeypatch.setattr(torch.cuda, name, stand_in)
    eng = engine(model_dir)
    runner = eng.runner
    graphs = DecodeGraphs(runner.model, runner.cache, 12, runner.max_model_len, capture=True)
    runner.graphs = graphs
    captured: list[int] = []
    forward = graphs.forward

    def capture_each_step(staged: Any, n: int) -> torch.Tensor:
        graphs.reset()
        captured.append(n)
        return forward(staged, n)

    graphs.forward = capture_each_step  # type: ignore[method-assign]
    assert_same(run(eng), expected)
    assert len(captured) >= 10 and {1, 12} <= set(captured)
    assert isinstance(graphs.runtime, CudaRuntime) and graphs.runtime.pool is not None


def test_graphs_are_dropped_when_the_weights_move(model_dir: Path) -> None:
    eng = engine(model_dir)
    graphs = eng.runner.graphs = eng.runner._decode_graphs(capture=False)
    assert graphs is not None
    run(eng)
    assert graphs.graphs
    param = next(eng.model.parameters())
    param.data = param.data.clone()  # what a reshard or a weight offload does
    eng.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert set(graphs.graphs) == {1}  # the old graphs were dropped, bucket 1 captured anew


def test_sdpa_graphs_refuse_a_gather_of_max_model_len_for_every_row(tmp_path: Path) -> None:
    """A graph's sdpa decode gathers max_model_len tokens of K and V for each captured row: at
    32k tokens x 256 rows (the defaults' max_num_seqs) 2 GiB a layer for this tiny model (2 KV
    heads of 16, fp32), refused where graphs are built; 8k tokens (0.5 GiB) and triton pass."""
    model = tiny_hf_model("qwen2", max_position_embeddings=32768)
    model_dir = save_hf_model(model, tmp_path / "long")

    def graphs_of(backend: str, max_model_len: int) -> Any:
        eng = Engine(
            EngineConfig(
                model=str(model_dir), attention_backend=backend, max_model_len=max_model_len,
                block_size=16, num_kv_blocks=max_model_len // 16, tune_host_malloc=False,
            )
        )  # fmt: skip
        assert eng.config.max_num_seqs == 256
        return eng.runner._decode_graphs(capture=False)

    with pytest.raises(ValueError, match=r"attention_backend='sdpa' with CUDA graphs") as info:
        graphs_of("sdpa", 32768)
    message = info.value.args[0]
    assert "max_model_len=32768" in message and "256 captured rows: 2.0 GiB" in message
    assert "enforce_eager=True" in message and "'triton'" in message
    assert graphs_of("sdpa", 8192) is not None
    if triton_interpreted():
        assert graphs_of("triton", 32768) is not None


def test_a_cpu_engine_runs_eagerly(model_dir: Path) -> None:
    assert engine(model_dir).runner.graphs is None


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_cuda_graph_tokens_equal_eager_tokens_and_follow_new_weights(
    tmp_path: Path, backend: str
) -> None:
    model_dir = save_hf_model(tiny_hf_model("qwen2"), tmp_path / "m")
    eager = engine(model_dir, device="cuda", enforce_eager=True, attention_backend=backend)
    graphed = engine(model_dir, device="cuda", attention_backend=backend)
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    assert_same(run(graphed), run(eager))
    assert graphed.runner.graphs.graphs  # the graphs were used
    other = tiny_hf_model("qwen2", seed=1).state_dict()
    for e in (eager, graphed):
        e.load_weights(other.items(), version=1)
    assert_same(run(graphed), run(eager))


@pytest.mark.parametrize("level", [1, 2])
def test_graphs_after_sleep_and_wake_up_give_the_eager_tokens(model_dir: Path, level: int) -> None:
    expected = run(engine(model_dir))
    eng = engine(model_dir)
    graphs = eng.runner.graphs = eng.runner._decode_graphs(capture=False)
    assert graphs is not None
    run(eng)
    eng.sleep(level)
    assert not graphs.graphs  # sleep dropped the graphs that read the released KV
    eng.wake_up()
    assert_same(run(eng), expected)
    assert graphs.graphs
