"""The trainer's update step: throughput against plain HF loops and the FLOP roofline, and
where its time goes (issue 35).

    OMP_NUM_THREADS=1 python benchmarks/trainer_bench.py [--steps 3] [--batches short long]
        [--before-src DIR]   # DIR: packages/trainer/src of an older trainer, run beside this one

The model is TRL's tiny-Llama GRPO shape (hidden 256, 4 layers, 4 heads, a 2048-word
vocabulary). Batches: `short` is TRL's setup, 8 prompts x 8 samples of 16-48-token prompts and
responses of up to 128 tokens (log-normal, median ~60); `long` is a long tail (64-token
prompts, log-normal responses of median ~150 up to 1500). Every variant does one on-policy
GRPO update per step: forward, logprobs, token-mean clipped surrogate, backward, grad clip,
AdamW; the old logprobs are the forward's own, detached (TRL with one iteration does the same).

Variants, each in its own process(es) with `--threads` torch threads per rank:
- patrl: `Trainer` with its defaults (packed micro-batches by token budget); patrl-padded the
  same with use_remove_padding=False; patrl-fsdp1 / patrl-fsdp2 under FSDP2 over 1 / 2 gloo
  ranks (fsdp2's time is its slowest rank's, on twice the cores); before: `--before-src`'s
  trainer with its defaults.
- hf-padded: what a TRL user has: micro-batches of `--hf-micro-batch` samples in arrival
  order, right-padded, `log_softmax` of the full logits.
- hf-plain: a plain HF forward + backward + AdamW on patrl's micro-batches, every sample its
  own unpadded forward: the "plain loop on unpadded tokens" the update is held against.
Each variant does one warm-up step; then `--steps` rounds each step every variant in turn
(interleaved, so load from other processes on a shared machine falls on all alike); medians
are reported, and ratios are the result (absolute times on a shared box are noise).

Profile: in the patrl processes the step is split by timing wrappers into forward (the model
call), logprob (logprob + entropy from the logits), loss, backward, optimizer (grad norm, clip,
AdamW, zero_grad) and other (the rest: Python between micro-batches, packing/padding, metric
reads). FSDP overhead is patrl-fsdp1 over patrl, padding's cost patrl-padded over patrl.

Roofline: one thread's fp32 matmul throughput (a 512 x 512 by 512 x 2048 matmul, median of
repeats) against the step's FLOPs: 6 x (linear-layer parameters) per token, plus causal
attention 6 x L^2 x hidden per layer per sample of L tokens (forward and backward).

Writes benchmarks/results/trainer_bench.json and prints tables.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB = 2048
PHASES = ("forward", "logprob", "loss", "backward", "optimizer")
Raw = tuple[list[list[int]], list[list[int]], list[float]]  # prompts, responses, advantages


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


def raw_batch(kind: str, seed: int = 0) -> Raw:
    """`short`: 8 prompts x 8 samples up to 128 response tokens; `long`: 32 long-tail samples."""
    g = torch.Generator().manual_seed(seed)
    if kind == "short":
        plens = torch.randint(16, 49, (8,), generator=g).repeat_interleave(8)
        rlens = torch.exp(4.1 + 0.6 * torch.randn(64, generator=g)).clamp(4, 128).long()
    else:
        plens = torch.full((32,), 64)
        rlens = torch.exp(5.0 + 0.8 * torch.randn(32, generator=g)).clamp(8, 1500).long()
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in plens]
    responses = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in rlens]
    advantages = torch.randn(len(prompts), generator=g).tolist()
    return prompts, responses, advantages


def lengths_of(raw: Raw) -> list[int]:
    return [len(p) + len(r) for p, r in zip(raw[0], raw[1], strict=True)]


def _use_source(src: str | None) -> None:
    """Import patrl.trainer from `src` (an older tree) in this process, before anything else."""
    if src:
        sys.path.insert(0, src)


class Phases:
    """Seconds per phase of the current step, accumulated by timing wrappers."""

    def __init__(self) -> None:
        self.t = dict.fromkeys(PHASES, 0.0)

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[phase] += time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        out, self.t = self.t, dict.fromkeys(PHASES, 0.0)
        return out


def instrument(trainer: Any) -> Phases:
    """Time the trainer's phases by wrapping what its step calls (module-level names)."""
    import patrl.trainer.trainer as tmod

    # The wrapped optimizer.step makes the LR scheduler warn on every step; the order is right.
    warnings.filterwarnings("ignore", message=r"Seems like `optimizer\.step\(\)` has been")
    ph = Phases()
    for name in ("packed_token_logprobs", "token_logprobs"):
        if hasattr(tmod, name):
            setattr(tmod, name, ph.wrap("logprob", getattr(tmod, name)))
    tmod.policy_loss = ph.wrap("loss", tmod.policy_loss)  # type: ignore[attr-defined]
    model = trainer.model
    model.forward = ph.wrap("forward", model.forward)
    torch.Tensor.backward = ph.wrap("backward", torch.Tensor.backward)  # type: ignore[method-assign]
    trainer.optimizer.step = ph.wrap("optimizer", trainer.optimizer.step)
    trainer._clip_grad_norm = ph.wrap("optimizer", trainer._clip_grad_norm)
    trainer.optimizer.zero_grad = ph.wrap("optimizer", trainer.optimizer.zero_grad)
    return ph


def serve(step: Callable[[], Any], commands: Any, out: Any, rank: int, ph: Phases | None) -> None:
    """Run `step()` once per "go" from the driver and report its time and phases."""
    out.put(("ready", rank))
    while commands.get() == "go":
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        out.put(("done", rank, elapsed, ph.take() if ph else {}))


def run_patrl(rank: int, world: int, port: int, spec: dict[str, Any], commands: Any, out: Any):  # type: ignore[no-untyped-def]
    _use_source(spec.get("src"))
    torch.set_num_threads(spec["threads"])
    from patrl.trainer import PolicyBatch, Trainer, TrainerConfig

    mesh = None
    if spec.get("mesh"):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(hours=1))
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    batch = PolicyBatch.from_responses(*spec["raw"])
    cfg = TrainerConfig.model_validate(
        {"optim": {"lr": 1e-5}, "ppo_max_token_len_per_gpu": spec["budget"], **spec["overrides"]}
    )
    trainer = Trainer(cfg, model_config(), mesh=mesh)
    serve(lambda: trainer.train_step(batch), commands, out, rank, instrument(trainer))
    if mesh is not None:
        dist.barrier(group=mesh.get_group())
        dist.destroy_process_group()


def run_hf(rank: int, world: int, port: int, spec: dict[str, Any], commands: Any, out: Any):  # type: ignore[no-untyped-def]
    """hf-padded (fixed micro-batches, padded) or hf-plain (patrl's micro-batches, per sample)."""
    torch.set_num_threads(spec["threads"])
    prompts, responses, advantages = spec["raw"]
    seqs = [torch.tensor(p + r) for p, r in zip(prompts, responses, strict=True)]
    masks = [
        torch.tensor([False] * len(p) + [True] * len(r))
        for p, r in zip(prompts, responses, strict=True)
    ]
    num_tokens = float(sum(len(r) for r in responses))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(), attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    mbs: list[list[int]] = spec["micro_batches"]
    padded = spec["padded"]

    def pad(xs: list[torch.Tensor], longest: int, fill: Any = 0) -> torch.Tensor:
        return torch.stack(
            [torch.nn.functional.pad(x, (0, longest - x.numel()), value=fill) for x in xs]
        )

    def loss_of(
        ids: torch.Tensor, attn: torch.Tensor | None, mask: torch.Tensor, adv: torch.Tensor
    ) -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        return torch.where(mask[:, 1:], per_token, 0.0).sum() / num_tokens

    def step() -> None:
        for mb in mbs:
            if padded:
                longest = max(seqs[i].numel() for i in mb)
                ids = pad([seqs[i] for i in mb], longest)
                attn = pad([torch.ones_like(seqs[i]) for i in mb], longest)
                mask = pad([masks[i] for i in mb], longest, False)
                adv = torch.tensor([advantages[i] for i in mb])[:, None]
                loss_of(ids, attn, mask, adv).backward()
            else:
                for i in mb:
                    adv = torch.tensor([[advantages[i]]])
                    loss_of(seqs[i][None], None, masks[i][None], adv).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    serve(step, commands, out, rank, None)


class Variant:
    """One variant's live processes, driven one step at a time."""

    def __init__(self, fn: Any, world: int, spec: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.out = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(world)]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.procs = [
            ctx.Process(target=fn, args=(r, world, port, spec, self.commands[r], self.out))
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self.times: list[float] = []
        self.phases: list[dict[str, float]] = []

    def wait_ready(self) -> None:
        for _ in self.procs:
            assert self.out.get(timeout=1800)[0] == "ready"

    def step(self) -> tuple[float, dict[str, float]]:
        """One step on every rank; a step is as slow as its slowest rank (rank 0's phases)."""
        for q in self.commands:
            q.put("go")
        reports = sorted((self.out.get(timeout=3600) for _ in self.procs), key=lambda r: r[1])
        return max(r[2] for r in reports), reports[0][3]

    def stop(self) -> None:
        for q in self.commands:
            q.put("stop")
        for p in self.procs:
            p.join(timeout=120)
            if p.exitcode != 0:
                raise RuntimeError(f"a benchmark process exited with {p.exitcode}")


def matmul_flops_per_s(threads: int) -> float:
    """Measured fp32 matmul throughput of `threads` threads (median of 20)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(512, 512), torch.randn(512, 2048)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(20):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * 512 * 512 * 2048 / statistics.median(times)


def step_flops(lengths: list[int]) -> float:
    """Forward + backward FLOPs of one update over samples of `lengths` (unpadded)."""
    c = model_config()
    h, layers = c.hidden_size, c.num_hidden_layers
    linear = layers * (4 * h * h + 3 * h * c.intermediate_size) + h * c.vocab_size
    return sum(6 * linear * n + 6 * layers * n * n * h for n in lengths)


def specs(args: Any, raw: Raw) -> dict[str, tuple[Any, int, dict[str, Any]]]:
    from patrl.trainer import plan_micro_batches

    lengths = lengths_of(raw)
    (plan,) = plan_micro_batches(lengths, args.budget, 1)
    order = list(range(len(lengths)))
    fixed = [order[i : i + args.hf_micro_batch] for i in range(0, len(order), args.hf_micro_batch)]
    base = {"raw": raw, "threads": args.threads, "budget": args.budget}
    # patrl's trainers: checkpointing off, as "auto" resolves on CPU; "before" runs its defaults.
    plain = {"enable_gradient_checkpointing": False}
    out: dict[str, tuple[Any, int, dict[str, Any]]] = {
        "patrl": (run_patrl, 1, {**base, "overrides": plain}),
        "patrl-padded": (
            run_patrl,
            1,
            {**base, "overrides": {**plain, "use_remove_padding": False}},
        ),
        "hf-plain": (run_hf, 1, {**base, "micro_batches": plan, "padded": False}),
        "hf-padded": (run_hf, 1, {**base, "micro_batches": fixed, "padded": True}),
    }
    if args.before_src:
        out["before"] = (run_patrl, 1, {**base, "overrides": {}, "src": args.before_src})
    if not args.no_fsdp:
        out["patrl-fsdp1"] = (run_patrl, 1, {**base, "overrides": plain, "mesh": True})
        out["patrl-fsdp2"] = (run_patrl, 2, {**base, "overrides": plain, "mesh": True})
    return out


def bench_batch(args: Any, kind: str, flops_per_s: float) -> dict[str, Any]:
    from patrl.trainer import padded_fraction, plan_micro_batches

    raw = raw_batch(kind)
    lengths = lengths_of(raw)
    tokens = sum(lengths)
    variants = {
        name: Variant(fn, world, spec) for name, (fn, world, spec) in specs(args, raw).items()
    }
    for v in variants.values():
        v.wait_ready()
        v.step()  # warm-up, untimed
    for _ in range(args.steps):
        for v in variants.values():
            t, ph = v.step()
            v.times.append(t)
            v.phases.append(ph)
    for v in variants.values():
        v.stop()
    roofline_s = step_flops(lengths) / flops_per_s
    med = {name: statistics.median(v.times) for name, v in variants.items()}
    runs: dict[str, Any] = {}
    for name, v in variants.items():
        phases = (
            {p: statistics.median(ph[p] for ph in v.phases) for p in PHASES} if v.phases[0] else {}
        )
        if phases:
            phases["other"] = max(0.0, med[name] - sum(phases.values()))
        runs[name] = {
            "step_times_s": v.times,
            "median_step_s": med[name],
            "tokens_per_s": tokens / med[name],
            "vs_hf_plain": med[name] / med["hf-plain"],
            "vs_hf_padded": med[name] / med["hf-padded"],
            "roofline_fraction": roofline_s / med[name],
            "phase_share": {p: t / med[name] for p, t in phases.items()},
        }
    (plan,) = plan_micro_batches(lengths, args.budget, 1)
    fixed = list(range(0, len(lengths), args.hf_micro_batch))
    return {
        "samples": len(lengths),
        "real_tokens": tokens,
        "longest": max(lengths),
        "median_len": statistics.median(lengths),
        "patrl_micro_batches": len(plan),
        "padded_fraction_patrl_plan": padded_fraction(lengths, plan),
        "padded_fraction_hf_padded": padded_fraction(
            lengths, [list(range(i, min(i + args.hf_micro_batch, len(lengths)))) for i in fixed]
        ),
        "roofline_step_s": roofline_s,
        "profile_ratios": {
            "padding_cost (patrl-padded / patrl)": med["patrl-padded"] / med["patrl"],
            **(
                {"fsdp_ws1_overhead (fsdp1 / patrl)": med["patrl-fsdp1"] / med["patrl"]}
                if "patrl-fsdp1" in med
                else {}
            ),
            **(
                {"fsdp_ws2 (fsdp2 / patrl, 2x cores)": med["patrl-fsdp2"] / med["patrl"]}
                if "patrl-fsdp2" in med
                else {}
            ),
            **({"after / before": med["patrl"] / med["before"]} if "before" in med else {}),
        },
        "runs": runs,
    }


def print_batch(kind: str, b: dict[str, Any]) -> None:
    print(
        f"\n{kind}: {b['samples']} samples, {b['real_tokens']} tokens, longest {b['longest']}, "
        f"{b['patrl_micro_batches']} patrl micro-batches, roofline {b['roofline_step_s']:.2f} s"
    )
    print(
        f"{'variant':<13} {'median s':>8} {'tok/s':>7} {'/plain':>6} {'/hfpad':>6} {'roof':>5}  phases"
    )
    for name, r in b["runs"].items():
        ph = " ".join(f"{p[:4]} {s:.0%}" for p, s in r["phase_share"].items())
        print(
            f"{name:<13} {r['median_step_s']:>8.2f} {r['tokens_per_s']:>7.0f} {r['vs_hf_plain']:>6.2f} "
            f"{r['vs_hf_padded']:>6.2f} {r['roofline_fraction']:>5.0%}  {ph}"
        )
    for k, v in b["profile_ratios"].items():
        print(f"  {k}: {v:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batches", nargs="+", default=["short", "long"], choices=["short", "long"]
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--budget", type=int, default=4096, help="ppo_max_token_len_per_gpu")
    parser.add_argument("--hf-micro-batch", type=int, default=8, help="hf-padded samples/mb")
    parser.add_argument("--before-src", default=None, help="an older packages/trainer/src")
    parser.add_argument("--no-fsdp", action="store_true", help="skip the FSDP variants")
    args = parser.parse_args()

    flops = matmul_flops_per_s(args.threads)
    result: dict[str, Any] = {
        "machine": f"{os.cpu_count()} cpus, torch {torch.__version__}, load {os.getloadavg()[0]:.1f}",
        "args": vars(args),
        "matmul_gflops_per_s": flops / 1e9,
        "batches": {},
    }
    for kind in args.batches:
        result["batches"][kind] = b = bench_batch(args, kind, flops)
        print_batch(kind, b)
    out = Path(__file__).parent / "results" / "trainer_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"matmul {flops / 1e9:.1f} GFLOP/s ({args.threads} thread(s)); wrote {out}")


if __name__ == "__main__":
    main()
