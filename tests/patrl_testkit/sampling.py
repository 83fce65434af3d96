"""The sampler's slow reference twin (`reference_sample`), for the CPU tests that check the
fast paths against it and the CUDA tests that check the device path against it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from patrl.rollout.sampler import truncated_candidates


def reference_sample(
    logits: torch.Tensor, params: Sequence[Any], generators: Sequence[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow twin of `sample` without its shortcuts: every row tempered, argmax and the
    last entry with mass computed for every row, sampled rows copied out; one uniform draw a
    sampled row, from its generator, in row order (the sampler's order). Host tensors."""
    logits = logits.float()
    temps = torch.tensor([p.effective_temperature for p in params])
    logprobs = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    v = logits.shape[-1]
    for i, p in enumerate(params):
        if p.greedy:
            continue
        draw = torch.rand((), generator=generators[i])
        probs = logprobs[i].exp()
        if 0 < p.top_k < v or p.top_p < 1:
            ids, kept = truncated_candidates(probs, p)
            tokens[i] = ids[reference_inverse_cdf(kept[None], draw[None])[0]]
        else:
            tokens[i] = reference_inverse_cdf(probs[None], draw[None])[0]
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def reference_inverse_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Each row's inverse CDF at its draw, never past its last entry with mass."""
    cdf = probs.cumsum(dim=-1)
    pos = torch.searchsorted(cdf, draws[:, None] * cdf[:, -1:], right=True)[:, 0]
    last = (probs.shape[-1] - 1) - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(pos, last)
