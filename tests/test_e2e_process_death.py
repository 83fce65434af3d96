"""Process death: SIGKILL one rank of the real GRPO job under torchrun.

With `--max-restarts 1` the agent restarts the workers, the job resumes from its newest complete
checkpoint (`trainer.resume_mode=auto`), loses at most the step in progress and finishes every
configured step; no checkpoint it leaves is corrupt. With `--max-restarts 0` the job fails in
bounded time, the survivor does not hang, and the output names the dead rank.

The fault comes from outside library code: a reward function (procdeath_faults.py) that kills
its own rank, run in the rank's process (`reward.num_workers=0`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from procdeath_faults import fault_env

from patrl.orchestrator import run_checkpoint
from patrl.orchestrator.main import restart_hazard
from patrl.trainer.checkpoint import read_marker
from patrl_testkit.processes import kill_tree

pytestmark = pytest.mark.multirank

STEPS = 4
DIES_AFTER_STEP = 2  # a rank dies in step 3; step 2's checkpoint is the newest complete one
BATCH, N = 4, 2  # prompts per step, samples per prompt


@dataclass(frozen=True)
class Mode:
    overrides: dict[str, Any]
    dies: int  # the rank killed: one that scores samples (the fault is a reward function)
    scorers: int  # ranks that share a step's samples for scoring
    trainer_ranks: int  # ranks that write a checkpoint
    at: str  # where the restart test kills it (procdeath_faults.WHERE)


MODES = {
    # Rank 1 scores half of each step and trains: it can die mid-checkpoint.
    "sync": Mode({}, dies=1, scorers=2, trainer_ranks=2, at="save"),
    # Rank 0 generates and scores every sample, rank 1 trains. Staleness 0 keeps each step's
    # samples together in rank 0's calls, so the fault's call count finds step 3's first.
    "async": Mode(
        {"trainer.mode": "async", "async_rl.rollout_ranks": 1, "async_rl.max_staleness": 0},
        dies=0,
        scorers=1,
        trainer_ranks=1,
        at="score",
    ),
}
JOB_TIMEOUT_S = 300.0  # a hang must fail the test, not the CI job
# From the death to the end of the job. The collective timeout (600 s) is far above it: passing
# means nobody waited on a dead peer; torchrun noticed the death and stopped the survivor.
SURVIVOR_BOUND_S = 60.0


def job_overrides(assets: Path, out: Path, mode: str) -> list[str]:
    values: dict[str, Any] = {
        "model.path": assets / "model",
        "data.train_files": assets / "train.jsonl",
        "data.train_batch_size": BATCH,
        "data.max_prompt_length": 32,
        "data.max_response_length": 8,
        "actor.ppo_mini_batch_size": BATCH,
        "rollout.n": N,
        "rollout.block_size": 4,
        "rollout.num_kv_blocks": 64,
        # Adaptive TP's start-up profiling is not what is tested here and costs seconds.
        "rollout.adaptive_tp.enable": "false",
        "reward.functions": '[{name: "procdeath_faults:killer"}]',
        "reward.num_workers": 0,  # in the rank's own process, so the fault kills the rank
        "trainer.total_training_steps": STEPS,
        "trainer.save_freq": 1,
        "trainer.max_checkpoints_to_keep": STEPS,  # keep all: each one is checked
        "trainer.test_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.resume_mode": "auto",
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.default_local_dir": out / "patrl" / "grpo",
        **MODES[mode].overrides,
    }
    return [f"{k}={v}" for k, v in values.items()]


def torchrun(overrides: list[str], max_restarts: int, env: dict[str, str]) -> tuple[int, str]:
    """(exit code, stdout and stderr interleaved) of the job on 2 local ranks."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        str(max_restarts),
        "-m",
        "patrl.orchestrator",
        *overrides,
    ]
    tests = str(Path(__file__).parent)
    full_env = {
        **os.environ,
        **env,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
    }
    # Its own session; a hang is ended by killing the agent and every process below it (torchrun
    # starts its workers in sessions of their own, out of reach of a process group kill).
    with subprocess.Popen(
        command,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as job:
        try:
            output, _ = job.communicate(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_tree(job.pid)
            output, _ = job.communicate()
            pytest.fail(f"the job hung: still running after {JOB_TIMEOUT_S}s\n{output[-6000:]}")
    return job.returncode, output


def fault(mode: str, at: str, tmp_path: Path) -> dict[str, str]:
    m = MODES[mode]
    run_dir = tmp_path / "patrl" / "grpo"
    calls_per_step = BATCH * N // m.scorers
    return fault_env(m.dies, DIES_AFTER_STEP, calls_per_step, at, run_dir, tmp_path / "died")


def assert_checkpoints_sound(
    run_dir: Path, model_dir: Path, steps: list[int], world_size: int
) -> None:
    """Exactly the checkpoints of `steps`, each complete, of this model and world, and every
    tensor readable; no staging debris left behind."""
    root = run_checkpoint.checkpoint_root(run_dir)
    names = sorted(p.name for p in root.iterdir() if p.name.startswith("global_step_"))
    assert names == sorted(f"global_step_{s}" for s in steps), names
    shapes = model_shapes(model_dir)
    for step in steps:
        path = run_checkpoint.step_dir(run_dir, step)
        run_checkpoint.check_resumable(path, shapes, set())
        assert read_marker(path / run_checkpoint.TRAINER_DIR)["world_size"] == world_size
        assert run_checkpoint.read_state(path)["step"] == step
        assert not list(path.rglob("*.tmp")), f"staging debris inside {path}"
        tensors = read_all_tensors(path / run_checkpoint.TRAINER_DIR)
        for name, shape in shapes.items():
            assert tuple(tensors[f"model.{name}"].shape) == shape
        assert all(torch.isfinite(t).all() for t in tensors.values()), path


def model_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118


def read_all_tensors(trainer_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, read whole in this one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(trainer_dir))
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def logged_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [int(r["step"]) for r in rows if "critic/score/mean" in r]


@pytest.mark.e2e
@pytest.mark.parametrize("mode", MODES)
def test_killed_rank_restarts_and_resumes(assets: Path, tmp_path: Path, mode: str) -> None:
    """A rank dies in step 3 (sync: writing step 3's checkpoint, after its shards are staged
    and before the commit, so the staged checkpoint is debris; async: the rollout rank, while
    scoring). Step 3 is lost; the restart resumes from step 2, redoes step 3 and finishes;
    every checkpoint left is whole."""
    m = MODES[mode]
    run_dir = tmp_path / "patrl" / "grpo"
    code, output = torchrun(job_overrides(assets, tmp_path, mode), 1, fault(mode, m.at, tmp_path))
    assert code == 0, output[-6000:]
    marker = tmp_path / "died"
    assert marker.exists(), "the fault never fired: nothing was tested"
    if m.at == "save":  # it died with step 3 staged, uncommitted; the restart cleared it
        staged = Path(marker.read_text())
        assert staged.parent == run_checkpoint.staging_dir(run_dir, DIES_AFTER_STEP + 1)
        assert not staged.parent.exists()
    resumed = re.findall(r"resumed from (\S+) at step (\d+)", output)
    expected = str(run_checkpoint.step_dir(run_dir, DIES_AFTER_STEP))
    assert resumed == [(expected, str(DIES_AFTER_STEP))], output[-6000:]
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))
    steps = list(range(1, STEPS + 1))
    assert_checkpoints_sound(run_dir, assets / "model", steps, m.trainer_ranks)


@pytest.mark.e2e
def test_killed_rank_without_restarts_fails_naming_it(assets: Path, tmp_path: Path) -> None:
    """Rank 1 dies scoring step 3. Rank 0, left in a collective, must not wait out the
    collective timeout: the job ends soon after the death, and torchrun's summary blames
    rank 1 (SIGKILL) as the root cause. (Sync only: naming the rank is torchrun's, the same
    in either mode, and each run costs a minute of CI.)"""
    m = MODES["sync"]
    run_dir = tmp_path / "patrl" / "grpo"
    code, output = torchrun(
        job_overrides(assets, tmp_path, "sync"), 0, fault("sync", "score", tmp_path)
    )
    ended = time.time()
    assert code != 0
    marker = tmp_path / "died"
    assert marker.exists(), "the fault never fired: nothing was tested"
    assert ended - marker.stat().st_mtime < SURVIVOR_BOUND_S, output[-6000:]
    root_cause = output[output.index("Root Cause") :]
    named = rf"rank\s*:\s*{m.dies} \(local_rank: {m.dies}\)\s+exitcode\s*:\s*-9"
    assert re.search(named, root_cause), output[-3000:]
    assert "resumed from" not in output
    assert logged_steps(run_dir) == list(range(1, DIES_AFTER_STEP + 1))
    steps = list(range(1, DIES_AFTER_STEP + 1))
    assert_checkpoints_sound(run_dir, assets / "model", steps, m.trainer_ranks)


def test_restart_hazard_is_named_only_for_restarts_on_a_shared_store() -> None:
    shared = {
        "TORCHELASTIC_MAX_RESTARTS": "1",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "GROUP_WORLD_SIZE": "2",  # several nodes: attempt numbers can differ between them
    }
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in (restart_hazard(shared) or "")
    assert restart_hazard({**shared, "GROUP_WORLD_SIZE": "1"}) is None  # init_world handles it
    assert restart_hazard({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert restart_hazard({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert restart_hazard({}) is None  # not under torchrun
