"""The bench's workloads: prompts with imposed response lengths (ignore_eos and per-request
max_tokens), the same prompts and seeds for every policy.

uniform, long_tail (log-normal quantiles, capped) and bimodal give all n samples of a prompt
one length; long_tail_per_sample gives each sample its own length under `LongTailSpec`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from patrl.lenpredict import (
    LongTailSpec,
    PromptGroup,
    group_by_step,
    long_tail_trace,
    longest_processing_time,
)
from patrl.rollout import SamplingParams

from .shapes import Scale


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
    z = np.array([NormalDist().inv_cdf((i + 0.5) / count) for i in range(count)])
    return median * np.exp(sigma * z)


def make_workloads(scale: Scale, vocab: int, seed: int = 0) -> list[Workload]:
    """uniform, long_tail, bimodal and long_tail_per_sample for `scale`, prompts of token ids
    below `vocab`; deterministic in `seed`."""
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
    rate, log-normal per-sample noise, capped) with its median:cap ratio kept at this cap,
    every sample its own length and sent as a request of its own, `prompt_ids` naming its
    prompt: a GRPO group's samples differ, and the tail is a few samples of many prompts."""
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
