"""Per-token logprobs and entropy from logits, computed in chunks of tokens.

The convention shared with the rollout engine: the logprob of token t is
`log_softmax(logits.float() / T)[t]` over the full vocabulary, before top-k / top-p, with T the
sampling temperature (1.0 when it is 0, greedy); entropy is that of the same distribution.
Forward and backward walk `chunk_tokens` tokens at a time and save only the logits and one
log-normaliser per token, so the extra memory is one fp32 chunk. See docs/training.md.
"""

from __future__ import annotations

from typing import Any

import torch


def effective_temperature(temperature: float) -> float:
    """The T of the shared convention: greedy (0) scores with the untempered distribution."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return 1.0 if temperature == 0 else float(temperature)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits.float() / temperature`, skipping the division (exact) at T = 1."""
    z = logits.float()
    return z if temperature == 1.0 else z / temperature


class _ChunkedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = logits.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for start in range(0, n, chunk):
            sl = slice(start, start + chunk)
            z = _scaled(logits[sl], temperature)
            lse[sl] = torch.logsumexp(z, dim=-1)
            log_p = z - lse[sl, None]
            logp[sl] = log_p.gather(-1, targets[sl, None]).squeeze(-1)
            # -sum p log p, not lse - sum p z: the latter cancels badly for peaked rows.
            entropy[sl] = -(log_p.exp() * log_p).sum(-1)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.set_materialize_grads(False)  # an unused output (entropy) then costs no backward work
        ctx.temperature = temperature
        ctx.chunk = chunk
        return logp, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None]:
        logits, targets, lse, entropy = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk):
            sl = slice(start, start + chunk)
            z = _scaled(logits[sl], t)
            log_p = z - lse[sl, None]
            p = log_p.exp()
            g = torch.zeros_like(z)
            if grad_logp is not None:
                # d log p_t / d z_j = [j == t] - p_j
                g -= p * grad_logp[sl, None]
                g.scatter_add_(-1, targets[sl, None], grad_logp[sl, None])
            if grad_entropy is not None:
                # d H / d z_j = -p_j (log p_j + H)
                g -= p * (log_p + entropy[sl, None]) * grad_entropy[sl, None]
            grad[sl] = (g if t == 1.0 else g / t).to(logits.dtype)
        return grad, None, None, None


def logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of `targets` and entropy under softmax(logits / T), both fp32, chunked.

    `logits` is `[..., vocab]`, `targets` the matching `[...]` token ids. Differentiable in
    `logits`; see the module docstring for the convention on T.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: "
            "targets must have the logits' shape without the vocab dimension"
        )
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    t = effective_temperature(temperature)
    lead = targets.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])  # a view when logits are contiguous
    flat_targets = targets.reshape(-1).long()
    logp, entropy = _ChunkedLogprobEntropy.apply(flat_logits, flat_targets, t, chunk_tokens)
    return logp.view(lead), entropy.view(lead)


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal-LM scoring: logprob and entropy *of each token of `input_ids`* `[batch, seq]`.

    Position i uses the logits at position i - 1; position 0 has no prediction and is 0.
    """
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [batch, seq, vocab] for input_ids "
            f"{tuple(input_ids.shape)}"
        )
    # Score every position against the next token (the last one against a dummy), so that the
    # logits are read through a view rather than copied by slicing off the last position.
    next_ids = torch.roll(input_ids, shifts=-1, dims=1)
    logp, entropy = logprobs_and_entropy(logits, next_ids, temperature, chunk_tokens)
    zero = logp.new_zeros(logp.shape[0], 1)
    return torch.cat([zero, logp[:, :-1]], dim=1), torch.cat([zero, entropy[:, :-1]], dim=1)
