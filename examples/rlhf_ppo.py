"""The three RLHF stages on the demo task: SFT warm start -> reward model -> PPO against it.

    python examples/rlhf_ppo.py                                         # 1 process
    torchrun --nproc_per_node 2 examples/rlhf_ppo.py                    # 2 ranks
    python examples/rlhf_ppo.py trainer.total_training_steps=5          # overrides pass through
    python examples/rlhf_ppo.py --rm-seed 1 --stage3 grpo               # see --help

Stage 1 is the demo's SFT warm start (built once, cached; see examples/grpo_adaptive_tp.py).
Stage 2 trains a tiny reward model by Bradley-Terry on synthetic preference pairs of the demo
task (a worked, correct answer preferred to an unworked one), starting from the SFT model's
backbone with a new score head; cached beside the demo, its held-out accuracy printed. Stage 3
is the main job (examples/configs/demo.yaml) with PPO_OVERRIDES: a critic and GAE, the RM's
score added to the rule reward (math-verify), and KL to the reference in the reward. Until this
build accepts those keys, `--stage3 auto` runs FALLBACK_OVERRIDES instead (GRPO against the same
RM, KL as a loss) and says so. Stages 1-2 run before the process group is joined: every rank
asks, a file lock lets one build while the others wait, then load.
"""

import argparse
import os
import sys
from pathlib import Path

from patrl.orchestrator.config import ConfigError, load_config
from patrl.orchestrator.main import main

CONFIG = str(Path(__file__).parent / "configs" / "demo.yaml")

# Stage 3: PPO with a critic (GAE) against the RM plus the rule reward, KL in the reward.
PPO_OVERRIDES = [
    "algorithm.adv_estimator=gae",
    "algorithm.gamma=1.0",
    "algorithm.lam=1.0",
    "trainer.critic_warmup=0",
    "critic.optim.lr=1e-3",  # the tiny demo model's value head learns at a high rate
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_penalty=kl",
    "algorithm.kl_ctrl.type=fixed",
    "algorithm.kl_ctrl.kl_coef=0.001",
]
# What runs until the PPO keys exist: GRPO against the same RM, KL to the reference as a loss.
FALLBACK_OVERRIDES = ["algorithm.adv_estimator=grpo", "actor.use_kl_loss=true"]
# In both: the learned RM beside the rule reward, and the run's name.
COMMON_OVERRIDES = [
    "reward_model.enable=true",
    "reward_model.weight=1.0",
    "trainer.experiment_name=rlhf_ppo",
]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rm-seed", type=int, default=0, help="seed of the RM's pairs and head")
    p.add_argument("--rm-pairs", type=int, default=512, help="RM training pairs")
    p.add_argument(
        "--stage3",
        choices=("auto", "ppo", "grpo"),
        default="auto",
        help="ppo: PPO_OVERRIDES; grpo: FALLBACK_OVERRIDES; auto: ppo when the config takes it",
    )
    p.add_argument("--stages", choices=("1-2", "1-3"), default="1-3", help="1-2: stop after the RM")
    p.add_argument("--quick", action="store_true", help="a barely trained demo model, for tests")
    return p.parse_known_args(argv)


def stage3_overrides(choice: str) -> list[str]:
    """PPO_OVERRIDES, or FALLBACK_OVERRIDES when asked or (auto) when the config rejects PPO's."""
    if choice == "ppo":
        return PPO_OVERRIDES
    if choice == "grpo":
        return FALLBACK_OVERRIDES
    try:
        load_config(CONFIG, PPO_OVERRIDES)
    except ConfigError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"[rlhf] stage 3: this build does not take the PPO keys ({str(err)[:200]}); "
                f"running {FALLBACK_OVERRIDES} instead",
                file=sys.stderr,
            )
        return FALLBACK_OVERRIDES
    return PPO_OVERRIDES


def run(argv: list[str]) -> int:
    from patrl_examples.demo import ensure_demo_assets
    from patrl_examples.demo.reward_model import RewardModelRecipe, ensure_demo_reward_model

    args, overrides = parse_args(argv)
    first = int(os.environ.get("RANK", "0")) == 0
    demo = ensure_demo_assets(quick=args.quick, progress=first)  # stage 1
    recipe = RewardModelRecipe(seed=args.rm_seed, num_train=args.rm_pairs)
    log = (lambda m: print(f"[rlhf] {m}", file=sys.stderr, flush=True)) if first else None
    rm = ensure_demo_reward_model(demo, recipe, log=log)  # stage 2
    if first:
        print(
            f"[rlhf] stage 2: reward model {rm.model_dir} held-out accuracy "
            f"{rm.val_accuracy:.3f} ({rm.manifest['recipe']['num_val']} pairs)",
            flush=True,
        )
    if args.stages == "1-2":
        return 0
    stage3 = [
        *stage3_overrides(args.stage3),
        *COMMON_OVERRIDES,
        f"reward_model.model.path={rm.model_dir}",
    ]
    if not any(o.startswith(("model.path=", "data.train_files=")) for o in overrides):
        # Stage 1's model and data (the --quick ones too), as main would choose them.
        stage3 += [
            f"model.path={demo.model_dir}",
            f"data.train_files={demo.train_file}",
            f"data.val_files={demo.val_file}",
        ]
    flags, pairs = split_flags(overrides)
    return main([*flags, *stage3, *pairs], default_config=CONFIG)


def split_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """(main's options such as --dry-run or --config FILE, the key=value overrides): main's
    parser takes options only before the overrides, and the user's overrides must come last."""
    flags: list[str] = []
    pairs: list[str] = []
    rest = iter(args)
    for arg in rest:
        if arg.startswith("-"):
            flags.append(arg)
            if arg == "--config":
                flags.append(next(rest, ""))
        else:
            pairs.append(arg)
    return flags, pairs


if __name__ == "__main__":  # reward workers are spawned and re-import this file
    sys.exit(run(sys.argv[1:]))
