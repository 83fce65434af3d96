"""patrl vs TRL's GRPOTrainer on CPU: seconds per GRPO step on the same job (issue 5).

    pip install trl   # benchmark-only dependency (measured with trl 1.16.0, accelerate 1.15.0)
    # or, keeping the venv's torch/transformers: pip install --no-deps --target DIR trl==1.16.0
    #     accelerate==1.15.0 psutil, and put DIR on PYTHONPATH after the sources
    OMP_NUM_THREADS=2 python benchmarks/vs_trl.py [--steps 5] [--quick] [--no-torchrun]
    OMP_NUM_THREADS=1 python benchmarks/vs_trl.py --threads 1     # steadier on a loaded box

The job is the demo recipe (examples/configs/demo.yaml): the cached demo model (a 0.6M-parameter
char-level Llama warm-started by SFT, built by `ensure_demo_assets` under $PATRL_CACHE_DIR), its
running-sum prompts, 16 prompts x 8 samples, max prompt 96 / response 256 tokens, temperature 1,
lr 1.5e-4 constant, clip 0.2/0.2, grad clip 1.0, token-mean loss (TRL's `dapo`), GRPO advantages
with std normalisation (TRL's `scale_rewards="group"`), no KL, one generation and one optimizer
step per step, rewards = the demo's reward functions and weights (patrl's math_verify, weight 1;
demo.reward:shows_work, weight 0) called per sample by TRL through a wrapper.

Both sides see the same prompts in the same order: patrl's loader (data.seed) draws the batches,
and TRL gets exactly those rows, unshuffled, as already chat-formatted text, whose token ids are
checked equal to patrl's before anything runs. Both run in this one process with the same torch
thread count, interleaved step by step (a TRL step, then a patrl step, from a TRL callback), so
load drift on a shared machine hits both alike; the per-step ratio of each adjacent pair is
reported beside the ratio of medians. Step 1 of each is a warm-up; the table reports medians of
the next --steps steps. A step is, for TRL, on_step_begin -> on_step_end (generation with HF
`generate`, rewards, advantages, loss, backward, optimizer step); for patrl,
`SyncGRPO.train_one_step` (generation on its engine, rewards, advantages, the update, the
weight sync into the engine; one optimizer step per batch, so, as in TRL, the old logprobs come
from the update's own forward and there is no separate scoring pass). Columns: gen+score = generation and rewards (TRL:
its `_generate_and_score_completions`, which also computes advantages), train = the rest of the
step; resp len / max = mean / longest response of the step in tokens (EOS included on both
sides), so a reader can see the work was comparable; resp tok/s = response tokens of the step /
the step's seconds; reward = the step's mean reward.

Setups (`--setups`): `demo` is the job above; `tiny` is TRL's own tiny-Llama GRPO setup as
issue 35 measured it: a randomly initialised Llama of width 256, 4 layers, 4 heads (MLP 688) over
the demo's tokenizer (character-level here, where TRL's test model is word-level: only the
vocabulary's size differs in cost), 8 prompts x 8 samples, up to 128 response tokens, the same
rewards and loss settings. Each setup's rows split a step into gen+score (TRL: its
`_generate_and_score_completions`; patrl: `timing_s/gen` + `timing_s/reward`) and update, both
measured: TRL's from the end of its generate-and-score to `on_step_end` (loss, backward, clip,
optimizer and scheduler step), patrl's its `timing_s/update_actor` (+ `old_log_prob` when a
scoring pass runs); patrl's weight sync into its engine (`timing_s/update_weights`) is the rest.

A third row runs the main job as users do, `torchrun --nproc_per_node 2
examples/grpo_adaptive_tp.py` (FSDP over 2 ranks, adaptive-TP rollouts, one thread per rank, so
the same 2 cores), with the same overrides; its step time is the job's own `timing_s/step`.

Threads: on the shared 2-core box, while other jobs kept its load average at 3-8, two intra-op
threads left both sides with medians of 25-65 s per step against 3-12 s with one thread, and
erratic (a patrl step 2 s in one minute and 60 s in the next: the threads spin against each
other and the other jobs), so `--threads 1` (with OMP_NUM_THREADS=1) gives the steadier
comparison there; the default stays at 2, for a machine that is otherwise idle.

Writes benchmarks/results/vs_trl[_quick][_threadsN].json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from patrl.orchestrator.config import JobConfig, load_config
from patrl.orchestrator.data import PromptItem, PromptLoader
from patrl.orchestrator.distributed import World
from patrl.orchestrator.rewards import resolve_reward_fn
from patrl_examples.demo import DemoAssets, ensure_demo_assets

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEMO_YAML = ROOT / "examples" / "configs" / "demo.yaml"
EXAMPLE = ROOT / "examples" / "grpo_adaptive_tp.py"
# --quick: a smoke run of the same pipeline, small enough for ~2 minutes.
QUICK = {
    "data.train_batch_size": 4,
    "actor.ppo_mini_batch_size": 4,
    "rollout.n": 4,
    "data.max_response_length": 96,
}


@dataclass(slots=True)
class StepRecord:
    """One measured step of one side."""

    seconds: float
    gen_score_seconds: float  # generation + rewards (+ TRL's advantages): the rest is training
    mean_response_tokens: float
    max_response_tokens: float  # a static batch (HF generate) decodes until this one ends
    generated_tokens: int
    mean_reward: float
    update_seconds: float = 0.0  # the policy update, measured (not step minus generation)
    parts: dict[str, float] = field(default_factory=dict)  # the side's own timing breakdown
    load_avg_1min: float | None = None  # of the whole machine, at the step's end (shared box)


def patrl_record(seconds: float, metrics: dict[str, float], samples: int) -> StepRecord:
    """A step of patrl's loop from its metrics line (`timing_s/*`, verl's names)."""
    parts = {k.removeprefix("timing_s/"): v for k, v in metrics.items() if "timing_s/" in k}
    mean_len = metrics["response_length/mean"]
    return StepRecord(
        seconds,
        parts["gen"] + parts["reward"],
        mean_len,
        metrics["response_length/max"],
        round(mean_len * samples),
        metrics["critic/score/mean"],
        parts["update_actor"] + parts.get("old_log_prob", 0.0),
        parts,
        os.getloadavg()[0],
    )


@dataclass(slots=True)
class Row:
    name: str
    steps: list[StepRecord]  # the warm-up step first

    @property
    def timed(self) -> list[StepRecord]:
        return self.steps[1:]

    def median(self, key: str) -> float:
        return statistics.median(float(getattr(s, key)) for s in self.timed)

    def tokens_per_s(self) -> float:
        return statistics.median(s.generated_tokens / s.seconds for s in self.timed)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="timed steps after 1 warm-up (default 5; quick 2)"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the one process")
    ap.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}, 2 timed steps")
    ap.add_argument("--no-torchrun", action="store_true", help="skip the 2-process patrl row")
    ap.add_argument(
        "--setups",
        nargs="+",
        default=["tiny", "demo"],
        choices=["tiny", "demo"],
        help="tiny: TRL's tiny-Llama GRPO setup; demo: the demo job (the torchrun row is its)",
    )
    ap.add_argument(
        "--out", default=None, help="default benchmarks/results/vs_trl[_quick][_threadsN].json"
    )
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 2 if args.quick else 5
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    trl = require_trl()
    torch.set_num_threads(args.threads)

    assets = ensure_demo_assets()
    results: dict[str, Any] = {}
    for setup in args.setups:
        print(f"=== setup {setup}", flush=True)
        run_root = Path(tempfile.mkdtemp())
        model_dir = tiny_model_dir(assets, run_root) if setup == "tiny" else assets.model_dir
        overrides = {**(QUICK if args.quick else {}), **(TINY if setup == "tiny" else {})}
        if setup == "tiny":
            overrides["model.path"] = model_dir
        config = job_config(assets, overrides, args.steps + 1, run_root)
        batches = prompt_batches(config, assets, args.steps + 1)
        trl_row, patrl_row = run_interleaved(config, assets, model_dir, batches, args.threads)
        rows = [trl_row, patrl_row]
        if setup == "demo" and not args.no_torchrun:
            rows.append(run_torchrun(config, assets, overrides, args.steps + 1))
        results[setup] = report(args, config, rows, trl.__version__)
    name = (
        "vs_trl"
        + ("_quick" if args.quick else "")
        + (f"_threads{args.threads}" if args.threads != 2 else "")
    )
    out = Path(args.out or RESULTS / f"{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


# TRL's tiny-Llama GRPO setup (issue 35): 8 prompts x 8 samples, responses up to 128 tokens.
TINY = {
    "data.train_batch_size": 8,
    "actor.ppo_mini_batch_size": 8,
    "rollout.n": 8,
    "data.max_response_length": 128,
}


def tiny_model_dir(assets: DemoAssets, root: Path) -> Path:
    """A randomly initialised Llama (width 256, 4 layers) beside the demo's tokenizer files."""
    import shutil

    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    demo = AutoConfig.from_pretrained(assets.model_dir)
    config = LlamaConfig(
        vocab_size=demo.vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        bos_token_id=demo.bos_token_id,
        eos_token_id=demo.eos_token_id,
        pad_token_id=demo.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    out = root / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(out)
    for f in assets.model_dir.iterdir():
        copy = f.is_file() and f.suffix != ".safetensors" and f.name != "config.json"
        if copy and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return out


def require_trl() -> Any:
    try:
        import trl
    except ImportError as err:
        raise SystemExit(
            f"benchmarks/vs_trl.py needs TRL, a benchmark-only dependency ({err}): "
            "pip install trl   (measured with trl 1.16.0; `pip install --no-deps trl accelerate "
            "psutil` keeps an existing torch/transformers untouched)"
        ) from None
    return trl


# ------------------------------------------------------------------------------- the job


def job_values(overrides: dict[str, Any], total_steps: int, run_root: Path) -> dict[str, Any]:
    """Overrides of the demo recipe for a timed run: no validation, saving, plots or resume."""
    return {
        "trainer.total_training_steps": total_steps,
        "trainer.test_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.save_freq": 0,
        "trainer.logger": "[jsonl]",
        "trainer.plots": "false",
        "trainer.resume_mode": "disable",
        "trainer.default_local_dir": run_root,
        **overrides,
    }


def job_config(
    assets: DemoAssets, overrides: dict[str, Any], total_steps: int, run_root: Path
) -> JobConfig:
    """The demo recipe pointed at the cached assets."""
    values: dict[str, Any] = {
        "model.path": assets.model_dir,
        "data.train_files": assets.train_file,
        **job_values(overrides, total_steps, run_root),
    }
    config = load_config(DEMO_YAML, [f"{k}={v}" for k, v in values.items()])
    if config.actor.ppo_mini_batch_size != config.data.train_batch_size:
        raise ValueError(
            f"actor.ppo_mini_batch_size={config.actor.ppo_mini_batch_size} != "
            f"data.train_batch_size={config.data.train_batch_size}: the TRL side is set up for "
            "one optimizer step per generated batch, as the demo recipe does"
        )
    return config


def prompt_batches(config: JobConfig, assets: DemoAssets, count: int) -> list[list[PromptItem]]:
    """The batches patrl's loader draws for the first `count` steps (a twin of its loader)."""
    from transformers import AutoTokenizer

    from patrl.orchestrator.data import dataset_for

    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir, local_files_only=True)
    dataset = dataset_for(config, tokenizer, str(assets.train_file))
    d = config.data
    loader = PromptLoader(dataset.items, d.train_batch_size, shuffle=d.shuffle, seed=d.seed)
    return [loader.next_batch() for _ in range(count)]


def reward_specs(config: JobConfig) -> list[tuple[str, float]]:
    return [(f.name, f.weight) for f in config.reward.functions]


# ------------------------------------------------------------------------------ patrl side


class PatrlSide:
    """patrl's synchronous loop in this process (one rank: no FSDP, static TP 1)."""

    def __init__(
        self,
        config: JobConfig,
        assets: DemoAssets,
        model_dir: Path,
        batches: list[list[PromptItem]],
    ):
        from patrl.orchestrator.sync_loop import SyncGRPO

        world = World(0, 1, 0, torch.device("cpu"))
        self.loop = SyncGRPO(config, world, str(model_dir), str(assets.train_file), None)
        self.batches = batches
        self.drawn: list[list[int]] = []
        self.records: list[StepRecord] = []
        draw = self.loop.loader.next_batch

        def watched(size: int | None = None) -> list[PromptItem]:
            items = draw(size)
            self.drawn.append([item.index for item in items])
            return items

        # Proof, not assumption, that the TRL side was given the prompts patrl trains on.
        self.loop.loader.next_batch = watched  # type: ignore[method-assign]

    def step(self) -> None:
        self.loop.step += 1  # what SyncGRPO.run does before each step
        start = time.perf_counter()
        metrics = self.loop.train_one_step()
        seconds = time.perf_counter() - start
        expected = [item.index for item in self.batches[len(self.records)]]
        if self.drawn[-1] != expected:
            raise RuntimeError(f"patrl drew prompts {self.drawn[-1]}, TRL was given {expected}")
        samples = len(expected) * self.loop.config.rollout.n
        self.records.append(patrl_record(seconds, metrics, samples))

    def close(self) -> None:
        if self.loop.rewards is not None:
            self.loop.rewards.close()


# -------------------------------------------------------------------------------- TRL side


def trl_reward(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A patrl reward function (response, answer, **meta) as a TRL reward function."""

    def reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
        meta_keys = [k for k in kwargs if k not in ("prompts", "completion_ids", "trainer_state")]
        out = []
        for i, completion in enumerate(completions):
            text = completion if isinstance(completion, str) else completion[-1]["content"]
            meta = {k: kwargs[k][i] for k in meta_keys if isinstance(kwargs[k], list)}
            value = fn(text, answer[i], **meta)
            out.append(float(value["score"] if isinstance(value, dict) else value))
        return out

    reward.__name__ = name.replace(":", ".")
    return reward


def trl_trainer(
    config: JobConfig,
    assets: DemoAssets,
    model_dir: Path,
    batches: list[list[PromptItem]],
    out_dir: Path,
) -> Any:
    """GRPOTrainer with patrl's settings, on exactly `batches` in order."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    d, r, a = config.data, config.rollout, config.actor
    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir, local_files_only=True)
    items = [item for batch in batches for item in batch]
    # TRL tokenizes a text prompt with `processing_class(text=...)`: check it sees patrl's ids.
    ids = tokenizer(text=[item.prompt for item in items])["input_ids"]
    for item, got in zip(items, ids, strict=True):
        if list(got) != item.prompt_token_ids:
            raise RuntimeError(f"prompt {item.index}: TRL would tokenize it as {got}, patrl as "
                               f"{item.prompt_token_ids}")  # fmt: skip
    rows = [{"prompt": item.prompt, "answer": item.answer, **item.extra} for item in items]
    specs = reward_specs(config)
    args = GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=d.train_batch_size * r.n,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=a.ppo_epochs,
        num_generations=r.n,
        max_steps=len(batches),
        max_completion_length=d.max_response_length,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=max(r.top_k, 0),  # verl's -1: off
        learning_rate=a.optim.lr,
        lr_scheduler_type="constant",
        warmup_steps=a.optim.num_warmup_steps,
        weight_decay=a.optim.weight_decay,
        adam_beta1=a.optim.betas[0],
        adam_beta2=a.optim.betas[1],
        adam_epsilon=a.optim.eps,
        optim="adamw_torch",
        max_grad_norm=a.grad_clip,
        epsilon=a.clip_low,
        epsilon_high=a.clip_high,
        beta=a.kl_loss_coef if a.use_kl_loss else 0.0,
        loss_type="dapo",  # tokens of the whole batch averaged: patrl's token-mean
        scale_rewards="group" if config.algorithm.norm_adv_by_std_in_grpo else "none",
        reward_weights=[w for _, w in specs],
        mask_truncated_completions=False,
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=a.enable_gradient_checkpointing is True,  # "auto" is off on CPU
        shuffle_dataset=False,
        seed=config.trainer.seed,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
    )
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=a.attn_implementation
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=[trl_reward(name, resolve_reward_fn(name)) for name, _ in specs],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )


def run_interleaved(
    config: JobConfig,
    assets: DemoAssets,
    model_dir: Path,
    batches: list[list[PromptItem]],
    threads: int,
) -> tuple[Row, Row]:
    """TRL's steps, each followed by one patrl step (run from TRL's on_step_end)."""
    from transformers import TrainerCallback

    patrl = PatrlSide(config, assets, model_dir, batches)
    trainer = trl_trainer(config, assets, model_dir, batches, Path(tempfile.mkdtemp()))
    samples = config.data.train_batch_size * config.rollout.n
    trl_steps: list[StepRecord] = []
    generate = trainer._generate_and_score_completions
    gen_seconds: list[float] = []
    gen_end: list[float] = []

    def timed_generate(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        out = generate(*a, **k)
        gen_end.append(time.perf_counter())
        gen_seconds.append(gen_end[-1] - start)
        return out

    trainer._generate_and_score_completions = timed_generate

    class Interleave(TrainerCallback):
        start = 0.0

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            check_threads(threads)
            self.start = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            end = time.perf_counter()
            seconds = end - self.start
            # Read now: TRL clears its metric lists whenever it logs (at the end of train()).
            m = trainer._metrics["train"]
            mean_len = m["completions/mean_length"][-1]
            record = StepRecord(
                seconds,
                gen_seconds[-1],
                mean_len,
                m["completions/max_length"][-1],
                round(mean_len * samples),
                m["reward"][-1],
                end - gen_end[-1],  # loss, backward, clip, optimizer and scheduler step
                {"generate_and_score": gen_seconds[-1], "train": seconds - gen_seconds[-1]},
                os.getloadavg()[0],
            )
            trl_steps.append(record)
            check_threads(threads)
            patrl.step()
            print(f"step {len(trl_steps)}/{len(batches)}: TRL {seconds:.2f} s, "
                  f"patrl {patrl.records[-1].seconds:.2f} s", flush=True)  # fmt: skip

    trainer.add_callback(Interleave())
    try:
        trainer.train()
    finally:
        patrl.close()
    if len(trl_steps) != len(batches) or len(patrl.records) != len(batches):
        raise RuntimeError(
            f"expected {len(batches)} steps each, got TRL {len(trl_steps)}, "
            f"patrl {len(patrl.records)}"
        )
    return Row("TRL GRPOTrainer (1 process)", trl_steps), Row("patrl (1 process)", patrl.records)


def check_threads(threads: int) -> None:
    if torch.get_num_threads() != threads:
        raise RuntimeError(f"torch threads changed to {torch.get_num_threads()}, want {threads}")


# ------------------------------------------------------------------------- patrl torchrun


def run_torchrun(
    config: JobConfig, assets: DemoAssets, overrides: dict[str, Any], total_steps: int
) -> Row:
    """The main job as users run it, 2 ranks x 1 thread, with the same settings."""
    run_root = Path(tempfile.mkdtemp(prefix="patrl-vs-trl-"))
    values = job_values(overrides, total_steps, run_root)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(EXAMPLE),
        *(f"{k}={v}" for k, v in values.items()),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATRL_CACHE_DIR": str(assets.root.parent)}
    print("running: " + " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env, cwd=ROOT)
    metrics = next(run_root.rglob("metrics.jsonl"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    samples = config.data.train_batch_size * config.rollout.n
    steps = []
    for h in (h for h in rows if "timing_s/step" in h):
        record = patrl_record(h["timing_s/step"], h, samples)
        record.load_avg_1min = None  # the job ran in another process: not known per step
        steps.append(record)
    return Row("patrl torchrun 2 ranks x 1 thread (the default job)", steps)


# -------------------------------------------------------------------------------- report


def report(args: argparse.Namespace, config: JobConfig, rows: list[Row], trl_version: str) -> Any:
    import accelerate
    import transformers

    trl_s = rows[0].median("seconds")
    d = config.data
    print(f"\n{d.train_batch_size} prompts x {config.rollout.n} samples, max prompt "
          f"{d.max_prompt_length} / response {d.max_response_length}; median of {args.steps} "
          f"steps after 1 warm-up; {args.threads} torch threads")  # fmt: skip
    print(
        f"{'':52s} {'s/step':>7s} {'vs TRL':>7s} {'gen+score':>9s} {'update':>6s} "
        f"{'resp len':>8s} {'max':>4s} {'resp tok/s':>10s} {'reward':>6s}  s per step"
    )
    for row in rows:
        per_step = ", ".join(f"{s.seconds:.2f}" for s in row.timed)
        gen = row.median("gen_score_seconds")
        train = row.median("update_seconds")
        print(
            f"{row.name:52s} {row.median('seconds'):7.2f} {trl_s / row.median('seconds'):6.2f}x "
            f"{gen:9.2f} {train:6.2f} {row.median('mean_response_tokens'):8.1f} "
            f"{row.median('max_response_tokens'):4.0f} {row.tokens_per_s():10.1f} "
            f"{row.median('mean_reward'):6.3f}  {per_step}"
        )
    loads = [s.load_avg_1min for row in rows for s in row.steps if s.load_avg_1min is not None]
    print(f"machine load average (1 min) during the in-process steps: "
          f"{min(loads):.1f} .. {max(loads):.1f} on {os.cpu_count()} CPUs")  # fmt: skip
    # Step i of TRL and step i of patrl ran back to back: their ratio sees the same load.
    paired = [t.seconds / p.seconds for t, p in zip(rows[0].timed, rows[1].timed, strict=True)]
    print(f"TRL / patrl (1 process) per interleaved step: "
          f"{', '.join(f'{r:.2f}' for r in paired)}; median {statistics.median(paired):.2f}")  # fmt: skip
    # The targets are per part: patrl's update / TRL's, generation alike.
    split = {
        key: statistics.median(
            getattr(p, key) / getattr(t, key)
            for t, p in zip(rows[0].timed, rows[1].timed, strict=True)
        )
        for key in ("update_seconds", "gen_score_seconds")
    }
    print(f"patrl / TRL per interleaved step, medians: update {split['update_seconds']:.2f}, "
          f"gen+score {split['gen_score_seconds']:.2f}")  # fmt: skip
    return {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch_threads": args.threads,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl_version,
            "accelerate": accelerate.__version__,
        },
        "args": vars(args),
        "config": json.loads(config.model_dump_json()),
        "paired_ratio_trl_over_patrl": paired,
        "median_paired_ratio": statistics.median(paired),
        "median_paired_patrl_over_trl": split,
        "rows": {
            row.name: {
                "median_s_per_step": row.median("seconds"),
                "median_gen_score_s": row.median("gen_score_seconds"),
                "median_update_s": row.median("update_seconds"),
                "speedup_vs_trl": trl_s / row.median("seconds"),
                "median_mean_response_tokens": row.median("mean_response_tokens"),
                "median_generated_tokens_per_s": row.tokens_per_s(),
                "median_reward": row.median("mean_reward"),
                "warmup": asdict(row.steps[0]),
                "steps": [asdict(s) for s in row.timed],
            }
            for row in rows
        },
    }


if __name__ == "__main__":
    main()
