"""Sequence packing (verl's `use_remove_padding`): a micro-batch's samples as one row.

The samples are concatenated into `[1, total]` with position ids restarting at 0 per sample;
attention must never cross a sample (varlen_attention.py, or flash-attn's varlen kernel fed
by the `cu_seq_lens_*` kwargs). Logprobs come back in the right-padded `[samples, longest]`
layout the losses take, zero at padding, so compute follows real tokens and the losses are
unchanged. See docs/training.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from patrl.trainer.logprobs import effective_temperature, logprobs_and_entropy


@dataclass(frozen=True)
class PackedRow:
    """One packed micro-batch: `input_ids` / `position_ids` `[1, total]` on the device,
    `bounds` the host-side sample offsets `(0, len0, len0 + len1, ..., total)`, and `dest`
    each packed token's flat index in the `[samples, longest]` padded layout."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    bounds: tuple[int, ...]
    longest: int
    dest: torch.Tensor

    def model_kwargs(self, host_bounds: bool) -> dict[str, Any]:
        """Keyword arguments of the HF forward: ids, positions and the varlen boundaries
        (flash-attn's `cu_seq_lens_*`; also `patrl_bounds` for `patrl_varlen` if asked)."""
        cu = torch.tensor(self.bounds, dtype=torch.int32).to(self.input_ids.device)
        kwargs: dict[str, Any] = {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": self.longest,
            "max_length_k": self.longest,
        }
        if host_bounds:
            kwargs["patrl_bounds"] = self.bounds
        return kwargs


def pack(ids: list[torch.Tensor], device: torch.device) -> PackedRow:
    """`ids` (1-D token tensors, each >= 1 token) concatenated into one row on `device`."""
    lengths = [int(t.numel()) for t in ids]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"pack needs non-empty samples, got lengths {lengths}")
    longest = max(lengths)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    positions = torch.cat([torch.arange(n) for n in lengths])
    dest = torch.cat([torch.arange(n) + row * longest for row, n in enumerate(lengths)])
    return PackedRow(
        input_ids=torch.cat(ids).long().view(1, -1).to(device),
        position_ids=positions.view(1, -1).to(device),
        bounds=tuple(bounds),
        longest=longest,
        dest=dest.to(device),
    )


def packed_token_logprobs(
    logits: torch.Tensor, row: PackedRow, temperature: float = 1.0, chunk_tokens: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` of a packed row, returned padded: logprob and entropy `[samples,
    longest]` of each token, 0 at each sample's first position and at padding."""
    flat = logits.reshape(-1, logits.shape[-1])
    ids = row.input_ids.view(-1)
    next_ids = torch.roll(ids, shifts=-1)
    logp, entropy = logprobs_and_entropy(
        flat, next_ids, effective_temperature(temperature), chunk_tokens
    )
    return _to_padded(logp, row), _to_padded(entropy, row)


def packed_values(values: torch.Tensor, row: PackedRow) -> torch.Tensor:
    """Per-position outputs `[total]` of a packed row (a value head's) in the padded
    `[samples, longest]` layout, aligned as logprobs are: position t holds the output at
    t - 1 (the state before token t), 0 at each sample's first position and at padding."""
    return _to_padded(values, row)


def _to_padded(values: torch.Tensor, row: PackedRow) -> torch.Tensor:
    """Shift each sample's predictions one position right (position t is scored by the
    logits at t - 1) and scatter them into the zero-padded `[samples, longest]` layout."""
    samples = len(row.bounds) - 1
    shifted = torch.cat([values.new_zeros(1), values[:-1]])
    starts = torch.tensor(row.bounds[:-1], device=values.device)
    shifted = shifted.index_fill(0, starts, 0.0)
    out = values.new_zeros(samples * row.longest)
    return out.index_copy(0, row.dest, shifted).view(samples, row.longest)
