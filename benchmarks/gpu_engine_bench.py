"""GPU decode throughput: patrl's Engine vs Hugging Face `generate` vs the HBM roofline.

    python benchmarks/gpu_engine_bench.py [--batches 1,16,64,256] [--steps 64] [--repeats 3]
    python benchmarks/gpu_engine_bench.py --tiny --device cpu   # a smoke run of the script

For each batch size B, on a random-init Llama-3.2-1B-shaped model in bf16 (random weights run
the same kernels as trained ones), one run measures side by side:
1. Engine decode tokens/s: B requests of --prompt-len tokens are prefilled, then --steps
   decode steps are timed (device synchronised before and after), for every attention backend
   the device has, with CUDA graphs (the default) and with `enforce_eager`.
2. HF `generate` decode tokens/s on the same GPU (sdpa attention, its default cache): the time
   of B x (--steps + 1) new tokens minus that of 1 new token, so prefill cancels out.
3. The roofline: a decode step must read every weight once and each sequence's KV; tokens/s
   at the device's copy bandwidth (measured in the same run: a 1 GiB device-to-device copy,
   read + write bytes over its time) is B / ((weight bytes + KV bytes) / bandwidth).
Each figure is the median of --repeats; the pairs run interleaved. JSON to
benchmarks/results/gpu_engine_bench.json. Without CUDA and without --device cpu it says so and
exits 0 (`nox -s bench` runs on CPU machines too).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from patrl.rollout import Engine, EngineConfig, SamplingParams

LLAMA_1B: dict[str, Any] = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write), best of 5."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def save_model(shape: dict[str, Any], dtype: torch.dtype, root: Path) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(dtype)
    model.save_pretrained(root, safe_serialization=True)
    return root


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def engine_decode(engine: Engine, batch: list[list[int]], steps: int) -> float:
    """Decode tokens/s of `batch`, prefill excluded."""
    device = engine.device
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=steps + 2, ignore_eos=True)
    for p in batch:
        engine.add_request(p, params)
    decodes = engine.counters.decode_steps
    while engine.counters.decode_steps == decodes:  # every prompt prefilled, one decode run
        engine.step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    elapsed = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    return len(batch) * steps / elapsed


def hf_decode(model: Any, batch: list[list[int]], steps: int, device: torch.device) -> float:
    """HF `generate` decode tokens/s: (steps + 1 new tokens) - (1 new token), prefill cancels."""
    ids = torch.tensor(batch, device=device)
    mask = torch.ones_like(ids)

    def timed(new: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        model.generate(
            ids, attention_mask=mask, do_sample=True, max_new_tokens=new, min_new_tokens=new,
            pad_token_id=0,
        )  # fmt: skip
        sync(device)
        return time.perf_counter() - t0

    elapsed = timed(steps + 1) - timed(1)
    return len(batch) * steps / elapsed if elapsed > 0 else float("nan")  # noise won


def roofline(model: Any, shape: dict[str, Any], batch: int, context: float, bw: float) -> float:
    """Tokens/s if a step only read every weight once and each sequence's KV, at `bw`."""
    elem = next(model.parameters()).element_size()
    weights = sum(p.numel() for p in model.parameters()) * elem
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * elem
    return batch / ((weights + batch * context * kv_per_token) / bw)


def make_engine(
    model_dir: Path, device: torch.device, backend: str, graphs: bool, batches: list[int], args: Any
) -> Engine:
    """An engine whose KV cache holds exactly max(batches) sequences of `max_model_len` tokens
    (`num_kv_blocks`): the bench holds several engines on one device at once, so none may take
    its KV from the device's free memory (`gpu_memory_utilization`), or the first would leave
    the others none."""
    fields: dict[str, Any] = dict(
        model=str(model_dir),
        device=str(device),
        attention_backend=backend,
        enforce_eager=not graphs,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(8192, args.prompt_len),
        max_model_len=args.prompt_len + args.steps + 8,
    )
    block_size = EngineConfig(**fields).block_size
    blocks = max(batches) * -(-fields["max_model_len"] // block_size)
    return Engine(EngineConfig(**fields, num_kv_blocks=blocks))


def build_engines(
    model_dir: Path,
    device: torch.device,
    variants: list[tuple[str, bool]],
    batches: list[int],
    args: Any,
) -> dict[tuple[str, bool], Engine]:
    """One engine per (attention backend, CUDA graphs) variant, all alive at once."""
    return {(b, g): make_engine(model_dir, device, b, g, batches, args) for b, g in variants}


def backends(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return ["sdpa"]
    found = ["sdpa"]
    found += [n for n, mod in (("triton", "triton"), ("flash", "flash_attn")) if _has(mod)]
    return found


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (smoke runs)")
    ap.add_argument("--out", default="benchmarks/results/gpu_engine_bench.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_engine_bench: no CUDA device here; skipped (--device cpu for a smoke run)")
        return
    shape = TINY if args.tiny else LLAMA_1B
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    bw = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 26)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(shape, dtype, Path(tmp))
        hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
        hf = hf.to(device).eval()
        variants = [(b, g) for b in backends(device) for g in (True, False)]
        if device.type != "cuda":
            variants = [("sdpa", False)]
        engines = build_engines(model_dir, device, variants, batches, args)
        rows = []
        for batch in batches:
            times: dict[str, list[float]] = {}
            for r in range(args.repeats):
                work = prompts(batch, args.prompt_len, shape["vocab_size"], seed=r)
                order = list(engines.items())
                order = order if r % 2 == 0 else order[::-1]
                for (b, g), eng in order:
                    name = f"engine_{b}_{'graphs' if g else 'eager'}"
                    times.setdefault(name, []).append(engine_decode(eng, work, args.steps))
                times.setdefault("hf_generate", []).append(hf_decode(hf, work, args.steps, device))
            med = {k: statistics.median(v) for k, v in times.items()}
            context = args.prompt_len + args.steps / 2
            roof = roofline(hf, shape, batch, context, bw)
            rows.append(
                {
                    "batch": batch,
                    "tok_s": med,
                    "roofline_tok_s": roof,
                    "fraction_of_roofline": {k: v / roof for k, v in med.items()},
                    "vs_hf": {k: v / med["hf_generate"] for k, v in med.items()},
                }
            )
            print(json.dumps(rows[-1]))
    result = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "model": "tiny" if args.tiny else "llama-3.2-1b-shaped, random init",
        "dtype": str(dtype),
        "copy_bandwidth_GBps": bw / 1e9,
        "args": vars(args),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
