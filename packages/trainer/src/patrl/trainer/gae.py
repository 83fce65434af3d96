"""Generalised advantage estimation over padded per-token tensors (verl's
`compute_gae_advantage_return`), on any device, with no host sync."""

from __future__ import annotations

import torch


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unwhitened advantages and returns `[batch, tokens]` of token-level `rewards` and `values`.

    Backwards over the tokens: delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma *
    lam * A_next, where V_next / A_next are those of the next token in `mask` (0 past the last);
    tokens outside `mask` are skipped. Returns = A + V. Values at unmasked tokens are garbage.
    """
    mask_f = mask.to(values.dtype)
    next_value = values.new_zeros(values.shape[0])
    last = values.new_zeros(values.shape[0])
    out = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * last
        m = mask_f[:, t]
        next_value = values[:, t] * m + (1 - m) * next_value
        last = adv * m + (1 - m) * last
        out.append(last)
    advantages = torch.stack(out[::-1], dim=1)
    return advantages, advantages + values
