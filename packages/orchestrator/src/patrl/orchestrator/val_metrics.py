"""verl's validation metrics: per data source and variable, the mean over each prompt's
`rollout.val_kwargs.n` responses, their spread, and bootstrapped best-of-k / worst-of-k.

Names are verl's (`process_validation_metrics` and its trainer's `_validate`):
`val-core/{data_source}/{var}/mean@{N}` for the core variable (`acc` when a reward function
reports one, else `reward`) and its `best@{N}/mean`; everything else under `val-aux/...`
(`std@N`, `best@k/std`, `worst@k/mean|std`, the smaller k, the other variables). A prompt's
statistics are taken over its own responses, then averaged over the source's prompts.

Variables: `reward` (each response's total reward) and each numeric entry a reward function
returned beside its score (`Sample.extras`; named by the entry's key, or `function/key` when
two functions return the same key). verl's `maj@k` votes on a string `pred`; patrl's reward
extras are numbers only, so there is no `maj@k`.

Best/worst-of-k draw 1000 bootstrap subsets of k responses with replacement from
`np.random.RandomState(seed)` (verl draws the same numbers from the global generator after
`np.random.seed(seed)`, which this leaves alone), for k = 2, 4, 8, ... below N and N itself.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from patrl.orchestrator.scoring import Sample

UNKNOWN_SOURCE = "unknown"  # verl's name for rows without a data_source
BOOTSTRAPS = 1000


def bootstrap(
    values: Sequence[float],
    k: int,
    reduce_fns: Sequence[Callable[[np.ndarray], float]],
    seed: int = 42,
    rounds: int = BOOTSTRAPS,
) -> list[tuple[float, float]]:
    """(mean, std) of each of `reduce_fns` over `rounds` subsets of `k` of `values` drawn with
    replacement (one subset feeds every function)."""
    rng = np.random.RandomState(seed)
    data = np.asarray(values, dtype=np.float64)
    got: list[list[float]] = [[] for _ in reduce_fns]
    for _ in range(rounds):
        subset = data[rng.choice(len(data), size=k, replace=True)]
        for out, fn in zip(got, reduce_fns, strict=True):
            out.append(float(fn(subset)))
    return [(float(np.mean(v)), float(np.std(v))) for v in got]


def subset_sizes(n: int) -> list[int]:
    """2, 4, 8, ... below `n`, then `n` (verl's best/worst-of-k sizes)."""
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n]


def prompt_metrics(values: Sequence[float], seed: int = 42) -> dict[str, float]:
    """One prompt's statistics of one variable over its `len(values)` responses."""
    n = len(values)
    out = {f"mean@{n}": float(np.mean(values))}
    if n > 1:
        out[f"std@{n}"] = float(np.std(values))
        for k in subset_sizes(n):
            (best, best_sd), (worst, worst_sd) = bootstrap(values, k, [np.max, np.min], seed)
            out[f"best@{k}/mean"], out[f"best@{k}/std"] = best, best_sd
            out[f"worst@{k}/mean"], out[f"worst@{k}/std"] = worst, worst_sd
    return out


def variables(samples: Sequence[Sample]) -> list[dict[str, float]]:
    """Each sample's variables: `reward` and its reward extras, named by key unless two
    functions share a key or the key is `reward` (then `function/key`)."""
    owners: dict[str, set[str]] = defaultdict(set)
    for s in samples:
        for name in s.extras:
            function, _, key = name.rpartition("/")
            owners[key].add(function)
    out = []
    for s in samples:
        row = {"reward": s.reward}
        for name, value in s.extras.items():
            key = name.rpartition("/")[2]
            clash = len(owners[key]) > 1 or key == "reward"  # the total keeps its name
            row[name if clash else key] = value
        out.append(row)
    return out


def validation_source_metrics(
    samples: Sequence[Sample], sources: Mapping[int, str], seed: int = 42
) -> dict[str, float]:
    """verl's `val-core/...` and `val-aux/...` metrics of `samples` (each prompt's responses
    grouped by `Sample.prompt_index`; `sources`: prompt index -> data source, those absent
    are "unknown"). A variable absent or NaN on a response is left out of its prompt's
    statistics."""
    grouped: dict[str, dict[int, dict[str, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for s, row in zip(samples, variables(samples), strict=True):
        source = sources.get(s.prompt_index) or UNKNOWN_SOURCE
        for var, value in row.items():
            if not math.isnan(value):
                grouped[source][s.prompt_index][var].append(value)
    out: dict[str, float] = {}
    for source, prompts in grouped.items():
        per_var: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for var_values in prompts.values():
            for var, values in var_values.items():
                for name, value in prompt_metrics(values, seed).items():
                    per_var[var][name].append(value)
        core = "acc" if "acc" in per_var else "reward"
        for var, metrics in per_var.items():
            top = max(int(name.split("@")[1].split("/")[0]) for name in metrics)
            for name, values in metrics.items():
                is_core = var == core and name.startswith(("mean", "best")) and f"@{top}" in name
                section = "val-core" if is_core else "val-aux"
                out[f"{section}/{source}/{var}/{name}"] = float(np.mean(values))
    return out
