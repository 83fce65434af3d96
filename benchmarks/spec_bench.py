"""Speculative rollouts (issue 44): rollout wall time and tokens/s with speculation on vs off.

    python benchmarks/spec_bench.py [--repeats 3] [--prompts 4] [--n 8] [--threads 1]

A GRPO-like workload: --prompts prompts x --n samples, each sample its own request under its
prompt's key (as TRL sends a group), response lengths forced (ignore_eos + max_tokens) to
evenly spaced quantiles of a log-normal (median 24, sigma 0.8, clamped to [8, 160]) so every
group has a long tail. Each repeat runs, on the same engine pair, two rollouts of the same
prompts: "epoch 1" (drafts from the group and the prompt only) and "epoch 2" (the first
rollout's responses are history), at temperature 1 (GRPO) and greedy (T = 0, an upper bound:
a random model's greedy text repeats itself). Off and on run interleaved (the order alternates
by repeat) so load drift hits both; figures are medians over --repeats.

The model: the demo's SFT model when its build is complete in the cache ($PATRL_CACHE_DIR or
~/.cache/patrl; never built here: that takes minutes), with its own prompts; else a random
Llama (fp32, ~25M parameters, vocab 8192) and random prompts: a random model's sampled text
gives drafts little to match (report it, don't tune for it).

Per rollout: wall time and this process's CPU time (one torch thread: CPU time is the work
done, less disturbed than wall time by other processes on a shared machine), generated
tokens/s, and the tail phase apart (steps that start with at most --tail running samples: their
time and tokens/s), plus acceptance, tokens per sample step and the accepted share by source
(`speculation_metrics`). With responses to EOS (the demo), speculation samples other (equally
distributed) responses than the run without it, so the two rollouts' tails differ in shape. Results: JSON on stdout and in
benchmarks/results/spec_bench.json, with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from patrl.rollout import Engine, EngineConfig, SamplingParams
from patrl.rollout.drafter import speculation_metrics

RANDOM_MODEL: dict[str, Any] = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=8192,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
LENGTHS: dict[str, float] = dict(median=24.0, sigma=0.8, low=8, high=160)


def demo_model() -> tuple[Path, list[list[int]], int] | None:
    """The cached demo model, its train prompts' token ids and a response cap (twice its
    longest gold response), if a complete build exists."""
    try:
        from patrl_examples.demo.assets import (
            DemoAssets,
            DemoRecipe,
            default_cache_root,
            is_complete,
        )
    except ImportError:
        return None
    recipe = DemoRecipe.default()
    root = default_cache_root() / f"demo-{recipe.key()}"
    if not is_complete(root, recipe):
        return None
    assets = DemoAssets.load(root)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    rows = [json.loads(line) for line in assets.train_file.read_text().splitlines()[:64]]
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": r[assets.prompt_key]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for r in rows
    ]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return assets.model_dir, prompts, 2 * assets.max_response_tokens


def random_model(path: Path) -> Path:
    """The random Llama, saved once under `path`."""
    marker = path / "bench_config.json"
    if marker.exists() and json.loads(marker.read_text()) == RANDOM_MODEL:
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**RANDOM_MODEL)).eval().save_pretrained(path)
    marker.write_text(json.dumps(RANDOM_MODEL))
    return path


def tail_lengths(n: int) -> list[int]:
    """`n` evenly spaced quantiles of LENGTHS' log-normal, clamped."""
    out = []
    for i in range(n):
        q = (i + 0.5) / n
        z = statistics.NormalDist().inv_cdf(q)
        length = LENGTHS["median"] * math.exp(LENGTHS["sigma"] * z)
        out.append(int(min(LENGTHS["high"], max(LENGTHS["low"], round(length)))))
    return out


def rollout(
    engine: Engine,
    prompts: list[list[int]],
    n: int,
    temperature: float,
    tail: int,
    seed: int,
    cap: int | None,
) -> dict[str, Any]:
    """One GRPO-like rollout driven step by step: wall time, tokens/s, the tail phase apart.
    `cap`: responses end at EOS within `cap` tokens (the demo); None: forced tail lengths."""
    lengths = tail_lengths(n)
    before = engine.stats()
    for i, p in enumerate(prompts):
        for j, length in enumerate(lengths):
            params = SamplingParams(
                temperature=temperature,
                max_tokens=length if cap is None else cap,
                ignore_eos=cap is None,
                seed=seed + 97 * i + j,
            )
            engine.add_request(p, params, prompt_key=f"prompt/{i}")
    # (running before, wall seconds, this process's CPU seconds, tokens) per step
    steps: list[tuple[int, float, float, int]] = []
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        running = engine.scheduler.num_running_samples()
        tokens = engine.counters.generated_tokens
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        steps.append(
            (
                running,
                time.perf_counter() - t0,
                time.process_time() - c0,
                engine.counters.generated_tokens - tokens,
            )
        )
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    generated = sum(s[3] for s in steps)
    tail_steps = [s for s in steps if 0 < s[0] <= tail]
    tail_s = sum(s[1] for s in tail_steps)
    tail_cpu_s = sum(s[2] for s in tail_steps)
    tail_tokens = sum(s[3] for s in tail_steps)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens": generated,
        "tokens_per_s": generated / wall,
        "steps": len(steps),
        "tail_s": tail_s,
        "tail_cpu_s": tail_cpu_s,
        "tail_tokens": tail_tokens,
        "tail_tokens_per_s": tail_tokens / tail_s if tail_s else 0.0,
        "tail_tokens_per_cpu_s": tail_tokens / tail_cpu_s if tail_cpu_s else 0.0,
        **speculation_metrics(before, engine.stats(), prefix=""),
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tail", type=int, default=4, help="tail phase: at most this many running")
    parser.add_argument("--draft", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument(
        "--spec-max-seqs", type=int, default=16, help="speculative.max_num_seqs (0: always)"
    )
    parser.add_argument(
        "--latency-profile",
        type=Path,
        help="speculative.latency_profile: steps draft only where the profile says it pays "
        "(python -m patrl.rollout.profile ... --query-lens 2 3 5 measures verify rows)",
    )
    parser.add_argument("--random-model", action="store_true", help="skip the demo model")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/patrl_spec_bench_model"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/spec_bench.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    demo = None if args.random_model else demo_model()
    cap: int | None = None
    if demo is not None:
        model_dir, pool, cap = demo
        prompts = pool[: args.prompts]
        model = "demo (SFT), responses to EOS"
    else:
        model_dir = random_model(args.model_dir)
        g = torch.Generator().manual_seed(0)
        vocab = RANDOM_MODEL["vocab_size"]
        prompts = [
            torch.randint(0, vocab, (32,), generator=g).tolist() for _ in range(args.prompts)
        ]
        model = "random llama (fp32, vocab 8192)"

    def make(spec: bool) -> Engine:
        return Engine(
            EngineConfig(
                model=str(model_dir),
                device="cpu",
                max_num_seqs=args.prompts * args.n,
                max_model_len=512,
                speculative={
                    "enable": spec,
                    "num_speculative_tokens": args.draft,
                    "max_num_seqs": args.spec_max_seqs,
                    "latency_profile": args.latency_profile and str(args.latency_profile),
                },
            )
        )

    results: dict[str, Any] = {}
    for temperature in (1.0, 0.0):
        runs: dict[str, list[dict[str, Any]]] = {}
        for r in range(args.repeats):
            order = (False, True) if r % 2 == 0 else (True, False)
            engines = {spec: make(spec) for spec in order}
            for epoch in (1, 2):
                for spec in order:
                    key = f"epoch{epoch}/{'on' if spec else 'off'}"
                    out = rollout(engines[spec], prompts, args.n, temperature, args.tail, r, cap)
                    runs.setdefault(key, []).append(out)
        section: dict[str, Any] = {k: median_of(v) for k, v in runs.items()}
        for epoch in (1, 2):
            off, on = section[f"epoch{epoch}/off"], section[f"epoch{epoch}/on"]
            section[f"epoch{epoch}/speedup"] = {
                "wall": off["wall_s"] / on["wall_s"],
                "cpu": off["cpu_s"] / on["cpu_s"],
                "tail_wall": off["tail_s"] / on["tail_s"] if on["tail_s"] else None,
                "tail_cpu": off["tail_cpu_s"] / on["tail_cpu_s"] if on["tail_cpu_s"] else None,
            }
        results[f"temperature_{temperature:g}"] = section
    report = {
        "model": model,
        "workload": {
            "prompts": args.prompts,
            "n": args.n,
            "lengths": tail_lengths(args.n) if cap is None else f"to EOS, at most {cap}",
            "tail_max_running": args.tail,
            "num_speculative_tokens": args.draft,
            "spec_max_seqs": args.spec_max_seqs,
            "latency_profile": args.latency_profile and str(args.latency_profile),
        },
        "threads": args.threads,
        "repeats": args.repeats,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
