"""Next-token sampling with one seeded generator per request, and the logprob of every token.

THE SHARED CONVENTION (patrl.trainer computes the very same quantity): the logprob returned
for a sampled token t is

    log_softmax(logits.float() / T)[t]

over the FULL vocabulary, before any top-k / top-p truncation, where T is the request's
temperature and T is taken as 1.0 when the temperature is 0 (greedy). Top-k logprobs, when
asked for, are the k largest entries of that same distribution.

How a row is sampled: greedy rows take the argmax of the logits. Other rows form the tempered
distribution, keep the top_k most likely tokens, then (renormalised) the smallest prefix whose
mass reaches top_p, and pick a token by inverse CDF with ONE uniform number drawn from the
request's own CPU `torch.Generator`. Every row is computed on its own, so a request's tokens do
not depend on which other requests share the batch, on the TP layout (every rank holds the full
logits and the same generator state) or on the device. Generator state can be exported and
imported to move a request to another replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "SampleOutput",
    "SamplingParams",
    "export_generator",
    "import_generator",
    "make_generator",
    "sample",
]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples. temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off.

    `n` samples of a request share its prompt's prefill; sample i draws from its own generator
    seeded with `seed + i` (a random seed when `seed` is None). A sample stops at `max_tokens`,
    at any of `stop_token_ids`, or at one of the model's EOS ids unless `ignore_eos`.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int = 0  # how many top logprobs to return with each token (0 = none)
    n: int = 1
    max_tokens: int = 256
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def effective_temperature(self) -> float:
        """The T of the shared convention."""
        return 1.0 if self.greedy else self.temperature


@dataclass(slots=True)
class SampleOutput:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, under the shared convention
    top_ids: torch.Tensor | None = None  # [B, K], K = max logprobs asked in the batch
    top_logprobs: torch.Tensor | None = None  # [B, K]


def make_generator(seed: int | None = None) -> torch.Generator:
    """A CPU generator (device-independent streams); a fresh random seed when `seed` is None."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def export_generator(g: torch.Generator) -> torch.Tensor:
    """The generator's full state (a uint8 tensor), to continue the stream elsewhere."""
    return g.get_state()


def import_generator(state: torch.Tensor) -> torch.Generator:
    g = torch.Generator()
    g.set_state(state)
    return g


@torch.inference_mode()
def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> SampleOutput:
    """One token per row of `logits` [B, V]; each row uses its own params and generator."""
    b = logits.shape[0]
    if not len(params) == len(generators) == b:
        raise ValueError(
            f"{b} logit rows, {len(params)} sampling params, {len(generators)} generators"
        )
    logits = logits.float()
    temps = torch.tensor([p.effective_temperature for p in params], device=logits.device)
    logprobs = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    v = logits.shape[-1]
    # Which path a row takes depends on its own params only, never on its batch neighbours.
    plain = [i for i, p in enumerate(params) if not p.greedy and not _truncates(p, v)]
    truncated = [i for i, p in enumerate(params) if not p.greedy and _truncates(p, v)]
    for rows, truncate in ((plain, False), (truncated, True)):
        if rows:
            draws = torch.stack([torch.rand((), generator=generators[i]) for i in rows])
            index = torch.tensor(rows, device=logits.device)
            tokens[index] = _inverse_cdf(
                logprobs[index].exp(), [params[i] for i in rows], draws.to(logits.device), truncate
            )
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    k = max(p.logprobs for p in params)
    if k == 0:
        return SampleOutput(tokens, chosen)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return SampleOutput(tokens, chosen, top_ids, top_logprobs)


def _truncates(p: SamplingParams, vocab_size: int) -> bool:
    return 0 < p.top_k < vocab_size or p.top_p < 1


def _inverse_cdf(
    probs: torch.Tensor, params: Sequence[SamplingParams], draws: torch.Tensor, truncate: bool
) -> torch.Tensor:
    """Token ids: the first candidate whose cumulative (kept) mass exceeds draw * total.

    Plain rows walk the vocabulary in id order; truncated rows walk their candidates sorted
    by probability, so that top-k / top-p can cut a prefix.
    """
    if truncate:
        # Candidates in descending probability (stable: ties keep vocabulary order).
        probs, order = probs.sort(dim=-1, descending=True, stable=True)
        probs = probs * _keep_mask(probs, params)
    cdf = probs.cumsum(dim=-1)
    pos = torch.searchsorted(cdf, draws[:, None] * cdf[:, -1:], right=True)[:, 0]
    # draw * total can round up to total; never step past the last token with mass.
    pos = torch.minimum(pos, _last_positive(probs))
    return order.gather(1, pos[:, None])[:, 0] if truncate else pos


def _keep_mask(sorted_probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Which sorted candidates survive top-k, then top-p on the renormalised top-k mass."""
    v = sorted_probs.shape[-1]
    device = sorted_probs.device
    k = torch.tensor([p.top_k if 0 < p.top_k < v else v for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    keep = torch.arange(v, device=device)[None, :] < k[:, None]
    kept = sorted_probs * keep
    kept = kept / kept.sum(dim=-1, keepdim=True)
    mass_before = kept.cumsum(dim=-1) - kept
    # The first candidate always survives (mass_before = 0 < top_p).
    return keep & (mass_before < top_p[:, None])


def _last_positive(probs: torch.Tensor) -> torch.Tensor:
    v = probs.shape[-1]
    return (v - 1) - (probs > 0).flip(-1).int().argmax(dim=-1)
