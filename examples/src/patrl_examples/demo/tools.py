"""The tool demo: the embedded addition task with a calculator the model may call.

Its warm start is the plain demo's model (`ensure_demo_assets`, built first if need be),
fine-tuned briefly on a mix of the plain demo's answers (worked lines or a bare boxed total)
and answers that call the calculator, in verl's hermes format, and box its result:

    <|assistant|><tool_call>{"name": "calculator", "arguments": {"expression": "7+1+5"}}</tool_call>
    </s><|tool|>13\\n<|assistant|>\\boxed{13}</s>

rendered by the tool tokenizer's chat template (`tokenizer.build_tool_tokenizer`) exactly as
`ToolAgentLoop` appends a tool turn at rollout time. Only the model's own tokens are trained on
(the call, the final answer and its EOS); the tool turn between them (the end of the call's
turn, the tool's answer and the next turn's opening) is masked, as RL's loss mask does. The
EOS after `</tool_call>` is the template's, not the model's: the rollout stops at
`</tool_call>` and appends it.

Two tasks (`TOOL_TASKS`): "addition", the plain demo's own (labelled single digits: the worked
lines mostly right, so the calculator barely pays), and "long_sums" (`long_sums.SumProblem`:
`Add: 325+267+630`), which a model this small mostly adds wrong by hand and mostly gets right
by copying the expression into a call, so calling pays. Its warm start calls the calculator on
a minority of problems and trains longer, at a higher rate, for the copying (`LONG_SUMS_SFT`);
then a second stage (`LONG_SUMS_MALFORMED_SFT`, a recipe whose `start` is the first) makes a
share of its calls malformed (`MALFORMED_KINDS`), each answered as the rollout answers it (the
tool's error observation, then a well-formed retry; or, with no closed call, nothing), so that
the warm start makes malformed calls as real models do and RL has them to train away.

A build directory `demo-tools-<key>` (next to the plain demo's in the cache): `model/` (the
fine-tuned model and the tool tokenizer), `data/` (the task's train and validation rows: the
plain demo's for "addition", drawn by the plain demo's seeds for "long_sums";
each tagged with verl's `extra_info: {"split": "train" | "test"}` so a reward can tell a training
rollout from a validation one), `tools.yaml` (the calculator's tool config) and `demo.json` (the manifest, written
last). The plain demo's build and cache key are untouched.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from patrl.orchestrator.agent.calculator import CalculatorTool
from patrl.orchestrator.agent.tool_parser import extract_tool_calls
from patrl.orchestrator.agent.tool_pool import ERROR_PREFIX
from patrl_examples.demo import long_sums
from patrl_examples.demo.assets import (
    MANIFEST,
    DemoRecipe,
    default_cache_root,
    ensure_demo_assets,
    file_lock,
    progress_logger,
    save_model,
    torch_threads,
)
from patrl_examples.demo.long_sums import LongSumsConfig, SumProblem
from patrl_examples.demo.sft import IGNORE, fit
from patrl_examples.demo.task import Problem, iter_problems
from patrl_examples.demo.tokenizer import build_tool_tokenizer

TOOL_BUILD_VERSION = 2
CALCULATOR = "calculator"
# The calculator's schema as the tool config gives it (the class's own, named here so the
# demonstrations render with the schema the rollout renders with).
TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": CALCULATOR,
        "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 7+1+5"}},
            "required": ["expression"],
        },
    },
}
TOOLS_YAML = """\
# The tool demo's tool config (verl's shape): patrl's built-in calculator.
tools:
  - class_name: patrl.orchestrator.agent.calculator.CalculatorTool
    config: {type: native}
"""
_TOOL_SFT_STREAM = 4  # the plain demo uses streams 1-3 of the seed
_SECOND_SFT_STREAM = 5  # a recipe with a `start`: its fine-tune draws fresh problems
# A task of its own draws its train and validation rows from the plain demo's streams.
_TRAIN_STREAM, _VAL_STREAM = 1, 2
# A problem of either task: both have the same answer interface.
AnyProblem = Problem | SumProblem


class ToolSFTConfig(BaseModel):
    """The tool warm start: a short fine-tune of the plain demo's model. Part of the key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(1200, gt=0)
    tool_fraction: float = Field(
        0.5, ge=0, le=1, description="share of demonstrations that call the calculator"
    )
    direct_fraction: float = Field(
        0.5, ge=0, le=1, description="of the others, the share that box a bare total"
    )
    malformed_fraction: float = Field(
        0.0,
        ge=0,
        le=1,
        description="of the calling demonstrations, the share whose first call is malformed "
        "(MALFORMED_KINDS, drawn uniformly)",
    )
    tokens_per_batch: int = Field(2048, gt=0)
    pool_size: int = Field(512, gt=0)
    lr: float = Field(5e-4, gt=0)
    warmup_steps: int = Field(30, ge=0)
    grad_clip: float = Field(1.0, gt=0)


# The long-sums warm start: calls on 40% of the demonstrations, so that greedy decoding starts
# out adding by hand and RL has a call share to raise; the others work the sum out line by line
# (no bare totals), which copies numbers as a call does. Longer and at a higher rate than the
# addition one, since copying three- and four-digit numbers is learned late.
LONG_SUMS_SFT = ToolSFTConfig(steps=3000, lr=2e-3, tool_fraction=0.4, direct_fraction=0.0)
# Its second stage, continuing from it (`ToolDemoRecipe.start`): the same mix with a fifth of
# the calling demonstrations opening with a malformed call (MALFORMED_KINDS), as real models'
# calls sometimes are, so that the warm start makes them at a measurable rate and RL has a
# well-formed share of calls to raise. A second stage, not the first stage's mix: mixed in from
# the start, the copying of the expression into the call was not learned in 3000 steps.
LONG_SUMS_MALFORMED_SFT = LONG_SUMS_SFT.model_copy(
    update={"steps": 600, "lr": 1e-3, "malformed_fraction": 0.2}
)


class ToolDemoRecipe(BaseModel):
    """The plain demo's recipe (the warm start's start, and the data unless `task` is set), the
    tool task and the tool fine-tune; with `start`, the fine-tune continues from that tool
    recipe's model (built first, cached as its own) instead of the plain demo's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: DemoRecipe = DemoRecipe()
    sft: ToolSFTConfig = ToolSFTConfig()
    task: LongSumsConfig | None = Field(
        None, description="long sums for the rows and demonstrations; None: the plain demo's task"
    )
    start: ToolDemoRecipe | None = Field(
        None, description="a tool recipe of the same base and task whose model this one tunes"
    )

    @model_validator(mode="after")
    def _same_task_as_start(self) -> ToolDemoRecipe:
        if self.start is not None and (
            self.start.base != self.base or self.start.task != self.task
        ):
            raise ValueError(
                "start: a tool recipe continues only from one of the same base and task"
            )
        return self

    @classmethod
    def default(cls, seed: int = 0, quick: bool = False, task: str = "addition") -> ToolDemoRecipe:
        """The real recipe of `task` (a TOOL_TASKS name), or a seconds-long one (a barely
        trained model) for tests."""
        if task not in TOOL_TASKS:
            raise ValueError(f"task={task!r}: use one of {sorted(TOOL_TASKS)}")
        config = TOOL_TASKS[task]
        base = DemoRecipe.default(seed, quick=quick)
        quick_update = {"steps": 3, "tokens_per_batch": 512, "pool_size": 32, "warmup_steps": 1}

        def stage(sft: ToolSFTConfig) -> ToolSFTConfig:
            return sft.model_copy(update=quick_update) if quick else sft

        if config is None:
            return cls(base=base, sft=stage(ToolSFTConfig()), task=None)
        start = cls(base=base, sft=stage(LONG_SUMS_SFT), task=config)
        return cls(base=base, sft=stage(LONG_SUMS_MALFORMED_SFT), task=config, start=start)

    def problems(self, seed: int) -> Iterator[AnyProblem]:
        """The endless stream of the task's problems drawn from `seed`."""
        if self.task is None:
            return iter_problems(seed, self.base.task)
        return long_sums.iter_problems(seed, self.task)

    def key(self) -> str:
        fields = self.model_dump()
        if self.task is None:  # left out: an addition recipe hashes as its own fields alone
            del fields["task"]
        if self.sft.malformed_fraction == 0:  # left out: such a recipe keeps its earlier key
            del fields["sft"]["malformed_fraction"]
        del fields["start"]
        if self.start is not None:  # its own key names it (left out when None, as above)
            fields["start"] = self.start.key()
        payload = json.dumps({"version": TOOL_BUILD_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


# The tool demo's tasks by name (`examples/grpo_tools.py --task`); None: the plain demo's.
TOOL_TASKS: dict[str, LongSumsConfig | None] = {"addition": None, "long_sums": LongSumsConfig()}


# ---------------------------------------------------------------- demonstrations


def call_text(problem: AnyProblem) -> str:
    """The model's calculator call for `problem`, hermes format: the addends joined by +."""
    expression = "+".join(str(x) for x in problem.addends)
    body = json.dumps({"name": CALCULATOR, "arguments": {"expression": expression}})
    return f"<tool_call>{body}</tool_call>"


def tool_messages(problem: AnyProblem) -> list[dict[str, str]]:
    """The whole conversation of a calculator answer: the call, the tool's answer, the box."""
    return [
        {"role": "user", "content": problem.prompt},
        {"role": "assistant", "content": call_text(problem)},
        {"role": "tool", "content": str(problem.answer)},
        {"role": "assistant", "content": problem.direct_solution()},
    ]


# Malformed first calls, each a way real models get hermes calls wrong, with the problem's
# expression in them: "unclosed_json" drops the JSON's last brace; "unclosed_tag" never writes
# `</tool_call>` (the turn ends at EOS, so the rollout finds no call and the sample ends
# unanswered); "wrong_argument" names the argument `expr`, not `expression`; "text_in_tag"
# writes the tool's name as text before the JSON inside the tag.
MALFORMED_KINDS = ("unclosed_json", "unclosed_tag", "wrong_argument", "text_in_tag")
DEMONSTRATION_KINDS = ("tool", "direct", "worked", *MALFORMED_KINDS)


def malformed_call_text(problem: AnyProblem, kind: str) -> str:
    """The model's malformed calculator call for `problem` of a MALFORMED_KINDS `kind`."""
    expression = "+".join(str(x) for x in problem.addends)
    body = json.dumps({"name": CALCULATOR, "arguments": {"expression": expression}})
    if kind == "unclosed_json":
        return f"<tool_call>{body[:-1]}</tool_call>"
    if kind == "unclosed_tag":
        return f"<tool_call>{body}"
    if kind == "wrong_argument":
        wrong = json.dumps({"name": CALCULATOR, "arguments": {"expr": expression}})
        return f"<tool_call>{wrong}</tool_call>"
    if kind == "text_in_tag":
        return f"<tool_call>{CALCULATOR} {body}</tool_call>"
    raise ValueError(f"kind={kind!r}: use one of {MALFORMED_KINDS}")


def observation(call: str) -> str | None:
    """What the rollout appends as the tool's answer to a model turn `call` (one call at
    most): None when it holds no closed call (the rollout ends the sample); a call that does
    not parse gets verl's error observation (the tool pool's text); a parsed one, the
    calculator's answer (for these calls, short of the demo's max_tool_response_length, so
    never truncated). The tool pool's answers are the reference (the demo's tests)."""
    _, calls = extract_tool_calls(call, "hermes")
    if not calls:
        return None
    if len(calls) > 1:
        raise ValueError(f"one call a turn, got {len(calls)} in {call!r}")
    parsed = calls[0]
    if parsed.error is not None or parsed.arguments is None:
        return ERROR_PREFIX + (parsed.error or "malformed call")
    if parsed.name != CALCULATOR:
        raise ValueError(f"a demonstration calls only the calculator, got {parsed.name!r}")
    response, _, _ = asyncio.run(CalculatorTool().execute("demo", parsed.arguments))
    return str(response.text)


def malformed_messages(problem: AnyProblem, kind: str) -> list[dict[str, str]]:
    """A conversation opening with a malformed call of `kind`: it ends there when the rollout
    would find no call in it ("unclosed_tag"); else the tool's error observation follows, and
    the model calls again, well-formed, and boxes the tool's answer (it reads the error and
    retries, as tool-use models are trained to)."""
    bad = malformed_call_text(problem, kind)
    messages = [{"role": "user", "content": problem.prompt}, {"role": "assistant", "content": bad}]
    answer = observation(bad)
    if answer is None:
        return messages
    return [
        messages[0],
        messages[1],
        {"role": "tool", "content": answer},
        *tool_messages(problem)[1:],
    ]


@dataclass(frozen=True, slots=True)
class Demonstration:
    """Token ids of a whole chat, `mask` 1 where the model is trained (its own tokens) and 0
    on the prompt and on tool turns; `prompt_len` ids are the prompt."""

    ids: list[int]
    mask: list[int]
    prompt_len: int


def encode_demonstration(
    problem: AnyProblem, tokenizer: PreTrainedTokenizerBase, kind: str
) -> Demonstration:
    """`kind`: "tool" (call, tool turn, boxed answer), "direct" (a bare boxed total),
    "worked" (the running sums) or a MALFORMED_KINDS name (`malformed_messages`). Rendered by the tokenizer's chat template with the calculator
    listed as the rollout renders it; ValueError if the template's rendering of the whole chat
    is not the concatenation of its turns' renderings (the demonstration would not be what a
    rollout appends)."""
    if kind == "tool":
        messages = tool_messages(problem)
    elif kind in MALFORMED_KINDS:
        messages = malformed_messages(problem, kind)
    elif kind in ("direct", "worked"):
        answer = problem.direct_solution() if kind == "direct" else problem.solution()
        messages = [
            {"role": "user", "content": problem.prompt},
            {"role": "assistant", "content": answer},
        ]
    else:
        raise ValueError(f"kind={kind!r}: use one of {DEMONSTRATION_KINDS}")
    # Each message's text is what rendering the chat up to it adds; an assistant message is
    # the model's own (trained), the rest (prompt, tool turns, and an assistant turn's opening)
    # is not. The template's EOS after an assistant turn is trained only where the turn ends
    # the chat: after a call the rollout stops at </tool_call> and the EOS is appended.
    pieces: list[tuple[str, int]] = []
    done = _render(tokenizer, messages[:1], add_generation_prompt=True)
    pieces.append((done, 0))
    for i in range(1, len(messages)):
        message = messages[i]
        if message["role"] == "assistant":
            last = i == len(messages) - 1
            text = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
            added = _added(done, text)
            content = message["content"]
            if not added.startswith(content):
                raise ValueError("the chat template does not render an assistant turn verbatim")
            pieces.append((content, 1))
            pieces.append((added[len(content) :], 1 if last else 0))
        else:
            text = _render(tokenizer, messages[: i + 1], add_generation_prompt=True)
            pieces.append((_added(done, text), 0))
        done = text
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in pieces:
        piece = list(tokenizer.encode(text, add_special_tokens=False))
        ids += piece
        mask += [trained] * len(piece)
    if ids != list(tokenizer.encode(done, add_special_tokens=False)):
        raise ValueError("the chat's turns encode differently from the whole chat")
    prompt_len = len(tokenizer.encode(pieces[0][0], add_special_tokens=False))
    return Demonstration(ids, mask, prompt_len)


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool,
) -> str:
    return str(
        tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=[TOOL_SCHEMA],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    )


def _added(before: str, after: str) -> str:
    if not after.startswith(before):
        raise ValueError(
            "the chat template renders a longer chat so that it no longer starts with the "
            "shorter chat's rendering"
        )
    return after[len(before) :]


def draw_kind(rng: random.Random, config: ToolSFTConfig) -> str:
    """A demonstration's kind (DEMONSTRATION_KINDS) by the config's shares. With no malformed
    share it draws as before that share existed, so such a recipe's demonstrations are too."""
    if rng.random() < config.tool_fraction:
        if config.malformed_fraction > 0 and rng.random() < config.malformed_fraction:
            return MALFORMED_KINDS[rng.randrange(len(MALFORMED_KINDS))]
        return "tool"
    return "direct" if rng.random() < config.direct_fraction else "worked"


# ---------------------------------------------------------------------- training


def iter_tool_batches(
    stream: Iterator[AnyProblem],
    tokenizer: PreTrainedTokenizerBase,
    config: ToolSFTConfig,
    rng: random.Random,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) batches of about `tokens_per_batch` padded tokens, the labels
    IGNORE wherever a demonstration's mask is 0 and on the padding."""
    while True:
        pool = [
            encode_demonstration(next(stream), tokenizer, draw_kind(rng, config))
            for _ in range(config.pool_size)
        ]
        pool.sort(key=lambda d: len(d.ids))
        batches: list[list[Demonstration]] = []
        current: list[Demonstration] = []
        for d in pool:
            if current and len(d.ids) * (len(current) + 1) > config.tokens_per_batch:
                batches.append(current)
                current = []
            current.append(d)
        batches.append(current)
        rng.shuffle(batches)
        for batch in batches:
            yield collate_masked(batch, tokenizer.pad_token_id)


def collate_masked(
    batch: Sequence[Demonstration], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(d.ids) for d in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    for row, d in enumerate(batch):
        ids = torch.tensor(d.ids)
        input_ids[row, : len(d.ids)] = ids
        labels[row, : len(d.ids)] = torch.where(torch.tensor(d.mask) == 1, ids, IGNORE)
    return input_ids, labels


def train_tool_sft(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    recipe: ToolDemoRecipe,
    log: Callable[[str], None] | None = None,
) -> list[float]:
    """Fine-tune in place on the demonstration mix; the loss of every step."""
    config = recipe.sft
    stream = _TOOL_SFT_STREAM if recipe.start is None else _SECOND_SFT_STREAM
    seed = recipe.base.stream_seed(stream)
    torch.manual_seed(seed)
    batches = iter_tool_batches(recipe.problems(seed), tokenizer, config, random.Random(seed))
    # sft.fit's loop, read with this fine-tune's numbers (AdamW's default weight decay)
    schedule = recipe.base.sft.model_copy(
        update={
            "steps": config.steps,
            "lr": config.lr,
            "warmup_steps": config.warmup_steps,
            "grad_clip": config.grad_clip,
            "weight_decay": 0.01,
        }
    )
    return fit(model, batches, schedule, log, label="tool sft")


# ------------------------------------------------------------------------ assets


@dataclass(frozen=True, slots=True)
class ToolDemoAssets:
    """Paths of a complete tool demo build."""

    root: Path
    model_dir: Path
    train_file: Path
    val_file: Path
    tool_config: Path
    manifest: dict[str, Any]

    @classmethod
    def load(cls, root: Path) -> ToolDemoAssets:
        return cls(
            root=root,
            model_dir=root / "model",
            train_file=root / "data" / "train.jsonl",
            val_file=root / "data" / "val.jsonl",
            tool_config=root / "tools.yaml",
            manifest=json.loads((root / MANIFEST).read_text()),
        )


def ensure_tool_demo_assets(
    cache_dir: Path | None = None,
    *,
    recipe: ToolDemoRecipe | None = None,
    progress: bool = True,
    threads: int = 1,
) -> ToolDemoAssets:
    """The tool demo under `cache_dir/demo-tools-<recipe hash>` (default cache: $PATRL_CACHE_DIR,
    else ~/.cache/patrl), built on the first call after the plain demo it starts from; one
    builder per machine (a file lock), the others wait and load it."""
    recipe = recipe or ToolDemoRecipe.default()
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = (root / f"demo-tools-{recipe.key()}").absolute()
    if _complete(target, recipe):
        return ToolDemoAssets.load(target)
    base = ensure_demo_assets(root, recipe=recipe.base, progress=progress, threads=threads)
    model_dir = base.root / "model"
    if recipe.start is not None:
        start = ensure_tool_demo_assets(
            root, recipe=recipe.start, progress=progress, threads=threads
        )
        model_dir = start.model_dir
    with file_lock(root / f".{target.name}.lock"):
        if _complete(target, recipe):
            return ToolDemoAssets.load(target)
        with torch_threads(threads):
            log = progress_logger(progress) or (lambda _: None)
            _build(target, base.root, model_dir, recipe, log)
    return ToolDemoAssets.load(target)


def _complete(target: Path, recipe: ToolDemoRecipe) -> bool:
    try:
        return bool(json.loads((target / MANIFEST).read_text()).get("key") == recipe.key())
    except (OSError, json.JSONDecodeError):
        return False


def copy_rows_with_split(source: Path, dest: Path, split: str) -> None:
    """Copy the JSONL rows of `source` to `dest`, each with verl's `extra_info["split"]` set to
    `split` (other fields, and any other `extra_info` keys, unchanged)."""
    lines = []
    for line in source.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        row["extra_info"] = {**row.get("extra_info", {}), "split": split}
        lines.append(json.dumps(row))
    dest.write_text("".join(f"{line}\n" for line in lines))


def write_rows(problems: Sequence[AnyProblem], dest: Path, split: str) -> None:
    """The problems' RL rows (`Problem.record`), each tagged with verl's `extra_info["split"]`."""
    rows = [{**p.record(), "extra_info": {"split": split}} for p in problems]
    dest.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _build(
    target: Path,
    base: Path,
    model_dir: Path,
    recipe: ToolDemoRecipe,
    log: Callable[[str], None],
) -> None:
    """Build into a temporary sibling and rename it into place (the caller holds the lock):
    the rows from the plain demo at `base` (or the task's), the model tuned from `model_dir`."""
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        start = time.perf_counter()
        (tmp / "data").mkdir(parents=True)
        for name, split, stream, count in (
            ("train.jsonl", "train", _TRAIN_STREAM, recipe.base.num_train),
            ("val.jsonl", "test", _VAL_STREAM, recipe.base.num_val),
        ):
            if recipe.task is None:
                copy_rows_with_split(base / "data" / name, tmp / "data" / name, split)
            else:
                stream_problems = recipe.problems(recipe.base.stream_seed(stream))
                write_rows(
                    [next(stream_problems) for _ in range(count)], tmp / "data" / name, split
                )
        (tmp / "tools.yaml").write_text(TOOLS_YAML)
        tokenizer = build_tool_tokenizer()
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if model.config.vocab_size != len(tokenizer):
            raise ValueError(
                f"the model at {model_dir} has {model.config.vocab_size} "
                f"tokens, the tool tokenizer {len(tokenizer)}"
            )
        log(f"teaching the demo model the calculator ({recipe.sft.steps} SFT steps)")
        losses = train_tool_sft(model, tokenizer, recipe, log)
        save_model(model, tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
        tail = losses[-20:]
        manifest = {
            "key": recipe.key(),
            "build_id": uuid.uuid4().hex,
            "recipe": recipe.model_dump(),
            "base": str(base),
            "start_model": str(model_dir),
            "final_sft_loss": sum(tail) / len(tail),
            "build_s": time.perf_counter() - start,
            "torch_threads": torch.get_num_threads(),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # last: complete
        if target.exists():  # an incomplete build or another recipe's
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"tool demo ready in {target}")
