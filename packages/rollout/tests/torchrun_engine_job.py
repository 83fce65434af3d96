"""Run by test_rollout_torchrun under `torchrun --nproc_per_node 2`, with no process group
made: each rank builds a StaticTP(tp=2) engine and an adaptive one from the environment alone,
generates, and writes what it got to OUT/rank<R>.json.

    torchrun --standalone --nproc_per_node 2 torchrun_engine_job.py MODEL_DIR PROFILE OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from patrl.rollout import AdaptiveTP, Engine, EngineConfig, SamplingParams, StaticTP, make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 for j in range(5 + i)] for i in range(4)]


def main(model_dir: str, profile: str, out: str) -> None:
    assert not dist.is_initialized()
    base = EngineConfig(model=model_dir, block_size=4, max_model_len=64, max_num_seqs=8)
    static = Engine(base.model_copy(update={"tp_policy": StaticTP(tp=2)}))
    rank = dist.get_rank()
    result = {
        "backend": str(dist.get_backend()),
        "tp_size": static.layout.tp_size,
        "tp_rank": static.layout.tp_rank,
        "kv_blocks": static.cache.num_blocks,
        "static": [o.outputs[0].token_ids for o in static.generate(prompts(), GREEDY)],
    }
    policy = AdaptiveTP(candidates=(1, 2), check_every=2, profile=profile)
    adaptive = make_engine(base.model_copy(update={"tp_policy": policy}))
    mine = prompts()[rank::2]  # each rank submits its replica's prompts
    result["adaptive_world"] = adaptive.groups.world_size if adaptive.groups else 1
    result["adaptive"] = [o.outputs[0].token_ids for o in adaptive.generate(mine, GREEDY)]
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
