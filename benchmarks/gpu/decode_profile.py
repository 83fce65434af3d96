"""Where a decode step's time goes on a device: the Llama-1B-shaped engine of
gpu_engine_bench.py (triton or sdpa, CUDA graphs on), per batch size: decode tokens/s greedy and
with seeded sampling, each step's wall time (median), and a torch.profiler table of the
host-side ops of a few steps (self CPU time) beside the device time they launched. "mixed":
a batch whose requests take greedy, tempered, top-p, top-k and unseeded params in turn (the
top-k / top-p rows are sampled on the host).

    python benchmarks/gpu/decode_profile.py [--batches 1,64] [--steps 48] [--tiny] [--device cpu]

JSON to --out (default benchmarks/results/decode_profile.json); the tables print.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_engine_bench import LLAMA_1B, TINY, make_engine, prompts, save_model, sync

from patrl.rollout import Engine, SamplingParams


def mixed_params(max_tokens: int) -> list[SamplingParams]:
    """A mixed batch's params, taken in turn by its requests: greedy, tempered, top-p,
    top-k, top-k with top-p, unseeded."""
    kw: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True}
    return [
        SamplingParams(temperature=0, **kw),
        SamplingParams(temperature=0.8, seed=1, **kw),
        SamplingParams(temperature=1.0, top_p=0.9, seed=2, **kw),
        SamplingParams(temperature=0.7, top_k=20, seed=3, **kw),
        SamplingParams(temperature=0.6, top_k=50, top_p=0.8, seed=4, **kw),
        SamplingParams(temperature=1.0, **kw),
    ]


def decode(
    engine: Engine,
    batch: list[list[int]],
    steps: int,
    params: SamplingParams | list[SamplingParams],
) -> dict:
    """Prefill `batch` (request i with `params`, or its i-th entry in turn), then time `steps`
    decode steps one by one; tokens/s and step times."""
    kinds = params if isinstance(params, list) else [params]
    for i, p in enumerate(batch):
        engine.add_request(p, kinds[i % len(kinds)])
    decodes = engine.counters.decode_steps
    while engine.counters.decode_steps == decodes:
        engine.step()
    sync(engine.device)
    times = []
    t0 = time.perf_counter()
    for _ in range(steps):
        s = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - s)
    sync(engine.device)
    elapsed = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    return {
        "tok_s": len(batch) * steps / elapsed,
        "step_ms_median": 1e3 * statistics.median(times),
        "step_ms_min": 1e3 * min(times),
    }


def profiled(engine: Engine, batch: list[list[int]], steps: int, device: torch.device) -> str:
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=steps + 8, ignore_eos=True)
    for p in batch:
        engine.add_request(p, params)
    for _ in range(4):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    while engine.has_unfinished():
        engine.step()
    return prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_profile.json"))
    args = ap.parse_args()
    device = torch.device(args.device)
    shape = TINY if args.tiny else LLAMA_1B
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(shape, torch.bfloat16, Path(tmp))
        engine = make_engine(model_dir, device, args.backend, device.type == "cuda", batches, args)
        for b in batches:
            batch = prompts(b, args.prompt_len, shape["vocab_size"], seed=b)
            row: dict[str, Any] = {"batch": b}
            for name, params in (
                (
                    "greedy",
                    SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True),
                ),
                (
                    "seeded",
                    SamplingParams(
                        temperature=1.0, seed=0, max_tokens=args.steps + 2, ignore_eos=True
                    ),
                ),
                (
                    "unseeded",
                    SamplingParams(temperature=1.0, max_tokens=args.steps + 2, ignore_eos=True),
                ),
                ("mixed", mixed_params(args.steps + 2)),
            ):
                decode(engine, batch, 8, params)  # warm: graphs captured, kernels compiled
                row[name] = decode(engine, batch, args.steps, params)
            print(json.dumps(row), flush=True)
            print(profiled(engine, batch, 16, device), flush=True)
            rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    info = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "backend": args.backend,
        "rows": rows,
    }
    args.out.write_text(json.dumps(info, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
