"""Adaptive TP against the best static layout on 2 gloo ranks (issue 8, "Benchmark").

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/adaptive_tp_bench.py [--quick]
    python benchmarks/adaptive_tp_bench.py [--quick]     (starts the torchrun above itself)
    python benchmarks/adaptive_tp_bench.py --report benchmarks/results/adaptive_tp_bench.json

Shapes (random-init Llamas built here, fp32, saved with safetensors under
benchmarks/results/models or $PATRL_CACHE_DIR):
- "mqa_20l" (the crossover shape since 2026-11-25, 102M parameters: Gemma-2B's attention, one
  KV head of 256, on 20 layers of width 512 with 4 query heads and Llama-2's 32k vocabulary).
  A TP=2 group cannot split one KV head: both ranks hold it (as vLLM and our resharder
  replicate KV heads past their number), so each reads the context of all its sequences every
  step, where a tp-1 replica reads its half's. At long contexts that read weighs: with 8
  prompts of 448-512 tokens x 8 samples and responses up to 128 tokens, two tp-1 replicas of 32
  step 1.4-1.5x faster than one TP=2 group of 64 (profile, 544 tokens a sequence: 0.19-0.20 vs
  0.27-0.28 s), while TP=2 runs one sequence 1.4-1.5x faster (0.014 vs 0.021 s).
  `adaptive_ceiling` 0.82-0.83 (three profiles). Decode cells fork 8 samples a prompt
  (`ProfileGrid.samples_per_prompt`), as the rollouts do. A rollout takes 10-18 s.
- "vocab_2l_h512" (the crossover shape until 2026-11-25, 166M parameters: Qwen2.5-0.5B's
  151,936-token vocabulary and untied head, 94% of the weights, on 2 layers of width 512,
  intermediate 2816, 8 heads, 2 KV heads). At batch 1 TP=2 halves the head each rank reads
  (2026-11-24: tp2 0.010-0.012 vs tp1 0.016-0.018 s a step); at 64 sequences the ranks of a TP group each
  gather and sample all 64 rows of 152k logits (the engine samples replicated, as vLLM's TP
  workers do), which at this width costs more than the half head they save, so two tp-1
  replicas of 32 win (fitted 0.10-0.12 vs 0.14-0.16 s a step). Rollouts of 64 sequences,
  checks every 8 decode steps. How it was chosen: the vocab_2l family at widths 384-896 was
  profiled and each profile given to crossover_ceiling.py; on the per-sample long-tail
  workload the simulator put the planner (true lengths) at 0.87x the best static at width 512,
  0.88 at 640, 0.90 at 384, 448 and 576, and 0.92-0.94 at 896. A narrower model makes two
  replicas win the full batch by more (the replicated sampling weighs more beside the head)
  and TP win the tail by less; 512 balances the two. Most of that full-batch cost was glibc
  mapping each 39 MB temporary of the sampling afresh every step; since the engine samples in
  chunks of rows under its 32 MB mmap ceiling (e27477f), two replicas win the full batch by
  only 1.08x (fitted 0.094 vs 0.101 s a step), and this shape's crossover is too slight for
  the long-tail target: a shape with a real one is still to be found.
- "vocab_2l" (width 896, 302M parameters, Qwen2.5-0.5B's width and heads): the crossover shape
  until 2026-11-24. Two tp-1 replicas beat one tp-2 group at 64 sequences by only 1.17-1.2x,
  so even switching for free at every step adaptive could not beat 0.85x the best static on
  any workload (`patrl.lenpredict.adaptive_ceiling`: 0.84-0.86 on its profile); it measured
  0.88-0.90x on the per-sample long tail.
- "wide_2l" (the first crossover candidate, 159M parameters: hidden 2048, intermediate 8192,
  2 layers, 16 heads, 8 KV heads, vocab 8192). The hoped-for crossover: at batch 1 a decode step
  is memory-bound (every weight read once a step), so TP=2 halves the bytes each rank reads
  for a few gloo collectives a step; at a large batch the step is compute-bound, TP splits the
  compute as well as DP does, and the collectives and the per-sequence work TP does not split
  (sampling, scheduling) should make two replicas faster. Few layers: few collectives a step.
  Since the TP collectives go through shared memory (ShmComm), TP=2 wins at batch 1 (0.019-0.026
  vs 0.029-0.034 s) and also at the rollouts' full batch (32 sequences: tp2 0.08-0.11 s a step
  vs 0.10-0.12 s for two batch-16 replicas): two replicas on one socket share its memory
  bandwidth and each reads all the weights, while a TP rank reads half. The fitted model's
  crossover, in the profiles that show one, is at 64 sequences, past these rollouts (and
  past what the profile measured): on this box there is no shape with a crossover inside a
  rollout's batch, so adaptive is held to "open at the best static layout and stay there".
- "wide_6l" (111M: hidden 1024, intermediate 4096, 6 layers): the first candidate, kept to
  re-profile with --shapes wide_6l --profile-only. Over gloo its 15 collectives a step made
  TP=2 lose even at batch 1; through shared memory TP=2 is 1.5x faster at batch 1 and 2x at batch 32
  (2026-11-23: 0.016 vs 0.024 s, 0.063 vs 0.124 s): no crossover either.
- "tiny": 2 layers, hidden 64: steps cost about as much as a collective, so TP=2 never pays
  and adaptive must simply not switch.
Each shape is profiled once here by `patrl.rollout.profile.profile_distributed` (written
atomically), and that file is the adaptive engines' `AdaptiveTP.profile`.

Workloads (lengths imposed with ignore_eos and per-request max_tokens; the same prompts and
seeds for every policy): uniform, long-tail (log-normal quantiles, capped: most short, a few
5-10x longer) and bimodal, n samples per prompt all of one length; and long-tail per sample
(simulate_cluster's DeepScaleR-like `LongTailSpec` scaled to the cap: each of a prompt's n
samples its own length, so each is sent as a request of one sample, the prompt's key shared:
the engine computes the repeated prompt once and its length predictor takes the requests of
one key as one group, as TRL sends a GRPO group). Both long-tail workloads are held to the
long-tail target.
Policies: static (dp2, tp1); static (dp1, tp2); adaptive with the engine's online length
predictor (after one untimed warm-up rollout of the same prompts and prompt keys, so it has
history, as in steady-state RL); adaptive with oracle lengths (`OracleLengths`); "cold"
adaptive, predicted lengths, reopened at tp 1 before every rollout (PAT's setting: the
layout moves only by the mid-rollout planner, whose switches the decision audit then shows).
The adaptive policies open where the first check of their previous rollout said (the steady
state of an RL run; every workload gets one untimed rollout first, as a new batch shape would
in RL). Every dp2 policy gets the same length-aware split (`Workload.replica_split`:
longest-processing-time first on the imposed lengths, a prompt's samples on one replica).
As in an RL step, every engine loads the full weights before each rollout (untimed, the
weight sync; for an adaptive engine it also makes the way back to its opening layout, which
RL gets for free); reported apart as `sync_s`.
Latency of a rollout: barrier, then `generate`; the max over ranks of its wall time. Each
repeat runs every policy once, in turn (interleaved, so load drifts on this shared machine hit
all policies alike); reported: the median over repeats and its ratio to the best static one
(the targets' measure), and the median of per-repeat ratios to the best static run of the same
repeat (paired: a slow stretch of this shared box hits both, so it is less noisy). Each repeat
starts the order one policy later: a policy's place in it moved its time by up to 6%.

Also reported: every switch decision's predicted gain / overhead / finish against the measured
overhead and finish (the measured gain is taken against the static (dp2, tp1) run of the same
repeat, which runs the same schedule up to the switch); the control overhead on the critical
path (each rollout's wall time less its switches and its busiest rank's decode time: the
checks, and the waits their synchronisation imposes) as a fraction of the busiest rank's decode
time; the simulator fed
the measured lengths and the fitted latency model, simulated vs measured for every policy; and
what switching for free at every step would take on each workload (`lockstep_free_switch`,
decode only, replicas in lockstep, on the latency model: an estimate, not a bound), noted on a
target row NOT MET where even that estimate misses the target.
Writes benchmarks/results/adaptive_tp_bench.json and a PNG timeline of a cold adaptive long-tail
rollout; prints the tables. --quick: the tiny shape and tiny workloads, to check the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from patrl.lenpredict import (
    AdaptivePolicy,
    LatencyModel,
    Layout,
    LongTailSpec,
    PlannerConfig,
    Profile,
    PromptGroup,
    ReconfigPlanner,
    RolloutSimulator,
    SimConfig,
    StaticPolicy,
    adaptive_ceiling,
    group_by_step,
    lockstep_free_switch,
    long_tail_trace,
    longest_processing_time,
)
from patrl.rollout import (
    AdaptiveEngine,
    AdaptiveTP,
    Engine,
    EngineConfig,
    OracleLengths,
    RequestOutput,
    SamplingParams,
    plot_timeline,
)
from patrl.rollout.loader import iter_checkpoint
from patrl.rollout.profile import ProfileGrid, profile_distributed, write_atomic
from patrl.tpreshard import GroupCache

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = (
    "static_dp2_tp1",
    "static_dp1_tp2",
    "adaptive_predicted",
    "adaptive_oracle",
    "adaptive_cold",
)
ADAPTIVE = POLICIES[2:]
STATIC = POLICIES[:2]
BLOCK = 16
CHECK_EVERY = AdaptiveTP().check_every  # the engine's default (--check-every overrides)
MAX_POSITIONS = 1024  # mqa_20l's contexts reach 641 tokens
MARGIN = 0.2
TARGET_LONG_TAIL = 0.85  # adaptive / best static on long-tail, shape with a crossover
TARGET_ELSEWHERE = 1.03
TARGET_CONTROL = 0.02  # control time / decode time


# what a shape is for: "crossover" shapes are held to the long-tail speed-up target, "none"
# shapes to no switching
def vocab_2l(hidden: int) -> dict[str, Any]:
    """Qwen2.5-0.5B's 151,936-token vocabulary and untied head on 2 layers of width `hidden`
    (intermediate 5.5x, heads of 64, or 32 where that gives an odd count, 2 KV heads)."""
    head_dim = 64 if (hidden // 64) % 2 == 0 else 32
    return dict(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 2 // 32 * 32,
        num_hidden_layers=2,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=False,
    )


# what a shape is for: "crossover" shapes are held to the long-tail speed-up target, "none"
# shapes to no switching. The vocab_2l family at any width is "vocab_2l_h<width>".
SHAPE_ROLE = {
    "mqa_20l": "crossover",
    "vocab_2l_h512": "crossover",
    "wide_2l": "none",
    "wide_6l": "none",
    "tiny": "none",
}
SHAPES: dict[str, dict[str, Any]] = {
    # Gemma-2B's attention (one KV head of 256) on 20 layers of width 512, Llama-2's 32k
    # vocabulary: 102M parameters
    "mqa_20l": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=20,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
    "wide_6l": dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=8192,
        tie_word_embeddings=False,
    ),
    "wide_2l": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=8192,
        tie_word_embeddings=False,
    ),
    # Qwen2.5-0.5B's width, heads and vocabulary, 2 layers: 302M parameters, 90% of them the
    # embedding and the untied head (the crossover shape until 2026-11-24)
    "vocab_2l": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=2,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    # the crossover shape: 166M parameters, 94% of them the embedding and the head
    "vocab_2l_h512": vocab_2l(512),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
}


@dataclass(frozen=True, slots=True)
class Scale:
    """How big one shape's runs are."""

    prompts_per_replica: int
    n: int
    max_len: int  # cap on imposed response lengths
    prompt_len: tuple[int, int]  # prompt tokens drawn in [lo, hi]
    grids: tuple[ProfileGrid, ...]  # profiled one after the other, rows merged
    # at least this many repeats: a tiny-shape rollout lasts ~0.2 s, and one burst of load on
    # this shared box moves a single run by up to 50%, so its median needs more of them
    min_repeats: int = 1
    # decode steps between planner checks; None: --check-every (the engine's default, 64).
    # A rollout of at most 96 tokens gets its tail seen within 8 steps of it starting.
    check_every: int | None = None
    # tokens a sequence holds, for the profile summary's step times and ceiling
    context_per_seq: int = 32

    @property
    def num_prompts(self) -> int:
        return 2 * self.prompts_per_replica

    @property
    def max_model_len(self) -> int:
        return self.prompt_len[1] + self.max_len + 1


def _grid(
    batches: tuple[int, ...],
    contexts: tuple[int, ...],
    passes: int = 3,
    prefill: tuple[int, ...] = (16, 64, 256),
    samples_per_prompt: int = 1,
) -> ProfileGrid:
    return ProfileGrid(
        tp_sizes=(1, 2),
        batch_sizes=batches,
        contexts=contexts,
        prefill_tokens=prefill,
        samples_per_prompt=samples_per_prompt,
        collective_bytes=(4, 4096, 65536, 1 << 20, 4 << 20),
        decode_steps=4,
        passes=passes,
        warmup_steps=4,
    )


def scale_for(shape: str, quick: bool) -> Scale:
    if quick:
        return Scale(4, 2, 32, (8, 16), (_grid((1, 2, 4, 8), (16, 48), passes=2),))
    if shape == "tiny":
        return Scale(8, 4, 160, (16, 24), (_grid((1, 4, 16, 32), (16, 96, 184)),), min_repeats=15)
    # 100M+ parameters at 1 thread on a loaded 2-core box: a batch-16 step takes ~0.2-0.5 s,
    # so 4 prompts x 4 samples per replica and responses up to 96 tokens keep a rollout near
    # 5-30 s. The profiler prefills every cell's batch x context tokens, minutes per pass
    # for a large batch at a long context here; so two grids: every batch size at a short
    # context, small batches at the longest one (which pins the per-context-token term).
    # Batch 32 is the whole rollout on one tp-2 replica: without it the model extrapolated
    # tp 2 past batch 16 and priced (dp 1, tp 2) slower than the measured static runs.
    # Batch 16 at the long context too: a full replica's per-context-token cost, which the
    # model took from batches 1 and 4 alone and got wrong by 30% at the rollouts' contexts.
    # Batches 2 and 3 (8 at the short context): single-threaded sgemm runs 2-3 rows of the
    # 152k-row head at a row's cost each (batch 3 slower than batch 4), and a tail of 1-3
    # sequences a replica is where the fold pays; without them the model priced those steps
    # 15-45% low and a stay's finish about 25% early (predicted gain of the fold 0.30-0.47 s with
    # true lengths, measured 0.61-0.76 s; with them 0.66 s, measured 0.67-0.79 s).
    if shape == "mqa_20l":
        # 8 prompts of ~480 tokens x 8 samples, responses up to 128 tokens: contexts of
        # 450-640 tokens, where the replicated KV head weighs (module docstring). Decode cells
        # fork 8 samples a prompt, as the rollouts do: a distinct 576-token prompt for each of
        # 64 sequences would take minutes a cell to prefill here.
        grid = _grid(
            (1, 2, 3, 4, 8, 16, 32, 64), (256, 576), prefill=(16, 128, 512), samples_per_prompt=8
        )
        return Scale(4, 8, 128, (448, 512), (grid,), check_every=8, context_per_seq=544)
    if shape.startswith("vocab_2l"):
        # 64 sequences: 32 per tp-1 replica, where two replicas beat one tp-2 group
        return Scale(
            8,
            4,
            96,
            (16, 24),
            (_grid((1, 2, 3, 4, 8, 16, 32, 64), (16,)), _grid((1, 2, 3, 4, 16, 32), (112,))),
            check_every=8,
        )
    return Scale(4, 4, 96, (16, 24), (_grid((1, 4, 16, 32), (16,)), _grid((1, 4, 16), (112,))))


# ----------------------------------------------------------------------------- workloads


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests of `n` samples each, all of a request's samples `lengths[i]` tokens long. A
    workload whose samples of one prompt differ sends each sample as a request of its own
    (n 1, the prompt repeated: the engine has one max_tokens per request) with `prompt_ids`
    naming the prompt, whose key makes them one group to the length predictor."""

    name: str
    prompts: list[list[int]]
    lengths: list[int]  # imposed response length of each request's samples
    n: int
    prompt_ids: tuple[int, ...] | None = None

    def params(self) -> list[SamplingParams]:
        return [
            SamplingParams(temperature=1.0, seed=1000 + i, n=self.n, max_tokens=L, ignore_eos=True)
            for i, L in enumerate(self.lengths)
        ]

    def keys(self) -> list[str]:
        return [f"{self.name}-{i}" for i in self.ids()]

    def ids(self) -> Sequence[int]:
        """The prompt of each request."""
        return self.prompt_ids or range(len(self.prompts))

    def groups(self) -> dict[int, list[int]]:
        """Each prompt's requests (one, or one per sample), in first-seen order."""
        out: dict[int, list[int]] = {}
        for request, prompt in enumerate(self.ids()):
            out.setdefault(prompt, []).append(request)
        return out

    def prompt_groups(self) -> list[PromptGroup]:
        """The simulator's view: one group per prompt with all its samples' lengths."""
        return [
            PromptGroup(
                f"p{prompt}",
                len(self.prompts[requests[0]]),
                tuple(self.lengths[r] for r in requests for _ in range(self.n)),
            )
            for prompt, requests in self.groups().items()
        ]

    def replica_split(self, num_replicas: int = 2) -> list[int]:
        """Each request's replica: longest-processing-time first on the imposed work, a
        prompt's requests together (as GRPO keeps a prompt's n samples on one replica, which
        prefills the prompt once for them all; the engine computes a prompt repeated in
        requests once, too)."""
        groups = self.groups()
        work = [self.n * sum(self.lengths[r] for r in requests) for requests in groups.values()]
        replica_of_group = longest_processing_time(work, num_replicas)
        out = [0] * len(self.prompts)
        for replica, requests in zip(replica_of_group, groups.values(), strict=True):
            for r in requests:
                out[r] = replica
        return out


def lognormal_quantiles(count: int, median: float, sigma: float) -> np.ndarray:
    """Evenly spaced quantiles of a log-normal: a deterministic, representative sample."""
    from statistics import NormalDist

    z = np.array([NormalDist().inv_cdf((i + 0.5) / count) for i in range(count)])
    return median * np.exp(sigma * z)


def make_workloads(scale: Scale, vocab: int, seed: int = 0) -> list[Workload]:
    rng = np.random.default_rng(seed)
    count, cap = scale.num_prompts, scale.max_len
    lo, hi = scale.prompt_len
    prompts = [rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in range(count)]
    uniform = rng.integers(cap // 4, cap // 2 + 1, count)
    tail = np.clip(lognormal_quantiles(count, cap / 10, 1.4), 2, cap)
    short = count - max(count // 4, 1)
    bimodal = np.r_[
        rng.integers(cap // 12, cap // 6 + 1, short),
        rng.integers(cap * 3 // 4, cap + 1, count - short),
    ]
    out = []
    for name, lengths in (("uniform", uniform), ("long_tail", tail), ("bimodal", bimodal)):
        order = rng.permutation(count)  # long and short prompts interleaved, not sorted
        out.append(Workload(name, prompts, [int(lengths[i]) for i in order], scale.n))
    out.append(per_sample_long_tail(prompts, scale, seed))
    return out


def per_sample_long_tail(prompts: list[list[int]], scale: Scale, seed: int) -> Workload:
    """simulate_cluster's DeepScaleR-like law (`LongTailSpec`: per-prompt scale and failure
    rate, log-normal per-sample noise, capped) with its median:cap ratio (2000:16384) kept at
    this cap, every sample its own length: a GRPO group's samples differ, and the tail is a
    few samples of many prompts, not whole prompts. crossover_ceiling.py found this law the
    one where the measured profile lets adaptive gain most (0.85x at 16 x 4, simulated)."""
    default = LongTailSpec()
    median = float(round(scale.max_len * default.median / default.max_length))
    groups = long_tail_lengths(len(prompts), scale.n, median, scale.max_len, seed)
    requests, lengths, ids = [], [], []
    for i, group in enumerate(groups):
        for length in group:
            requests.append(prompts[i])
            lengths.append(length)
            ids.append(i)
    return Workload("long_tail_per_sample", requests, lengths, 1, tuple(ids))


def long_tail_lengths(prompts: int, n: int, median: float, cap: int, seed: int) -> list[list[int]]:
    """Each prompt's n response lengths under `LongTailSpec` with this median and cap, at least
    2 tokens (the bench imposes them with max_tokens; one token leaves no decode step)."""
    spec = dataclasses.replace(LongTailSpec(), median=median, max_length=cap)
    groups = group_by_step(long_tail_trace(spec, prompts, n, steps=1, seed=seed))[0]
    return [[max(2, int(t)) for t in g.response_tokens] for g in groups]


# ----------------------------------------------------------------------------- model, profile


def cache_root() -> Path:
    return Path(os.environ.get("PATRL_CACHE_DIR", RESULTS / "models"))


def model_dir(shape: str) -> Path:
    return cache_root() / f"adaptive_tp_{shape}"


def shape_config(shape: str) -> dict[str, Any]:
    """The Llama config fields of a named shape, or of "vocab_2l_h<width>" for any width."""
    if shape in SHAPES:
        return SHAPES[shape]
    width = shape.removeprefix("vocab_2l_h")
    if shape.startswith("vocab_2l_h") and width.isdigit() and int(width) % 64 == 0:
        return vocab_2l(int(width))
    raise SystemExit(
        f"unknown shape {shape!r}; choose from {sorted(SHAPES)} or vocab_2l_h<width>, the "
        "width a multiple of 64"
    )


def shape_role(shape: str) -> str:
    return SHAPE_ROLE.get(shape, "crossover" if shape.startswith("vocab_2l") else "none")


def build_model(shape: str) -> Path:
    """Rank 0 only: save a random-init Llama of `shape` once (write, then rename); a cached
    one of other dimensions (a shape whose definition changed) is built again."""
    path = model_dir(shape)
    wanted = shape_config(shape)
    if (path / "config.json").is_file():
        cached = json.loads((path / "config.json").read_text())
        if all(cached.get(k) == v for k, v in wanted.items()):
            return path
        shutil.rmtree(path)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=MAX_POSITIONS, **wanted)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(config).save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)
    return path


def base_config(model: Path, scale: Scale) -> EngineConfig:
    # every sample of the rollout on one replica (after a switch to tp 2): each prompt's
    # blocks once (its samples share them), each sample's response and its copy of the
    # prompt's last, partly filled block, plus slack
    prompt_blocks = scale.num_prompts * -(-scale.prompt_len[1] // BLOCK)
    sample_blocks = scale.num_prompts * scale.n * (-(-scale.max_len // BLOCK) + 2)
    return EngineConfig(
        model=str(model),
        dtype="float32",
        device="cpu",
        block_size=BLOCK,
        num_kv_blocks=prompt_blocks + sample_blocks + 16,
        max_num_seqs=scale.num_prompts * scale.n,
        max_num_batched_tokens=max(2048, scale.max_model_len),
        max_model_len=scale.max_model_len,
    )


def profile_shape(base: EngineConfig, scale: Scale, path: Path, world: Any) -> float:
    """Profile every grid on all ranks; rank 0 merges the rows and writes `path` atomically."""
    start = time.perf_counter()
    profiles = [profile_distributed(base, grid, world) for grid in scale.grids]
    if dist.get_rank(world) == 0:
        first = profiles[0]
        assert first is not None
        merged = first.model_copy(
            update={
                "decode": [r for p in profiles if p for r in p.decode],
                "prefill": [r for p in profiles if p for r in p.prefill],
                "switches": [r for p in profiles if p for r in p.switches],
                "notes": {**first.notes, "grid": " + ".join(repr(g) for g in scale.grids)},
            }
        )
        write_atomic(merged, path)
    dist.barrier(group=world)
    return time.perf_counter() - start


def profile_summary(profile: Profile, rollout_batch: int, ctx: int = 32) -> dict[str, Any]:
    """Measured step times at tp 1 and 2 for batch 1 and the largest batch (shortest context),
    and whether the fitted model has a crossover where the rollouts can use it: TP=2 faster
    for one sequence, two tp-1 replicas faster for the rollouts' full batch (`rollout_batch`
    sequences: half per replica at tp 1, all of them at tp 2)."""
    batches = sorted({r.batch for r in profile.decode})
    rows: dict[str, float] = {}
    for tp in (1, 2):
        for b in (batches[0], batches[-1]):
            cells = [r for r in profile.decode if r.tp == tp and r.batch == b]
            rows[f"tp{tp}_b{b}_s"] = min(cells, key=lambda r: r.context_tokens).seconds
    lm = LatencyModel.fit(profile)
    big = -(-rollout_batch // 2)

    def step(tp: int, b: int) -> float:
        return float(lm.step_time(tp, b, b * ctx))

    small_tp2 = step(2, 1) < step(1, 1)
    big_dp = step(1, big) < step(2, 2 * big)
    ceiling = adaptive_ceiling(lm, Layout(2, 1), Layout(1, 2), rollout_batch, ctx)
    return {
        "measured": rows,
        "model": {
            "tp1_b1_s": step(1, 1),
            "tp2_b1_s": step(2, 1),
            f"tp1_b{big}_s (dp2 x {big})": step(1, big),
            f"tp2_b{2 * big}_s (dp1 x {2 * big})": step(2, 2 * big),
            "context_per_seq": ctx,
        },
        "crossover": bool(small_tp2 and big_dp),
        "tp2_faster_at_batch_1": bool(small_tp2),
        "dp2_faster_at_largest_batch": bool(big_dp),
        # the least adaptive / best static any workload of at most rollout_batch sequences
        # allows, switching for free (patrl.lenpredict.ceiling)
        "ceiling": dataclasses.asdict(ceiling),
    }


# ----------------------------------------------------------------------------- runs


@dataclass(slots=True)
class Engines:
    static_dp: Engine
    static_tp: Engine
    predicted: AdaptiveEngine
    oracle: AdaptiveEngine
    oracle_lengths: OracleLengths
    cold: AdaptiveEngine

    def of(self, policy: str) -> Engine | AdaptiveEngine:
        engines: dict[str, Engine | AdaptiveEngine] = {
            "static_dp2_tp1": self.static_dp,
            "static_dp1_tp2": self.static_tp,
            "adaptive_predicted": self.predicted,
            "adaptive_oracle": self.oracle,
            "adaptive_cold": self.cold,
        }
        return engines[policy]


def set_check_every(steps: int) -> None:
    global CHECK_EVERY
    CHECK_EVERY = steps


def make_engines(
    base: EngineConfig, profile: Path, groups: GroupCache, check_every: int
) -> Engines:
    adaptive = base.model_copy(
        update={
            "tp_policy": AdaptiveTP(
                candidates=(1, 2),
                check_every=check_every,
                margin=MARGIN,
                kv_policy="auto",
                profile=str(profile),
            )
        }
    )
    oracle = OracleLengths({})
    return Engines(
        static_dp=Engine(base, groups.layout(1), groups),
        static_tp=Engine(base, groups.layout(2), groups),
        predicted=AdaptiveEngine(adaptive, groups=groups),
        oracle=AdaptiveEngine(adaptive, groups=groups, lengths=oracle),
        oracle_lengths=oracle,
        cold=AdaptiveEngine(adaptive, groups=groups),
    )


def my_share(policy: str, workload: Workload, replica_of: list[int], rank: int) -> list[int]:
    """Prompt indices this rank generates: its replica's, or all of them at tp 2."""
    if policy == "static_dp1_tp2":
        return list(range(len(workload.prompts)))
    return [i for i, r in enumerate(replica_of) if r == rank]


def tell_oracle(engines: Engines, workload: Workload, mine: list[int], world: Any) -> None:
    """Every rank's request ids of the coming rollout with their lengths, to every rank (rank
    0 plans for all replicas)."""
    engine = engines.oracle
    first = engine.next_request_number()
    rank = dist.get_rank(world)
    lengths = {
        (f"req-{rank}-{first + j}", k): workload.lengths[i]
        for j, i in enumerate(mine)
        for k in range(workload.n)
    }
    gathered: list[Any] = [None] * dist.get_world_size(world)
    dist.all_gather_object(gathered, lengths, group=world)
    for part in gathered:
        engines.oracle_lengths.final.update(part)


def rollout(
    engines: Engines,
    policy: str,
    workload: Workload,
    replica_of: list[int],
    world: Any,
) -> dict[str, Any]:
    rank = dist.get_rank(world)
    engine = engines.of(policy)
    mine = my_share(policy, workload, replica_of, rank)
    if policy == "adaptive_oracle":
        tell_oracle(engines, workload, mine, world)
    params = workload.params()
    if policy == "adaptive_cold":
        # PAT's setting: every rollout opens wide (tp 1) and only the mid-rollout planner
        # moves it
        cold = engines.cold
        controller = cold.controller
        assert controller is not None and cold.groups is not None
        controller.opening_tp = controller.policy.start_tp
        cold.return_later(cold.groups.layout(controller.policy.start_tp))
    # the RL step's weight sync, untimed: an adaptive engine goes back to its opening layout
    # in it (the model rebuilt there from the full tensors), as it does in the RL loop
    dist.barrier(group=world)
    start = time.perf_counter()
    engine.load_weights(iter_checkpoint(engine.config.model), engine.weight_version + 1)
    sync_s = time.perf_counter() - start
    before = engine.stats()
    dist.barrier(group=world)
    start = time.perf_counter()
    outs = engine.generate(
        [workload.prompts[i] for i in mine],
        [params[i] for i in mine],
        prompt_keys=[workload.keys()[i] for i in mine],
    )
    seconds = time.perf_counter() - start
    check_lengths(outs, [workload.lengths[i] for i in mine], policy)
    stats = engine.stats()
    times: list[Any] = [None] * dist.get_world_size(world)
    dist.all_gather_object(times, (seconds, sync_s), group=world)
    record: dict[str, Any] = {
        "latency_s": max(t for t, _ in times),
        "sync_s": max(t for _, t in times),
        "rank_s": [t for t, _ in times],
    }
    if policy.startswith("adaptive"):
        keys = ("tp_control_s", "tp_decode_s", "tp_critical_control_s", "tp_critical_decode_s")
        for key in (*keys, "tp_planner_s", "tp_reconfig_s", "tp_reset_s"):
            record[key] = stats[key] - before[key]
        record["switches"] = int(stats["tp_switches"] - before["tp_switches"])
        record["checks"] = int(stats["tp_checks"] - before["tp_checks"])
        record["decisions"] = stats["tp_decisions"]
        record["timeline"] = stats["timeline"]
    return record


def check_lengths(outs: Sequence[RequestOutput], lengths: list[int], policy: str) -> None:
    """The benchmark imposes every length: a different one means the comparison is void."""
    for out, want in zip(outs, lengths, strict=True):
        got = [len(c.token_ids) for c in out.outputs]
        if got != [want] * len(got):
            raise RuntimeError(f"{policy}: request {out.request_id} generated {got}, not {want}")


def profiled_with(path: Path, scale: Scale) -> bool:
    """Whether `path` holds a profile of these grids (`profile_shape` notes them)."""
    if not path.is_file():
        return False
    grid = " + ".join(repr(g) for g in scale.grids)
    return Profile.load(path).notes.get("grid") == grid


def run_shape(
    shape: str,
    scale: Scale,
    repeats: int,
    world: Any,
    suffix: str,
    profile_only: bool = False,
    reuse_profile: bool = False,
) -> dict[str, Any]:
    rank = dist.get_rank(world)
    if rank == 0:
        build_model(shape)
    dist.barrier(group=world)
    model = model_dir(shape)
    base = base_config(model, scale)
    profile_path = RESULTS / f"adaptive_tp_profile_{shape}{suffix}.json"
    timeline_png = RESULTS / f"adaptive_tp_timeline_{shape}{suffix}.png"
    if reuse_profile and profiled_with(profile_path, scale):
        log(rank, f"[{shape}] reusing {profile_path}")
        profile_s = 0.0
    else:
        log(rank, f"[{shape}] profiling ...")
        profile_s = profile_shape(base, scale, profile_path, world)
    profile = Profile.load(profile_path)
    summary = profile_summary(profile, scale.num_prompts * scale.n, scale.context_per_seq)
    log(rank, f"[{shape}] profile in {profile_s:.0f} s: {json.dumps(summary)}")
    if profile_only:
        return {"profile_path": str(profile_path), "profile_s": profile_s, "profile": summary}

    groups = GroupCache([1, 2], world_size=dist.get_world_size(world), rank=rank)
    engines = make_engines(base, profile_path, groups, scale.check_every or CHECK_EVERY)
    workloads = make_workloads(scale, profile.model.vocab_size)
    warm = Workload("warmup", workloads[0].prompts[:2], [4, 4], scale.n)
    for policy in POLICIES:  # first steps of an engine pay one-off allocations
        rollout(engines, policy, warm, [0, 1], world)
    out: dict[str, Any] = {
        "shape": {**shape_config(shape), "num_params": profile.model.num_params},
        "profile_path": str(profile_path),
        "profile_s": profile_s,
        "profile": summary,
        "check_every": scale.check_every or CHECK_EVERY,
        "workloads": {},
    }
    for workload in workloads:
        replica_of = workload.replica_split()
        # warm-up: the online predictor gets this prompt set's history, and every adaptive
        # engine's first check names where this batch opens (steady-state RL)
        for policy in ADAPTIVE:
            rollout(engines, policy, workload, replica_of, world)
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
        for rep in range(repeats):
            # one policy later each repeat: a policy's place in the order moved its time
            # (static (dp2, tp1) run after the adaptive engines took 17.3-17.8 s, after one
            # static and one adaptive engine 16.4-16.6 s; 2026-11-25, uniform, mqa_20l)
            shift = rep % len(POLICIES)
            for policy in POLICIES[shift:] + POLICIES[:shift]:
                runs[policy].append(rollout(engines, policy, workload, replica_of, world))
                log(
                    rank,
                    f"[{shape}] {workload.name} rep {rep} {policy}: {runs[policy][-1]['latency_s']:.2f} s",
                )
        if workload.name == "long_tail" and rank == 0:
            last = runs["adaptive_cold"][-1]  # opens wide: the planner's switch shows
            plot_timeline(
                last["timeline"],
                last["decisions"],
                timeline_png,
                title=f"{shape}: adaptive opened at tp 1 (predicted lengths), long-tail, rank 0",
            )
        out["workloads"][workload.name] = summarise(workload, replica_of, runs, scale)
    if rank == 0:
        simulate(out, profile, workloads, scale)
    return out


def summarise(
    workload: Workload, replica_of: list[int], runs: dict[str, list[dict[str, Any]]], scale: Scale
) -> dict[str, Any]:
    medians = {p: statistics.median(r["latency_s"] for r in runs[p]) for p in POLICIES}
    best = min(STATIC, key=lambda p: medians[p])
    policies: dict[str, Any] = {}
    for p in POLICIES:
        entry: dict[str, Any] = {
            "latency_s": [r["latency_s"] for r in runs[p]],
            "median_s": medians[p],
            "vs_best_static": medians[p] / medians[best],
            # each repeat against the best static run of the same repeat (they ran back to
            # back, so a slow stretch of this shared box hits both): less noisy than the above
            "paired_vs_best_static": statistics.median(
                a["latency_s"] / b["latency_s"] for a, b in zip(runs[p], runs[best], strict=True)
            ),  # (print_report derives it from latency_s, for files written before it)
            "sync_s": [r["sync_s"] for r in runs[p]],
        }
        if p.startswith("adaptive"):
            control = sum(r["tp_control_s"] for r in runs[p])
            decode = sum(r["tp_decode_s"] for r in runs[p])
            critical = sum(r["tp_critical_control_s"] for r in runs[p])
            critical_decode = sum(r["tp_critical_decode_s"] for r in runs[p])
            entry.update(
                switches=[r["switches"] for r in runs[p]],
                checks=[r["checks"] for r in runs[p]],
                opening_tp=[r["timeline"][0]["tp_size"] for r in runs[p] if r["timeline"]],
                # rank 0's own check time, waiting for a busier replica included
                control_s=control,
                decode_s=decode,
                rank0_control_fraction=control / decode if decode else None,
                # what control (checks, and the waits they impose) added to the critical
                # path (see patrl.rollout.adaptive.critical_path)
                critical_control_s=critical,
                critical_decode_s=critical_decode,
                control_fraction=critical / critical_decode if critical_decode else None,
                planner_s=sum(r["tp_planner_s"] for r in runs[p]),
                reconfig_s=sum(r["tp_reconfig_s"] for r in runs[p]),
                reset_s=sum(r["tp_reset_s"] for r in runs[p]),
                switch_decisions=audit(runs[p], runs["static_dp2_tp1"]),
            )
        policies[p] = entry
    return {
        "lengths": workload.lengths,
        "prompt_tokens": [len(p) for p in workload.prompts],
        "n": workload.n,
        "prompt_ids": list(workload.prompt_ids) if workload.prompt_ids else None,
        "replica_of": replica_of,
        "best_static": best,
        "policies": policies,
    }


def audit(runs: list[dict[str, Any]], static_dp: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each switch decision with its prediction and what was measured. Up to the switch the
    adaptive rollout runs the static (dp2, tp1) schedule, so that run of the same repeat, less
    the switch time, stands in for "had it stayed" (net of the check overhead between them)."""
    out = []
    for rep, (run, static) in enumerate(zip(runs, static_dp, strict=True)):
        for d in run["decisions"]:
            if d["action"] != "switch":
                continue
            stay_s = static["latency_s"] - d["t"]
            measured_net = stay_s - d["measured_finish_s"]
            out.append(
                {
                    "repeat": rep,
                    "t": d["t"],
                    "tp": f"{d['current_tp']}->{d['target_tp']}",
                    "num_seqs": d["num_seqs"],
                    "migrated": d["num_migrated"],
                    "recomputed": d["num_recomputed"],
                    "predicted_gain_s": d["predicted_gain_s"],
                    "predicted_overhead_s": d["predicted_overhead_s"],
                    "predicted_net_s": d["predicted_gain_s"] - d["predicted_overhead_s"],
                    "predicted_finish_s": d["predicted_finish_s"],
                    "measured_overhead_s": d["measured_overhead_s"],
                    "measured_finish_s": d["measured_finish_s"],
                    "measured_stay_finish_s": stay_s,
                    "measured_net_s": measured_net,
                    "measured_gain_s": measured_net + (d["measured_overhead_s"] or 0.0),
                }
            )
    return out


def simulator_for(
    latency: LatencyModel, scale: Scale, seqs: int
) -> tuple[RolloutSimulator, PlannerConfig]:
    """The rollout simulator and planner settings of this bench's engines (2 ranks, LPT,
    the shape's check interval) for rollouts of `seqs` sequences."""
    config = SimConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=max(2048, scale.max_model_len),
        block_size=BLOCK,
        plan_interval_steps=scale.check_every or CHECK_EVERY,
        assignment="lpt",
    )
    planner_config = PlannerConfig(candidate_tp=(1, 2), margin=MARGIN, max_num_seqs=seqs)
    return RolloutSimulator(latency, 2, config), planner_config


def simulate(
    out: dict[str, Any], profile: Profile, workloads: list[Workload], scale: Scale
) -> None:
    """The simulator fed each workload's measured lengths and this profile's latency model."""
    latency = LatencyModel.fit(profile)
    sim, planner_config = simulator_for(latency, scale, scale.num_prompts * scale.n)
    for workload in workloads:
        entry = out["workloads"][workload.name]
        groups = workload.prompt_groups()
        tp = statistics.mode(entry["policies"]["adaptive_oracle"]["opening_tp"] or [1])
        policies: dict[str, StaticPolicy | AdaptivePolicy] = {
            "static_dp2_tp1": StaticPolicy(Layout(dp=2, tp=1)),
            "static_dp1_tp2": StaticPolicy(Layout(dp=1, tp=2)),
            # where the measured runs opened (the first check's choice of the rollout before)
            "adaptive_oracle": AdaptivePolicy(
                ReconfigPlanner(latency, 2, planner_config), start=Layout(dp=2 // tp, tp=tp)
            ),
            "adaptive_cold": AdaptivePolicy(
                ReconfigPlanner(latency, 2, planner_config), start=Layout(dp=2, tp=1)
            ),
        }
        free = lockstep_free_switch(
            latency,
            Layout(dp=2, tp=1),
            Layout(dp=1, tp=2),
            np.repeat(workload.lengths, workload.n),
            np.repeat([len(p) for p in workload.prompts], workload.n),
            np.repeat(workload.replica_split(), workload.n),
        )
        entry["lockstep_free_switch"] = {
            "dp2_s": free.wide_s,
            "tp2_s": free.narrow_s,
            "free_s": free.free_s,
            "ratio": free.ratio,
        }
        for name, policy in policies.items():
            result = sim.run(groups, policy)  # split on the true lengths, as measured
            measured = entry["policies"][name]["median_s"]
            entry["policies"][name]["simulated_s"] = result.total_s
            entry["policies"][name]["sim_over_measured"] = result.total_s / measured
            entry["policies"][name]["simulated_switches"] = [list(s) for s in result.switches]


# ----------------------------------------------------------------------------- report


def verdict(
    shape: str, workload: str, policy: str, metric: str, value: Any, target: str, met: bool
) -> dict[str, Any]:
    return {
        "shape": shape,
        "workload": workload,
        "policy": policy,
        "metric": metric,
        "value": value,
        "target": target,
        "met": bool(met),
    }


def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target, the measured value, and whether it was met. The targets follow the shape's
    role (SHAPE_ROLE), not what its profile turned out to show: a crossover shape whose
    profile has no crossover fails that line and is still held to the long-tail target."""
    out = []
    for shape, res in results["shapes"].items():
        role = shape_role(shape)
        if role == "crossover":
            crossover = res["profile"]["crossover"]
            out.append(
                verdict(shape, "-", "-", "profile has a crossover", crossover, "True", crossover)
            )
        for wname, w in res["workloads"].items():
            for p in ("adaptive_predicted", "adaptive_oracle"):
                ratio = w["policies"][p]["vs_best_static"]
                long_tail = role == "crossover" and wname.startswith("long_tail")
                limit = TARGET_LONG_TAIL if long_tail else TARGET_ELSEWHERE
                ok = ratio <= limit
                line = verdict(shape, wname, p, "adaptive / best static", ratio, f"<= {limit}", ok)
                lockstep = w.get("lockstep_free_switch", {}).get("ratio")
                if lockstep is not None and not ok and lockstep > limit:
                    line["note"] = (
                        f"free switching at every step, lockstep estimate: x{lockstep:.3f}"
                    )
                out.append(line)
                frac = w["policies"][p]["control_fraction"]
                ok = frac is not None and frac < TARGET_CONTROL
                out.append(
                    verdict(shape, wname, p, "control / decode", frac, f"< {TARGET_CONTROL}", ok)
                )
            if role == "none":
                switches = sum(
                    sum(w["policies"][p]["switches"]) for p in ADAPTIVE if p in w["policies"]
                )
                out.append(
                    verdict(shape, wname, "adaptive", "switches", switches, "== 0", switches == 0)
                )
    return out


def print_report(results: dict[str, Any]) -> None:
    for shape, res in results["shapes"].items():
        s = res["shape"]
        print(
            f"\n== shape {shape}: {s['num_params'] / 1e6:.1f}M params, hidden {s['hidden_size']}, "
            f"{s['num_hidden_layers']} layers, fp32; profile {res['profile_s']:.0f} s"
        )
        prof = res["profile"]
        print("profile (measured, shortest context):", fmt_dict(prof["measured"]))
        print("latency model:", fmt_dict(prof["model"]), "| crossover:", prof["crossover"])
        print(f"{'workload':10s} | " + " | ".join(f"{p:>22s}" for p in POLICIES))
        for wname, w in res["workloads"].items():
            cells = []
            for p in POLICIES:
                if p not in w["policies"]:  # a results file from before the policy existed
                    cells.append("-")
                    continue
                e = w["policies"][p]
                sw = f" sw{sum(e['switches'])}" if "switches" in e else ""
                cells.append(f"{e['median_s']:7.2f}s x{e['vs_best_static']:.3f}{sw:>5s}")
            print(f"{wname:20s} | " + " | ".join(f"{c:>22s}" for c in cells))
        print("median of per-repeat ratios to the best static run of the same repeat:")
        for wname, w in res["workloads"].items():
            best = w["policies"][w["best_static"]]["latency_s"]
            paired = {
                p: statistics.median(
                    a / b for a, b in zip(w["policies"][p]["latency_s"], best, strict=True)
                )
                for p in ADAPTIVE
                if p in w["policies"]
            }
            print(f"  {wname:20s} " + "  ".join(f"{p}=x{v:.3f}" for p, v in paired.items()))
        if all("sync_s" in e for w in res["workloads"].values() for e in w["policies"].values()):
            print("weight sync before each rollout, untimed (median s):")
            for wname, w in res["workloads"].items():
                print(
                    f"  {wname:20s} "
                    + "  ".join(
                        f"{p}={statistics.median(e['sync_s']):.2f}"
                        for p, e in w["policies"].items()
                    )
                )
        print("simulated / measured (median):")
        for wname, w in res["workloads"].items():
            sims = {p: w["policies"].get(p, {}).get("sim_over_measured") for p in POLICIES}
            print(
                f"  {wname:20s} "
                + "  ".join(f"{p}={v:.2f}" for p, v in sims.items() if v is not None)
            )
        if all("lockstep_free_switch" in w for w in res["workloads"].values()):
            print(
                "switching for free at every step, decode only, replicas in lockstep, on the "
                "latency model (an estimate, not a bound): dp2 / tp2 / free s, free / best"
            )
            for wname, w in res["workloads"].items():
                b = w["lockstep_free_switch"]
                print(
                    f"  {wname:20s} {b['dp2_s']:.2f} / {b['tp2_s']:.2f} / {b['free_s']:.2f} s"
                    f"  x{b['ratio']:.3f}"
                )
        print(
            "control overhead on the critical path (rollout wall time less switches and the "
            "busiest rank's decode time, summed / the busiest rank's decode time):"
        )
        for wname, w in res["workloads"].items():
            print(
                f"  {wname:20s} "
                + "  ".join(
                    f"{p}={w['policies'][p]['control_fraction']:.4f}"
                    for p in ADAPTIVE
                    if p in w["policies"]
                )
            )
        print(
            "switch decisions: predicted gain / overhead / finish vs measured overhead / finish / net gain"
        )
        for wname, w in res["workloads"].items():
            for p in (p for p in ADAPTIVE if p in w["policies"]):
                for d in w["policies"][p]["switch_decisions"]:
                    print(
                        f"  {wname:20s} {p:18s} rep {d['repeat']} t={d['t']:.2f}s {d['tp']} "
                        f"seqs {d['num_seqs']} (mig {d['migrated']}, rc {d['recomputed']}): "
                        f"pred gain {d['predicted_gain_s']:.2f} ovh {d['predicted_overhead_s']:.2f} "
                        f"finish {d['predicted_finish_s']:.2f} | meas ovh {d['measured_overhead_s']:.2f} "
                        f"finish {d['measured_finish_s']:.2f} net {d['measured_net_s']:+.2f} "
                        f"(pred net {d['predicted_net_s']:+.2f})"
                    )
    print("\ntargets:")
    for v in results["verdicts"]:
        value = "-" if v["value"] is None else f"{v['value']:.4g}"
        print(
            f"  {v['shape']:5s} {v['workload']:20s} {v['policy']:18s} {v['metric']:24s} "
            f"{value:>8s} target {v['target']:8s} {'MET' if v['met'] else 'NOT MET'}"
            + (f"  ({v['note']})" if v.get("note") else "")
        )


def fmt_dict(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def reprint(path: Path) -> None:
    results = json.loads(path.read_text())
    results["verdicts"] = verdicts(results)
    path.write_text(json.dumps(results, indent=1))
    print_report(results)


def relaunch_under_torchrun() -> None:
    """`python benchmarks/adaptive_tp_bench.py` (as `nox -s bench` runs it) starts the two
    ranks itself."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    raise SystemExit(subprocess.call([*command, __file__, *sys.argv[1:]], env=env))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny shape and workloads (~1-2 min)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-only", action="store_true", help="profile the shapes, then stop")
    ap.add_argument("--shapes", nargs="+", default=None, help="default: mqa_20l tiny (quick: tiny)")
    ap.add_argument(
        "--report", metavar="JSON", help="re-derive the verdicts of a results file and print it"
    )
    ap.add_argument("--check-every", type=int, default=CHECK_EVERY, help="decode steps per check")
    ap.add_argument(
        "--reuse-profile",
        action="store_true",
        help="keep a shape's profile from an earlier run when it measured the same grids",
    )
    args = ap.parse_args()
    set_check_every(args.check_every)
    if args.report:
        reprint(Path(args.report))
        return
    if "WORLD_SIZE" not in os.environ:
        relaunch_under_torchrun()
    torch.set_num_threads(1)  # two ranks share this machine's cores
    dist.init_process_group("gloo")
    world = dist.group.WORLD
    rank = dist.get_rank()
    try:
        if dist.get_world_size() != 2:
            raise SystemExit(
                f"run with torchrun --nproc_per_node 2, got world size {dist.get_world_size()}"
            )
        shapes = args.shapes or (["tiny"] if args.quick else ["mqa_20l", "tiny"])
        for shape in shapes:
            shape_config(shape)  # exits naming an unknown shape
        suffix = "_quick" if args.quick else ""
        results: dict[str, Any] = {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, gloo, 2 ranks x 1 torch thread",
            "torch": torch.__version__,
            "loadavg_before": os.getloadavg(),
            "repeats": args.repeats,
            "check_every": CHECK_EVERY,
            "margin": MARGIN,
            "quick": args.quick,
            "shapes": {},
        }
        start = time.perf_counter()
        for shape in shapes:
            scale = scale_for(shape, args.quick)
            repeats = max(args.repeats, scale.min_repeats)
            res = run_shape(
                shape, scale, repeats, world, suffix, args.profile_only, args.reuse_profile
            )
            results["shapes"][shape] = {**res, "repeats": repeats}
        if args.profile_only:
            return
        if rank == 0:
            results["loadavg_after"] = os.getloadavg()
            results["wall_s"] = time.perf_counter() - start
            results["verdicts"] = verdicts(results)
            for res in results["shapes"].values():
                for w in res["workloads"].values():
                    for p in w["policies"].values():
                        p.pop("timeline", None)
            path = RESULTS / f"adaptive_tp_bench{suffix}.json"
            path.write_text(json.dumps(results, indent=1))
            print_report(results)
            print(
                f"\nwritten to {path}; load average before {results['loadavg_before']}, after {results['loadavg_after']}"
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
