"""The tool demo: GRPO with multi-turn tool rollouts on the embedded addition task.

    python -m nox -s demo_tools                                     # 2 ranks, via nox
    torchrun --nproc_per_node 2 examples/grpo_tools.py              # 2 ranks
    python examples/grpo_tools.py trainer.total_training_steps=5    # 1 process
    python examples/grpo_tools.py --dry-run                         # print the resolved config

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
"""

import sys
from pathlib import Path

from patrl.orchestrator.main import main
from patrl_examples.demo.tools import ensure_tool_demo_assets


def tool_demo_overrides() -> list[str]:
    """The built tool demo's model, data and tool config, as overrides (built on first use;
    every rank calls this before the job's first collective, one builds, the others wait)."""
    assets = ensure_tool_demo_assets()
    return [
        f"model.path={assets.model_dir}",
        f"data.train_files={assets.train_file}",
        f"data.val_files={assets.val_file}",
        f"rollout.multi_turn.tool_config_path={assets.tool_config}",
    ]


if __name__ == "__main__":  # reward workers are spawned and re-import this file
    config = str(Path(__file__).parent / "configs" / "demo_tools.yaml")
    sys.exit(main([*tool_demo_overrides(), *sys.argv[1:]], default_config=config))
