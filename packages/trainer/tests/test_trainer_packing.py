"""Packed micro-batches (use_remove_padding) against the padded reference path, fp32."""

from __future__ import annotations

import pytest
import torch
from trainer_testkit import config, full_weights, make_batch, tiny_llama, tiny_qwen2_tied

from patrl.trainer import Trainer
from patrl.trainer.packing import pack

# fp32 on CPU: the packed and padded forwards run GEMMs of different shapes, so they agree to
# round-off, not bit for bit.
TOL = 1e-5


def test_pack_restarts_positions_and_maps_tokens_to_padded_slots() -> None:
    row = pack(
        [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])], torch.device("cpu")
    )
    assert row.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert row.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert row.bounds == (0, 3, 4, 6)
    assert row.dest.tolist() == [0, 1, 2, 3, 6, 7]
    with pytest.raises(ValueError, match="non-empty"):
        pack([torch.tensor([1]), torch.tensor([], dtype=torch.long)], torch.device("cpu"))


@pytest.mark.parametrize("model", [tiny_llama, tiny_qwen2_tied])
def test_packed_logprobs_equal_padded(model: object) -> None:
    batch = make_batch(3, [9, 2, 17, 5, 1, 12])
    packed = Trainer(config(ppo_max_token_len_per_gpu=200), model())  # type: ignore[operator]
    padded = Trainer(config(ppo_max_token_len_per_gpu=200, use_remove_padding=False), model())  # type: ignore[operator]
    assert packed.attn_implementation == "patrl_varlen"
    for a, b in zip(packed.compute_logprobs(batch), padded.compute_logprobs(batch), strict=True):
        assert a.shape == b.shape
        assert a[0] == 0.0
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_packed_step_equals_padded_step(mode: str) -> None:
    """Loss, metrics, gradients (through the update) and scored logprobs, with the entropy
    bonus and the KL term on, over several micro-batches."""
    batch = make_batch(4, [14, 3, 9, 21, 6, 6, 11, 2])
    over = {
        "ppo_max_token_len_per_gpu": 60,
        "loss_agg_mode": mode,
        "entropy_coeff": 0.01,
        "use_kl_loss": True,
        "optim": {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.0},
    }
    packed = Trainer(config(**over), tiny_llama())
    padded = Trainer(config(**over, use_remove_padding=False), tiny_llama())
    before = full_weights(padded)
    m_packed, m_padded = packed.train_step(batch), padded.train_step(batch)
    for key in (
        "actor/loss",
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy",
        "actor/grad_norm",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
    ):
        assert m_packed[key] == pytest.approx(m_padded[key], abs=TOL), key
    for a, b in zip(packed.scored_logprobs(), padded.scored_logprobs(), strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)
    after_packed, after_padded = full_weights(packed), full_weights(padded)
    for name, w in after_padded.items():
        assert not torch.equal(w, before[name]) or name.endswith("rotary_emb.inv_freq")
        torch.testing.assert_close(after_packed[name], w, atol=TOL, rtol=0)


def test_packing_rejects_an_attention_it_cannot_pack() -> None:
    with pytest.raises(ValueError, match="use_remove_padding"):
        Trainer(config(attn_implementation="flex_attention"), tiny_llama())


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_packed_step_equals_padded_step_on_cuda(attn: str) -> None:
    """On CUDA, fp32: patrl_varlen (sdpa) or flash-attn's varlen kernel (bf16 compute, looser
    tolerance) against the padded sdpa reference."""
    if attn == "flash_attention_2":
        pytest.importorskip("flash_attn")
    dtype = {"sdpa": "float32", "flash_attention_2": "bfloat16"}[attn]
    tol = {"sdpa": 1e-4, "flash_attention_2": 5e-2}[attn]
    batch = make_batch(5, [14, 3, 9, 21, 6, 6, 11, 2])
    over = {"ppo_max_token_len_per_gpu": 60, "param_dtype": dtype}
    packed = Trainer(config(**over, attn_implementation=attn), tiny_llama(), device="cuda")
    padded = Trainer(config(**over, use_remove_padding=False), tiny_llama(), device="cuda")
    m_packed, m_padded = packed.train_step(batch), padded.train_step(batch)
    assert m_packed["actor/loss"] == pytest.approx(m_padded["actor/loss"], abs=tol)
    for a, b in zip(packed.scored_logprobs(), padded.scored_logprobs(), strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=0)
