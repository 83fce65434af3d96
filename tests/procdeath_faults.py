"""Faults a test injects into a running GRPO job from the outside, with no hook in library code.

`killer` is a reward function (`reward.functions=[{name: "procdeath_faults:killer"}]`). With
`reward.num_workers=0` it runs in the rank's own process, so it can SIGKILL that rank: the
hardest death there is (no exception, no `finally`, no atexit, sockets torn down by the OS).
It is told what to do through the environment, which torchrun hands to every worker:

- PROCDEATH_RANK: the rank that dies;
- PROCDEATH_AFTER_STEP, PROCDEATH_CALLS_PER_STEP: the dying rank's first reward call of step
  AFTER_STEP + 1 (call number AFTER_STEP x CALLS_PER_STEP + 1) waits until the checkpoint of
  step AFTER_STEP is complete, so the restart has something to resume from and the step in
  progress is lost; then
- PROCDEATH_AT: `score` dies right there, in the middle of the step; `save` dies inside the
  next checkpoint's write, after this rank's trainer shards are staged but before the
  checkpoint is committed (debris the restart must ignore);
- PROCDEATH_RUN_DIR: the job's run directory (where its checkpoints are);
- PROCDEATH_MARKER: a file created just before dying (holding, for `save`, the directory the
  trainer had just written); while it exists nothing dies, so the restarted job runs through.

Unset, it is a plain reward. Its score is the share of digits in the response: dense, so a
random model gets non-zero advantages.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

ENV_RANK = "PROCDEATH_RANK"
ENV_AFTER_STEP = "PROCDEATH_AFTER_STEP"
ENV_CALLS_PER_STEP = "PROCDEATH_CALLS_PER_STEP"
ENV_AT = "PROCDEATH_AT"
ENV_RUN_DIR = "PROCDEATH_RUN_DIR"
ENV_MARKER = "PROCDEATH_MARKER"
WHERE = ("score", "save")
# A checkpoint that does not come is a broken test set-up, not a reason to hang the job.
CHECKPOINT_WAIT_S = 120.0

_calls = 0
_armed_save = False


def killer(response: str, answer: str, **meta: Any) -> float:
    if _due():
        if os.environ.get(ENV_AT, "score") == "save":
            _arm_save()
        else:
            die()
    return sum(c.isdigit() for c in response) / max(1, len(response))


def fault_env(
    rank: int, after_step: int, calls_per_step: int, at: str, run_dir: Path, marker: Path
) -> dict[str, str]:
    """The environment that makes `killer` kill `rank` once, as described above."""
    if at not in WHERE:
        raise ValueError(f"at={at!r}: accepted are {WHERE}")
    return {
        ENV_RANK: str(rank),
        ENV_AFTER_STEP: str(after_step),
        ENV_CALLS_PER_STEP: str(calls_per_step),
        ENV_AT: at,
        ENV_RUN_DIR: str(run_dir),
        ENV_MARKER: str(marker),
    }


def die(note: str = "") -> None:
    """Leave the marker, then SIGKILL this process."""
    Path(os.environ[ENV_MARKER]).write_text(note)
    os.kill(os.getpid(), signal.SIGKILL)


def _due() -> bool:
    global _calls
    if ENV_RANK not in os.environ or os.environ.get("RANK") != os.environ[ENV_RANK]:
        return False
    if Path(os.environ[ENV_MARKER]).exists():
        return False  # already died once: this is the restarted job
    _calls += 1
    step = int(os.environ[ENV_AFTER_STEP])
    if _calls != step * int(os.environ[ENV_CALLS_PER_STEP]) + 1:
        return False
    _wait_for_checkpoint(step)
    return True


def _wait_for_checkpoint(step: int) -> None:
    """In sync mode it is there already; an async trainer may still be writing it."""
    done = Path(os.environ[ENV_RUN_DIR]) / f"global_step_{step}" / "state.json"
    deadline = time.monotonic() + CHECKPOINT_WAIT_S
    while not done.is_file():
        if time.monotonic() > deadline:
            raise RuntimeError(f"procdeath: no {done} after {CHECKPOINT_WAIT_S}s")
        time.sleep(0.01)


def _arm_save() -> None:
    """Make this rank's next checkpoint write end in SIGKILL once its shards are staged."""
    global _armed_save
    if _armed_save:
        return
    _armed_save = True
    from patrl.trainer import Trainer

    original = Trainer.save

    def save_then_die(self: Trainer, path: Any, *args: Any, **kwargs: Any) -> Any:
        original(self, path, *args, **kwargs)
        die(str(path))

    Trainer.save = save_then_die  # type: ignore[method-assign]
