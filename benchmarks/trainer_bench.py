"""Trainer throughput on a long-tail GRPO batch: patrl (1 and 2 ranks) vs a plain HF loop.

    python benchmarks/trainer_bench.py [--samples 48] [--steps 3] [--threads 2]

Each configuration lives in its own processes (so peak RSS is its own) and does one warm-up
step; then `--steps` rounds each time one step of every configuration in turn (interleaved, so
that load from other processes on a shared machine falls on all alike), and the median step
time of each is reported. All three do the same work per step:
a no-grad scoring pass for the old logprobs, then forward + backward of the GRPO clipped
surrogate (token-mean) over the whole batch, then one AdamW step.

- patrl-1rank: `Trainer` without a mesh, one process with `--threads` threads; micro-batches
  by token budget (sorted, little padding), chunked logprobs.
- patrl-2rank: `Trainer` with FSDP2 over 2 gloo ranks, `--threads / 2` threads per rank (the
  same cores split in two); time is the slowest rank's.
- hf-loop: what a TRL user has: micro-batches of a fixed number of samples in arrival order,
  right-padded, `log_softmax` of the full logits, one process with `--threads` threads.

Tokens/s counts real (unpadded) tokens. Results go to benchmarks/results/trainer_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, LlamaConfig

from patrl.trainer import PolicyBatch, Trainer, TrainerConfig, padded_fraction, plan_micro_batches

VOCAB = 2048


def model_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )


def long_tail_batch(samples: int, seed: int = 0) -> PolicyBatch:
    """64-token prompts, log-normal response lengths (median ~150, tail to 1500)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(5.0 + 0.8 * torch.randn(samples, generator=g)).clamp(8, 1500).long()
    prompts = [torch.randint(0, VOCAB, (64,), generator=g).tolist() for _ in range(samples)]
    responses = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in lengths]
    advantages = torch.randn(samples, generator=g).tolist()
    return PolicyBatch.from_responses(prompts, responses, advantages)


def trainer_config(budget: int) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {"optim": {"lr": 1e-5}, "ppo_max_token_len_per_gpu": budget, "logprob_chunk_tokens": 1024}
    )


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def serve(step: Any, rank: int, commands: Any, out: Any, extra: dict[str, Any]) -> None:
    """Run `step()` once per "go" from the driver; report its time; stop on "stop"."""
    out.put(("ready", rank))
    while commands.get() == "go":
        start = time.perf_counter()
        step()
        out.put(("done", rank, time.perf_counter() - start, {**extra, "rss": _peak_rss_gb()}))


def run_patrl(rank: int, world: int, port: int, args: Any, commands: Any, out: Any) -> None:
    torch.set_num_threads(max(1, args.threads // world))
    mesh = None
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=1800)
        )
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    batch = long_tail_batch(args.samples)
    trainer = Trainer(trainer_config(args.budget), model_config(), mesh=mesh)
    padded = trainer._padded_fraction(batch)
    serve(lambda: trainer.train_step(batch), rank, commands, out, {"padded_fraction": padded})
    if mesh is not None:
        dist.barrier(group=mesh.get_group())
        dist.destroy_process_group()


def run_hf_loop(rank: int, world: int, port: int, args: Any, commands: Any, out: Any) -> None:
    """The baseline: fixed-size micro-batches in arrival order, full log_softmax."""
    torch.set_num_threads(args.threads)
    batch = long_tail_batch(args.samples)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(), attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    order = list(range(len(batch)))
    mbs = [order[i : i + args.hf_micro_batch] for i in range(0, len(order), args.hf_micro_batch)]
    num_tokens = float(sum(int(m.sum()) for m in batch.loss_mask))

    def padded(mb: list[int]) -> tuple[torch.Tensor, ...]:
        longest = max(batch.input_ids[i].numel() for i in mb)

        def pad(xs: list[torch.Tensor], fill: Any = 0) -> torch.Tensor:
            return torch.stack(
                [torch.nn.functional.pad(x, (0, longest - x.numel()), value=fill) for x in xs]
            )

        ids = pad([batch.input_ids[i] for i in mb])
        attn = pad([torch.ones_like(batch.input_ids[i]) for i in mb])
        mask = pad([batch.loss_mask[i] for i in mb], False)
        adv = pad([batch.advantages[i] for i in mb], 0.0)
        return ids, attn, mask, adv

    def logprobs(ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return torch.nn.functional.pad(logp, (1, 0))

    def step() -> None:
        with torch.no_grad():
            old = [logprobs(*padded(mb)[:2]) for mb in mbs]
        for mb, old_lp in zip(mbs, old, strict=True):
            ids, attn, mask, adv = padded(mb)
            ratio = torch.exp(logprobs(ids, attn) - old_lp)
            per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
            loss = torch.where(mask, per_token, 0.0).sum() / num_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    serve(step, rank, commands, out, {"padded_fraction": padded_fraction(batch.lengths, mbs)})


class Config:
    """One configuration's live processes, driven one step at a time."""

    def __init__(self, fn: Any, world: int, args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.out = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(world)]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.procs = [
            ctx.Process(target=fn, args=(r, world, port, args, self.commands[r], self.out))
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self.times: list[float] = []
        self.last: dict[str, Any] = {}
        self.rss = 0.0

    def wait_ready(self) -> None:
        for _ in self.procs:
            assert self.out.get(timeout=1800)[0] == "ready"

    def step(self) -> float:
        """One step on every rank; a step is as slow as its slowest rank."""
        for q in self.commands:
            q.put("go")
        reports = [self.out.get(timeout=3600) for _ in self.procs]
        self.last = reports[0][3]
        self.rss = max(self.rss, *(r[3]["rss"] for r in reports))
        return max(r[2] for r in reports)

    def stop(self) -> None:
        for q in self.commands:
            q.put("stop")
        for p in self.procs:
            p.join(timeout=120)
            if p.exitcode != 0:
                raise RuntimeError(f"a benchmark process exited with {p.exitcode}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="cores for every configuration")
    parser.add_argument("--budget", type=int, default=4096, help="ppo_max_token_len_per_gpu")
    parser.add_argument("--hf-micro-batch", type=int, default=8, help="baseline samples/mb")
    args = parser.parse_args()

    batch = long_tail_batch(args.samples)
    real_tokens = sum(batch.lengths)
    configs = {
        "hf-loop": Config(run_hf_loop, 1, args),
        "patrl-1rank": Config(run_patrl, 1, args),
        "patrl-2rank": Config(run_patrl, 2, args),
    }
    for c in configs.values():
        c.wait_ready()
        c.step()  # warm-up, untimed
    # Rounds interleave the configurations, so that load from other processes on a shared
    # machine falls on all of them alike; only one configuration runs at a time.
    for _ in range(args.steps):
        for c in configs.values():
            c.times.append(c.step())
    for c in configs.values():
        c.stop()
    base = statistics.median(configs["hf-loop"].times)
    runs: dict[str, dict[str, Any]] = {}
    for name, c in configs.items():
        median = statistics.median(c.times)
        runs[name] = {
            "step_times_s": c.times,
            "median_step_s": median,
            "tokens_per_s": real_tokens / median,
            "speedup_vs_hf_loop": base / median,
            "padded_fraction": c.last["padded_fraction"],
            "peak_rss_gb_per_rank": c.rss,
        }
    (plan,) = plan_micro_batches(batch.lengths, args.budget, 1)
    result = {
        "machine": f"{os.cpu_count()} cpus, torch {torch.__version__}",
        "args": vars(args),
        "batch": {
            "samples": len(batch),
            "real_tokens": real_tokens,
            "longest": max(batch.lengths),
            "median_len": statistics.median(batch.lengths),
            "patrl_micro_batches_1rank": len(plan),
        },
        "runs": runs,
    }
    out = Path(__file__).parent / "results" / "trainer_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"batch: {len(batch)} samples, {real_tokens} real tokens, longest {max(batch.lengths)}")
    print(
        f"{'config':<12} {'median s':>9} {'tokens/s':>9} {'vs hf':>6} {'padded':>7} {'rss GB':>7}"
    )
    for name, r in runs.items():
        print(
            f"{name:<12} {r['median_step_s']:>9.2f} {r['tokens_per_s']:>9.0f} "
            f"{r['speedup_vs_hf_loop']:>6.2f} {r['padded_fraction']:>7.1%} "
            f"{r['peak_rss_gb_per_rank']:>7.2f}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
