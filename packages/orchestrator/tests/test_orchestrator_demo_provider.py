"""The demo hook: a job that asks for the demo task takes its model and data from the provider
registered under the `patrl.assets` entry point group, never from a module imported by name;
with none installed (or two) preflight and the run refuse it naming the keys that ask for the
demo and how to install one; a job with its own model and data never looks.

The installed entry points are replaced here (`demo_provider.entry_points`), so these tests
hold with or without the examples project; examples/tests checks its own registration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.orchestrator import demo_provider, preflight
from patrl.orchestrator.config import ConfigError
from patrl.orchestrator.demo_provider import DemoUnavailable
from patrl.orchestrator.distributed import World
from patrl.orchestrator.errors import JobError
from patrl.orchestrator.main import resolve_assets
from patrl_testkit.jobs import tiny_job_overrides

ONE = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))


def _installed(monkeypatch: pytest.MonkeyPatch, *values: str) -> None:
    """Stand-in for the installed distributions: exactly these `demo` entry points."""
    found = [EntryPoint(name="demo", value=v, group="patrl.assets") for v in values]

    def entry_points(*, group: str, name: str) -> list[EntryPoint]:
        assert (group, name) == (demo_provider.ENTRY_POINT_GROUP, demo_provider.DEMO)
        return found

    monkeypatch.setattr(demo_provider, "entry_points", entry_points)


def _job(assets: Path, tmp_path: Path, drop: tuple[str, ...], *extra: str) -> list[str]:
    """The kit's tiny job on `assets`, less the keys in `drop` (left to the demo), plus `extra`."""
    kept = [o for o in tiny_job_overrides(assets, tmp_path / "runs") if not o.startswith(drop)]
    return [*kept, *extra]


@dataclass
class FakeAssets:
    model_dir: Path
    train_file: Path
    val_file: Path


@dataclass
class FakeProvider:
    """A provider serving the kit's addition job as the demo, counting what is asked of it."""

    assets: FakeAssets | None = None
    built: bool = True  # whether `built_assets` finds them (else the demo is still to build)
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def built_assets(self) -> FakeAssets | None:
        self.calls.append(("built_assets", None))
        return self.assets if self.built else None

    def ensure_assets(self, progress: bool = True) -> FakeAssets:
        self.calls.append(("ensure_assets", progress))
        assert self.assets is not None
        return self.assets

    def build_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        self.calls.append(("build_tokenizer", None))
        assert self.assets is not None
        return AutoTokenizer.from_pretrained(self.assets.model_dir, local_files_only=True)


# The entry point `test_orchestrator_demo_provider:FAKE` loads this (test basenames are unique,
# and pytest imports this file under its basename).
FAKE = FakeProvider()


@pytest.fixture
def fake(assets: Path, monkeypatch: pytest.MonkeyPatch) -> FakeProvider:
    FAKE.assets = FakeAssets(assets / "model", assets / "train.jsonl", assets / "val.jsonl")
    FAKE.built = True
    FAKE.calls.clear()
    _installed(monkeypatch, f"{__name__}:FAKE")
    return FAKE


@pytest.mark.parametrize(
    ("drop", "extra", "keys"),
    [
        (
            ("model.path", "data.train_files"),
            (),
            "model.path is unset and data.train_files is unset",
        ),
        (("model.path",), (), "model.path is unset"),
        (("data.train_files",), ("data.train_files=demo",), "data.train_files=demo"),
        ((), ("data.val_files=demo",), "data.val_files=demo"),
    ],
)
def test_the_demo_without_a_provider_is_refused_naming_the_keys_and_the_install(
    drop: tuple[str, ...],
    extra: tuple[str, ...],
    keys: str,
    assets: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATRL_CACHE_DIR", str(tmp_path / "cache"))
    _installed(monkeypatch)
    config = preflight.load(None, _job(assets, tmp_path, drop, *extra))
    with pytest.raises(ConfigError) as info:
        preflight.check(config, 1)
    message = str(info.value)
    for fact in (
        f"{keys}, which asks for the demo task",
        "pip install -e examples",
        "patrl.assets",
    ):
        assert fact in message, message
    # the run's own path says the same, as one line (a JobError), before touching the world
    with pytest.raises(DemoUnavailable) as run_info:
        resolve_assets(config, ONE)
    assert isinstance(run_info.value, JobError) and keys in str(run_info.value)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "runs").exists()


def test_a_job_with_its_own_model_and_data_needs_no_provider(
    assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _installed(monkeypatch)
    config = preflight.check(preflight.load(None, _job(assets, tmp_path, ())), 1)
    assert resolve_assets(config, ONE) == (
        str(assets / "model"),
        str(assets / "train.jsonl"),
        None,
    )


def test_two_providers_are_refused_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(monkeypatch, "one.demo:provider", "two.demo:provider")
    with pytest.raises(DemoUnavailable) as info:
        demo_provider.load_demo_provider("model.path is unset")
    message = str(info.value)
    assert "2 distributions" in message and "one.demo:provider, two.demo:provider" in message


def test_the_registered_provider_supplies_the_model_and_data(
    fake: FakeProvider, assets: Path, tmp_path: Path
) -> None:
    """No model or data given: preflight checks the provider's built assets (reading nothing
    else), and the run takes the provider's model, train and val files."""
    config = preflight.load(None, _job(assets, tmp_path, ("model.path", "data.train_files")))
    preflight.check(config, 1)
    assert fake.calls == [("built_assets", None)]
    fake.calls.clear()
    got = resolve_assets(config, ONE)
    assert got == (str(assets / "model"), str(assets / "train.jsonl"), str(assets / "val.jsonl"))
    assert fake.calls == [("ensure_assets", True)]


def test_own_data_on_the_unbuilt_demo_model_is_read_with_the_providers_tokenizer(
    fake: FakeProvider, assets: Path, tmp_path: Path
) -> None:
    """Data of the job's own, the demo's model not built yet: preflight reads the data with
    the provider's tokenizer, so a bad file is named before the demo's build."""
    fake.built = False
    (tmp_path / "empty.jsonl").write_text("")
    config = preflight.load(
        None,
        _job(assets, tmp_path, ("model.path",), f"data.train_files={tmp_path / 'empty.jsonl'}"),
    )
    with pytest.raises(ConfigError) as info:
        preflight.check(config, 1)
    assert "data.train_files: no rows in" in str(info.value), str(info.value)
    assert fake.calls == [("built_assets", None), ("build_tokenizer", None)]
    # the control: good data of its own passes, the demo still unbuilt
    good = _job(assets, tmp_path, ("model.path",))
    preflight.check(preflight.load(None, good), 1)
