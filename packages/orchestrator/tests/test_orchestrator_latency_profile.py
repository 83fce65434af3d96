"""The job's latency profile on several nodes: each node may have its own cache directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from patrl.lenpredict import Profile
from patrl.orchestrator.distributed import World
from patrl.orchestrator.latency_profile import ensure_profile, job_grid, profile_key
from patrl.rollout import EngineConfig
from patrl_testkit.models import save_tiny_model
from patrl_testkit.multirank import run_ranks
from patrl_testkit.profiles import synthetic_profile


def _ensure(rank: int, world_size: int, model: Path, roots: list[Path]) -> str:
    world = World(rank, world_size, rank, torch.device("cpu"))
    engine = EngineConfig(model=str(model), device="cpu")
    grid = job_grid((1, 2), 4, 40)
    if rank == 0:  # only the first node's cache has it: nothing must be measured
        key = profile_key(str(model), engine, world_size, grid)
        synthetic_profile(str(model), tp2_speedup=3.0).save(roots[0] / "profiles" / f"{key}.json")
    torch.distributed.barrier()
    path = ensure_profile(str(model), engine, world, grid, roots[rank])
    assert path.parent.parent == roots[rank]
    return path.read_text()


@pytest.mark.multirank
def test_a_profile_cached_on_the_first_node_reaches_every_nodes_cache(tmp_path: Path) -> None:
    model = save_tiny_model(tmp_path / "model", "llama", "plain")
    roots = [tmp_path / "node0", tmp_path / "node1"]
    (roots[0] / "profiles").mkdir(parents=True)
    texts = run_ranks(_ensure, world_size=2, args=(model, roots), timeout_s=120)
    first, second = (Profile.model_validate_json(t) for t in texts)
    assert first == second
    assert second.hardware.name == "synthetic"  # rank 0's profile, copied, not measured
