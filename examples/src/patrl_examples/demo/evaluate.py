"""pass@1 of a model directory on the demo task, sampled by patrl's own engine.

The reward here is the exact boxed integer: stricter than math-verify (which also accepts an
unboxed last number), so a pass here is a pass for the orchestrator's math reward too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from patrl.rollout import Engine, EngineConfig, SamplingParams
from patrl_examples.demo.reward import shows_work
from patrl_examples.demo.tokenizer import prompt_text

_BOXED = re.compile(r"\\boxed\{(-?\d+)\}")


@dataclass(frozen=True, slots=True)
class PassAtOne:
    greedy: float
    temperature_1: float
    samples_per_prompt: int
    num_prompts: int
    mean_response_tokens: float
    # Shares of responses that work the sum out line by line rather than box a bare total.
    worked_greedy: float
    worked_temperature_1: float


def boxed_answer(text: str) -> str | None:
    """The integer of a response's one `\\boxed{N}`; None when there is none or several
    (math-verify reads several as a set, which equals no single gold number)."""
    if text.count("\\boxed") != 1:
        return None
    found = _BOXED.findall(text)
    return found[0] if found else None


def read_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def is_correct(response: str, answer: str) -> bool:
    return boxed_answer(response) == answer


def chat_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[list[int]]:
    """Prompt token ids through the chat template, ending in the assistant marker."""
    return [
        list(tokenizer.encode(prompt_text(tokenizer, p), add_special_tokens=False)) for p in prompts
    ]


def pass_at_one(
    model_dir: Path,
    prompts: list[str],
    answers: list[str],
    *,
    samples: int = 4,
    max_tokens: int = 320,
    seed: int = 0,
) -> PassAtOne:
    """Greedy pass@1 and temperature-1.0 pass@1 (mean over `samples` draws per prompt)."""
    engine = Engine(
        EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=2048, max_num_seqs=256)
    )
    token_ids = chat_prompts(read_tokenizer(model_dir), prompts)
    greedy = engine.generate(token_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    # A seed per prompt: one shared seed would draw the same uniforms for every prompt, so
    # e.g. the choice of the first token would be made alike across the whole set.
    sampled = engine.generate(
        token_ids,
        [
            SamplingParams(
                n=samples, temperature=1.0, max_tokens=max_tokens, seed=seed * 100_003 + i
            )
            for i in range(len(token_ids))
        ],
    )
    greedy_hits = [
        is_correct(out.outputs[0].text or "", a) for out, a in zip(greedy, answers, strict=True)
    ]
    sampled_hits = [
        is_correct(c.text or "", a)
        for out, a in zip(sampled, answers, strict=True)
        for c in out.outputs
    ]
    lengths = [len(c.token_ids) for out in sampled for c in out.outputs]
    greedy_texts = [out.outputs[0].text or "" for out in greedy]
    sampled_texts = [c.text or "" for out in sampled for c in out.outputs]
    return PassAtOne(
        greedy=sum(greedy_hits) / len(greedy_hits),
        temperature_1=sum(sampled_hits) / len(sampled_hits),
        samples_per_prompt=samples,
        num_prompts=len(prompts),
        mean_response_tokens=sum(lengths) / len(lengths),
        worked_greedy=_share_worked(greedy_texts),
        worked_temperature_1=_share_worked(sampled_texts),
    )


def _share_worked(texts: list[str]) -> float:
    return sum(shows_work(t, "") for t in texts) / len(texts)
