"""enable_gradient_checkpointing: the bool overrides, "auto" from the memory estimate."""

from __future__ import annotations

import pytest
import torch
from trainer_testkit import config, tiny_llama

from patrl.trainer import Trainer
from patrl.trainer.memory_plan import step_memory_bytes, use_checkpointing


def test_explicit_setting_wins_and_auto_is_off_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert use_checkpointing(True, cpu, 0) is True
    assert use_checkpointing(False, cpu, 1 << 60) is False
    assert use_checkpointing("auto", cpu, 1 << 60) is False
    with pytest.raises(ValueError, match="enable_gradient_checkpointing"):
        use_checkpointing("sometimes", cpu, 0)  # type: ignore[arg-type]


def test_estimate_grows_with_tokens_and_shrinks_with_ranks() -> None:
    cfg = tiny_llama()
    one = step_memory_bytes(cfg, 1024, torch.float32, 1)
    assert step_memory_bytes(cfg, 2048, torch.float32, 1) > one
    assert step_memory_bytes(cfg, 1024, torch.bfloat16, 1) < one
    assert step_memory_bytes(cfg, 1024, torch.float32, 2) < one
    # Activations alone: tokens x (layers x (10h + 4i) + vocab) values, at least.
    h, i = cfg.hidden_size, cfg.intermediate_size
    assert one > 1024 * (cfg.num_hidden_layers * (10 * h + 4 * i) + cfg.vocab_size) * 4


def test_with_lora_only_the_adapters_carry_optimizer_state() -> None:
    cfg = tiny_llama()
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv_width = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    full = step_memory_bytes(cfg, 64, torch.bfloat16, 1)
    lora = step_memory_bytes(cfg, 64, torch.bfloat16, 1, lora_rank=8)
    # Same activations: the difference is 16 bytes a weight against 2 (the bf16 base) plus
    # 16 bytes an adapter weight, r x (in + out) on each of a layer's seven linears.
    params = layers * (2 * h * h + 2 * h * kv_width + 3 * h * i) + cfg.vocab_size * h * (
        1 if cfg.tie_word_embeddings else 2
    )
    adapters = layers * 8 * (4 * h + 2 * (h + kv_width) + 3 * (h + i))
    assert full - lora == 16 * params - (2 * params + 16 * adapters)
    assert step_memory_bytes(cfg, 64, torch.bfloat16, 2, lora_rank=8) < lora


def test_trainer_resolves_auto_to_off_on_cpu_and_keeps_an_explicit_true() -> None:
    assert Trainer(config(), tiny_llama()).checkpointing is False
    assert Trainer(config(enable_gradient_checkpointing=True), tiny_llama()).checkpointing


@pytest.mark.gpu
def test_auto_turns_checkpointing_on_when_the_estimate_exceeds_free_cuda_memory() -> None:
    device = torch.device("cuda")
    free, _ = torch.cuda.mem_get_info(device)
    assert use_checkpointing("auto", device, 2 * free) is True
    assert use_checkpointing("auto", device, free // 4) is False
