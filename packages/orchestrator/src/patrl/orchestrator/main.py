"""`python -m patrl.orchestrator [--config FILE] [--dry-run] [key=value ...]`, also under torchrun.

Configuration errors are reported on every rank before any process group is joined, so a typo
fails in a second with the key named, not after minutes of start-up.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from patrl.orchestrator.config import ConfigError, JobConfig, dump_config, load_config
from patrl.orchestrator.distributed import World, barrier, close_world, init_world


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="patrl",
        description="GRPO with adaptive-TP rollouts. Overrides are dotted keys: rollout.n=8 "
        "data.train_batch_size=16 actor.optim.lr=1e-5",
    )
    parser.add_argument(
        "--config", help="YAML file with the job's sections (data, rollout, actor, ...)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, default_config: str | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        config = load_config(args.config or default_config, args.overrides)
    except (ConfigError, OSError) as err:
        if rank == 0:
            print(f"patrl: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        if rank == 0:
            print(dump_config(config), end="")
        return 0
    world = init_world()
    try:
        run(config, world)
    except BaseException:
        # Say which rank failed; torchrun then stops the others.
        print(
            f"[rank {world.rank}] patrl failed:\n{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    close_world(world)
    return 0


def run(config: JobConfig, world: World) -> Any:
    from patrl.orchestrator.sync_loop import SyncGRPO

    model_dir, train_files, val_files = resolve_assets(config, world)
    loop = SyncGRPO(config, world, model_dir, train_files, val_files)
    return loop.run()


def resolve_assets(config: JobConfig, world: World) -> tuple[str, Any, Any]:
    """The model and data to use; the embedded demo task fills in whatever is not given."""
    model, train, val = config.model.path, config.data.train_files, config.data.val_files
    if model is not None and train is not None:
        return model, train, val
    from patrl.orchestrator.demo import ensure_demo_assets

    # Every rank asks; a file lock lets one build while the others wait on the lock (not on a
    # collective, whose timeout a slow first build on a busy machine could exceed).
    assets = ensure_demo_assets(progress=world.is_first)
    barrier(world)
    return (
        model or str(assets.model_dir),
        train if train is not None else str(assets.train_file),
        val if val is not None or train is not None else str(assets.val_file),
    )
