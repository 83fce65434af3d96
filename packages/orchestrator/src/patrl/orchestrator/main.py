"""`python -m patrl.orchestrator [--config FILE] [--dry-run] [key=value ...]`, also under torchrun.

Bad input (configuration, model, data, layout, resume checkpoint: preflight.py) fails on every
rank, naming the culprit, before any process group is joined or anything is written;
`--dry-run` runs the same checks and prints the resolved config. verl's key paths are accepted
(verl_keys.py), and verl's Hydra `--config-path DIR --config-name NAME` file is read as overrides
before the command line's; the first rank prints a note for each key that has no effect here. A rank that dies (even by
SIGKILL) takes the job down, and torchrun names the rank that failed first; with
`--max-restarts N` the workers restart and resume from the newest complete checkpoint
(`trainer.resume_mode=auto`), losing at most the step in progress. A run whose checkpoint is
already at `trainer.total_training_steps` says so and exits 0 without building anything.

Arguments are parsed before torch and the loops are imported, so `--help` and a malformed
command line answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from patrl.orchestrator.config import JobConfig
    from patrl.orchestrator.distributed import World


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="patrl",
        description="GRPO with adaptive-TP rollouts. Overrides are dotted keys: rollout.n=8 "
        "data.train_batch_size=16 actor.optim.lr=1e-5",
    )
    parser.add_argument(
        "--config", help="YAML file with the job's sections (data, rollout, actor, ...)"
    )
    parser.add_argument(
        "--config-path",
        help="verl's (Hydra's) config directory; with --config-name, that YAML's keys are "
        "read as overrides before the command line's",
    )
    parser.add_argument("--config-name", help="verl's (Hydra's) config name in --config-path")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config, model, data, layout and resume checkpoint; print the config",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, default_config: str | None = None) -> int:
    args = parse_args(argv)
    from patrl.orchestrator import preflight
    from patrl.orchestrator.config import ConfigError, dump_config
    from patrl.orchestrator.distributed import close_world, init_world
    from patrl.orchestrator.run import completed

    rank = int(os.environ.get("RANK", "0"))
    notices: list[str] = []
    try:
        overrides = [*hydra_overrides(args.config_path, args.config_name), *args.overrides]
        config = preflight.load(args.config or default_config, overrides, notices)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        config = preflight.check(config, world_size, local)
    except ConfigError as err:
        if rank == 0:
            print(f"patrl: {err}", file=sys.stderr)
        return 2
    if rank == 0:
        for note in notices:
            print(f"patrl: note: {note}", file=sys.stderr)
    if args.dry_run:
        if rank == 0:
            print(dump_config(config), end="")
        return 0
    if (done := completed(config)) is not None:
        if rank == 0:
            print(done, flush=True)
        return 0
    if rank == 0 and (hazard := restart_hazard(os.environ)):
        print(f"patrl: warning: {hazard}", file=sys.stderr, flush=True)
    # torchrun stops its workers with SIGTERM (on Ctrl-C, or when another rank failed):
    # unwound like Ctrl-C, so what the rank holds is released and rank 0 says where to resume.
    with stop_signals():
        world = init_world()
        code = run_and_report(config, world)
    if code == 0:
        close_world(world)
    return code


HYDRA_DEFAULTS = ("ppo_trainer", "_self_")  # verl's defaults list, which patrl's defaults are


def hydra_overrides(config_path: str | None, config_name: str | None) -> list[str]:
    """verl's `--config-path DIR --config-name NAME` (a Hydra config on top of verl's
    ppo_trainer defaults) as `key=value` overrides, one per setting of DIR/NAME(.yaml), in
    the file's order; Hydra's own `hydra:` section is not read. A defaults list naming
    anything but ppo_trainer and _self_, or a missing file, is a ConfigError naming it."""
    import json

    import yaml

    from patrl.orchestrator.config import ConfigError

    if config_path is None and config_name is None:
        return []
    if config_path is None or config_name is None:
        raise ConfigError("--config-path and --config-name go together (verl's Hydra config)")
    path = Path(config_path) / config_name
    if path.suffix not in (".yaml", ".yml"):
        path = path.with_name(path.name + ".yaml")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except OSError as err:
        raise ConfigError(f"--config-path/--config-name: {str(path)!r}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    tree.pop("hydra", None)
    defaults = tree.pop("defaults", list(HYDRA_DEFAULTS))
    other = [d for d in defaults or [] if d not in HYDRA_DEFAULTS]
    if other:
        raise ConfigError(
            f"{path}: defaults {other} are not verl's ppo_trainer config; patrl's defaults are "
            f"verl's ppo_trainer, so the accepted defaults are {list(HYDRA_DEFAULTS)}"
        )

    def leaves(node: dict[str, Any], prefix: str) -> Iterator[str]:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}={json.dumps(value)}"

    return list(leaves(tree, ""))


def run_and_report(config: JobConfig, world: World) -> int:
    """Run the job on this rank; the exit code, with what went wrong said once: a JobError in
    one line, a stop as where to resume, anything else as this rank's traceback."""
    from patrl.orchestrator.errors import JobError
    from patrl.orchestrator.watchdog import start_watchdog
    from patrl.trainer import NonFiniteError

    watchdog = start_watchdog(world.rank, world.size, config.trainer.heartbeat_timeout_s)
    try:
        with run_dir_lock(config, world):
            run(config, world)
    except (JobError, NonFiniteError) as err:
        if not getattr(err, "collective", True):
            print(f"patrl: rank {world.rank}: {err}", file=sys.stderr, flush=True)
        elif world.is_first:
            print(f"patrl: {err}", file=sys.stderr, flush=True)
        return 1
    except BaseException as err:
        # A stop signal reaches every rank at once, and a rank blocked in a collective may see
        # its peer leave before its own signal is handled: a failure with a stop signal close
        # behind it is that stop, not a fault to report.
        if isinstance(err, KeyboardInterrupt) or _stopped_within(STOP_GRACE_S):
            if world.is_first:
                print(f"patrl: {stopped_message(config)}", file=sys.stderr, flush=True)
            return 130
        # Say which rank failed; torchrun then stops the others. A peer's death surfaces here
        # as a connection error on the survivors: that is a consequence, not the cause.
        consequence = (
            " (if another rank died first, this is the consequence: torchrun's summary names "
            "the first failure)"
            if world.distributed
            else ""
        )
        print(
            f"[rank {world.rank}] patrl failed{consequence}:\n{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    finally:
        if watchdog is not None:
            watchdog.stop()
    return 0


@contextlib.contextmanager
def run_dir_lock(config: JobConfig, world: World) -> Iterator[None]:
    """The run directory's lock (run_lock.py), taken by the first rank; a refusal is raised on
    every rank alike (JobError), before any of them writes. The directories the lock made are
    removed again if the run left them empty (it failed before writing anything)."""
    from patrl.orchestrator.distributed import broadcast_object
    from patrl.orchestrator.errors import JobError
    from patrl.orchestrator.run_lock import RunDirLock

    lock, refused = None, None
    made = _missing_dirs(config.run_dir) if world.is_first else []
    if world.is_first:
        try:
            lock = RunDirLock(config.run_dir).acquire()
        except JobError as err:
            refused = str(err)
    refused = broadcast_object(world, refused)
    if refused is not None:
        raise JobError(refused)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
            _remove_empty(made)


def _missing_dirs(path: Path) -> list[Path]:
    """`path` and each of its ancestors that does not exist yet, deepest first."""
    missing = []
    path = path.absolute()
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_empty(dirs: list[Path]) -> None:
    """Remove each of `dirs` (deepest first) that is an empty directory; stop at the first
    that is not (it holds what the run wrote)."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return


# The stop signals this process received (SIGINT, SIGTERM), in order.
_STOPS: list[int] = []
STOP_GRACE_S = 1.0


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGINT and SIGTERM handled by `_stop_signal` inside the block (the main thread only);
    the previous handlers and a clean record afterwards."""
    _STOPS.clear()
    previous = {sig: signal.signal(sig, _stop_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_signal(signum: int, frame: object) -> None:
    """Ctrl-C (SIGINT) and torchrun's stop (SIGTERM): recorded, and raised in the main thread
    as KeyboardInterrupt the first time, so that what the rank holds is released."""
    _STOPS.append(signum)
    if len(_STOPS) == 1:
        raise KeyboardInterrupt


def _stopped_within(seconds: float) -> bool:
    """Whether a stop signal came, or comes within `seconds` (it may still be on its way)."""
    deadline = time.monotonic() + seconds
    try:
        while not _STOPS and time.monotonic() < deadline:
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass  # the signal landed here
    return bool(_STOPS)


def stopped_message(config: JobConfig) -> str:
    """What a user whose run was stopped needs: why, and where it resumes."""
    from patrl.orchestrator import run_checkpoint

    how = (
        "terminated (SIGTERM: Ctrl-C on torchrun, or another rank failed and torchrun stopped "
        "the rest; its summary names the first failure)"
        if signal.SIGTERM in _STOPS
        else "interrupted (Ctrl-C)"
    )
    newest = run_checkpoint.latest_checkpoint(config.run_dir)
    if newest is None:
        return f"{how}, before the first checkpoint of {config.run_dir}"
    return (
        f"{how}; the newest checkpoint is {newest}: the same command resumes from it "
        "(trainer.resume_mode=auto)"
    )


def restart_hazard(env: Mapping[str, str]) -> str | None:
    """Why torchrun's worker restarts may fail to rejoin in this environment, or None.

    torch's c10d rendezvous hands every attempt the same store, and the process group's keys in
    it carry no attempt number: a restarted worker can read the dead attempt's addresses (and
    the async schedule its control keys) and fail to connect or hang. On one node `init_world`
    prefixes the keys with the attempt number; across nodes the attempt numbers can differ."""
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts == 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if env.get("GROUP_WORLD_SIZE", "1") == "1":
        return None  # one node: init_world keeps each attempt's keys apart
    return (
        f"torchrun --max-restarts {restarts} with the rendezvous store shared across restarts "
        "(torch's default): restarted workers can read the dead attempt's addresses from it and "
        "fail to connect or hang; launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for a store "
        "per attempt"
    )


def run(config: JobConfig, world: World) -> Any:
    model_dir, train_files, val_files = resolve_assets(config, world)
    if config.trainer.mode == "async":
        from patrl.orchestrator.async_loop import AsyncSchedule

        timeout = config.async_rl.peer_timeout_s
        return AsyncSchedule(config, world, model_dir, train_files, val_files, timeout).run()
    from patrl.orchestrator.sync_loop import SyncSchedule

    loop = SyncSchedule(config, world, model_dir, train_files, val_files)
    return loop.run()


def resolve_assets(config: JobConfig, world: World) -> tuple[str, Any, Any]:
    """The model and data to use; the demo task (its installed provider: `demo_provider`)
    fills in whatever is not given."""
    from patrl.orchestrator import preflight
    from patrl.orchestrator.distributed import barrier

    demo = None
    if preflight.uses_demo(config):
        # Every rank asks; a file lock lets one build while the others wait on the lock (not on
        # a collective, whose timeout a slow first build on a busy machine could exceed).
        demo = preflight.demo_provider_for(config).ensure_assets(progress=world.is_first)
        barrier(world)
    model, train, val = preflight.choose_assets(config, demo)
    assert model is not None  # given, or the demo's
    return model, train, val
