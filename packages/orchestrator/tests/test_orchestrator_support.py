"""Which jobs the schedules run (support.py): one list of refusals that preflight reports and
both schedules re-check, and the run's length resolved once, where the config is finalised,
then passed on as it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.orchestrator import build, preflight, support
from patrl.orchestrator.config import JobConfig, load_config
from patrl.orchestrator.distributed import World
from patrl.orchestrator.errors import JobError
from patrl_testkit.jobs import tiny_job_overrides

CPU1 = World(0, 1, 0, torch.device("cpu"))


def _job(assets: Path, tmp_path: Path, **extra: Any) -> JobConfig:
    return load_config(None, tiny_job_overrides(assets, tmp_path / "run", **extra))


def test_one_list_holds_every_schedules_refusals(assets: Path, tmp_path: Path) -> None:
    both = _job(
        assets,
        tmp_path,
        **{
            "trainer.mode": "async",
            "algorithm.adv_estimator": "remax",
            "rollout.multi_turn.enable": "true",  # with no tool config: refused
        },
    )
    problems = support.unsupported(both, 1)
    assert problems == [*support.multi_turn_refusals(both), *support.async_refusals(both, 1)]
    assert [p.split(":")[0] for p in problems] == [
        "rollout.multi_turn.enable=true with rollout.multi_turn.tool_config_path is unset",
        "trainer.mode=async needs at least 2 ranks (rollout ranks and trainer ranks apart) and "
        "this job has 1",
        "trainer.mode=async does not support algorithm.adv_estimator=remax",
    ]
    assert support.unsupported(_job(assets, tmp_path), 1) == []  # the control


def test_preflight_reports_the_refusals_once(assets: Path, tmp_path: Path) -> None:
    config = _job(assets, tmp_path, **{"trainer.mode": "async", "async_rl.rollout_ranks": 2})
    with pytest.raises(preflight.PreflightError) as err:
        preflight.check(config, 2)
    assert err.value.problems == support.unsupported(config, 2)
    assert err.value.problems[0].startswith("async_rl.rollout_ranks=2 leaves no trainer rank")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_schedule_refuses_what_preflight_refuses_before_building(
    assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A caller that skipped preflight gets the same words, before data or an engine is
    built (load_data would be the first thing built)."""
    from patrl.orchestrator.async_loop import AsyncSchedule
    from patrl.orchestrator.sync_loop import SyncSchedule

    def no_build(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("built before the refusal")

    monkeypatch.setattr("patrl.orchestrator.sync_loop.load_data", no_build)
    monkeypatch.setattr("patrl.orchestrator.async_loop.load_data", no_build)
    config = _job(assets, tmp_path, **{"trainer.mode": mode, "rollout.multi_turn.enable": "true"})
    schedule = SyncSchedule if mode == "sync" else AsyncSchedule
    with pytest.raises(support.UnsupportedJob) as err:
        schedule(config, CPU1, str(assets / "model"), config.data.train_files, None)
    assert str(err.value) == "; ".join(support.unsupported(config, 1))
    assert "with rollout.multi_turn.tool_config_path is unset: the tool agent loop needs" in str(
        err.value
    )
    assert isinstance(err.value, JobError) and isinstance(err.value, ValueError)


def _count_resolves(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    calls: list[int | None] = []
    resolve = build.resolve_schedule

    def counting(config: JobConfig, num_train_prompts: int | None) -> JobConfig:
        calls.append(num_train_prompts)
        return resolve(config, num_train_prompts)

    monkeypatch.setattr(build, "resolve_schedule", counting)
    monkeypatch.setattr(preflight, "resolve_schedule", counting)
    return calls


def test_a_config_preflight_resolved_is_passed_on_as_it_is(
    assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """preflight read the train set and fixed the run's length: the schedule runs that very
    config; nothing resolves it again."""
    from patrl.orchestrator.sync_loop import SyncSchedule

    calls = _count_resolves(monkeypatch)
    config = preflight.check(_job(assets, tmp_path, **{"trainer.total_epochs": 2}), 1)
    assert config.schedule_resolved and len(calls) == 1
    loop = SyncSchedule(config, CPU1, str(assets / "model"), config.data.train_files, None)
    assert loop.config is config
    assert len(calls) == 1


def test_an_epoch_count_preflight_could_not_read_is_resolved_with_the_data(
    assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_resolves(monkeypatch)
    config = _job(assets, tmp_path, **{"trainer.total_epochs": 2})  # not preflight-checked
    assert not config.schedule_resolved
    data = build.load_data(config, str(assets / "model"), config.data.train_files, None)
    per_epoch = len(data.train_set) // config.data.train_batch_size
    assert calls == [len(data.train_set)] and per_epoch > 0
    assert data.config.total_steps == 2 * per_epoch
    assert data.config.actor.optim.total_training_steps == 2 * per_epoch
    assert data.config.schedule_resolved


def test_multi_turn_partial_rollouts_run_in_every_layout(tmp_path: Path) -> None:
    """Multi-turn with partial rollouts is refused in no layout (adaptive TP's driver cuts
    the world's samples at its quota); an unset tool config still is."""
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools: []\n")
    base = [
        "data.train_files=/d.jsonl",
        "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.tool_config_path={tools}",
        "rollout.over_sample_rate=0.5",
    ]
    for adaptive in ("true", "false"):
        config = load_config(None, [*base, f"rollout.adaptive_tp.enable={adaptive}"])
        for world_size in (1, 2, 4):
            assert support.unsupported(config, world_size) == [], (adaptive, world_size)
    untooled = load_config(None, [base[0], base[1], base[3], "rollout.adaptive_tp.enable=true"])
    (problem,) = support.unsupported(untooled, 2)
    assert problem.startswith("rollout.multi_turn.enable=true with rollout.multi_turn.tool_")
