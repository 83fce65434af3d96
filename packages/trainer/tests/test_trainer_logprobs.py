"""Chunked logprobs/entropy against the plain autograd formula (the slow twin)."""

from __future__ import annotations

import pytest
import torch

from patrl.trainer import effective_temperature, logprobs_and_entropy, token_logprobs


def _naive(
    logits: torch.Tensor, targets: torch.Tensor, t: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax(logits.float() / effective_temperature(t), dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.3])
def test_chunked_matches_naive_values_and_gradients(chunk: int, temperature: float) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 37, generator=g)).requires_grad_(True)
    targets = torch.randint(0, 37, (2, 5), generator=g)
    w_logp, w_ent = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)

    logp, ent = logprobs_and_entropy(logits, targets, temperature, chunk)
    (grad,) = torch.autograd.grad((logp * w_logp).sum() + (ent * w_ent).sum(), logits)
    ref_logp, ref_ent = _naive(logits, targets, temperature)
    (ref_grad,) = torch.autograd.grad((ref_logp * w_logp).sum() + (ref_ent * w_ent).sum(), logits)

    torch.testing.assert_close(logp, ref_logp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)


def test_gradient_of_logprob_only() -> None:
    logits = torch.randn(6, 11, requires_grad=True)
    targets = torch.randint(0, 11, (6,))
    logp, _ = logprobs_and_entropy(logits, targets, 1.0, 4)
    (grad,) = torch.autograd.grad(logp.sum(), logits)
    (ref,) = torch.autograd.grad(_naive(logits, targets, 1.0)[0].sum(), logits)
    torch.testing.assert_close(grad, ref)


def test_temperature_zero_means_untempered() -> None:
    logits = torch.randn(4, 9)
    targets = torch.randint(0, 9, (4,))
    torch.testing.assert_close(
        logprobs_and_entropy(logits, targets, 0.0)[0], logprobs_and_entropy(logits, targets, 1.0)[0]
    )
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        logprobs_and_entropy(logits, targets, -1.0)


def test_bf16_logits_are_scored_in_fp32() -> None:
    logits = torch.randn(3, 7, 50).to(torch.bfloat16)
    targets = torch.randint(0, 50, (3, 7))
    logp, ent = logprobs_and_entropy(logits, targets, 0.9, 5)
    ref_logp, ref_ent = _naive(logits, targets, 0.9)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent)


def test_only_logits_and_per_token_vectors_are_saved_for_backward() -> None:
    """No second [tokens x vocab] tensor is kept alive between forward and backward."""
    tokens, vocab = 64, 101
    logits = torch.randn(tokens, vocab, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs_and_entropy(logits, targets, 0.8, chunk_tokens=8)
    assert sum(saved) <= tokens * vocab + 3 * tokens  # logits + targets, lse, entropy
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _naive(logits, targets, 0.8)
    assert sum(saved) >= 2 * tokens * vocab  # the twin it replaces keeps full copies


def test_token_logprobs_shift() -> None:
    logits = torch.randn(2, 6, 13)
    ids = torch.randint(0, 13, (2, 6))
    logp, ent = token_logprobs(logits, ids, 1.0, chunk_tokens=5)
    assert torch.all(logp[:, 0] == 0) and torch.all(ent[:, 0] == 0)
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(logp[:, 1:], ref)


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="without the vocab dimension"):
        logprobs_and_entropy(torch.randn(3, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[batch, seq, vocab\]"):
        token_logprobs(torch.randn(2, 5, 7), torch.zeros(2, 6, dtype=torch.long))
