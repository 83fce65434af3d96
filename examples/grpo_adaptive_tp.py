"""The main job: GRPO on the embedded demo task, rollouts on patrl's own engine.

    torchrun --nproc_per_node 2 examples/grpo_adaptive_tp.py            # 2 ranks
    python examples/grpo_adaptive_tp.py                                 # 1 process
    torchrun --nproc_per_node 2 examples/grpo_adaptive_tp.py rollout.n=4 trainer.total_training_steps=5
    python examples/grpo_adaptive_tp.py --dry-run                       # print the resolved config

Several nodes (one agent per node, the same line on each): docs/distributed.md.

With no arguments it builds (once, then cached) a tiny Llama-architecture model with its own
tokenizer, warm-started by SFT on a synthetic arithmetic task whose solutions have long-tailed
lengths, and trains it with GRPO; the reward is the exactness of the final \\boxed{} answer
(math-verify). Settings come from examples/configs/demo.yaml; any key can be overridden on the
command line, and `model.path=... data.train_files=...` points it at a real model and dataset.
That task is this examples project's `patrl_examples.demo` (`pip install -e examples`; `nox -s
demo` installs it), which the orchestrator finds through its `patrl.assets` entry point.

Rollouts use adaptive TP (rollout.adaptive_tp, on by default with 2+ ranks): each starts with
one data-parallel replica per rank, and the planner folds replicas into a TP group when its
latency model (profiled once on this machine, cached) predicts the long tail finishes sooner.
`rollout.over_sample_rate=0.25` adds partial rollouts (unfinished groups resume next step).
"""

import sys
from pathlib import Path

from patrl.orchestrator.main import main

if __name__ == "__main__":  # reward workers are spawned and re-import this file
    sys.exit(main(default_config=str(Path(__file__).parent / "configs" / "demo.yaml")))
