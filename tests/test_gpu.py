"""What only a CUDA device can show (`nox -s gpu`; skipped without CUDA): HF parity in bf16 on
each attention backend the device has, and GRPO steps of a ~0.5B Qwen2-shaped model.

Parity is teacher-forced: HF scores the engine's own greedy output, so one early flip of a
near-tie does not cascade into every later position.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.rollout import Engine, SamplingParams
from patrl.rollout.config import EngineConfig
from patrl_testkit.jobs import write_addition_task
from patrl_testkit.models import save_hf_model, tiny_hf_model

pytestmark = pytest.mark.gpu

# Qwen2-0.5B's shape (its vocabulary aside, which the GRPO test takes from the demo tokenizer).
QWEN2_HALF_B: dict[str, Any] = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def backends() -> list[str]:
    names = ["sdpa"]
    if importlib.util.find_spec("triton") is not None:
        names.append("triton")
    if importlib.util.find_spec("flash_attn") is not None:
        names.append("flash")
    return names


@pytest.mark.parametrize("backend", backends())
def test_bf16_greedy_decoding_matches_transformers(backend: str, tmp_path: Path) -> None:
    # A larger init than HF's default: a random model's logits are then not near-ties everywhere.
    hf = tiny_hf_model(
        "qwen2", flavour="plain", vocab_size=4096, initializer_range=0.1,
        **{**QWEN2_HALF_B, "num_hidden_layers": 4},
    ).to(torch.bfloat16)  # fmt: skip
    model_dir = save_hf_model(hf, tmp_path / "m")
    config = EngineConfig(
        model=str(model_dir), device="cuda", dtype="bfloat16", attention_backend=backend
    )
    engine = Engine(config)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (int(n),), generator=g).tolist() for n in range(5, 69, 8)]
    greedy = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    outputs = engine.generate(prompts, greedy)
    hf = hf.cuda()
    same = total = 0
    diffs = []
    for prompt, out in zip(prompts, outputs, strict=True):
        sample = out.outputs[0]
        ids = torch.tensor([prompt + list(sample.token_ids)], device="cuda")
        with torch.no_grad():
            logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
        tokens = torch.tensor(sample.token_ids, device="cuda")
        same += int((logits.argmax(-1) == tokens).sum())
        total += len(tokens)
        ref = logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
        diffs.append((ref - torch.tensor(sample.logprobs, device="cuda")).abs())
    diff = torch.cat(diffs)
    assert same >= 0.99 * total, f"{backend}: greedy tokens agree on {same}/{total} positions"
    assert float(diff.mean()) <= 2e-2, f"{backend}: mean |logprob diff| {float(diff.mean()):.4f}"


@pytest.mark.e2e
def test_three_grpo_steps_of_a_half_billion_qwen2(tmp_path: Path) -> None:
    from patrl.orchestrator.config import load_config
    from patrl.orchestrator.distributed import World
    from patrl.orchestrator.sync_loop import SyncGRPO
    from patrl_examples.demo.tokenizer import build_tokenizer

    tok = build_tokenizer()
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    hf = tiny_hf_model(
        "qwen2", flavour="plain", vocab_size=len(tok), pad_token_id=tok.pad_token_id,
        **QWEN2_HALF_B, **ids,
    )  # fmt: skip
    model = save_hf_model(hf.to(torch.bfloat16), tmp_path / "model", tok)
    write_addition_task(tmp_path, {"train": 64, "val": 8})
    overrides = {
        "model.path": model,
        "data.train_files": tmp_path / "train.jsonl",
        "data.val_files": tmp_path / "val.jsonl",
        "data.train_batch_size": 16,
        "data.max_prompt_length": 32,
        "data.max_response_length": 64,
        "actor.ppo_mini_batch_size": 16,
        "rollout.n": 8,
        "trainer.total_training_steps": 3,
        "trainer.test_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.default_local_dir": tmp_path / "run",
    }
    config = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    world = World(0, 1, 0, torch.device("cuda", 0))
    loop = SyncGRPO(config, world, str(model), config.data.train_files, config.data.val_files)
    steps = [h for h in loop.run().history if "critic/score/mean" in h]
    assert len(steps) == 3
    for h in steps:
        assert all(torch.isfinite(torch.tensor(float(v))) for v in h.values() if _number(v))
        # The engine's bf16 logprobs against the trainer's: a wrong weight sync would be far off.
        assert h["training/rollout_probs_diff_mean"] < 0.05, h


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
