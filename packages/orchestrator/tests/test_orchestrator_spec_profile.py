"""The job prices speculation from a latency profile: `rollout.speculative.latency_profile`
when set, else the job's own adaptive-TP profile when it has verify rows. A speculating job's
profile grid gains query lengths; a job without speculation measures the grid it always did.

No profile is measured here: the job's cache is seeded with a synthetic profile of the tiny
model at exactly the key the job asks for (so the real cache lookup runs), and no test reads a
clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import patrl.orchestrator.build as build
from patrl.lenpredict import Profile, VerifyRow
from patrl.orchestrator.config import load_config
from patrl.orchestrator.distributed import World
from patrl.orchestrator.latency_profile import (
    ensure_profile,
    job_grid,
    profile_key,
    spec_query_lens,
)
from patrl.rollout import Engine, EngineConfig
from patrl.rollout.profile import ProfileGrid, model_info
from patrl_testkit.models import save_tiny_model
from patrl_testkit.profiles import profile_from

WORLD = World(0, 1, 0, torch.device("cpu"))


def flat_profile(model: Path, verify: bool) -> Profile:
    """A weight-bound profile of `model` (every step costs the same): drafts always pay."""
    info = model_info(model, Engine(EngineConfig(model=str(model), device="cpu")))
    profile = profile_from(lambda tp, b, c: 0.01, tp_sizes=(1,)).model_copy(update={"model": info})
    if verify:
        rows = [
            VerifyRow(tp=1, batch=b, query_len=q, context_tokens=c, seconds=0.01 + 1e-5 * q)
            for b in (1, 4)
            for q in (2, 5)
            for c in (64, 512)
        ]
        profile = profile.model_copy(update={"verify": rows})
    return profile


def job(tmp_path: Path, *overrides: str) -> Any:
    return load_config(
        None,
        [
            "rollout.adaptive_tp.enable=true",
            "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2",
            "data.max_prompt_length=64",
            "data.max_response_length=64",
            "rollout.n=2",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            *overrides,
        ],
    )


@pytest.fixture
def seeded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`seed(model, profile)`: the grids the job asks for, each with `profile` cached at its
    key first (the job's real `ensure_profile` then finds it and measures nothing)."""
    monkeypatch.setenv("PATRL_CACHE_DIR", str(tmp_path / "cache"))
    grids: list[ProfileGrid] = []

    def seed(profile: Profile) -> list[ProfileGrid]:
        def cached(
            model_dir: str, engine: EngineConfig, world: World, grid: ProfileGrid, root: Path
        ) -> Path:
            assert not engine.speculative.enable  # the profiler's rows run without drafting
            grids.append(grid)
            key = profile_key(model_dir, engine, world.size, grid)
            (root / "profiles").mkdir(parents=True, exist_ok=True)
            profile.save(root / "profiles" / f"{key}.json")
            return ensure_profile(model_dir, engine, world, grid, root)

        monkeypatch.setattr(build, "ensure_profile", cached)
        return grids

    return seed


def test_the_jobs_own_profile_with_verify_rows_prices_speculation(
    tmp_path: Path, seeded: Any
) -> None:
    model = save_tiny_model(tmp_path / "model", "llama", "plain")
    grids = seeded(flat_profile(model, verify=True))
    config = job(tmp_path, "rollout.speculative.enable=true")
    engine = build.engine_config(config, str(model), WORLD)
    assert grids[-1].query_lens == spec_query_lens(4) == (2, 3, 5)
    path = engine.speculative.latency_profile
    assert path is not None and Profile.load(path).verify  # the job's cached profile
    assert Path(path).parent == tmp_path / "cache" / "profiles"
    # the engine takes it (shape and dtype checked) and, every step being weight-bound, drafts
    e = build.build_engine(config, str(model), WORLD)
    assert e.config.speculative.latency_profile == path
    assert e.drafter is not None and e.drafter.pays([4, 4], 100)


def test_a_profile_without_verify_rows_leaves_the_drafter_unpriced(
    tmp_path: Path, seeded: Any
) -> None:
    model = save_tiny_model(tmp_path / "model", "llama", "plain")
    seeded(flat_profile(model, verify=False))
    engine = build.engine_config(
        job(tmp_path, "rollout.speculative.enable=true"), str(model), WORLD
    )
    assert engine.speculative.enable and engine.speculative.latency_profile is None


def test_a_job_without_speculation_measures_the_grid_it_always_did(
    tmp_path: Path, seeded: Any
) -> None:
    model = save_tiny_model(tmp_path / "model", "llama", "plain")
    grids = seeded(flat_profile(model, verify=True))
    engine = build.engine_config(job(tmp_path), str(model), WORLD)
    # batches of 2 prompts x 2 samples, 128 positions: the grid a job always measured
    assert grids[-1] == job_grid((1,), 4, 128) and not grids[-1].query_lens
    assert not engine.speculative.enable and engine.speculative.latency_profile is None
    spec = job(tmp_path, "rollout.speculative.enable=true")
    build.engine_config(spec, str(model), WORLD)
    assert grids[-1] == job_grid((1,), 4, 128, (2, 3, 5))


def test_the_users_latency_profile_wins_without_adaptive_tp_too(tmp_path: Path) -> None:
    model = save_tiny_model(tmp_path / "model", "llama", "plain")
    given = tmp_path / "mine.json"
    flat_profile(model, verify=False).save(given)
    for adaptive in ("true", "false"):
        config = job(
            tmp_path,
            "rollout.speculative.enable=true",
            f"rollout.speculative.latency_profile={given}",
            f"rollout.adaptive_tp.enable={adaptive}",
            f"rollout.adaptive_tp.profile={given}",
        )
        engine = build.engine_config(config, str(model), WORLD)
        assert engine.speculative.latency_profile == str(given)
