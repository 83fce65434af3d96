"""Live reconfiguration cost (issue 6): (dp2, tp1) -> (dp1, tp2) and back, on 2 gloo ranks.

    python benchmarks/reconfig_bench.py [--repeats 3] [--max-recompute-tokens 8192]

Model: a random-init Llama of ~124M parameters (hidden 768, 12 layers, 12 heads, 4 KV heads,
intermediate 2048, vocab 32000, untied head), fp32, saved once under --model-dir.
For each cell (unfinished sequences N in 1, 8, 32; context C in 256, 1024 tokens), the two
replicas (one rank each) are given N sequences in total, imported with C tokens of random KV
(the content does not change the cost of moving it), then, median of --repeats runs each:
- migrate: `Engine.reconfigure(2, "migrate")`; its report's weights / KV / total times and bytes;
- recompute: `reconfigure(2, "recompute")` plus the engine steps until every sequence is
  running again (the prefill of prompt + generated tokens at tp 2); measured only where
  N * C <= --max-recompute-tokens (a 32 x 1024 prefill takes minutes on this box), else null;
- the reverse, (dp1, tp2) -> (dp2, tp1) with migrate, which gathers weights and KV heads;
- restart: building a fresh Engine at tp 2 from the checkpoint (the teardown-and-reload
  alternative; the checkpoint is in the page cache, so this is a lower bound on a real restart)
  plus, where measured, the re-prefill of every sequence (a restart loses the KV).
The crossover is the context length per sequence at which a measured recompute stops being
cheaper than a measured migrate, interpolated linearly in C from the measured cells.
Results: benchmarks/results/reconfig_bench.json; a table is printed.
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import itertools

from multirank import run_ranks

from patrl.kvstore import SequenceKV
from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.outputs import SequenceState
from patrl.rollout.sampler import SamplingParams, export_generator, make_generator
from patrl.tpreshard import GroupCache

SEQS = (1, 8, 32)
CONTEXTS = (256, 1024)
BLOCK = 16


def build_model(model_dir: Path) -> Path:
    if (model_dir / "config.json").is_file():
        return model_dir
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)
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


def _body(rank: int, world_size: int, model_dir: str, repeats: int, max_rc: int) -> Any:
    torch.set_num_threads(1)
    groups = GroupCache([1, 2], world_size=world_size, rank=rank)
    start = time.perf_counter()
    engine = Engine(_config(model_dir), groups.layout(1), groups)
    first_load_s = time.perf_counter() - start
    params = sum(p.numel() for p in engine.model.parameters())
    cells = []
    for count in SEQS:
        for context in CONTEXTS:
            mine = count // 2 + (count % 2 if rank == 0 else 0)
            runs: dict[str, list[float]] = {}
            info: dict[str, Any] = {}
            for rep in range(repeats):
                for policy in ("migrate", "recompute"):
                    if policy == "recompute" and count * context > max_rc:
                        continue
                    engine.import_requests(_states(engine, mine, context, f"r{rank}.{rep}"))
                    report = engine.reconfigure(2, policy)
                    prefill = _until_running(engine) if policy == "recompute" else 0.0
                    back = engine.reconfigure(1, "migrate") if policy == "migrate" else None
                    _clear(engine)
                    if back is None:
                        engine.reconfigure(1, "migrate")
                    key = policy
                    runs.setdefault(f"{key}_total_s", []).append(report.total_s + prefill)
                    runs.setdefault(f"{key}_weights_s", []).append(report.weights_s)
                    runs.setdefault(f"{key}_cache_s", []).append(report.cache_s)
                    runs.setdefault(f"{key}_kv_s", []).append(report.kv_s + prefill)
                    if back is not None:
                        runs.setdefault("reverse_total_s", []).append(back.total_s)
                        runs.setdefault("reverse_weights_s", []).append(back.weights_s)
                        runs.setdefault("reverse_kv_s", []).append(back.kv_s)
                        info.update(
                            kv_bytes_moved=report.kv_bytes_sent + report.kv_bytes_received,
                            reverse_kv_bytes_moved=back.kv_bytes_sent + back.kv_bytes_received,
                            weight_bytes_received_grow=report.weight_bytes_received,
                            weight_bytes_received_shrink=back.weight_bytes_received,
                            weight_peak_bytes_shrink=back.weight_peak_bytes,
                            weight_bytes_tp1=back.weight_bytes_after,
                            weight_bytes_tp2=back.weight_bytes_before,
                        )
                    else:
                        info["tokens_recomputed"] = report.tokens_recomputed
            cells.append(
                {
                    "seqs": count,
                    "context": context,
                    **{k: statistics.median(v) for k, v in runs.items()},
                    **info,
                }
            )
    restarts = []
    for _ in range(repeats):
        start = time.perf_counter()
        fresh = Engine(_config(model_dir), groups.layout(2), groups)
        restarts.append(time.perf_counter() - start)
        del fresh
    return {
        "rank": rank,
        "params": params,
        "first_load_s": first_load_s,
        "restart_s": statistics.median(restarts),
        "cells": cells,
    }


def _fmt(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def crossover(cells: list[dict[str, Any]], seqs: int) -> float | None:
    """Context where recompute_total_s - migrate_total_s changes sign (linear in C), if seen."""
    rows = [c for c in cells if c["seqs"] == seqs and "recompute_total_s" in c]
    rows.sort(key=lambda c: c["context"])
    diffs = [(c["context"], c["recompute_total_s"] - c["migrate_total_s"]) for c in rows]
    if diffs and diffs[0][1] > 0:
        return None  # recompute is dearer already at the shortest measured context
    for (c0, d0), (c1, d1) in itertools.pairwise(diffs):
        if d0 <= 0 < d1:
            return c0 + (c1 - c0) * (-d0) / (d1 - d0)
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-recompute-tokens", type=int, default=8192)
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "patrl_reconfig_124m"))
    args = ap.parse_args()
    model_dir = build_model(Path(args.model_dir))
    load_before = os.getloadavg()
    per_rank = run_ranks(
        _body,
        2,
        args=(str(model_dir), args.repeats, args.max_recompute_tokens),
        timeout_s=3000,
    )
    r0 = per_rank[0]
    cells = r0["cells"]
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, gloo, 1 thread per rank",
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "params": r0["params"],
        "repeats": args.repeats,
        "restart_s": r0["restart_s"],
        "first_load_s": r0["first_load_s"],
        "cells": cells,
        "crossover_context": {str(n): crossover(cells, n) for n in SEQS},
    }
    out = Path(__file__).parent / "results" / "reconfig_bench.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(
        f"model: {r0['params'] / 1e6:.0f}M params fp32; restart (fresh load at tp2): "
        f"{r0['restart_s']:.2f}s (rank 0, median of {args.repeats})"
    )
    head = (
        "seqs ctx | migrate s (weights / cache / kv) | recompute s | reverse s (w / kv) | KV MB"
        " | restart s (load + re-prefill) | restart / migrate"
    )
    print(head)
    for c in cells:
        rc = c.get("recompute_total_s")
        prefill = None if rc is None else c["recompute_kv_s"]
        c["restart_s"] = None if prefill is None else r0["restart_s"] + prefill
        c["restart_over_migrate"] = (
            None if c["restart_s"] is None else c["restart_s"] / c["migrate_total_s"]
        )
        print(
            f"{c['seqs']:4d} {c['context']:4d} | {c['migrate_total_s']:.3f} "
            f"({c['migrate_weights_s']:.3f} / {c['migrate_cache_s']:.3f} / "
            f"{c['migrate_kv_s']:.3f}) | "
            f"{_fmt(rc, 3)} | {c['reverse_total_s']:.3f} "
            f"({c['reverse_weights_s']:.3f} / {c['reverse_kv_s']:.3f}) | "
            f"{c['kv_bytes_moved'] / 1e6:.1f} | "
            f"{_fmt(c['restart_s'], 3)} | {_fmt(c['restart_over_migrate'], 1)}"
        )
    print("crossover context (recompute stops being cheaper):", result["crossover_context"])
    print(f"written to {out}")


if __name__ == "__main__":
    main()
