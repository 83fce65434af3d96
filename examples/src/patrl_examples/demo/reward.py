"""What the demo's rewards cannot show on their own: whether a response worked the sum out.

The demo's warm start answers some prompts with the numbered lines and some with a bare
`\\boxed{N}` (SFTConfig.direct_fraction). The reward (math-verify) only says whether the total
is right; listing `shows_work` beside it with weight 0 logs, every step, the share of responses
that wrote the lines: `reward/patrl_examples.demo.reward:shows_work/mean`. That share going
up while the reward goes up is RL finding out that working it out pays.
"""

from __future__ import annotations

import re
from typing import Any

from patrl.orchestrator.agent.tool_parser import extract_tool_calls

# The first line of a worked solution restates the first addend: "a7: 7".
_FIRST_LINE = re.compile(r"a\d+: \d+(\n|$)")


def shows_work(response: str, answer: str, **meta: Any) -> float:
    """1.0 when the response opens like a worked solution (`a7: 7`), right or wrong."""
    return 1.0 if _FIRST_LINE.match(response) else 0.0


def calls_tool(response: str, answer: str, **meta: Any) -> float:
    """1.0 when the response calls a tool (a `<tool_call>` opens in it), well-formed or not:
    the tool demo's share of responses that reach for the calculator."""
    return 1.0 if "<tool_call>" in response else 0.0


def well_formed_call(response: str, answer: str, **meta: Any) -> float:
    """1.0 when the response calls a tool and every call it opens is well-formed: closed by
    `</tool_call>`, valid JSON (hermes), naming `calculator` with a string `expression`.
    Its mean over `calls_tool`'s is the share of calling responses whose calls are well-formed."""
    opened = response.count("<tool_call>")
    if opened == 0:
        return 0.0
    _, calls = extract_tool_calls(response, "hermes")
    ok = [
        c
        for c in calls
        if c.error is None
        and c.name == "calculator"
        and isinstance((c.arguments or {}).get("expression"), str)
    ]
    return 1.0 if len(ok) == opened else 0.0


def training_split(meta: dict[str, Any]) -> bool:
    """Whether the row is a training row: verl's `extra_info["split"] == "train"` (the tool demo
    tags its rows so; a row without the tag is not one)."""
    extra = meta.get("extra_info")
    return isinstance(extra, dict) and extra.get("split") == "train"


def malformed_call_penalty(response: str, answer: str, **meta: Any) -> float:
    """The tool demo's format reward (verl's tool-RL recipes pay one beside correctness), as a
    penalty: on a training row, -1.0 when the response opens a call that is not well-formed
    (`calls_tool` but not `well_formed_call`), else 0.0; 0.0 on any other row, so validation's
    pass@1 stays correctness alone. A penalty rather than a bonus for a good call: a bonus
    pays calling itself, so the model calls on every prompt, miscopied addends and all, where
    its worked lines would have been right more often."""
    if not training_split(meta) or calls_tool(response, answer) == 0.0:
        return 0.0
    return 0.0 if well_formed_call(response, answer) == 1.0 else -1.0
