"""Assets of a real GRPO job for end-to-end tests and benchmarks: a tiny random Llama with the
embedded demo's tokenizer, and an "a+b=?" task whose reward a random model can climb."""

from __future__ import annotations

import json
import random
from pathlib import Path

from patrl_testkit.models import save_tiny_model


def save_demo_llama(path: Path) -> Path:
    """The kit's plain tiny Llama (128 positions) with the demo tokenizer and its special
    token ids, saved to `path` -> path."""
    from patrl_examples.demo.tokenizer import build_tokenizer

    tok = build_tokenizer()
    return save_tiny_model(
        path,
        "llama",
        "plain",
        tokenizer=tok,
        max_position_embeddings=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def write_addition_task(root: Path, rows: dict[str, int], max_operand: int = 9) -> None:
    """`root/<split>.jsonl` for each split in `rows` (in its order): that many rows of
    {"prompt": "a+b=?", "answer": "a+b"}, operands in [0, max_operand], one Random(0)."""
    rng = random.Random(0)
    for split, count in rows.items():
        with (root / f"{split}.jsonl").open("w") as f:
            for _ in range(count):
                a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
                f.write(json.dumps({"prompt": f"{a}+{b}=?", "answer": str(a + b)}) + "\n")


def addition_job(root: Path) -> Path:
    """`root/model` (`save_demo_llama`), 32 train and 4 val addition rows of single digits."""
    save_demo_llama(root / "model")
    write_addition_task(root, {"train": 32, "val": 4})
    return root


def tiny_job_overrides(assets: Path, run_dir: Path, **extra: object) -> list[str]:
    """Command-line overrides of a tiny job on `addition_job` assets: 4 prompts x 2 samples of
    at most 8 tokens, static TP, the in-process `format` reward, a checkpoint every step, no
    validation, JSONL metrics only, no plots, all in `run_dir`; `extra` adds or replaces keys."""
    values: dict[str, object] = {
        "model.path": assets / "model",
        "data.train_files": assets / "train.jsonl",
        "data.train_batch_size": 4,
        "data.max_prompt_length": 32,
        "data.max_response_length": 8,
        "actor.ppo_mini_batch_size": 4,
        "rollout.n": 2,
        "rollout.block_size": 4,
        "rollout.num_kv_blocks": 64,
        "rollout.adaptive_tp.enable": "false",
        "reward.functions": '[{name: "format"}]',
        "reward.num_workers": 0,
        "trainer.save_freq": 1,
        "trainer.test_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.default_local_dir": run_dir,
        **extra,
    }
    return [f"{k}={v}" for k, v in values.items()]


def digit_reward(response: str, answer: str, **meta: object) -> float:
    """The share of digits in `response`: a dense reward, so a random model's advantages are
    non-zero and its weights move. Jobs name it `patrl_testkit.jobs:digit_reward`."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


def learning_job_extras(assets: Path) -> dict[str, object]:
    """Keys that turn `tiny_job_overrides` into a job that learns: `digit_reward`, 4 samples of
    at most 16 tokens, 2-sample mini-batches at lr 1e-3, 128 KV blocks, and the val rows."""
    return {
        "data.val_files": assets / "val.jsonl",
        "data.max_response_length": 16,
        "actor.ppo_mini_batch_size": 2,
        "actor.optim.lr": 1e-3,
        "rollout.n": 4,
        "rollout.num_kv_blocks": 128,
        "reward.functions": '[{name: "patrl_testkit.jobs:digit_reward"}]',
    }
