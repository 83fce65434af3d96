"""What a CUDA device shows (`nox -s gpu`; the `gpu` cases skip without CUDA): bf16 decoding
on each attention backend the device has, as close to the fp32 truth as HF's own bf16 decoding
(and the same check on CPU), and GRPO steps of a ~0.5B Qwen2-shaped model.

Closeness is teacher-forced: the fp32 model scores each decoder's own greedy output, so one
early flip of a near-tie does not cascade into every later position.
"""

from __future__ import annotations

import gc
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.rollout import Engine, SamplingParams
from patrl.rollout.config import EngineConfig
from patrl_testkit.jobs import write_addition_task
from patrl_testkit.models import save_hf_model, tiny_hf_model

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


def _scored(
    truth: Any, prompts: list[list[int]], outputs: list[tuple[list[int], list[float]]], device: str
) -> tuple[float, float]:
    """(share of positions where the fp32 `truth` picks the decoded token, mean |logprob diff|
    of the decoder's logprobs against the truth's), teacher-forced on the decoded tokens."""
    same = total = 0
    diffs = []
    for prompt, (tokens, logprobs) in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt + tokens], device=device)
        with torch.no_grad():
            logits = truth(ids).logits[0, len(prompt) - 1 : -1].float()
        picked = torch.tensor(tokens, device=device)
        same += int((logits.argmax(-1) == picked).sum())
        total += len(tokens)
        ref = logits.log_softmax(-1).gather(1, picked[:, None])[:, 0]
        diffs.append((ref - torch.tensor(logprobs, device=device)).abs())
    return same / total, float(torch.cat(diffs).mean())


def _hf_greedy(
    model: Any, prompt: list[int], steps: int, device: str
) -> tuple[list[int], list[float]]:
    """HF's own incremental greedy decoding (its KV cache): tokens and their logprobs."""
    ids = torch.tensor([prompt], device=device)
    tokens: list[int] = []
    logprobs: list[float] = []
    past = None
    with torch.no_grad():
        for _ in range(steps):
            out = model(ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            lp = out.logits[0, -1].float().log_softmax(-1)
            token = int(lp.argmax())
            tokens.append(token)
            logprobs.append(float(lp[token]))
            ids = torch.tensor([[token]], device=device)
    return tokens, logprobs


@pytest.mark.parametrize(
    "device,backend",
    [("cpu", "sdpa")] + [pytest.param("cuda", b, marks=pytest.mark.gpu) for b in backends()],
)
def test_bf16_decoding_is_as_close_to_fp32_as_transformers_bf16(
    device: str, backend: str, tmp_path: Path
) -> None:
    """The engine's bf16 greedy decoding, scored against the same weights in fp32, is as close
    as HF's own bf16 decoding is (within a margin). Agreement with HF's bf16 token for token is
    not the measure: two correct bf16 implementations round differently (op order, fused
    projections), and on this model even HF's incremental bf16 decoding agrees with HF's bf16
    full forward on only ~97% of greedy positions (measured on CPU and on an H200)."""
    # A larger init than HF's default: a random model's logits are then not near-ties everywhere.
    shape = dict(vocab_size=4096, initializer_range=0.1, **{**QWEN2_HALF_B, "num_hidden_layers": 4})
    truth = tiny_hf_model("qwen2", flavour="plain", **shape).to(device)
    hf16 = tiny_hf_model("qwen2", flavour="plain", **shape).to(torch.bfloat16)
    model_dir = save_hf_model(hf16, tmp_path / "m")
    hf16 = hf16.to(device)
    g = torch.Generator().manual_seed(0)
    steps = 96 if device == "cuda" else 48
    prompts = [torch.randint(0, 4096, (int(n),), generator=g).tolist() for n in range(5, 69, 8)]
    config = EngineConfig(
        model=str(model_dir), device=device, dtype="bfloat16", attention_backend=backend,
        gpu_memory_utilization=0.3,  # a failed test's engine (held by its traceback) leaves room
    )  # fmt: skip
    engine = Engine(config)
    greedy = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    decoded = [
        (list(o.outputs[0].token_ids), list(o.outputs[0].logprobs))
        for o in engine.generate(prompts, greedy)
    ]
    del engine  # its KV cache back before the next test sizes one
    gc.collect()
    ours = _scored(truth, prompts, decoded, device)
    theirs = _scored(truth, prompts, [_hf_greedy(hf16, p, steps, device) for p in prompts], device)
    # The margins: bf16 noise of two implementations on 8 x 96 positions (CPU: agreement
    # 0.883 vs 0.871, logprob diff 0.110 vs 0.132 at 96 steps).
    print("closeness to fp32 (agreement, mean |logprob diff|):", backend, ours, "HF bf16:", theirs)
    assert ours[0] >= theirs[0] - 0.04, (
        f"{backend}: greedy agreement with fp32 {ours} vs HF bf16 {theirs}"
    )
    assert ours[1] <= 1.3 * theirs[1] + 0.01, (
        f"{backend}: logprob diff to fp32 {ours} vs HF bf16 {theirs}"
    )


@pytest.mark.gpu
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
