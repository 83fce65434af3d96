"""Device-to-host syncs of a steady decode step: at most 2, and as many at 2 layers as at 8.

On a GPU each `.item()`, `.tolist()`, `bool(t)`, `nonzero()` or copy to the host blocks the host
until the device drains. On CPU every tensor is a host tensor, so a TorchFunctionMode counts
every such call inside `Engine.step`, except in the two functions that copy to the host on
purpose, which count as one each whatever they do inside: the copy-out of a step's samples
(`SampleOutput.to_host`) and the host sampling of top-k / top-p rows
(`sampler._sample_truncated_rows`, one copy of all such rows, then host work only).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from patrl.rollout import sampler
from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.sampler import SamplingParams
from patrl_testkit.models import save_hf_model, tiny_hf_model

SYNCS: set[Callable[..., Any]] = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
}


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a `Tensor.to` call targets the host (a device -> host copy on a GPU)."""
    targets = [*args[1:], kwargs.get("device")]
    return any(
        (isinstance(t, str) and t.startswith("cpu"))
        or (isinstance(t, torch.device) and t.type == "cpu" and not kwargs.get("non_blocking"))
        for t in targets
    )


def _implicit_upload(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A blocking copy from pageable host memory on CUDA: a tensor indexed by a Python list,
    or `torch.tensor(data, device=...)`."""
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, list) for i in index)
    return func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None


class CountSyncs(TorchFunctionMode):
    """Counts the calls that would block the host on a device tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.calls: list[str] = []
        self.paused = False

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if not self.paused and (
            func in SYNCS
            or (func is torch.Tensor.to and _to_host(args, kwargs))
            or _implicit_upload(func, args, kwargs)
        ):
            self.count += 1
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


def step_syncs(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Syncs of each of 4 decode steps with 8 running samples (greedy, plain, top-k and top-p
    sampling, some asking for top logprobs), then of a step that prefills a new prompt."""
    config = EngineConfig(
        model=str(model_dir), block_size=4, num_kv_blocks=256, max_model_len=256,
        tune_host_malloc=False,
    )  # fmt: skip
    engine = Engine(config)
    params = [
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=2, logprobs=3, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=2, n=2, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=5, seed=3, max_tokens=64, ignore_eos=True),
        SamplingParams(top_p=0.8, seed=4, logprobs=1, max_tokens=64, ignore_eos=True),
    ]
    for i, p in enumerate(params):
        engine.add_request([3 + i, 17, 42, 5 + i, 9], p)
    while engine.counters.decode_steps < 2:  # every prefill done, decoding in full
        engine.step()
    assert engine.scheduler.num_running_samples() == 8
    mode = CountSyncs()

    def counted_once(f: Callable[..., Any]) -> Callable[..., Any]:
        def once(*args: Any) -> Any:
            mode.count += 1
            mode.paused = True
            try:
                return f(*args)
            finally:
                mode.paused = False

        return once

    monkeypatch.setattr(sampler.SampleOutput, "to_host", counted_once(sampler.SampleOutput.to_host))
    monkeypatch.setattr(
        sampler, "_sample_truncated_rows", counted_once(sampler._sample_truncated_rows)
    )
    counts = []
    for step in range(5):
        if step == 4:
            engine.add_request(list(range(10, 30)), params[1])
            prefills = engine.counters.prefill_steps
        mode.count, mode.calls = 0, []
        with mode:
            engine.step()
        counts.append(mode.count)
    assert engine.counters.prefill_steps == prefills + 1  # the last step was a prefill
    return counts


def test_a_step_makes_at_most_two_host_syncs_as_many_at_2_layers_as_at_8(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = {
        layers: step_syncs(
            save_hf_model(tiny_hf_model("llama", num_hidden_layers=layers), tmp_path / str(layers)),
            monkeypatch,
        )
        for layers in (2, 8)
    }
    # the copy-out, and the top-k / top-p rows' copy (the sampler's inputs were staged
    # before the forward without reading anything back)
    assert max(counts[2] + counts[8]) <= 2, counts
    assert counts[2] == counts[8], counts


def test_the_mode_counts_the_calls_that_sync() -> None:
    t = torch.arange(4)
    with CountSyncs() as mode:
        t.tolist()
        bool(t[0])
        int(t[1])
        t.nonzero()
        t.to("cpu")
        t.to(torch.device("cpu"), non_blocking=True)  # the host -> device upload pattern
        t[[0, 2]]
        t[torch.tensor([1])] = 3
        torch.tensor([1, 2], device="cpu")
        t.sum()
    assert mode.count == 7, mode.calls
