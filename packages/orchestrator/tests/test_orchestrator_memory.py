"""The job's memory keys: the KV budget per device, and rollout.free_cache_engine (the engine
asleep during the policy update) changing nothing that is computed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.orchestrator.build import CPU_KV_CACHE_BYTES, engine_config
from patrl.orchestrator.config import load_config
from patrl.orchestrator.distributed import World
from patrl.orchestrator.sync_loop import SyncGRPO
from patrl_testkit.jobs import learning_job_extras, tiny_job_overrides


def _overrides(assets: Path, run_dir: Path, **extra: Any) -> list[str]:
    own = {
        "rollout.temperature": 1.0,
        "trainer.total_training_steps": 2,
        "trainer.test_freq": 2,
        "trainer.save_freq": 0,
        "trainer.val_before_train": "true",
    }
    return tiny_job_overrides(assets, run_dir, **{**learning_job_extras(assets), **own, **extra})


def test_kv_budget_is_fixed_on_cpu_and_measured_on_cuda(assets: Path, tmp_path: Path) -> None:
    config = load_config(None, _overrides(assets, tmp_path, **{"rollout.num_kv_blocks": "null"}))
    model = str(assets / "model")
    on_cpu = engine_config(config, model, World(0, 1, 0, torch.device("cpu")))
    assert on_cpu.kv_cache_memory_bytes == CPU_KV_CACHE_BYTES == 1 << 29
    on_gpu = engine_config(config, model, World(0, 1, 0, torch.device("cuda", 0)))
    assert on_gpu.kv_cache_memory_bytes is None
    assert on_gpu.gpu_memory_utilization == config.rollout.gpu_memory_utilization == 0.5
    given = load_config(
        None, _overrides(assets, tmp_path, **{"rollout.kv_cache_memory_bytes": 4096})
    )
    assert (
        engine_config(given, model, World(0, 1, 0, torch.device("cuda", 0))).kv_cache_memory_bytes
        == 4096
    )


def _run(assets: Path, run_dir: Path, **extra: Any) -> tuple[list[dict[str, float]], list[int]]:
    config = load_config(None, _overrides(assets, run_dir, **extra))
    world = World(0, 1, 0, torch.device("cpu"))
    loop = SyncGRPO(config, world, str(assets / "model"), config.data.train_files, None)
    levels: list[int] = []
    sleep = loop.engine.sleep

    def spy(level: int = 1) -> None:
        levels.append(level)
        sleep(level)

    loop.engine.sleep = spy  # type: ignore[method-assign]
    history = loop.run().history
    return [{k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/"))}
            for h in history], levels  # fmt: skip


@pytest.mark.e2e
@pytest.mark.parametrize("offload_weights", [False, True])
def test_free_cache_engine_changes_no_token_and_no_metric(
    assets: Path, tmp_path: Path, offload_weights: bool
) -> None:
    off, none = _run(assets, tmp_path / "off")  # CPU: None means off
    on, levels = _run(
        assets,
        tmp_path / "on",
        **{"rollout.free_cache_engine": "true", "rollout.offload_weights": str(offload_weights)},
    )
    assert none == [] and levels == [2 if offload_weights else 1] * 2
    steps = [h for h in on if "critic/score/mean" in h]
    assert len(steps) == 2 and "response_length/mean" in steps[0]
    assert on == off
