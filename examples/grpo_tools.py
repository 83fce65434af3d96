"""The tool demo: GRPO with multi-turn tool rollouts on the embedded addition task.

    python -m nox -s demo_tools                                     # 2 ranks, via nox
    torchrun --nproc_per_node 2 examples/grpo_tools.py              # 2 ranks
    python examples/grpo_tools.py trainer.total_training_steps=5    # 1 process
    python examples/grpo_tools.py --dry-run                         # print the resolved config
    torchrun --nproc_per_node 2 examples/grpo_tools.py --task long_sums   # sums the tool pays on

It builds (once, then cached next to the main demo) the tool demo: the main demo's model
fine-tuned on answers that sometimes call a calculator in verl's hermes format
(`<tool_call>{"name": "calculator", ...}</tool_call>`), continue after the tool's answer and
box it (patrl_examples.demo.tools). GRPO then trains it with `rollout.multi_turn` on: each
call runs patrl's CalculatorTool, its answer is appended as tokens, and only the model's own
tokens are trained. Validation pass@1 is `val-core/acc/mean@1`; the share of responses that
call the calculator is `reward/patrl_examples.demo.reward:calls_tool/mean`, the calls and
their malformed ones `multi_turn/tool_calls` and `multi_turn/tool_errors`. Beside
correctness (math_verify) the reward has a format term: -0.5 for a response with a malformed
call, on training rows only (`patrl_examples.demo.reward:malformed_call_penalty`). Settings come
from examples/configs/demo_tools.yaml; any key can be overridden on the command line.

`--task long_sums` (`python -m nox -s demo_tools_long_sums`) swaps in sums of two to four
numbers of two or three digits, `Add: 325+267+630` (patrl_examples.demo.long_sums), which the
small model mostly adds wrong by hand and mostly gets right by a calculator call; its warm
start calls the calculator on 40% of its demonstrations (tools.LONG_SUMS_SFT), then a second
stage opens a fifth of those with a malformed call answered by the tool's error and retried
(tools.LONG_SUMS_MALFORMED_SFT); its settings are examples/configs/demo_tools_long_sums.yaml.
"""

import argparse
import sys
from pathlib import Path

from patrl.orchestrator.main import main
from patrl_examples.demo.tools import TOOL_TASKS, ToolDemoRecipe, ensure_tool_demo_assets

CONFIGS = {
    "addition": Path(__file__).parent / "configs" / "demo_tools.yaml",
    "long_sums": Path(__file__).parent / "configs" / "demo_tools_long_sums.yaml",
}


def tool_demo_overrides(task: str = "addition", quick: bool = False) -> list[str]:
    """The built tool demo of `task` (a TOOL_TASKS name; `quick`: a barely trained one, for
    tests): its model, data and tool config, as overrides (built on first use; every rank
    calls this before the job's first collective, one builds, the others wait)."""
    assets = ensure_tool_demo_assets(recipe=ToolDemoRecipe.default(task=task, quick=quick))
    return [
        f"model.path={assets.model_dir}",
        f"data.train_files={assets.train_file}",
        f"data.val_files={assets.val_file}",
        f"rollout.multi_turn.tool_config_path={assets.tool_config}",
    ]


def run(argv: list[str]) -> int:
    """`--task NAME` picks the task and its default config, `--quick` a barely trained warm
    start (for tests); every other argument goes to the job (overrides, `--dry-run`,
    `--config`)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--task", choices=sorted(TOOL_TASKS), default="addition")
    parser.add_argument("--quick", action="store_true")
    args, rest = parser.parse_known_args(argv)
    config = str(CONFIGS[args.task])
    return main([*tool_demo_overrides(args.task, args.quick), *rest], default_config=config)


if __name__ == "__main__":  # reward workers are spawned and re-import this file
    sys.exit(run(sys.argv[1:]))
