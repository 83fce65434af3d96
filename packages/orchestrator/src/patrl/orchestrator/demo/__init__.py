"""The demo task's old import path: the task lives in the `patrl-demo` package (`patrl.demo`).
Every module of it is importable here under its old name too (`patrl.orchestrator.demo.reward`,
as reward paths in existing configs name it), as the same module object."""

import importlib
import sys

from patrl.demo import *  # noqa: F403
from patrl.demo import __all__  # noqa: F401

for _name in (
    "assets",
    "evaluate",
    "model",
    "preferences",
    "reward",
    "reward_model",
    "sft",
    "task",
    "tokenizer",
):
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"patrl.demo.{_name}")
