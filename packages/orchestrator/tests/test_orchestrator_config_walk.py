"""The one walk over a config file (`config.yaml_settings`): what it yields, that loading a
file walks it once for both the config and preflight's lines, and that an unknown key is worded
by one helper (`config.unknown_key`) on every path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from patrl.orchestrator import preflight
from patrl.orchestrator.config import ConfigError, Setting, load_config, yaml_settings

TEXT = """\
rollout:
  n: 4
  adaptive_tp:
    candidates: [1, 2]
actor_rollout_ref:
  actor:
    optim:
      lr: 3.0e-6
reward:
  functions:
    - name: format
      weight: 0.5
data:
  train_batch_size: 8
"""


def test_the_walk_yields_each_key_with_its_value_and_line() -> None:
    assert yaml_settings(TEXT, "job.yaml") == [
        Setting("rollout", None, 1, "section"),
        Setting("rollout.n", 4, 2, "value"),
        Setting("rollout.adaptive_tp", None, 3, "section"),
        Setting("rollout.adaptive_tp.candidates", [1, 2], 4, "value"),
        Setting("actor_rollout_ref", None, 5, "section"),
        Setting("actor_rollout_ref.actor", None, 6, "section"),
        Setting("actor_rollout_ref.actor.optim", None, 7, "section"),
        Setting("actor_rollout_ref.actor.optim.lr", 3e-6, 8, "value"),
        Setting("reward", None, 9, "section"),
        Setting("reward.functions", [{"name": "format", "weight": 0.5}], 10, "value"),
        Setting("reward.functions.0.name", "format", 11, "entry"),
        Setting("reward.functions.0.weight", 0.5, 12, "entry"),
        Setting("data", None, 13, "section"),
        Setting("data.train_batch_size", 8, 14, "value"),
    ]


def test_the_walk_reads_values_as_yaml_does() -> None:
    """Every value a setting carries is what yaml.safe_load reads at its place."""
    loaded = yaml.safe_load(TEXT)
    for s in yaml_settings(TEXT, "job.yaml"):
        if s.kind == "value":
            node: Any = loaded
            for part in s.key.split("."):
                node = node[part]
            assert s.value == node, s.key


def test_loading_a_file_walks_it_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """preflight.load judges the keys and builds the config from the same settings: the YAML
    is composed once, never loaded a second time."""
    path = tmp_path / "job.yaml"
    path.write_text(TEXT)
    calls = {"compose": 0, "safe_load": 0}
    compose, safe_load = yaml.compose, yaml.safe_load

    def counting_compose(*args: Any, **kwargs: Any) -> Any:
        calls["compose"] += 1
        return compose(*args, **kwargs)

    def counting_safe_load(*args: Any, **kwargs: Any) -> Any:
        calls["safe_load"] += 1
        return safe_load(*args, **kwargs)

    monkeypatch.setattr(yaml, "compose", counting_compose)
    monkeypatch.setattr(yaml, "safe_load", counting_safe_load)
    config = preflight.load(path)
    assert calls == {"compose": 1, "safe_load": 0}
    assert (config.rollout.n, config.actor.optim.lr) == (4, 3e-6)
    assert config == load_config(path)


def test_an_unknown_key_reads_the_same_on_every_path(tmp_path: Path) -> None:
    """The file's line is preflight's addition; the words are the one helper's."""
    path = tmp_path / "job.yaml"
    path.write_text("rollout:\n  n: 4\n  temprature: 0.5\n")
    with pytest.raises(ConfigError) as direct:
        load_config(path)
    with pytest.raises(ConfigError) as checked:
        preflight.load(path)
    with pytest.raises(ConfigError) as override:
        load_config(None, ["rollout.temprature=0.5"])
    words = "unknown key 'rollout.temprature': rollout accepts ['adaptive_tp', 'agent',"
    assert str(direct.value).startswith(words)
    assert str(checked.value) == f"{path} line 3: {direct.value}"
    assert str(override.value) == str(direct.value)
    assert "did you mean temperature?" in str(direct.value)


def test_a_list_entrys_unknown_key_is_named_on_the_command_line_too() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["reward.functions.0.nme=x"])
    assert str(err.value) == (
        "unknown key 'reward.functions.0.nme': reward.functions.0 accepts ['name', 'weight']; "
        "did you mean name?"
    )


def test_a_key_set_twice_is_named_with_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("rollout:\n  n: 4\n  n: 5\ndata:\n  seed: 1\nrollout:\n  top_k: 3\n")
    with pytest.raises(preflight.PreflightError) as err:
        preflight.load(path)
    assert err.value.problems == [
        f"{path} line 3: key 'rollout.n' is set twice (first on line 2); keep one",
        f"{path} line 6: key 'rollout' is set twice (first on line 1); keep one",
    ]


def test_malformed_yaml_and_a_top_level_value_are_named(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("data:\n  seed: [1\n")
    with pytest.raises(preflight.PreflightError) as err:
        preflight.load(path)
    assert f"{path} line 3, column 1: malformed YAML" in str(err.value)
    path.write_text("- rollout\n")
    with pytest.raises(ConfigError) as top:
        load_config(path)
    assert str(top.value) == f"{path}: the top level must be a mapping of sections, got list"
    path.write_text("")
    assert load_config(path) == load_config(None)
