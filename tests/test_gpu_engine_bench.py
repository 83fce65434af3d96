"""benchmarks/gpu_engine_bench.py holds four engines (two attention backends, with and
without CUDA graphs) on one device at once. Through the engine's real KV sizing, on a fake
device a little larger than what the process holds: each engine gets the KV its batches need,
and all of them fit together (sized from free memory, the first took it all and the second
got none)."""

from __future__ import annotations

import argparse
import gc
import importlib.util
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch

from patrl.rollout.kv_budget import DeviceMemory

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_engine_bench.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_engine_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def live_bytes() -> int:
    """Bytes of every tensor storage alive in this process."""
    storages = {}
    with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for tensor in tensors:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class FakeDevice:
    """A MemoryProbe of a device of `total` bytes whose memory in use is every tensor this
    process holds; a forward's activations are not counted."""

    def __init__(self, total: int) -> None:
        self.total = total

    def read(self) -> DeviceMemory:
        return DeviceMemory(max(0, self.total - live_bytes()), self.total)

    def peak_during(self, fn: object) -> int:
        assert callable(fn)
        fn()
        return 0


def test_the_benchs_engines_fit_one_device_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = load_bench()
    model_dir = bench.save_model(bench.TINY, torch.float32, tmp_path / "tiny")
    # 0.9 x total leaves 16 MiB beyond what is held now: a sized-from-memory engine takes it
    device = FakeDevice(int((live_bytes() + (16 << 20)) / 0.9))
    monkeypatch.setattr("patrl.rollout.model_runner.probe_for", lambda _device: device)
    args = argparse.Namespace(prompt_len=8, steps=4, verify=0, spec_rollout=False)
    batches = [1, 4]
    backends = ["sdpa", "triton"] if importlib.util.find_spec("triton") else ["sdpa"]
    variants = [(b, g) for b in backends for g in (True, False)]
    engines = bench.build_engines(model_dir, torch.device("cpu"), variants, batches, args)
    assert list(engines) == variants
    for engine in engines.values():  # max(batches) sequences of max_model_len tokens each
        assert engine.runner.cache.capacity_tokens >= max(batches) * engine.runner.max_model_len
    assert device.read().free > 0  # all of them fit
