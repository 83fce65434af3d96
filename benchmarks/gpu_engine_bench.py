"""GPU decode throughput: patrl's Engine vs Hugging Face `generate` vs the HBM roofline.

    python benchmarks/gpu_engine_bench.py [--batches 1,16,64,256] [--steps 64] [--repeats 3]
    python benchmarks/gpu_engine_bench.py --tiny --device cpu   # a smoke run of the script
    python benchmarks/gpu_engine_bench.py --verify 4 [--spec-rollout]   # + what speculation costs

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
With `--verify K`, per batch size and attention backend, what a speculative step costs:
4. `verify_over_decode`: the engine's own verify step (scheduler, `ModelRunner` verify batch of
   B sequences x (K + 1) tokens, verification, rollback), drafts forced to K tokens that the
   model rejects (so each step emits one token and the KV context grows as a decode step's),
   over a plain decode step of an engine without speculation at the same B and context
   (greedy; also at temperature 1, seeded), the median of --repeats ratios of the two runs'
   times over --steps steps. From it the break-even: a verify step emits 1 + a tokens a
   sequence (a accepted draft tokens), so it pays when 1 + a > ratio; reported as accepted
   tokens (ratio - 1), as a share of the K drafted, and as the per-token acceptance p of a
   chain (1 + p + ... + p^K = ratio). With graphs, the same over an eager decode step (the
   verify step itself runs eagerly).
5. `all_accepted`: drafts forced to the decode run's own greedy tokens, so every draft is
   accepted (K + 1 tokens a step): tokens/s against the decode run's, over the same output
   positions. Every sequence's tokens must equal the decode run's (`matching_sequences`:
   in bf16 the two paths' kernels round differently and a near-tie may flip).
6. With `--spec-rollout`, spec_bench.py's GRPO-like workload (--spec-prompts x --spec-n
   samples, long-tailed lengths, epochs 1 and 2) on the verify engine with its own drafter
   (speculating at most 16 running samples) vs the decode engine: tail tokens/s (steps that
   start with at most --spec-n / 2 running samples) and acceptance, at temperature 1 and greedy
   (a random model's drafts are poor; greedy is the upper bound), on the first backend.
Each figure is the median of --repeats; the pairs run interleaved. JSON to
benchmarks/results/gpu_engine_bench.json, rewritten (whole, atomically) after each section so
a run cut short keeps what it measured. Without CUDA and without --device cpu it says so and
exits 0 (`nox -s bench` runs on CPU machines too).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from patrl.rollout import Engine, EngineConfig, SamplingParams
from patrl.rollout.drafter import Draft, Drafter, Sample

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
    model_dir: Path,
    device: torch.device,
    backend: str,
    graphs: bool,
    batches: list[int],
    args: Any,
    speculate: int = 0,
) -> Engine:
    """An engine whose KV cache holds exactly `max_seqs(batches, args)` sequences of
    `model_len(args)` tokens (`num_kv_blocks`): the bench holds several engines on one device
    at once, so none may take its KV from the device's free memory (`gpu_memory_utilization`),
    or the first would leave the others none. `speculate` > 0: speculation on, drafts of up to
    that many tokens (spec_bench's settings: speculating at most 16 running samples)."""
    fields: dict[str, Any] = dict(
        model=str(model_dir),
        device=str(device),
        attention_backend=backend,
        enforce_eager=not graphs,
        max_num_seqs=max_seqs(batches, args),
        max_num_batched_tokens=max(8192, args.prompt_len),
        max_model_len=model_len(args),
    )
    if speculate:
        fields["speculative"] = {
            "enable": True,
            "num_speculative_tokens": speculate,
            "max_num_seqs": 16,
        }
    block_size = EngineConfig(**fields).block_size
    blocks = fields["max_num_seqs"] * -(-fields["max_model_len"] // block_size)
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


def max_seqs(batches: list[int], args: Any) -> int:
    """The engines' max_num_seqs: the largest batch, or every sample of --spec-rollout. `args`
    without --verify's fields (gpu/decode_profile.py's) asks for none of it."""
    rollout = args.spec_prompts * args.spec_n if getattr(args, "spec_rollout", False) else 0
    return max(*batches, rollout)


def model_len(args: Any) -> int:
    """The engines' max_model_len: the decode runs' prompts and steps, the verify runs'
    (`verify_max_tokens`) and --spec-rollout's prompts and longest response (as `max_seqs`,
    `args` may lack the last two's fields)."""
    need = args.steps + 2
    if getattr(args, "verify", 0):
        need = max(need, verify_max_tokens(args.steps, args.verify))
    need += args.prompt_len
    if getattr(args, "spec_rollout", False):
        need = max(need, SPEC_PROMPT_LEN + max(spec_bench().tail_lengths(args.spec_n)))
    return need + 6


# ------------------------------------------------------------------ speculation (--verify)

SPEC_PROMPT_LEN = 32  # spec_bench's prompts


def spec_bench() -> ModuleType:
    """benchmarks/spec_bench.py (its workload and `rollout`), loaded from beside this file."""
    path = Path(__file__).with_name("spec_bench.py")
    spec = importlib.util.spec_from_file_location("spec_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def verify_max_tokens(steps: int, k: int) -> int:
    """max_tokens of the verify runs: room for the first decode step, `steps` timed steps and
    the all-accepted run's K + 1 a step, with a full draft left for its last timed step."""
    return steps + 2 * (k + 1) + 2


class ForcedDrafter(Drafter):
    """A drafter whose drafts are set by the bench: every sample's next K tokens of a
    `reference` (its prompt's tokens from a decode run; `mode` "accept"), the same with the
    first token moved off the reference ("reject": under greedy the step emits exactly the
    reference token, so each step adds one token of context, as a decode step does), or
    nothing (None: no step speculates). The engine's scheduler, verify batch, verification
    and rollback run as for any drafter's drafts; only where drafts come from differs."""

    def __init__(self, k: int, vocab_size: int) -> None:
        super().__init__(k, adaptive=False)
        self.vocab_size = vocab_size
        self.mode: str | None = None
        self.reference: dict[tuple[int, ...], list[int]] = {}
        self.position: dict[int, tuple[tuple[int, ...], int]] = {}

    def speculates(self, num_seqs: int) -> bool:
        return self.mode is not None

    def observe(self, seq: Sample) -> None:
        super().observe(seq)
        self.position[seq.seq_id] = (tuple(seq.prompt_token_ids), len(seq.output_token_ids))

    def propose(self, seq_id: int, context: Sequence[int], limit: int) -> Draft:
        prompt, done = self.position[seq_id]
        tokens = list(self.reference.get(prompt, [])[done : done + min(limit, self.max_draft)])
        if tokens and self.mode == "reject":
            tokens[0] = (tokens[0] + 1) % self.vocab_size
        return Draft(tokens, "group" if tokens else None)


def timed_run(
    engine: Engine, batch: list[list[int]], params: SamplingParams, steps: int
) -> tuple[float, int, list[list[int]]]:
    """`batch` run to the end under `params`; the seconds and tokens of `steps` steps after
    every prompt is prefilled and one decode step has run (device synchronised around them),
    and every request's tokens. The engine's step timeline starts afresh (`stats` copies it)."""
    device = engine.device
    engine.reset_timeline()
    ids = [engine.add_request(p, params) for p in batch]
    done: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            done[out.request_id] = list(out.outputs[0].token_ids)

    decodes = engine.counters.decode_steps
    while engine.counters.decode_steps == decodes:
        step()
    sync(device)
    tokens = engine.counters.generated_tokens
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    elapsed = time.perf_counter() - t0
    tokens = engine.counters.generated_tokens - tokens
    while engine.has_unfinished():
        step()
    return elapsed, tokens, [done[i] for i in ids]


def break_even(ratio: float, k: int) -> dict[str, float | None]:
    """What a verify step of K draft tokens costing `ratio` decode steps must yield to pay:
    accepted tokens a sequence (ratio - 1), their share of the K drafted, and the per-token
    acceptance p of a chain (1 + p + ... + p^K = ratio, by bisection); None where even K
    accepted tokens do not pay."""
    if ratio > k + 1:
        return {"accepted_tokens": None, "acceptance": None, "chain_acceptance": None}
    need = max(0.0, ratio - 1)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**j for j in range(k + 1)) < ratio else (lo, mid)
    return {"accepted_tokens": need, "acceptance": need / k, "chain_acceptance": lo}


def verify_runs(
    decode: dict[str, Engine],
    spec: Engine,
    forced: ForcedDrafter,
    work: list[list[int]],
    steps: int,
    k: int,
) -> tuple[dict[str, float], dict[str, float], dict[str, float], int]:
    """One repeat of `verify_row` on prompts `work`, `steps` timed steps: seconds a step and
    tokens/s by run ("decode_<name>", "decode_t1", "verify_reject", "verify_reject_t1",
    "verify_accept"), the verify runs' drafted and accepted tokens and tokens a sequence's
    step, and how many greedy verify runs' sequences equal the decode run's tokens."""
    length = verify_max_tokens(steps, k)
    greedy = SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=0, max_tokens=length, ignore_eos=True)
    accept_steps = max(1, steps // (k + 1))  # about the decode run's output positions
    per_step: dict[str, float] = {}
    tok_s: dict[str, float] = {}
    drafts: dict[str, float] = {}
    want: list[list[int]] = []
    for name, eng in decode.items():
        t, n, got = timed_run(eng, work, greedy, steps)
        want = want or got
        per_step[f"decode_{name}"], tok_s[f"decode_{name}"] = t / steps, n / t
    t, _, _ = timed_run(next(iter(decode.values())), work, sampled, steps)
    per_step["decode_t1"] = t / steps
    forced.reference = {tuple(p): w for p, w in zip(work, want, strict=True)}
    matching = 0
    runs = (("reject", greedy, steps), ("reject_t1", sampled, steps))
    for mode, params, timed in (*runs, ("accept", greedy, accept_steps)):
        forced.mode = mode.removesuffix("_t1")
        before = spec.stats()
        try:
            t, n, got = timed_run(spec, work, params, timed)
        finally:
            forced.mode = None
        after = spec.stats()
        per_step[f"verify_{mode}"], tok_s[f"verify_{mode}"] = t / timed, n / t
        for key in ("drafted", "accepted"):
            stat = f"spec_{key}_tokens"
            drafts[f"{mode}/{key}"] = after[stat] - before[stat]
        drafts[f"{mode}/tokens_per_step"] = n / (len(work) * timed)
        if params is greedy:
            matching += sum(g == w for g, w in zip(got, want, strict=True))
    return per_step, tok_s, drafts, matching


def verify_row(
    decode: dict[str, Engine],
    spec: Engine,
    forced: ForcedDrafter,
    batch: int,
    args: Any,
    vocab: int,
) -> dict[str, Any]:
    """One batch size's verify measurements on one backend (`decode`: its engines without
    speculation by name, "graphs" first where there is one; `spec`: its speculating engine,
    `forced` installed as its drafter), after one untimed warm-up repeat of two steps (the
    verify step's first shapes may compile kernels); see the module docstring, items 4, 5."""
    k, steps = args.verify, args.steps
    verify_runs(decode, spec, forced, prompts(batch, args.prompt_len, vocab, 99), 2, k)
    per_step: dict[str, list[float]] = {}  # seconds a step
    tok_s: dict[str, list[float]] = {}
    drafts: dict[str, list[float]] = {}
    matching = 0
    main = next(iter(decode))
    for r in range(args.repeats):
        work = prompts(batch, args.prompt_len, vocab, seed=100 + r)
        got = verify_runs(decode, spec, forced, work, steps, k)
        for into, values in zip((per_step, tok_s, drafts), got[:3], strict=True):
            for key, value in values.items():
                into.setdefault(key, []).append(value)
        matching += got[3]

    def ratio(num: str, den: str) -> float:
        pairs = zip(per_step[num], per_step[den], strict=True)
        return statistics.median(a / b for a, b in pairs)

    over = ratio("verify_reject", f"decode_{main}")
    row: dict[str, Any] = {
        "batch": batch,
        "k": k,
        "decode": main,
        "decode_s_per_step": statistics.median(per_step[f"decode_{main}"]),
        "verify_s_per_step": statistics.median(per_step["verify_reject"]),
        "verify_over_decode": over,
        "break_even": break_even(over, k),
        "verify_over_decode_t1": ratio("verify_reject_t1", "decode_t1"),
    }
    if main != "eager" and "eager" in decode:
        row["verify_over_eager_decode"] = ratio("verify_reject", "decode_eager")
    accepted, plain = (
        statistics.median(tok_s["verify_accept"]),
        statistics.median(tok_s[f"decode_{main}"]),
    )
    row["all_accepted"] = {
        "tokens_per_step": statistics.median(drafts["accept/tokens_per_step"]),
        "tok_s": accepted,
        "decode_tok_s": plain,
        "speedup_vs_decode": accepted / plain,
    }
    row["drafts"] = {key: statistics.median(v) for key, v in drafts.items()}
    row["matching_sequences"] = f"{matching} of {2 * batch * args.repeats}"
    row["all_match"] = matching == 2 * batch * args.repeats
    return row


def verify_section(
    model_dir: Path,
    engines: dict[tuple[str, bool], Engine],
    batches: list[int],
    args: Any,
    vocab: int,
    save: Any,
) -> dict[str, Any]:
    """--verify's rows by backend and --spec-rollout's on the first backend; one speculating
    engine per backend (with graphs where its decode engines have them), built here; `save`
    is called with the section so far after each row."""
    device = next(iter(engines.values())).device
    section: dict[str, Any] = {"k": args.verify, "rows": {}}
    for backend in dict.fromkeys(b for b, _ in engines):
        decode = {("graphs" if g else "eager"): e for (b, g), e in engines.items() if b == backend}
        decode = dict(sorted(decode.items(), key=lambda kv: kv[0] != "graphs"))
        spec = make_engine(
            model_dir, device, backend, "graphs" in decode, batches, args, args.verify
        )
        own = spec.drafter
        forced = ForcedDrafter(args.verify, vocab)
        spec.drafter = spec.scheduler.drafter = forced
        rows = section["rows"].setdefault(backend, [])
        for batch in batches:
            rows.append(verify_row(decode, spec, forced, batch, args, vocab))
            print(json.dumps({"verify": backend, **rows[-1]}))
            save(section)
        spec.drafter = spec.scheduler.drafter = own
        if args.spec_rollout and "rollout" not in section:
            section["rollout"] = {"backend": backend, **spec_rollout(decode, spec, args, vocab)}
            print(json.dumps({"spec_rollout": section["rollout"]}))
            save(section)
        del spec, forced
    return section


def spec_rollout(decode: dict[str, Engine], spec: Engine, args: Any, vocab: int) -> dict[str, Any]:
    """spec_bench's GRPO-like rollout (`rollout`: tail tokens/s, acceptance), epochs 1 and 2,
    at temperature 1 and greedy, speculation off (`decode`'s first engine) vs on (`spec`, its
    own drafter, history forgotten between temperatures); medians of --repeats."""
    bench = spec_bench()
    off_engine = next(iter(decode.values()))
    g = torch.Generator().manual_seed(0)
    work = [
        torch.randint(3, vocab, (SPEC_PROMPT_LEN,), generator=g).tolist()
        for _ in range(args.spec_prompts)
    ]
    tail = max(1, args.spec_n // 2)
    out: dict[str, Any] = {
        "prompts": args.spec_prompts,
        "n": args.spec_n,
        "lengths": bench.tail_lengths(args.spec_n),
        "tail_max_running": tail,
    }
    for temperature in (1.0, 0.0):
        runs: dict[str, list[dict[str, Any]]] = {}
        for r in range(args.repeats):
            assert spec.drafter is not None
            spec.drafter.merge_reset()  # no history from an earlier repeat or temperature
            order = (False, True) if r % 2 == 0 else (True, False)
            for epoch in (1, 2):
                for on in order:
                    engine = spec if on else off_engine
                    result = bench.rollout(engine, work, args.spec_n, temperature, tail, r, None)
                    runs.setdefault(f"epoch{epoch}/{'on' if on else 'off'}", []).append(result)
        section: dict[str, Any] = {}
        kept = ("wall_s", "tokens_per_s", "tail_s", "tail_tokens_per_s", "steps")
        for key, results in runs.items():
            names = [*kept, *(n for n in results[0] if n.startswith("spec_"))]
            section[key] = {n: statistics.median(r[n] for r in results) for n in names}
        for epoch in (1, 2):
            off, on = section[f"epoch{epoch}/off"], section[f"epoch{epoch}/on"]
            section[f"epoch{epoch}/speedup"] = {
                "wall": off["wall_s"] / on["wall_s"],
                "tail": off["tail_s"] / on["tail_s"] if on["tail_s"] else None,
            }
        out[f"temperature_{temperature:g}"] = section
    return out


def backends(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return ["sdpa"]
    found = ["sdpa"]
    found += [n for n, mod in (("triton", "triton"), ("flash", "flash_attn")) if _has(mod)]
    return found


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` whole: written beside it, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Run the bench (`argv`: the command line's arguments); returns the results it wrote,
    None without a CUDA device (skipped)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (smoke runs)")
    ap.add_argument(
        "--verify", type=int, default=0, metavar="K",
        help="also time verify steps of K draft tokens against decode steps (0: no)",
    )  # fmt: skip
    ap.add_argument(
        "--spec-rollout", action="store_true",
        help="with --verify: spec_bench's GRPO-like rollout, speculation on vs off",
    )  # fmt: skip
    ap.add_argument("--spec-prompts", type=int, default=4, help="--spec-rollout's prompts")
    ap.add_argument("--spec-n", type=int, default=8, help="--spec-rollout's samples a prompt")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode table (1-3)")
    ap.add_argument("--out", default="benchmarks/results/gpu_engine_bench.json")
    args = ap.parse_args(argv)
    if args.verify < 0:
        ap.error(f"--verify must be >= 0 draft tokens, got {args.verify}")
    if args.spec_rollout and not args.verify:
        ap.error("--spec-rollout needs --verify K (the draft length)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_engine_bench: no CUDA device here; skipped (--device cpu for a smoke run)")
        return None
    shape = TINY if args.tiny else LLAMA_1B
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    bw = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 26)
    out = Path(args.out)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "model": "tiny" if args.tiny else "llama-3.2-1b-shaped, random init",
        "dtype": str(dtype),
        "copy_bandwidth_GBps": bw / 1e9,
        "args": vars(args),
        "rows": [],
    }

    def save(verify: dict[str, Any] | None = None) -> None:
        if verify is not None:
            result["verify"] = verify
        write_atomically(out, json.dumps(result, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(shape, dtype, Path(tmp))
        hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
        hf = hf.to(device).eval()
        variants = [(b, g) for b in backends(device) for g in (True, False)]
        if device.type != "cuda":
            variants = [("sdpa", False)]
        engines = build_engines(model_dir, device, variants, batches, args)
        rows = result["rows"]
        for batch in [] if args.no_decode else batches:
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
            save()
        if args.verify:
            del hf
            verify_section(model_dir, engines, batches, args, shape["vocab_size"], save)
    save()
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
