"""The engine's recorded logprobs are the trainer's, for the same weights and tokens.

Both follow one convention: log_softmax(logits / T) over the full vocabulary, T = 1 when
greedy. If either side drifts (temperature, truncation, dtype), GRPO's ratio is off from step 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from patrl.rollout import Engine, EngineConfig, SamplingParams
from patrl.trainer import PolicyBatch, Trainer, TrainerConfig
from patrl_testkit.models import save_tiny_model

PROMPTS = [[3, 17, 42, 8, 99], [5, 6], [120, 4, 4, 4, 4, 4, 4, 4, 31]]


def tiny(family: str, path: Path) -> Path:
    """The kit's plain tiny `family` model (128 positions, vocab 160), Qwen2's embeddings tied."""
    return save_tiny_model(
        path,
        family,
        "plain",
        max_position_embeddings=128,
        vocab_size=160,
        tie_word_embeddings=family == "qwen2",
    )


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(
            temperature=0.7, top_p=0.9, top_k=40, seed=1, max_tokens=20, ignore_eos=True, n=2
        ),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.3, seed=2, max_tokens=20, ignore_eos=True),
    ],
    ids=["t0.7-top_p-top_k", "greedy", "t1.3"],
)
def test_trainer_logprobs_equal_engine_logprobs(
    family: str, params: SamplingParams, tmp_path: Path
) -> None:
    model_dir = tiny(family, tmp_path)
    engine = Engine(
        EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=64, max_model_len=128)
    )
    outputs = engine.generate(PROMPTS, params)
    prompts, responses, recorded = [], [], []
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        for c in out.outputs:
            prompts.append(prompt)
            responses.append(c.token_ids)
            recorded.append(torch.tensor(c.logprobs))
    trainer = Trainer(TrainerConfig(temperature=params.temperature), str(model_dir))
    batch = PolicyBatch.from_responses(prompts, responses, [0.0] * len(prompts))
    for r, lp, ours in zip(responses, trainer.compute_logprobs(batch), recorded, strict=True):
        torch.testing.assert_close(lp[-len(r) :], ours, rtol=0, atol=1e-4)
