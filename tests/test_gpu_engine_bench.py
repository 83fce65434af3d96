"""benchmarks/gpu_engine_bench.py holds four engines (two attention backends, with and
without CUDA graphs) on one device at once. Through the engine's real KV sizing, on a fake
device a little larger than what the process holds: each engine gets the KV its batches need,
and all of them fit together (sized from free memory, the first took it all and the second
got none). Its --verify measurement runs on CPU on a tiny model: the engine's verify steps
with forced drafts, their tokens equal to the decode path's."""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
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
    args = argparse.Namespace(prompt_len=8, steps=4)
    batches = [1, 4]
    backends = ["sdpa", "triton"] if importlib.util.find_spec("triton") else ["sdpa"]
    variants = [(b, g) for b in backends for g in (True, False)]
    engines = bench.build_engines(model_dir, torch.device("cpu"), variants, batches, args)
    assert list(engines) == variants
    for engine in engines.values():  # max(batches) sequences of max_model_len tokens each
        assert engine.runner.cache.capacity_tokens >= max(batches) * engine.runner.max_model_len
    assert device.read().free > 0  # all of them fit


def test_verify_times_the_engines_verify_step_whose_tokens_are_the_decode_paths(
    tmp_path: Path,
) -> None:
    """--verify on a tiny model on CPU: per batch size, forced drafts of K tokens went
    through the engine's verify steps, all rejected in the timed run against decode (one token
    a step, exactly the drafts the sequences had room for) and all accepted in the run drafted
    from the decode run's own greedy tokens (K + 1 a step), whose every token equals the decode
    path's (fp32: the two paths agree exactly here); --spec-rollout's greedy tail drafts from
    its identical group. The JSON on disk is what `main` returns."""
    bench = load_bench()
    out = tmp_path / "bench.json"
    k, steps, batches = 3, 4, [1, 3]
    argv = ["--device", "cpu", "--tiny", "--batches", "1,3", "--steps", str(steps)]
    argv += ["--repeats", "1", "--verify", str(k), "--no-decode", "--out", str(out)]
    argv += ["--spec-rollout", "--spec-prompts", "1", "--spec-n", "4"]
    result = bench.main(argv)
    assert json.loads(out.read_text()) == result
    rows = result["verify"]["rows"]["sdpa"]
    assert [r["batch"] for r in rows] == batches
    length = bench.verify_max_tokens(steps, k)
    # a sequence drafts min(K, room - 1) at each step after its first token
    room = sum(min(k, length - 1 - n) for n in range(1, length))
    for row, b in zip(rows, batches, strict=True):
        assert row["k"] == k and row["decode"] == "eager"
        assert row["all_match"] and row["matching_sequences"] == f"{2 * b} of {2 * b}"
        d = row["drafts"]
        assert d["reject/drafted"] == b * room and d["reject/accepted"] == 0
        assert d["reject/tokens_per_step"] == 1
        assert d["accept/accepted"] == d["accept/drafted"] > 0
        assert d["accept/tokens_per_step"] == k + 1
        assert row["all_accepted"]["tokens_per_step"] == k + 1
        ratio = row["verify_over_decode"]
        assert ratio == pytest.approx(row["verify_s_per_step"] / row["decode_s_per_step"])
        assert row["break_even"] == bench.break_even(ratio, k)
        assert row["verify_over_decode_t1"] > 0
    rollout = result["verify"]["rollout"]
    greedy = rollout["temperature_0"]
    assert greedy["epoch1/on"]["spec_acceptance"] == 1.0  # four identical greedy samples
    assert greedy["epoch1/on"]["steps"] < greedy["epoch1/off"]["steps"]
    assert "spec_acceptance" not in greedy["epoch1/off"]
    assert set(rollout["temperature_1"]) == set(greedy)


def test_break_even_acceptance_of_a_verify_step() -> None:
    """A verify step of K drafts costing r decode steps pays from r - 1 accepted tokens;
    the chain's per-token acceptance p solves 1 + p + ... + p^K = r; beyond K + 1 nothing
    pays."""
    bench = load_bench()
    assert bench.break_even(1.0, 4) == {"accepted_tokens": 0.0, "acceptance": 0.0,
                                        "chain_acceptance": 0.0}  # fmt: skip
    even = bench.break_even(2.0, 4)
    assert even["accepted_tokens"] == 1.0 and even["acceptance"] == 0.25
    p = even["chain_acceptance"]
    assert sum(p**j for j in range(5)) == pytest.approx(2.0, abs=1e-9)
    assert bench.break_even(5.0, 4)["chain_acceptance"] == pytest.approx(1.0, abs=1e-9)
    assert bench.break_even(5.5, 4) == dict.fromkeys(
        ("accepted_tokens", "acceptance", "chain_acceptance")
    )


def test_spec_rollout_without_verify_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_bench().main(["--device", "cpu", "--tiny", "--spec-rollout"])
    assert "--spec-rollout needs --verify K" in capsys.readouterr().err
