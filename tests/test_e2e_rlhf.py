"""The three RLHF stages on the demo (examples/rlhf_ppo.py): the preference pairs are what they
claim, stage 2's reward model learns them, and a 2-step stage 3 against that RM completes."""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from patrl.trainer.reward_model import PreferenceKeys, check_reward_model_dir
from patrl.trainer.reward_model.preferences import check_row
from patrl_examples.demo import ensure_demo_assets
from patrl_examples.demo.evaluate import is_correct
from patrl_examples.demo.preferences import (
    DEFAULT_KINDS,
    REJECTED_KINDS,
    preference_pairs,
)
from patrl_examples.demo.reward import shows_work
from patrl_examples.demo.reward_model import RewardModelRecipe, ensure_demo_reward_model
from patrl_examples.demo.task import Problem

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
_LINE = re.compile(r"[a-z](\d+): (\d+)\+(\d+)=(-?\d+)")
# (works it out, boxes the right total) of each rejected kind.
EXPECTED = {
    "bare": (False, True),
    "bare_wrong": (False, False),
    "slip": (True, False),
    "wrong_box": (True, False),
}


def problem_of(prompt: str) -> Problem:
    return Problem(tuple(int(x) for x in re.findall(r"[a-z](\d+)", prompt.removeprefix("Add: "))))


def wrong_lines(response: str) -> int:
    """Worked lines whose sum is wrong."""
    return sum(int(a) + int(b) != int(c) for _, a, b, c in _LINE.findall(response))


def test_preference_rows_are_well_formed_and_differ_as_designed() -> None:
    rows = preference_pairs(64, seed=3, kinds=REJECTED_KINDS)
    assert rows == preference_pairs(64, seed=3, kinds=REJECTED_KINDS)  # seeded
    assert rows != preference_pairs(64, seed=4, kinds=REJECTED_KINDS)
    assert Counter(r["kind"] for r in rows) == {k: 16 for k in REJECTED_KINDS}
    for i, row in enumerate(rows):
        check_row(row, i, "generated", PreferenceKeys())
        problem = problem_of(row["prompt"])
        chosen, rejected, answer = row["chosen"], row["rejected"], row["answer"]
        assert answer == str(problem.answer)
        assert chosen == problem.solution() and shows_work(chosen, answer) == 1.0
        assert is_correct(chosen, answer) and wrong_lines(chosen) == 0
        assert rejected != chosen
        worked = shows_work(rejected, answer) == 1.0
        assert (worked, is_correct(rejected, answer)) == EXPECTED[row["kind"]], row
        if row["kind"] == "slip":  # one slipped sum, carried on consistently
            assert wrong_lines(rejected) == 1
        if row["kind"] == "wrong_box":  # right lines, wrong box
            assert wrong_lines(rejected) == 0
            assert rejected.splitlines()[:-1] == chosen.splitlines()[:-1]
    default = preference_pairs(10, seed=0)
    assert {r["kind"] for r in default} == set(DEFAULT_KINDS)
    with pytest.raises(ValueError, match=r"'typo'.*accepted"):
        preference_pairs(4, seed=0, kinds=("bare", "typo"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rlhf-cache")


@pytest.mark.e2e  # a stage of examples/rlhf_ppo.py's pipeline
def test_stage2_reward_model_learns_the_pairs_and_is_cached(cache: Path) -> None:
    demo = ensure_demo_assets(cache, quick=True, progress=False)
    recipe = RewardModelRecipe(num_train=128)  # stage 3 below reuses it
    rm = ensure_demo_reward_model(demo, recipe, cache)
    assert rm.val_accuracy >= 0.8, rm.manifest
    assert rm.manifest["steps"] == 128 // recipe.batch_size
    check_reward_model_dir(rm.model_dir)  # an HF one-label sequence classifier with a tokenizer
    again = ensure_demo_reward_model(demo, recipe, cache)
    assert again.root == rm.root and again.manifest == rm.manifest  # loaded, not rebuilt
    other = ensure_demo_reward_model(
        demo, RewardModelRecipe(seed=1, num_train=16, num_val=8), cache
    )
    assert other.root != rm.root


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rlhf_ppo", ROOT / "examples" / "rlhf_ppo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.e2e  # a stage of examples/rlhf_ppo.py's pipeline
def test_stage3_runs_two_steps_against_the_reward_model(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATRL_CACHE_DIR", str(cache))
    example = load_example()
    overrides: dict[str, Any] = {
        "data.train_batch_size": 4,
        "data.max_response_length": 48,
        "actor.ppo_mini_batch_size": 4,
        "rollout.n": 2,
        "reward.num_workers": 0,
        "trainer.total_training_steps": 2,
        "trainer.test_freq": 0,
        "trainer.save_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.resume_mode": "disable",
        "trainer.default_local_dir": tmp_path,
    }
    # main's options may come anywhere among the overrides; they go first, the overrides last.
    assert example.split_flags(["a.b=1", "--dry-run", "--config", "f.yaml", "c.d=2"]) == (
        ["--dry-run", "--config", "f.yaml"],
        ["a.b=1", "c.d=2"],
    )
    argv = ["--quick", "--rm-pairs", "128", *(f"{k}={v}" for k, v in overrides.items())]
    assert example.run(argv) == 0
    rows = [json.loads(x) for x in next(tmp_path.rglob("metrics.jsonl")).read_text().splitlines()]
    steps = [r for r in rows if "reward_model/score/mean" in r]
    assert [int(r["step"]) for r in steps] == [1, 2]
    if example.stage3_overrides("auto") == example.PPO_OVERRIDES:  # the PPO keys exist
        assert all("critic/vf_explained_var" in r for r in steps)
    else:
        assert all("actor/kl_loss" in r for r in steps)
