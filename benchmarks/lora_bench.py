"""LoRA against full fine-tuning: the trainer's memory and the weight sync's bytes and time
per step (issue 47).

    OMP_NUM_THREADS=1 python benchmarks/lora_bench.py [--rank 16] [--hidden 512] [--layers 8]

The model is a random Llama (hidden 512, 8 layers, 8 heads / 4 kv heads, MLP 1408, vocab
8192: 32M parameters) saved as fp32 safetensors. Each variant (full, LoRA rank r on all
linear layers; LoRA with its frozen base in bf16, `param_dtype=bfloat16`, as CUDA's default)
runs in its own process: build the `Trainer`, take 2 GRPO steps on 8 samples of
64 tokens, then sync into an `Engine` of the same model 3 times (the trainer's
`iter_full_weights` into `Engine.load_weights`, as the sync loop does). Reported per variant:
- trainable parameters, and the trainer's state bytes: parameters + AdamW state, counted from
  the tensors (exact);
- peak RSS of the process after the steps (ru_maxrss; includes the engine built after it only
  in `peak_rss_total_gb`);
- sync bytes per step (what `iter_full_weights` yields) and the median sync time.
On a GPU the peak would be `torch.cuda.max_memory_allocated`; this machine measures CPU.

Writes benchmarks/results/lora_bench.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def _save_model(path: Path, hidden: int, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def _variant(model_dir: str, rank: int, param_dtype: str, out: Any) -> None:
    torch.set_num_threads(1)
    from patrl.rollout import Engine, EngineConfig
    from patrl.trainer import PolicyBatch, Trainer, TrainerConfig

    lora = {"lora_rank": rank, "lora_alpha": 2.0 * rank} if rank else {}
    cfg = TrainerConfig.model_validate(
        {"optim": {"lr": 1e-4}, "lora": lora, "param_dtype": param_dtype}
    )
    trainer = Trainer(cfg, model_dir)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        prompts = [torch.randint(0, 8192, (16,), generator=g).tolist() for _ in range(8)]
        responses = [torch.randint(0, 8192, (48,), generator=g).tolist() for _ in range(8)]
        adv = torch.randn(8, generator=g).tolist()
        trainer.train_step(PolicyBatch.from_responses(prompts, responses, adv))
    params = list(trainer.model.parameters())
    state_bytes = sum(p.numel() * p.element_size() for p in params)
    frozen_bytes = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
    for st in trainer.optimizer.state.values():
        state_bytes += sum(t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t))
    peak_trainer = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    engine_cfg: dict[str, Any] = {"model": model_dir, "num_kv_blocks": 40, "block_size": 16}
    if rank:
        engine_cfg |= {"lora_rank": rank, "lora_alpha": 2.0 * rank}
    engine = Engine(EngineConfig(**engine_cfg))
    times, sent = [], 0
    for version in range(3):
        start = time.perf_counter()
        pairs = [p for bucket in trainer.iter_full_weights(1 << 28) for p in bucket]
        engine.load_weights(pairs, version=version + 1)
        times.append(time.perf_counter() - start)
        sent = sum(t.numel() * t.element_size() for _, t in pairs)
    out.put(
        {
            "variant": (f"lora r={rank}" if rank else "full")
            + (", bf16 base" if param_dtype == "bfloat16" else ""),
            "parameters": sum(p.numel() for p in params),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "trainer_state_mb": state_bytes / 2**20,
            "frozen_params_mb": frozen_bytes / 2**20,
            "peak_rss_trainer_gb": peak_trainer,
            "peak_rss_total_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "sync_mb_per_step": sent / 2**20,
            "sync_s_median": statistics.median(times),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(_save_model(Path(tmp) / "model", args.hidden, args.layers))
        for rank, dtype in ((0, "float32"), (args.rank, "float32"), (args.rank, "bfloat16")):
            q = ctx.Queue()
            p = ctx.Process(target=_variant, args=(model_dir, rank, dtype, q))
            p.start()
            while p.is_alive() and q.empty():
                p.join(timeout=1.0)
            if q.empty():
                raise SystemExit(f"the rank={rank} variant failed (exit code {p.exitcode})")
            rows.append(q.get())
            p.join()
    result = {"model": {"hidden": args.hidden, "layers": args.layers}, "rows": rows}
    out = Path(__file__).parent / "results" / "lora_bench.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys))


if __name__ == "__main__":
    main()
