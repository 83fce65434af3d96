"""Live reconfiguration cost (issue 6): (dp2, tp1) -> (dp1, tp2) and back, on 2 gloo ranks.

    python benchmarks/reconfig_bench.py [--repeats 3] [--seqs 1 8 32] [--contexts 1 4 ... 1024]

Model: a random-init Llama of ~124M parameters (hidden 768, 12 layers, 12 heads, 4 KV heads,
intermediate 2048, vocab 32000, untied head), fp32, saved once under --model-dir.
For each cell (unfinished sequences N; context C tokens each), the two replicas (one rank each)
are given N sequences in total, imported with C tokens of random KV (the content does not change
the cost of moving it), then:
- migrate, median of --repeats: `reconfigure(engine, 2, "migrate")`, its report split into
  weights / cache (the new layout's KV pool) / kv (the head exchange) / other (the export, the
  state exchange and the import); then the reverse, (dp1, tp2) -> (dp2, tp1) with migrate,
  which gathers weights and KV heads;
- recompute: `reconfigure(engine, 2, "recompute")` plus the engine steps until every sequence is
  running again (the prefill of prompt + generated tokens at tp 2), median of --repeats, or of
  1 run where the first prefill took more than --slow-prefill-s; a cell whose prefill would take
  more than --max-prefill-s (by the per-sequence prefill time measured at the same context
  with fewer sequences in this run) is not run but *estimated* from that rate, and labelled so;
- restart: building a fresh Engine at tp 2 from the checkpoint (the teardown-and-reload
  alternative; the checkpoint is in the page cache, so a lower bound on a real restart) plus
  the re-prefill of every sequence (a restart loses the KV): the recompute cell's prefill.
The crossover, per sequence count, is the context at which recompute stops being cheaper than
migrate, comparing their KV cost (total minus weights and cache: what depends on the policy),
interpolated linearly in C between the measured contexts.
Results: benchmarks/results/reconfig_bench.json (or --out); a table is printed. With --before
(a JSON written by this script from the code before a change, e.g. with --migrate-only), the
migrate breakdown is printed beside it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from patrl.kvstore import SequenceKV
from patrl.rollout.adaptive import ReconfigReport, reconfigure
from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.outputs import SequenceState
from patrl.rollout.sampler import SamplingParams, export_generator, make_generator
from patrl.tpreshard import GroupCache
from patrl_testkit.models import save_tiny_model
from patrl_testkit.multirank import run_ranks

SEQS = (1, 8, 32)
CONTEXTS = (1, 4, 16, 32, 64, 256, 1024)
BLOCK = 16
PARTS = ("weights", "cache", "kv", "other")
MODEL: dict[str, Any] = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def build_model(model_dir: Path) -> Path:
    """The kit's plain Llama at MODEL's sizes (seed 0), kept once built."""
    if not (model_dir / "config.json").is_file():
        save_tiny_model(model_dir, "llama", "plain", **MODEL)
    return model_dir


def _config(model_dir: str) -> EngineConfig:
    # Room for 32 sequences of 1024 tokens on one replica, plus their next blocks.
    blocks = 32 * (1024 // BLOCK + 2) + 16
    return EngineConfig(model=model_dir, block_size=BLOCK, num_kv_blocks=blocks, max_model_len=2048)


def _states(engine: Engine, count: int, context: int, tag: str) -> list[SequenceState]:
    spec = engine.cache.spec
    total = engine.model.config.num_kv_heads
    g = torch.Generator().manual_seed(context + count)
    out = []
    for i in range(count):
        prompt = torch.randint(0, 32000, (context,), generator=g).tolist()
        shape = (spec.num_layers, context, spec.num_kv_heads, spec.head_dim)
        kv = SequenceKV(tuple(prompt), torch.randn(shape), torch.randn(shape), 0, total)
        out.append(
            SequenceState(
                request_id=f"{tag}-{i}",
                sample_index=0,
                prompt_token_ids=prompt,
                output_token_ids=[1],
                output_logprobs=[0.0],
                params=SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True),
                generator_state=export_generator(make_generator(i)),
                kv=kv,
            )
        )
    return out


def _clear(engine: Engine) -> None:
    for rid in engine.request_ids():
        engine.abort(rid)
    engine.step()  # collects the aborted requests


def _until_running(engine: Engine) -> float:
    start = time.perf_counter()
    sched = engine.scheduler
    while sched.waiting or sched.prefilling is not None:
        engine.step()
    return time.perf_counter() - start


def _parts(report: ReconfigReport, extra_kv_s: float = 0.0) -> dict[str, float]:
    total = report.total_s + extra_kv_s
    known = report.weights_s + report.cache_s + report.kv_s + extra_kv_s
    return {
        "total": total,
        "weights": report.weights_s,
        "cache": report.cache_s,
        "kv": report.kv_s + extra_kv_s,
        "other": total - known,  # export + state exchange (groups_s) + import
    }


def _world_max(value: float, group: Any) -> float:
    """The slowest rank's value: every rank takes the same repeat/estimate decisions."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _migrate_runs(
    engine: Engine, mine: int, context: int, tag: str, repeats: int
) -> tuple[dict[str, float], dict[str, Any]]:
    runs: dict[str, list[float]] = {}
    info: dict[str, Any] = {}
    for rep in range(repeats):
        engine.import_requests(_states(engine, mine, context, f"{tag}.{rep}"))
        report = reconfigure(engine, 2, "migrate")
        back = reconfigure(engine, 1, "migrate")
        _clear(engine)
        for part, value in _parts(report).items():
            runs.setdefault(f"migrate_{part}_s", []).append(value)
        for part, value in _parts(back).items():
            runs.setdefault(f"reverse_{part}_s", []).append(value)
        info.update(
            kv_bytes_moved=report.kv_bytes_sent + report.kv_bytes_received,
            reverse_kv_bytes_moved=back.kv_bytes_sent + back.kv_bytes_received,
            weight_bytes_received_grow=report.weight_bytes_received,
            weight_bytes_received_shrink=back.weight_bytes_received,
            weight_peak_bytes_shrink=back.weight_peak_bytes,
            weight_bytes_tp1=back.weight_bytes_after,
            weight_bytes_tp2=back.weight_bytes_before,
        )
    return {k: statistics.median(v) for k, v in runs.items()}, info


def _recompute_runs(
    engine: Engine, mine: int, context: int, tag: str, repeats: int, slow_s: float, world: Any
) -> dict[str, Any]:
    runs: dict[str, list[float]] = {}
    out: dict[str, Any] = {}
    for rep in range(repeats):
        engine.import_requests(_states(engine, mine, context, f"{tag}.rc{rep}"))
        report = reconfigure(engine, 2, "recompute")
        prefill = _world_max(_until_running(engine), world)
        _clear(engine)
        reconfigure(engine, 1, "migrate")
        for part, value in _parts(report, prefill).items():
            runs.setdefault(f"recompute_{part}_s", []).append(value)
        runs.setdefault("recompute_prefill_s", []).append(prefill)
        out["tokens_recomputed"] = report.tokens_recomputed
        if prefill > slow_s:
            break  # a slow prefill is measured once
    out.update({k: statistics.median(v) for k, v in runs.items()})
    out["recompute_repeats"] = len(runs["recompute_prefill_s"])
    return out


def _body(rank: int, world_size: int, model_dir: str, opts: dict[str, Any]) -> Any:
    torch.set_num_threads(1)
    groups = GroupCache([1, 2], world_size=world_size, rank=rank)
    world = groups.world_group()
    start = time.perf_counter()
    engine = Engine(_config(model_dir), groups.layout(1), groups)
    first_load_s = time.perf_counter() - start
    params = sum(p.numel() for p in engine.model.parameters())
    cells = []
    per_seq_prefill: dict[int, float] = {}  # context -> prefill seconds per sequence, measured
    for context in opts["contexts"]:
        for count in opts["seqs"]:
            mine = count // 2 + (count % 2 if rank == 0 else 0)
            tag = f"r{rank}.{count}.{context}"
            medians, info = _migrate_runs(engine, mine, context, tag, opts["repeats"])
            cell: dict[str, Any] = {"seqs": count, "context": context, **medians, **info}
            if not opts["migrate_only"]:
                rate = per_seq_prefill.get(context)
                if rate is not None and rate * count > opts["max_prefill_s"]:
                    cell["recompute_prefill_s"] = rate * count
                    cell["recompute_prefill_estimated"] = True
                else:
                    rc = _recompute_runs(
                        engine, mine, context, tag, opts["repeats"], opts["slow_s"], world
                    )
                    cell.update(rc, recompute_prefill_estimated=False)
                    per_seq_prefill[context] = rc["recompute_prefill_s"] / count
            cells.append(cell)
    restarts = []
    for _ in range(max(5, opts["repeats"])):  # cheap, and every small cell's ratio rests on it
        start = time.perf_counter()
        fresh = Engine(_config(model_dir), groups.layout(2), groups)
        restarts.append(time.perf_counter() - start)
        del fresh
    return {
        "rank": rank,
        "params": params,
        "first_load_s": first_load_s,
        "restart_load_s": statistics.median(restarts),
        "cells": cells,
    }


def _kv_cost(cell: dict[str, Any], policy: str) -> float | None:
    """What the policy costs beyond the weights and the cache, which both policies pay."""
    if f"{policy}_total_s" not in cell:
        return None
    return cell[f"{policy}_total_s"] - cell[f"{policy}_weights_s"] - cell[f"{policy}_cache_s"]


def crossover(cells: list[dict[str, Any]], seqs: int) -> dict[str, Any]:
    """Context where recompute's KV cost minus migrate's changes sign (linear in C), if seen."""
    rows = sorted(
        (c for c in cells if c["seqs"] == seqs and _kv_cost(c, "recompute") is not None),
        key=lambda c: c["context"],
    )
    diffs = [(c["context"], _kv_cost(c, "recompute") - _kv_cost(c, "migrate")) for c in rows]  # type: ignore[operator]
    if not diffs:
        return {"context": None, "note": "no measured recompute cell"}
    if diffs[0][1] > 0:
        return {"context": None, "note": f"recompute dearer already at {diffs[0][0]} tokens"}
    for (c0, d0), (c1, d1) in itertools.pairwise(diffs):
        if d0 <= 0 < d1:
            return {"context": c0 + (c1 - c0) * (-d0) / (d1 - d0), "note": "interpolated"}
    return {"context": None, "note": f"recompute cheaper up to {diffs[-1][0]} tokens"}


def _fmt(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _complete(cells: list[dict[str, Any]], restart_load_s: float) -> None:
    for c in cells:
        prefill = c.get("recompute_prefill_s")
        c["restart_s"] = None if prefill is None else restart_load_s + prefill
        c["restart_estimated"] = bool(c.get("recompute_prefill_estimated"))
        c["restart_over_migrate"] = (
            None if c["restart_s"] is None else c["restart_s"] / c["migrate_total_s"]
        )


def _print_table(result: dict[str, Any]) -> None:
    print(
        f"model: {result['params'] / 1e6:.0f}M params fp32; restart load (fresh engine at tp2): "
        f"{result['restart_load_s']:.2f}s (rank 0, median of {max(5, result['repeats'])})"
    )
    print(
        "seqs  ctx | migrate s (weights / cache / kv / other) | reverse s (w / kv) | KV MB |"
        " recompute s (prefill) | restart s | restart/migrate"
    )
    for c in result["cells"]:
        est = " est" if c.get("restart_estimated") else ""
        rc = c.get("recompute_total_s")
        rc_txt = f"{_fmt(rc, 3)} ({_fmt(c.get('recompute_prefill_s'), 3)}{est})"
        print(
            f"{c['seqs']:4d} {c['context']:4d} | {c['migrate_total_s']:.3f} ("
            + " / ".join(f"{c[f'migrate_{p}_s']:.3f}" for p in PARTS)
            + f") | {c['reverse_total_s']:.3f} ({c['reverse_weights_s']:.3f} / "
            f"{c['reverse_kv_s']:.3f}) | {c['kv_bytes_moved'] / 1e6:6.1f} | {rc_txt} | "
            f"{_fmt(c.get('restart_s'), 2)}{est} | {_fmt(c.get('restart_over_migrate'), 1)}{est}"
        )
    print("crossover (recompute stops being cheaper):", json.dumps(result["crossover_context"]))


def _print_before_after(before: dict[str, Any], after: dict[str, Any]) -> None:
    print("migrate (dp2,tp1)->(dp1,tp2), medians, s: before -> after (after/before)")
    print("seqs  ctx | " + " | ".join(f"{p:>22s}" for p in ("total", *PARTS)))
    old = {(c["seqs"], c["context"]): c for c in before["cells"]}
    for c in after["cells"]:
        b = old.get((c["seqs"], c["context"]))
        if b is None:
            continue
        cols = []
        for p in ("total", *PARTS):
            x, y = b.get(f"migrate_{p}_s"), c[f"migrate_{p}_s"]
            ratio = "" if not x else f" ({y / x:.2f})"
            cols.append(f"{_fmt(x, 3)} -> {y:.3f}{ratio}".rjust(22))
        print(f"{c['seqs']:4d} {c['context']:4d} | " + " | ".join(cols))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seqs", type=int, nargs="+", default=list(SEQS))
    ap.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    ap.add_argument("--slow-prefill-s", type=float, default=30.0)
    ap.add_argument("--max-prefill-s", type=float, default=240.0)
    ap.add_argument("--migrate-only", action="store_true")
    ap.add_argument("--before", type=Path, default=None)
    ap.add_argument("--label", default="")
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "reconfig_bench.json"
    )
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "patrl_reconfig_124m"))
    args = ap.parse_args()
    model_dir = build_model(Path(args.model_dir))
    opts = {
        "repeats": args.repeats,
        "seqs": sorted(args.seqs),
        "contexts": sorted(args.contexts),
        "slow_s": args.slow_prefill_s,
        "max_prefill_s": args.max_prefill_s,
        "migrate_only": args.migrate_only,
    }
    load_before = os.getloadavg()
    start = time.perf_counter()
    per_rank = run_ranks(_body, 2, args=(str(model_dir), opts), timeout_s=3000)
    r0 = per_rank[0]
    cells = r0["cells"]
    _complete(cells, r0["restart_load_s"])
    result = {
        "label": args.label,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, gloo, 1 thread per rank",
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "wall_s": time.perf_counter() - start,
        "params": r0["params"],
        "repeats": args.repeats,
        "repeats_note": (
            "medians of `repeats` runs; recompute cells whose first prefill took more than "
            f"{args.slow_prefill_s} s ran once (recompute_repeats); cells with "
            "recompute_prefill_estimated=true were not run: prefill = the per-sequence prefill "
            "time measured at that context with fewer sequences x seqs"
        ),
        "restart_load_s": r0["restart_load_s"],
        "first_load_s": r0["first_load_s"],
        "cells": cells,
        "crossover_context": {str(n): crossover(cells, n) for n in opts["seqs"]},
    }
    if args.before is not None:
        result["before"] = json.loads(args.before.read_text())
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    _print_table(result)
    if args.before is not None:
        _print_before_after(result["before"], result)
    print(f"load average before {load_before}, after {result['loadavg_after']}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
