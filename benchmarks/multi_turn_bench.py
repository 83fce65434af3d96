"""Multi-turn rollouts with tools (issue 46): rollout time of a tool-calling workload with
injected tool latency, patrl's agent loop against two slow twins, side by side in one run.

    python benchmarks/multi_turn_bench.py [--repeats 3] [--samples 16] [--turns 4] [--threads 1]

The workload: --samples samples (groups of --n sharing a prompt of --prompt-len random ids);
each makes --turns model turns of forced lengths (ignore_eos + max_tokens: evenly spaced
quantiles of a log-normal, median 24, clamped to [8, 96]), and after each turn but the last
one tool call whose latency is injected (a tool that sleeps in its worker thread: evenly
spaced quantiles of a log-normal, median --tool-ms, a long tail) and whose answer appends
--tool-tokens fixed ids. Lengths, latencies and answers are the same in every mode, and
decoding is greedy, so every mode computes the same trajectories (checked: `same_tokens`).

Modes, each a median over --repeats (the modes interleaved, their order rotating by repeat, so
load drift hits all of them):

- `kept_kv`: patrl's `AgentLoopRunner` as `ToolAgentLoop` drives it: each turn is kept in the
  engine with its KV (`keep=True`, `continues=` the previous turn), so a continuation prefills
  exactly its new tokens; a sample waiting on its tool holds no decode slot, the others keep
  decoding. Its per-continuation prefill is read off the engine's counter: its total less the
  first turns' prefill, which is `agent_loop`'s (the same prompts, cached alike).
- `agent_loop`: the same runner with its turns submitted whole (`keep_kv=False`) to an engine
  with prefix caching on: a continuation prefills what the prefix cache lacks (the new tokens
  and the part of the last KV block that was not full).
- `reprefill` (slow twin a): the same runner on an engine with prefix caching off, so each
  turn prefills the whole conversation.
- `blocking_batch` (slow twin b, `BlockingBatchTwin` below): the batch moves turn by turn in
  lock step, as a rollout that waits for the whole batch's tool calls does: every sample's
  turn is generated (`Engine.generate`, prefix caching on), then every call runs, and the next
  turn starts when the slowest call has answered.

Per mode: wall time, this process's CPU time, the engine's busy time (in `step`) and its idle
time (wall - busy: waiting for tools, or for the event loop; on a loaded machine wall time
swings with the load, the idle time much less), the engine's prefilled tokens (its counter) and
generated tokens; per continuation turn (turns 2..T), the tokens submitted, the tokens the
prefix cache held at submission, the prefill that leaves (submitted - cached), and the tokens
new to the engine: the tool's appended ids plus the previous turn's last sampled token (its KV
is computed only when it is fed back). With prefix caching the prefill exceeds the new tokens
only by the part of the last KV block that was not full (< block size). The model: a random
Llama (fp32, 5.2M parameters, vocab 4096), built once under --model-dir. Results: JSON on
stdout and in --out, with the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from patrl.orchestrator.agent import AgentLoop, AgentLoopOutput, AgentLoopRunner, ToolPool
from patrl.orchestrator.agent.base_tool import BaseTool
from patrl.orchestrator.agent.schemas import OpenAIFunctionToolSchema, ToolResponse
from patrl.orchestrator.agent.tool_parser import FunctionCall
from patrl.rollout import Engine, EngineConfig, SamplingParams

RANDOM_MODEL: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=4096,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
TURN_LENGTHS: dict[str, float] = dict(median=24.0, sigma=0.7, low=8, high=96)
LATENCY_SIGMA = 0.9  # the tool latency's log-normal spread (its median is --tool-ms)
MODES = ("kept_kv", "agent_loop", "reprefill", "blocking_batch")

SLEEP_SCHEMA = OpenAIFunctionToolSchema.model_validate(
    {
        "type": "function",
        "function": {
            "name": "sleep",
            "description": "Answer after `seconds` (the injected tool latency).",
            "parameters": {
                "type": "object",
                "properties": {"seconds": {"type": "number"}},
                "required": ["seconds"],
            },
        },
    }
)


class SleepTool(BaseTool):
    """A tool whose latency is its argument: it blocks its worker thread for `seconds` (as a
    remote call would), then answers "ok"."""

    def __init__(self) -> None:
        super().__init__({}, SLEEP_SCHEMA)

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        time.sleep(float(parameters["seconds"]))
        return ToolResponse(text="ok"), 0.0, {}


@dataclass(slots=True)
class Plan:
    """One sample's scripted conversation: its prompt, each turn's forced length, and after
    each turn but the last, its tool call's latency and the ids the answer appends."""

    prompt: list[int]
    turn_lengths: list[int]
    latencies_s: list[float]
    tool_ids: list[list[int]]


@dataclass(slots=True)
class TurnRecord:
    """One continuation turn (turn >= 2): tokens submitted, tokens the prefix cache held at
    submission, and tokens new to the engine (the appended ids + the last sampled token)."""

    turn: int
    submitted: int
    cached: int
    new: int


@dataclass
class Records:
    turns: list[TurnRecord] = field(default_factory=list)


def quantiles(n: int, median: float, sigma: float, low: float, high: float) -> list[float]:
    """`n` evenly spaced quantiles of a log-normal of `median` and `sigma`, clamped."""
    out = []
    for i in range(n):
        z = statistics.NormalDist().inv_cdf((i + 0.5) / n)
        out.append(min(high, max(low, median * math.exp(sigma * z))))
    return out


def make_plans(
    samples: int, n: int, turns: int, prompt_len: int, tool_tokens: int, tool_ms: float, vocab: int
) -> list[Plan]:
    """The workload: group g's samples share a prompt; turn lengths and latencies are spread
    over samples and turns by a fixed shuffle, so every turn has short and long ones."""
    g = torch.Generator().manual_seed(0)
    cells = samples * turns
    lengths = [round(x) for x in quantiles(cells, **TURN_LENGTHS)]  # type: ignore[arg-type]
    latencies = quantiles(samples * (turns - 1), tool_ms / 1000, LATENCY_SIGMA, 0.0, 60.0)
    order = torch.randperm(cells, generator=g).tolist()
    lat_order = torch.randperm(len(latencies), generator=g).tolist()
    prompts = [
        torch.randint(5, vocab, (prompt_len,), generator=g).tolist()
        for _ in range(-(-samples // n))
    ]
    plans = []
    for s in range(samples):
        plans.append(
            Plan(
                prompt=prompts[s // n],
                turn_lengths=[lengths[order[s * turns + t]] for t in range(turns)],
                latencies_s=[latencies[lat_order[s * (turns - 1) + t]] for t in range(turns - 1)],
                tool_ids=[
                    torch.randint(5, vocab, (tool_tokens,), generator=g).tolist()
                    for _ in range(turns - 1)
                ],
            )
        )
    return plans


def turn_params(length: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True)


def sleep_call(seconds: float) -> FunctionCall:
    return FunctionCall(name="sleep", arguments={"seconds": seconds})


class ScriptedToolLoop(AgentLoop):
    """An agent loop that follows a `Plan`: each model turn forced to its length, then one
    call to the sleep tool in the `ToolPool` and its fixed answer ids appended (mask 0).
    Records each continuation's submitted and prefix-cached tokens."""

    def __init__(self, pool: ToolPool, records: Records, keep: bool = False) -> None:
        super().__init__(tokenizer=None)
        self.pool = pool
        self.records = records
        self.keep = keep  # each turn kept with its KV for the next (the runner releases)

    async def run(self, sampling_params: SamplingParams, **kwargs: Any) -> AgentLoopOutput:
        plan: Plan = kwargs["plan"]
        ids = list(plan.prompt)
        mask: list[int] = []
        logprobs: list[float] = []
        blocks = self.server_manager.engine.cache.blocks
        previous: str | None = None
        for t, length in enumerate(plan.turn_lengths):
            if t > 0 and not self.keep:
                new = len(plan.tool_ids[t - 1]) + 1
                self.records.turns.append(
                    TurnRecord(t + 1, len(ids), blocks.num_cached_prefix(ids), new)
                )
            turn_id = f"s{kwargs['sample_index']}-t{t}"
            out = await self.server_manager.generate(
                turn_id,
                prompt_ids=ids,
                sampling_params=turn_params(length),
                keep=self.keep,
                continues=previous if self.keep else None,
            )
            previous = turn_id
            ids += out.token_ids
            mask += [1] * len(out.token_ids)
            logprobs += out.log_probs
            if t == len(plan.turn_lengths) - 1:
                break
            outcome = await self.pool.call(sleep_call(plan.latencies_s[t]))
            if outcome.error is not None:
                raise RuntimeError(f"the sleep tool failed: {outcome.text}")
            ids += plan.tool_ids[t]
            mask += [0] * len(plan.tool_ids[t])
            logprobs += [0.0] * len(plan.tool_ids[t])
        n = len(plan.prompt)
        return AgentLoopOutput(
            ids[:n], ids[n:], mask, logprobs, num_turns=2 * len(plan.turn_lengths)
        )


class BlockingBatchTwin:
    """Slow twin (b): the batch moves turn by turn in lock step. Each turn generates every
    sample's turn at once (`Engine.generate`), then runs every sample's call in the pool and
    waits for all of them, so the next turn waits for the slowest call and for the longest
    turn. Same trajectories as `ScriptedToolLoop`'s; records the same per-turn counts."""

    def __init__(self, engine: Engine, pool: ToolPool, records: Records) -> None:
        self.engine, self.pool, self.records = engine, pool, records

    def run(self, plans: Sequence[Plan]) -> list[list[int]]:
        convs = [list(p.prompt) for p in plans]
        blocks = self.engine.cache.blocks
        for t in range(len(plans[0].turn_lengths)):
            if t > 0:
                for p, ids in zip(plans, convs, strict=True):
                    new = len(p.tool_ids[t - 1]) + 1
                    self.records.turns.append(
                        TurnRecord(t + 1, len(ids), blocks.num_cached_prefix(ids), new)
                    )
            params = [turn_params(p.turn_lengths[t]) for p in plans]
            outs = self.engine.generate(convs, params)
            for ids, out in zip(convs, outs, strict=True):
                ids += out.outputs[0].token_ids
            if t == len(plans[0].turn_lengths) - 1:
                break

            async def calls(t: int = t) -> None:
                await asyncio.gather(*(self.pool.call(sleep_call(p.latencies_s[t])) for p in plans))

            asyncio.run(calls())
            for p, ids in zip(plans, convs, strict=True):
                ids += p.tool_ids[t]
        return convs


def random_model(path: Path) -> Path:
    """The random Llama, saved once under `path`."""
    marker = path / "bench_config.json"
    if marker.exists() and json.loads(marker.read_text()) == RANDOM_MODEL:
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**RANDOM_MODEL)).eval().save_pretrained(path)
    marker.write_text(json.dumps(RANDOM_MODEL))
    return path


def rollout(engine: Engine, mode: str, plans: list[Plan], workers: int) -> dict[str, Any]:
    """One rollout of `plans` in `mode` on `engine` (its prefix cache reset first): the
    figures above, and the trajectories (prompt + response ids) to compare across modes."""
    engine.cache.blocks.reset_prefix_cache()
    pool = ToolPool([SleepTool()], timeout_s=120.0, max_workers=workers)
    records = Records()
    before = engine.counters.prefill_tokens, engine.counters.generated_tokens
    busy = engine.counters.busy_s
    start, cpu_start = time.perf_counter(), time.process_time()
    if mode == "blocking_batch":
        trajectories = BlockingBatchTwin(engine, pool, records).run(plans)
    else:
        keep = mode == "kept_kv"
        loop = ScriptedToolLoop(pool, records, keep=keep)
        runner = AgentLoopRunner(engine, {"scripted": loop}, "scripted", keep_kv=keep)
        outs = runner.run([{"plan": p} for p in plans], turn_params(1))
        trajectories = [o.prompt_ids + o.response_ids for o in outs]
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    busy = engine.counters.busy_s - busy
    prefilled = engine.counters.prefill_tokens - before[0]
    generated = engine.counters.generated_tokens - before[1]
    turns = sorted({r.turn for r in records.turns})
    per_turn = {}
    for t in turns:
        rs = [r for r in records.turns if r.turn == t]
        per_turn[str(t)] = {
            "submitted": statistics.mean(r.submitted for r in rs),
            "prefilled": statistics.mean(r.submitted - r.cached for r in rs),
            "new": statistics.mean(r.new for r in rs),
        }
    first = sum(len(p.prompt) for p in plans)
    continuation_prefill = sum(r.submitted - r.cached for r in records.turns)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "engine_busy_s": busy,
        "engine_idle_s": wall - busy,
        "prefilled_tokens": prefilled,
        "generated_tokens": generated,
        "first_turn_prompt_tokens": first,
        "continuation_prefill_per_turn": continuation_prefill / max(1, len(records.turns)),
        "continuation_new_per_turn": statistics.mean(r.new for r in records.turns)
        if records.turns
        else 0.0,
        "per_turn": per_turn,
        "trajectories": trajectories,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="samples sharing a prompt (a group)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=384)
    parser.add_argument("--tool-tokens", type=int, default=32)
    parser.add_argument("--tool-ms", type=float, default=300.0, help="median tool latency")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/patrl_multi_turn_bench"))
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/multi_turn_bench.json")
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    model = random_model(args.model_dir)
    plans = make_plans(
        args.samples,
        args.n,
        args.turns,
        args.prompt_len,
        args.tool_tokens,
        args.tool_ms,
        RANDOM_MODEL["vocab_size"],
    )

    def make(prefix_caching: bool) -> Engine:
        return Engine(
            EngineConfig(
                model=str(model),
                dtype="float32",
                device="cpu",
                block_size=args.block_size,
                num_kv_blocks=-(-(args.samples * 2048) // args.block_size),
                max_model_len=4096,
                enable_prefix_caching=prefix_caching,
            )
        )

    engines = {m: make(m != "reprefill") for m in MODES}
    for m in MODES:  # warm up each engine (first-call allocations, kernel choices)
        rollout(engines[m], m, plans[: args.n], args.samples)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for m in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
            runs[m].append(rollout(engines[m], m, plans, args.samples))
    reference = runs["kept_kv"][0]["trajectories"]
    results: dict[str, Any] = {}
    for m in MODES:
        same = all(run["trajectories"] == reference for run in runs[m])
        for run in runs[m]:
            del run["trajectories"]
        scalar = {
            k: statistics.median(run[k] for run in runs[m])
            for k in ("wall_s", "cpu_s", "engine_busy_s", "engine_idle_s")
        }
        last = runs[m][-1]  # token counts are the same every repeat
        results[m] = {
            **scalar,
            **{k: v for k, v in last.items() if k not in scalar},
            "wall_s_runs": [run["wall_s"] for run in runs[m]],
            "same_tokens": same,
        }
    kept, cached = results["kept_kv"], results["agent_loop"]
    continuations = args.samples * (args.turns - 1)
    first_turns = (
        cached["prefilled_tokens"] - cached["continuation_prefill_per_turn"] * continuations
    )
    kept["continuation_prefill_per_turn"] = (kept["prefilled_tokens"] - first_turns) / continuations
    kept["continuation_new_per_turn"] = cached["continuation_new_per_turn"]
    for m in MODES[1:]:
        results[m]["slowdown_vs_kept_kv"] = results[m]["wall_s"] / kept["wall_s"]
    tool_s = [sum(p.latencies_s) for p in plans]
    report = {
        "workload": {
            "samples": args.samples,
            "n": args.n,
            "turns": args.turns,
            "prompt_len": args.prompt_len,
            "tool_tokens": args.tool_tokens,
            "tool_ms_median": args.tool_ms,
            "tool_s_per_sample_max": max(tool_s),
            "blocking_tool_s": sum(
                max(p.latencies_s[t] for p in plans) for t in range(args.turns - 1)
            ),
            "block_size": args.block_size,
            "repeats": args.repeats,
            "threads": args.threads,
            "model": RANDOM_MODEL,
        },
        "results": results,
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
