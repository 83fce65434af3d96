"""`python -m patrl_examples.demo [--out DIR]`: build the demo and say what was built."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from patrl_examples.demo.assets import (
    DemoAssets,
    DemoRecipe,
    ensure_demo_assets,
    ensure_demo_at,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m patrl_examples.demo",
        description="Build (or find cached) the demo model and dataset of the main job.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="build into exactly this directory (default: the cache, $PATRL_CACHE_DIR or "
        "~/.cache/patrl, under demo-<recipe hash>)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a seconds-long build, for tests")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads while building (default 1)"
    )
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")
    args = parser.parse_args(argv)
    recipe = DemoRecipe.default(args.seed, args.quick)
    if args.out is not None:
        assets = ensure_demo_at(args.out, recipe, threads=args.threads)
    else:
        assets = ensure_demo_assets(recipe=recipe, threads=args.threads)
    print(json.dumps(assets.manifest, indent=2) if args.json else describe(assets))
    return 0


def describe(assets: DemoAssets) -> str:
    m = assets.manifest
    lengths = m["solution_tokens"]
    lines = [
        f"demo assets      {assets.root}",
        f"  model          {assets.model_dir}  ({m['num_parameters'] / 1e6:.2f}M parameters, "
        f"Llama, char-level vocab of 128)",
        f"  train / val    {assets.train_file}  /  {assets.val_file}",
        f"  columns        prompt={assets.prompt_key!r} answer={assets.answer_key!r}",
        f"  longest        prompt {assets.max_prompt_tokens} tokens (chat-formatted), "
        f"gold response {assets.max_response_tokens} tokens",
        f"  gold lengths   median {lengths['median']:.0f}  p90 {lengths['p90']:.0f}  "
        f"p99 {lengths['p99']:.0f}  max {lengths['max']:.0f} tokens",
        f"  final SFT loss {m['final_sft_loss']:.4f}",
    ]
    ev = m.get("evaluation")
    if ev:
        lines.append(
            f"  pass@1         greedy {ev['pass@1_greedy']:.3f}   temperature 1.0 "
            f"{ev['pass@1_temperature_1']:.3f}  ({ev['num_prompts']} val prompts x "
            f"{ev['samples_per_prompt']} samples)"
        )
        lines.append(
            f"  works it out   greedy {ev['worked_greedy']:.3f}   temperature 1.0 "
            f"{ev['worked_temperature_1']:.3f}  (share of responses with numbered lines)"
        )
    timings = "  ".join(f"{k} {v:.1f}" for k, v in m["timings"].items())
    lines.append(f"  build time     {timings}  ({m['torch_threads']} torch threads)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
