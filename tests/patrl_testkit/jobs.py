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
    from patrl.orchestrator.demo.tokenizer import build_tokenizer

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
