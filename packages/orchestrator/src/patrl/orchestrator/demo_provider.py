"""Where the main job's demo task comes from: a provider found through the `patrl.assets`
entry point group, never imported by name.

A job that leaves `model.path` unset, leaves `data.train_files` unset or names it `demo`, or
names `data.val_files: demo`, takes those from the demo task. The library does not ship that
task: a separate project registers it, as the checkout's examples project does
(`examples/pyproject.toml`, `pip install -e examples`):

    [project.entry-points."patrl.assets"]
    demo = "patrl_examples.demo.provider"

The entry point names an object (a module will do) with the `DemoProvider` functions. Any other
project may register its own `demo` the same way; exactly one may be installed.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol, cast

from patrl.orchestrator.errors import JobError

ENTRY_POINT_GROUP = "patrl.assets"
DEMO = "demo"
INSTALL = "pip install -e examples"


class DemoAssets(Protocol):
    """A built demo: a Hugging Face model directory (tokenizer included) and the train and
    validation JSONL files (`prompt` and `answer` columns)."""

    @property
    def model_dir(self) -> Path: ...

    @property
    def train_file(self) -> Path: ...

    @property
    def val_file(self) -> Path: ...


class DemoProvider(Protocol):
    """What the orchestrator calls on the registered `demo`."""

    def built_assets(self) -> DemoAssets | None:
        """The demo if it is already built; else None. Builds and writes nothing (preflight
        calls it to check what is there)."""
        ...

    def ensure_assets(self, progress: bool = True) -> DemoAssets:
        """The demo, built on the first call and reused after; safe to call on every rank of
        one machine at once (one builds, the others wait and load). `progress`: print the
        build's progress."""
        ...

    def build_tokenizer(self) -> Any:
        """The demo model's tokenizer, built in memory (a PreTrainedTokenizerBase): preflight
        reads a job's own data with it before the demo model is built."""
        ...


class DemoUnavailable(JobError):
    """The job asks for the demo task and no provider of it is installed (or more than one)."""


def load_demo_provider(wanted_by: str) -> DemoProvider:
    """The installed `demo` provider of the `patrl.assets` group.

    `wanted_by` says which keys ask for the demo (e.g. "model.path is unset"); it leads the
    DemoUnavailable raised when no provider is installed, or several are."""
    found = list(entry_points(group=ENTRY_POINT_GROUP, name=DEMO))
    if not found:
        raise DemoUnavailable(
            f"{wanted_by}, which asks for the demo task, and no demo is installed: it comes "
            f"from the patrl-examples project (entry point {DEMO!r} in group "
            f"{ENTRY_POINT_GROUP!r}); install it from the checkout with `{INSTALL}`, or give "
            "model.path and data.train_files of your own"
        )
    if len(found) > 1:
        values = ", ".join(sorted(ep.value for ep in found))
        raise DemoUnavailable(
            f"{wanted_by}, which asks for the demo task, and {len(found)} distributions "
            f"register a {DEMO!r} in entry point group {ENTRY_POINT_GROUP!r} ({values}); "
            "uninstall all but one"
        )
    return cast(DemoProvider, found[0].load())
