"""`python -m patrl.trainer.reward_model`: train a Bradley-Terry reward model (see __init__).

One process, or `torchrun --nproc-per-node N -m patrl.trainer.reward_model ...` for FSDP2 over
N ranks. Every step and each epoch's held-out accuracy go to stdout and <output>/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

from patrl.trainer.hf_export import check_writable
from patrl.trainer.reward_model.bradley_terry import BradleyTerryTrainer, log_line
from patrl.trainer.reward_model.checks import load_tokenizer
from patrl.trainer.reward_model.preferences import PreferenceKeys, read_preferences, tokenize_pairs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m patrl.trainer.reward_model", description=__doc__)
    p.add_argument("--model", required=True, help="causal LM or sequence-classification HF dir")
    p.add_argument("--train-files", nargs="+", required=True, help=".jsonl/.parquet pairs")
    p.add_argument("--val-files", nargs="*", default=None, help="held-out pairs")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held out when no val files")
    p.add_argument("--output", required=True, help="directory to write the reward model to")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8, help="pairs per optimizer step")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-length", type=int, default=1024, help="tokens per sequence at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--chosen-key", default="chosen")
    p.add_argument("--rejected-key", default="rejected")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Train, evaluate after each epoch, save; returns the last held-out metrics."""
    args = parse_args(argv)
    check_args(args)
    keys = PreferenceKeys(args.prompt_key, args.chosen_key, args.rejected_key)
    train_rows = read_preferences(args.train_files, keys)
    val_rows = read_preferences(args.val_files, keys) if args.val_files else []
    tokenizer = load_tokenizer(args.model, "--model")
    if not val_rows:
        random.Random(args.seed).shuffle(train_rows)
        held = max(1, int(len(train_rows) * args.val_fraction))
        train_rows, val_rows = train_rows[held:], train_rows[:held]
    train = tokenize_pairs(train_rows, tokenizer, args.max_length, keys)
    val = tokenize_pairs(val_rows, tokenizer, args.max_length, keys)
    held_note = "" if args.val_files else f" (after holding out {len(val)} for validation)"
    size = step_batch(
        len(train), args.batch_size, int(os.environ.get("WORLD_SIZE", "1")), held_note
    )
    mesh, device = _distributed()
    trainer = BradleyTerryTrainer(
        args.model,
        mesh=mesh,
        device=device,
        lr=args.lr,
        weight_decay=args.weight_decay,
        seed=args.seed,
    )
    is_first = trainer.rank_and_size[0] == 0
    out = Path(args.output)
    metrics_file = out / "metrics.jsonl" if is_first else None
    if metrics_file is not None:
        out.mkdir(parents=True, exist_ok=True)
        metrics_file.unlink(missing_ok=True)
    step, held_out = 0, {}
    for epoch in range(args.epochs):
        order = list(range(len(train)))
        random.Random(args.seed + epoch).shuffle(order)
        for start in range(0, len(order) - size + 1, size):
            step += 1
            m = trainer.train_step([train[i] for i in order[start : start + size]])
            if is_first:
                log_line(
                    metrics_file,
                    {"step": step, "train/loss": m["loss"], "train/accuracy": m["accuracy"]},
                )
        held_out = trainer.evaluate(val)
        if is_first:
            log_line(
                metrics_file,
                {
                    "epoch": epoch + 1,
                    "val/loss": held_out["loss"],
                    "val/accuracy": held_out["accuracy"],
                },
            )
    trainer.save(out, tokenizer)
    if mesh is not None:
        torch.distributed.destroy_process_group()
    return held_out


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the first flag whose value cannot make a trained model, before any
    file is read."""
    if args.epochs < 1:
        raise ValueError(
            f"--epochs {args.epochs}: accepted 1 or more (0 would save the model untrained)"
        )
    if not 0 <= args.val_fraction < 1:
        raise ValueError(
            f"--val-fraction {args.val_fraction}: the share of the pairs held out, accepted "
            "0 <= f < 1 (or give --val-files)"
        )
    if not math.isfinite(args.lr) or args.lr <= 0:
        raise ValueError(f"--lr {args.lr}: accepted a finite number above 0")
    if not math.isfinite(args.weight_decay) or args.weight_decay < 0:
        raise ValueError(f"--weight-decay {args.weight_decay}: accepted a finite number >= 0")
    if args.max_length < 1:
        raise ValueError(f"--max-length {args.max_length}: accepted 1 or more tokens")
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output {args.output}: exists and is not a directory")
    check_writable(out, "--output")


def step_batch(num_pairs: int, batch_size: int, world_size: int, held_note: str = "") -> int:
    """The pairs of one optimizer step: `batch_size` rounded down to a multiple of
    `world_size` (every rank takes the same number). ValueError naming the numbers where a
    rank would get no pair, or an epoch of `num_pairs` would hold no step (the model would be
    saved untrained); `held_note` says how `num_pairs` was reached."""
    if batch_size < 1:
        raise ValueError(f"--batch-size {batch_size}: pairs per step, accepted 1 or more")
    size = batch_size - batch_size % world_size
    if size == 0:
        raise ValueError(
            f"--batch-size {batch_size} on {world_size} ranks gives each rank no pair per step "
            f"(the batch is split evenly over the ranks); use --batch-size {world_size} or a "
            f"multiple of it"
        )
    if num_pairs == 0:
        raise ValueError(
            f"no training pairs{held_note}: give more pairs, or hold fewer out "
            "(--val-fraction, or --val-files)"
        )
    if num_pairs < size:
        on = f" on {world_size} ranks" if world_size > 1 else ""
        raise ValueError(
            f"{num_pairs} training pairs{held_note} and --batch-size {batch_size}{on} make "
            f"no training step (a step takes {size} pairs), so the model would be saved "
            f"untrained; lower --batch-size to at most {num_pairs}"
            + (f" (a multiple of {world_size})" if world_size > 1 else "")
            + ", or give more pairs"
        )
    return size


def cli(argv: Sequence[str] | None = None) -> int:
    """`main` as a command: bad input is one line on stderr and exit code 2."""
    try:
        main(argv)
    except ValueError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"patrl: error: {err}", file=sys.stderr)
        return 2
    return 0


def _distributed() -> tuple[DeviceMesh | None, torch.device]:
    """(mesh, device) under torchrun (WORLD_SIZE > 1), else (None, cuda or cpu)."""
    cuda = torch.cuda.is_available()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None, torch.device("cuda" if cuda else "cpu")
    from torch.distributed.device_mesh import init_device_mesh

    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    return init_device_mesh(device.type, (torch.distributed.get_world_size(),)), device


if __name__ == "__main__":
    sys.exit(cli())
