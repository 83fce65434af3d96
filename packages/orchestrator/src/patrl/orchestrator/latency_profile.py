"""The latency profile adaptive TP plans with: given, or measured once on this machine and cached.

Step latency depends on the model's shape, the dtype, the device, the world and the TP sizes,
not on the weights, so a profile measured for one run serves every later run of the same shape
here: it is cached under the cache root by a hash of exactly those. A run keeps the profile it
used as `<run_dir>/profile.json`, beside its length log, for `python -m
patrl.lenpredict.simulate`; a one-process run, which has nothing to fold, measures TP 1 for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from patrl.lenpredict import Profile
from patrl.orchestrator.distributed import World, all_gather_objects, barrier, broadcast_object
from patrl.rollout import EngineConfig
from patrl.rollout.profile import ProfileGrid, profile_distributed, profile_single, write_atomic

RUN_PROFILE = "profile.json"


def cache_root() -> Path:
    """$PATRL_CACHE_DIR, else ~/.cache/patrl (shared with the demo assets)."""
    env = os.environ.get("PATRL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "patrl"


def spec_query_lens(num_speculative_tokens: int) -> tuple[int, ...]:
    """The verify rows' query lengths for a job that drafts up to `num_speculative_tokens`
    tokens: one draft token, two, and the most it drafts (capped at 8), enough to fit the
    fixed and the per-token price of verifying (lenpredict's `verify_time`)."""
    longest = 1 + min(num_speculative_tokens, 8)
    return tuple(sorted({2, min(3, longest), longest}))


def job_grid(
    tp_sizes: tuple[int, ...],
    max_batch: int,
    max_model_len: int,
    query_lens: tuple[int, ...] = (),
) -> ProfileGrid:
    """A grid that spans the rollout's batch sizes and lengths, small enough for start-up;
    with `query_lens` (a speculating job) verify rows too, else the grid (and its cache key)
    is that of a job without speculation.

    Batches 2 and 3 are where a replica's tail runs, and where the planner prices staying
    against a fold; on a CPU each row there costs about as much as one more row, which a fit
    from batches 1 and 4 alone would misprice."""
    batches = sorted(
        {1, 2, 3, 4, 8, 16, *(b for b in (64, 256) if b <= max_batch), max(1, max_batch)}
    )
    contexts = sorted({c for c in (16, 64, max_model_len // 2) if c >= 8})
    grid = ProfileGrid(
        tp_sizes=tp_sizes,
        batch_sizes=tuple(batches),
        contexts=tuple(contexts),
        prefill_tokens=(16, 64, 256),
        collective_bytes=(4, 16384, 1 << 20),
        decode_steps=6,
        passes=2,
        warmup_steps=3,
        query_lens=query_lens,
    )
    return grid.fit_to(max_model_len)


# Bumped when the profiler measures something new, so cached profiles are measured again.
PROFILER_VERSION = 6


def profile_key(model_dir: str, engine: EngineConfig, world_size: int, grid: ProfileGrid) -> str:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shape = {
        k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"
    }
    identity = [
        shape,
        engine.dtype,
        engine.device,
        engine.tp_comm,  # the TP collectives' cost is in every tp > 1 row
        world_size,
        repr(grid),
        platform.machine(),
        PROFILER_VERSION,
    ]
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[
        :16
    ]


def ensure_profile(
    model_dir: str,
    engine: EngineConfig,
    world: World,
    grid: ProfileGrid,
    cache_root: Path,
) -> Path:
    """The cached profile for this job's shape, measured now (every rank takes part) unless the
    first rank has it; then written to every rank's own cache, which on several nodes need not
    be one filesystem. Every rank calls this and gets the same profile at its `path`."""
    path = cache_root / "profiles" / f"{profile_key(model_dir, engine, world.size, grid)}.json"
    have = all_gather_objects(world, path.exists())
    if all(have):
        return path
    text = None
    if have[0]:
        text = path.read_text() if world.is_first else None
    else:
        if world.is_first:
            print(f"profiling rollout latency for adaptive TP (once; cached at {path}) ...")
        start = time.perf_counter()
        if world.distributed:
            profile = profile_distributed(engine, grid, dist.group.WORLD, progress=world.is_first)
        else:
            profile = profile_single(engine, grid, progress=True)
        if profile is not None:
            text = profile.model_dump_json()
            print(f"profiled in {time.perf_counter() - start:.0f} s")
    text = broadcast_object(world, text)
    if not path.exists():
        write_atomic(Profile.model_validate_json(text), path)
    barrier(world)
    return path


def keep_run_profile(profile: str | Path, run_dir: Path, world: World) -> Path:
    """Copy the profile the run plans with to `<run_dir>/profile.json` (first rank; staged,
    then renamed), so the run's length log can be simulated against it."""
    dest = Path(run_dir) / RUN_PROFILE
    src = Path(profile)
    if world.is_first and not (dest.exists() and dest.resolve() == src.resolve()):
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
        os.close(fd)
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return dest
