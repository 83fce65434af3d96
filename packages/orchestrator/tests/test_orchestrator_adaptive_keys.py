"""`rollout.adaptive_tp` is the engine's own policy class (patrl.rollout.AdaptiveTP) with the
job's keys added: the same keys and defaults, and every setting reaches the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from patrl.orchestrator.build import engine_config
from patrl.orchestrator.config import AdaptiveTPConfig, ConfigError, load_config
from patrl.orchestrator.distributed import World
from patrl.rollout import AdaptiveTP
from patrl_testkit.jobs import tiny_job_overrides


def test_the_section_is_the_engines_policy_with_its_defaults() -> None:
    assert issubclass(AdaptiveTPConfig, AdaptiveTP)
    section = AdaptiveTPConfig()
    for name, field in AdaptiveTP.model_fields.items():
        assert getattr(section, name) == getattr(AdaptiveTP(), name), name
        assert AdaptiveTPConfig.model_fields[name].default == field.default, name
    assert set(section.model_dump()) == {
        *AdaptiveTP.model_fields,
        "enable",
        "keep_full_weights",
    } - {"kind"}


def test_every_setting_reaches_the_engine(assets: Path, tmp_path: Path) -> None:
    """Each key off its default: the engine's policy carries every one, on the candidates the
    world allows and the given profile."""
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    settings = {
        "rollout.adaptive_tp.enable": "true",
        "rollout.adaptive_tp.candidates": "[1,2,4]",
        "rollout.adaptive_tp.check_every": 7,
        "rollout.adaptive_tp.check_budget": 0.25,
        "rollout.adaptive_tp.margin": 0.5,
        "rollout.adaptive_tp.kv_policy": "recompute",
        "rollout.adaptive_tp.profile": profile,
    }
    config = load_config(None, tiny_job_overrides(assets, tmp_path / "run", **settings))
    engine = engine_config(config, str(assets / "model"), World(0, 2, 0, torch.device("cpu")))
    assert engine.tp_policy == AdaptiveTP(
        candidates=(1, 2),  # 4 does not divide a world of 2
        check_every=7,
        check_budget=0.25,
        margin=0.5,
        kv_policy="recompute",
        profile=str(profile),
    )
    assert engine.keep_full_weights is True


def test_the_section_keeps_the_jobs_rules() -> None:
    """One candidate, or none usable, is a static-TP job (not the engine's error); `kind` is
    no key; the library's bounds keep their words."""
    one = load_config(None, ["rollout.adaptive_tp.candidates=[1]"])
    assert one.rollout.adaptive_tp.candidates == (1,)
    one.rollout.adaptive_tp.enable = False  # the async schedule turns it off in place
    assert "kind" not in one.model_dump()["rollout"]["adaptive_tp"]
    with pytest.raises(ConfigError, match=r"rollout\.adaptive_tp\.kind: is the engine's policy"):
        load_config(None, ["rollout.adaptive_tp.kind=adaptive"])
    with pytest.raises(ConfigError, match=r"rollout\.adaptive_tp\.check_every: Input should be"):
        load_config(None, ["rollout.adaptive_tp.check_every=0"])
    with pytest.raises(ConfigError, match=r"unknown key 'rollout\.adaptive_tp\.margn'"):
        load_config(None, ["rollout.adaptive_tp.margn=0.1"])
