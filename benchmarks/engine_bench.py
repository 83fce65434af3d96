"""Rollout engine benchmark: patrl's Engine vs transformers `generate`, batch-1 decode vs the
weight-streaming floor, and deduplicated prefill (issue 3).

    python benchmarks/engine_bench.py [--repeats 3] [--threads 1,2] [--requests 64]

One run measures, side by side, for each thread count in --threads (torch.set_num_threads):
1. Useful tokens/s of `Engine.generate` vs Hugging Face `generate` on the same random-init
   ~134M-parameter Llama (fp32), the same prompts and the same per-request response lengths
   (forced: engine `ignore_eos` + `max_tokens`; HF `min_new_tokens` = `max_new_tokens`), plain
   temperature-1 sampling (no top-k / top-p) in both. HF runs batches of --hf-batch requests,
   left-padded, each generating up to its longest request: what HF users get. Useful tokens are
   the tokens requested; wall time includes prefill. Two workloads with the same useful token
   count: long-tail lengths (evenly spaced quantiles of a log-normal, median 10, sigma 1,
   clamped to [4, 64]: for 64 requests mostly 4-25 tokens, a tail to 64) and uniform lengths
   (every request the long-tail mean). Prompts are 16-48 tokens, fresh every repeat. 64
   requests (8 prompts x n=8, a small RL batch) through a 16-wide batch: the engine's
   max_num_seqs and HF's batch size are the same --hf-batch, so both run 16 at a time and
   differ in what they do when a request finishes (refill the slot vs pad to the longest).
2. Batch-1 decode step latency (one request, wall time of `Engine.step()`, prefill excluded)
   against the weight-streaming floor: parameter bytes / read bandwidth, the bandwidth measured
   right before by `torch.sum` over a 1 GiB fp32 tensor (32x the L3 cache).
3. Prefill time of 16 prompts x n=8 samples: 128 separately submitted requests vs 16 requests
   of n=8 (forked prefill), both with `enable_prefix_caching=False` and `max_tokens=1`, so each
   run is prefill steps only (time = sum of the engine's step timeline).
Plus a cProfile of engine decode steps at the throughput batch size, and the load average.

Every timed pair runs interleaved (the order alternates by repeat) so that load drift on a
shared machine hits both sides; each figure is a median of --repeats runs. The model is saved
once under --model-dir and reused by later runs. Results: benchmarks/results/engine_bench.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from patrl.rollout import Engine, EngineConfig, SamplingParams

MODEL: dict[str, Any] = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
BLOCK_SIZE = 16
PROMPT_LEN = (16, 48)  # uniform, inclusive
LONG_TAIL: dict[str, float] = dict(median=10.0, sigma=1.0, low=4, high=64)
PREFILL: dict[str, int] = dict(prompts=16, n=8, prompt_len=16)
DECODE_B1_TOKENS = 17
TARGETS = {"long_tail_min": 2.0, "uniform_min": 0.9, "decode_floor_max": 1.5, "prefill_min": 5.0}


# ------------------------------------------------------------------ model and workloads


def ensure_model(path: Path) -> Path:
    """The random-init checkpoint, built once: rebuilding costs ~10 s and 540 MB of writes."""
    marker = path / "bench_config.json"
    if marker.exists() and json.loads(marker.read_text()) == MODEL:
        return path
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL)).eval()
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(MODEL))
    return path


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    lengths: list[int]  # response tokens requested, per prompt

    @property
    def useful_tokens(self) -> int:
        return sum(self.lengths)


def long_tail_lengths(n: int) -> list[int]:
    """n evenly spaced quantiles of a log-normal, clamped, in a fixed shuffled order.

    Quantiles rather than random draws: every run gets the same, representative tail instead
    of whatever 16 draws happen to give."""
    dist = statistics.NormalDist(0.0, LONG_TAIL["sigma"])
    lengths = [
        LONG_TAIL["median"] * float(torch.tensor(dist.inv_cdf((i + 0.5) / n)).exp())
        for i in range(n)
    ]
    clamped = [int(min(max(round(x), LONG_TAIL["low"]), LONG_TAIL["high"])) for x in lengths]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    return [clamped[i] for i in order]


def random_prompts(count: int, seed: int, vocab: int, lens: tuple[int, int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lens[0], lens[1] + 1, (count,), generator=g).tolist()
    return [torch.randint(0, vocab, (s,), generator=g).tolist() for s in sizes]


def workloads(requests: int, seed: int, vocab: int) -> dict[str, Workload]:
    """Fresh prompts for every repeat (no prefix-cache hits across repeats), fixed lengths."""
    tail = long_tail_lengths(requests)
    uniform = [round(sum(tail) / len(tail))] * requests
    prompts = random_prompts(requests, seed, vocab, PROMPT_LEN)
    return {
        "long_tail": Workload("long_tail", prompts, tail),
        "uniform": Workload("uniform", prompts, uniform),
    }


# --------------------------------------------------------------------------- runners


def run_engine(engine: Engine, work: Workload, seed: int) -> float:
    params = [
        SamplingParams(temperature=1.0, seed=seed + i, max_tokens=n, ignore_eos=True)
        for i, n in enumerate(work.lengths)
    ]
    start = time.perf_counter()
    outs = engine.generate(work.prompts, params)
    elapsed = time.perf_counter() - start
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != work.lengths:
        raise RuntimeError(f"engine generated {got}, asked for {work.lengths}")
    return elapsed


def run_hf(model: Any, work: Workload, batch_size: int, seed: int) -> float:
    """HF generate in arrival order, batches left-padded and run to their longest request."""
    torch.manual_seed(seed)
    elapsed = 0.0
    for b in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[b : b + batch_size]
        longest = max(work.lengths[b : b + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=longest,
                min_new_tokens=longest,
                pad_token_id=0,
            )
        elapsed += time.perf_counter() - start
        if out.shape[1] != width + longest:
            raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, asked for {longest}")
    return elapsed


def read_bandwidth(buffer: torch.Tensor) -> float:
    """Bytes/s of one streaming read (torch.sum) of `buffer`, which dwarfs every cache."""
    start = time.perf_counter()
    buffer.sum()
    return buffer.numel() * buffer.element_size() / (time.perf_counter() - start)


def engine_decode_b1(engine: Engine, seed: int) -> float:
    """Median wall time of Engine.step() for one request's decode steps (prefill excluded)."""
    prompt = random_prompts(1, seed, engine.model.config.vocab_size, (32, 32))[0]
    engine.add_request(
        prompt, SamplingParams(seed=seed, max_tokens=DECODE_B1_TOKENS, ignore_eos=True)
    )
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # times[0] is the prefill


def hf_decode_b1(model: Any, seed: int) -> float:
    """Median forward time of HF's own decode loop (KV cache, one token, batch 1): a reference."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=g)
    times = []
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        for _ in range(DECODE_B1_TOKENS - 1):
            token = out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            out = model(token, past_key_values=out.past_key_values, use_cache=True)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def prefill_time(engine: Engine, seed: int, shared: bool) -> dict[str, float]:
    """Prefill steps' time (sum of the step timeline) of 16 prompts x n=8, max_tokens=1."""
    p = PREFILL
    prompts = random_prompts(
        p["prompts"], seed, engine.model.config.vocab_size, (p["prompt_len"],) * 2
    )
    before = engine.counters.prefill_tokens
    if shared:
        engine.generate(prompts, SamplingParams(n=p["n"], seed=seed, max_tokens=1, ignore_eos=True))
    else:
        engine.generate(
            [q for q in prompts for _ in range(p["n"])],
            [SamplingParams(seed=seed + i, max_tokens=1, ignore_eos=True) for i in range(p["n"])]
            * p["prompts"],
        )
    if not all(r.is_prefill for r in engine.timeline):
        raise RuntimeError("a max_tokens=1 run took a decode step")
    return {
        "prefill_s": sum(r.duration_s for r in engine.timeline),
        "prefill_tokens": engine.counters.prefill_tokens - before,
        "steps": len(engine.timeline),
    }


def profile_decode(engine: Engine, batch: int, top: int = 15) -> list[dict[str, Any]]:
    """cProfile of 5 steady decode steps of `batch` requests (48-token prompts, ~10 tokens in)."""
    prompts = random_prompts(batch, 999, engine.model.config.vocab_size, (48, 48))
    for i, q in enumerate(prompts):
        engine.add_request(q, SamplingParams(seed=i, max_tokens=20, ignore_eos=True))
    for _ in range(10):
        engine.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        engine.step()
    prof.disable()
    while engine.has_unfinished():
        engine.step()
    stats = pstats.Stats(prof)
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = []
    for (file, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(file).name}:{line}({func})",
                "calls": calls,
                "tottime_s": tottime,
                "cumtime_s": cumtime,
                "share": tottime / total,
            }
        )
    rows.sort(key=lambda r: r["tottime_s"], reverse=True)
    return [{"step_s": total / 5}, *rows[:top]]


def interleaved(
    repeats: int, a: Callable[[int], Any], b: Callable[[int], Any]
) -> tuple[list, list]:
    """Run a and b `repeats` times, alternating which goes first, so drift hits both."""
    ra, rb = [], []
    for r in range(repeats):
        if r % 2 == 0:
            ra.append(a(r))
            rb.append(b(r))
        else:
            rb.append(b(r))
            ra.append(a(r))
    return ra, rb


# ------------------------------------------------------------------------ one config


def engine_for(model_dir: Path, **overrides: Any) -> Engine:
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        num_kv_blocks=384,
        max_model_len=256,
        max_num_batched_tokens=2048,
    )
    return Engine(EngineConfig(**{**kwargs, **overrides}))


def decode_section(engine: Engine, hf: Any, repeats: int) -> dict[str, Any]:
    """Batch-1 decode vs the weight-streaming floor; bandwidth measured in the same window."""
    mc = engine.model.config
    param_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    # A decode step reads one row of the input embedding, not the table: a stricter floor.
    embed_bytes = mc.vocab_size * mc.hidden_size * next(engine.model.parameters()).element_size()
    buffer = torch.ones(1 << 28)  # 1 GiB of fp32
    bandwidth, eng_b1, hf_b1 = [], [], []
    for r in range(repeats):
        bandwidth.append(max(read_bandwidth(buffer) for _ in range(3)))
        eng_b1.append(engine_decode_b1(engine, 100 + r))
        hf_b1.append(hf_decode_b1(hf, 100 + r))
    bw = statistics.median(bandwidth)
    floor = param_bytes / bw
    floor_no_embed = (param_bytes - embed_bytes) / bw
    return {
        "read_bandwidth_GBps": [b / 1e9 for b in bandwidth],
        "param_bytes": param_bytes,
        "floor_s": floor,
        "floor_without_embedding_s": floor_no_embed,
        "engine_step_s": eng_b1,
        "hf_forward_s": hf_b1,
        "engine_over_floor": statistics.median(eng_b1) / floor,
        "engine_over_floor_without_embedding": statistics.median(eng_b1) / floor_no_embed,
        "hf_over_floor": statistics.median(hf_b1) / floor,
    }


def throughput_section(
    engine: Engine, hf: Any, name: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Useful tokens/s of the engine and of HF generate on one workload, interleaved."""
    vocab = hf.config.vocab_size
    works = [workloads(args.requests, 1000 + r, vocab)[name] for r in range(args.repeats)]
    eng_s, hf_s = interleaved(
        args.repeats,
        lambda r: run_engine(engine, works[r], r),
        lambda r: run_hf(hf, works[r], args.hf_batch, r),
    )
    useful = works[0].useful_tokens
    return {
        "lengths": works[0].lengths,
        "useful_tokens": useful,
        "engine_s": eng_s,
        "hf_s": hf_s,
        "engine_tok_s": useful / statistics.median(eng_s),
        "hf_tok_s": useful / statistics.median(hf_s),
        "ratio": statistics.median(hf_s) / statistics.median(eng_s),
    }


def prefill_section(model_dir: Path, repeats: int) -> dict[str, Any]:
    p = PREFILL
    engine = engine_for(model_dir, max_num_seqs=p["prompts"] * p["n"], enable_prefix_caching=False)
    prefill_time(engine, 0, shared=True)  # warm-up at this batch shape
    shared, separate = interleaved(
        repeats,
        lambda r: prefill_time(engine, 2000 + r, shared=True),
        lambda r: prefill_time(engine, 2000 + r, shared=False),
    )
    return {
        "shared": shared,
        "separate": separate,
        "ratio": statistics.median(s["prefill_s"] for s in separate)
        / statistics.median(s["prefill_s"] for s in shared),
    }


def log(threads: int, what: str) -> None:
    load = os.getloadavg()[0]
    print(f"[{time.strftime('%H:%M:%S')} threads={threads} load={load:.1f}] {what}", flush=True)


def bench_threads(threads: int, args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    torch.set_num_threads(threads)
    result: dict[str, Any] = {"threads": threads, "loadavg_start": os.getloadavg()}
    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = engine_for(model_dir, max_num_seqs=args.hf_batch)
    warm = Workload("warm-up", random_prompts(2, 12345, hf.config.vocab_size, (8, 8)), [4, 4])
    run_engine(engine, warm, 0)
    run_hf(hf, warm, 2, 0)
    log(threads, "batch-1 decode vs floor")
    result["decode_b1"] = decode_section(engine, hf, args.repeats)
    result["throughput"] = {}
    for name in ("long_tail", "uniform"):
        log(threads, f"engine vs HF generate, {name}")
        result["throughput"][name] = throughput_section(engine, hf, name, args)
    log(threads, "profile")
    result["profile_decode"] = {
        str(b): profile_decode(engine, b) for b in sorted({1, args.hf_batch})
    }
    del engine, hf  # before the prefill engine loads its own copy of the weights
    log(threads, "prefill, shared vs separate")
    result["prefill"] = prefill_section(model_dir, args.repeats)
    result["loadavg_end"] = os.getloadavg()
    result["wall_s"] = time.perf_counter() - start
    return result


# ----------------------------------------------------------------------------- report


def table(results: list[dict[str, Any]]) -> str:
    rows = [f"{'measure':44s} {'patrl':>10s} {'reference':>10s} {'ratio':>7s} {'target':>8s}  met"]
    for res in results:
        load = f"load avg {res['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f}"
        rows.append(f"-- torch threads = {res['threads']} ({load}, {res['wall_s']:.0f} s)")
        for name, key in (("long-tail", "long_tail"), ("uniform", "uniform")):
            t = res["throughput"][key]
            target = TARGETS[f"{key}_min"]
            rows.append(
                f"{'useful tok/s vs HF generate, ' + name:44s} {t['engine_tok_s']:10.1f} "
                f"{t['hf_tok_s']:10.1f} {t['ratio']:6.2f}x {'>=' + str(target) + 'x':>8s}  "
                f"{'yes' if t['ratio'] >= target else 'NO'}"
            )
        d = res["decode_b1"]
        eng_ms = statistics.median(d["engine_step_s"]) * 1e3
        rows.append(
            f"{'batch-1 decode step ms vs floor (all params)':44s} {eng_ms:10.1f} "
            f"{d['floor_s'] * 1e3:10.1f} {d['engine_over_floor']:6.2f}x "
            f"{'<=' + str(TARGETS['decode_floor_max']) + 'x':>8s}  "
            f"{'yes' if d['engine_over_floor'] <= TARGETS['decode_floor_max'] else 'NO'}"
        )
        rows.append(
            f"{'  ... floor without the embedding table':44s} {eng_ms:10.1f} "
            f"{d['floor_without_embedding_s'] * 1e3:10.1f} "
            f"{d['engine_over_floor_without_embedding']:6.2f}x"
        )
        hf_ms = statistics.median(d["hf_forward_s"]) * 1e3
        rows.append(
            f"{'  HF decode forward ms vs floor (reference)':44s} {hf_ms:10.1f} "
            f"{d['floor_s'] * 1e3:10.1f} {d['hf_over_floor']:6.2f}x"
        )
        bw = statistics.median(d["read_bandwidth_GBps"])
        rows.append(f"{'  read bandwidth (torch.sum of 1 GiB), GB/s':44s} {bw:10.2f}")
        p = res["prefill"]
        shared_ms = statistics.median(s["prefill_s"] for s in p["shared"]) * 1e3
        sep_ms = statistics.median(s["prefill_s"] for s in p["separate"]) * 1e3
        rows.append(
            f"{'prefill ms, 16 x n=8: shared vs separate':44s} {shared_ms:10.1f} {sep_ms:10.1f} "
            f"{p['ratio']:6.2f}x {'>=' + str(TARGETS['prefill_min']) + 'x':>8s}  "
            f"{'yes' if p['ratio'] >= TARGETS['prefill_min'] else 'NO'}"
        )
        for batch, prof in res["profile_decode"].items():
            step_ms = prof[0]["step_s"] * 1e3
            rows.append(f"   cProfile, engine decode step at batch {batch}: {step_ms:.0f} ms/step")
            for r in prof[1:7]:
                rows.append(f"     {r['share'] * 100:5.1f}%  {r['function']}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument(
        "--hf-batch", type=int, default=16, help="HF batch size = the engine's max_num_seqs"
    )
    parser.add_argument("--model-dir", default="/tmp/patrl_engine_bench_llama134m")
    parser.add_argument("--out", default="benchmarks/results/engine_bench.json")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error(f"--repeats must be >= 3 (medians), got {args.repeats}")

    start = time.perf_counter()
    load_start = os.getloadavg()
    model_dir = ensure_model(Path(args.model_dir))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for threads in (int(t) for t in args.threads.split(",")):
        results.append(bench_threads(threads, args, model_dir))
        # Written after every configuration: a slow second one must not lose the first.
        summary = summarise(args, results, load_start, time.perf_counter() - start)
        out.write_text(json.dumps(summary, indent=2))
        print(table(results[-1:]), flush=True)
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)")


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def summarise(
    args: argparse.Namespace, results: list[dict[str, Any]], load_start: Any, wall_s: float
) -> dict[str, Any]:
    return {
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "model": {
            **MODEL,
            "params": results[0]["decode_b1"]["param_bytes"] // 4,
            "dtype": "float32",
        },
        "workload": {
            "requests": args.requests,
            "hf_batch": args.hf_batch,
            "prompt_len_uniform": PROMPT_LEN,
            "long_tail": {**LONG_TAIL, "kind": "log-normal quantiles, clamped"},
            "sampling": "temperature 1.0, no top-k/top-p, lengths forced",
            "prefill": PREFILL,
        },
        "repeats": args.repeats,
        "targets": TARGETS,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "wall_s": wall_s,
        "configs": results,
    }


if __name__ == "__main__":
    main()
