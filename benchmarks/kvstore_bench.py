"""KV-store benchmark: bookkeeping throughput, fork memory, bookkeeping vs a decode step.

    python benchmarks/kvstore_bench.py [--repeats 5] [--out benchmarks/results/kvstore_bench.json]

Measures, side by side in one run (medians of --repeats):
- allocate / append / free throughput with 256 concurrent sequences (block size 16);
- KV blocks held by 8 forked samples of one 1,000-token prompt vs 8 independent copies;
- the per-step bookkeeping of a decode step (append one token, slot mapping, block table,
  mark computed) for a batch, as a fraction of that batch's decode forward of a ~100M-parameter
  Llama (Hugging Face, random init, fp32, one token per sequence with a 128-token KV cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from patrl.kvstore import BlockManager

BLOCK = 16


def bookkeeping_round(num_seqs: int, prompt_len: int, steps: int) -> dict[str, float]:
    bm = BlockManager(
        num_blocks=num_seqs * (prompt_len + steps) // BLOCK + num_seqs, block_size=BLOCK
    )
    prompts = [[s, *range(prompt_len - 1)] for s in range(num_seqs)]  # distinct first token
    t0 = time.perf_counter()
    for s, p in enumerate(prompts):
        bm.allocate(s, p)
        bm.mark_computed(s, prompt_len)
    t1 = time.perf_counter()
    step_times = []
    for step in range(steps):
        ts = time.perf_counter()
        for s in range(num_seqs):
            bm.append(s, [step])
            n = bm.num_tokens(s)
            bm.slot_mapping(s, n - 1, n)
            bm.block_table(s)
        for s in range(num_seqs):
            bm.mark_computed(s, 1)
        step_times.append(time.perf_counter() - ts)
    t2 = time.perf_counter()
    for s in range(num_seqs):
        bm.free(s)
    t3 = time.perf_counter()
    bm.check_integrity()
    return {
        "allocate_per_s": num_seqs / (t1 - t0),
        "append_per_s": num_seqs * steps / (t2 - t1),
        "free_per_s": num_seqs / (t3 - t2),
        "decode_step_bookkeeping_s": statistics.median(step_times),
    }


def fork_memory(prompt_len: int = 1000, n: int = 8) -> dict[str, float]:
    forked = BlockManager(num_blocks=4096, block_size=BLOCK)
    forked.allocate(0, list(range(prompt_len)))
    forked.mark_computed(0, prompt_len)
    forked.fork(0, range(1, n))
    for s in range(n):
        forked.append(s, [10_000 + s])  # each sample's first token: copies the shared tail block
    copies = BlockManager(num_blocks=4096, block_size=BLOCK, enable_prefix_caching=False)
    for s in range(n):
        copies.allocate(s, [*range(prompt_len), 10_000 + s])
        copies.mark_computed(s, prompt_len + 1)
    return {
        "forked_blocks": forked.num_used_blocks,
        "independent_blocks": copies.num_used_blocks,
        "ratio": forked.num_used_blocks / copies.num_used_blocks,
    }


def decode_step_time(batch: int, context: int, repeats: int) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=640,
        intermediate_size=1728,
        num_hidden_layers=12,
        num_attention_heads=10,
        num_key_value_heads=10,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    params = sum(p.numel() for p in model.parameters())
    with torch.inference_mode():
        prompt = torch.randint(0, config.vocab_size, (batch, context))
        out = model(prompt, use_cache=True)
        cache = out.past_key_values
        times = []
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(repeats):
            t = time.perf_counter()
            model(token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t)
    decode_step_time.params = params  # type: ignore[attr-defined]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/kvstore_bench.json")
    args = parser.parse_args()

    rounds = [bookkeeping_round(256, 128, 64) for _ in range(args.repeats)]
    throughput = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    memory = fork_memory()
    ratios = {}
    for batch in (32, 256):
        book = statistics.median(
            bookkeeping_round(batch, 128, 16)["decode_step_bookkeeping_s"]
            for _ in range(args.repeats)
        )
        step = decode_step_time(batch, 128, args.repeats)
        ratios[batch] = {"bookkeeping_s": book, "decode_forward_s": step, "ratio": book / step}

    result = {
        "machine": "CPU, torch " + torch.__version__ + f", {torch.get_num_threads()} threads",
        "repeats": args.repeats,
        "throughput_256_seqs": throughput,
        "fork_memory_8_samples_1000_tokens": memory,
        "bookkeeping_vs_decode_step": {
            "model_params": getattr(decode_step_time, "params", None),
            "by_batch": ratios,
        },
        "targets": {"fork_ratio_max": 1 / 7, "bookkeeping_ratio_max": 0.05},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))

    print(f"{'measure':48s} {'value':>14s}")
    for k, v in throughput.items():
        print(f"{k + ' (256 seqs)':48s} {v:14.6g}")
    print(
        f"{'forked blocks / independent blocks':48s} {memory['forked_blocks']:6d} / {memory['independent_blocks']:<6d}"
    )
    print(f"{'fork memory ratio (target <= 0.143)':48s} {memory['ratio']:14.4f}")
    for batch, r in ratios.items():
        label = f"bookkeeping / decode step, batch {batch} (<= 0.05)"
        print(
            f"{label:48s} {r['ratio']:14.4f}   ({r['bookkeeping_s'] * 1e3:.2f} ms / {r['decode_forward_s'] * 1e3:.1f} ms)"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
