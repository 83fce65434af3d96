"""Memory across folds: every group a fold uses had its communicator made at start-up (an
NCCL group makes one, in device memory, at its first collective), no fold makes a group or a
pair communicator, and a folded engine sleeps and wakes with its kept full weights."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from patrl.rollout.adaptive import reconfigure
from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.sampler import SamplingParams
from patrl.tpreshard import GroupCache, kept_tensors
from patrl_testkit.models import save_hf_model, tiny_hf_model
from patrl_testkit.multirank import run_ranks

pytestmark = pytest.mark.multirank

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
_RECORDED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "new_group",
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(tiny_hf_model("llama"), tmp_path_factory.mktemp("llama_fold_memory"))


def _recording(calls: list[tuple[str, Any]]) -> Callable[[], None]:
    """Patch torch.distributed's tensor collectives and new_group to append (name, group);
    returns the undo."""
    originals = {name: getattr(dist, name) for name in _RECORDED}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            if name == "batch_isend_irecv":
                group = args[0][0].group
            calls.append((name, group))
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))

    def undo() -> None:
        for name, fn in originals.items():
            setattr(dist, name, fn)

    return undo


def _fold(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    groups = GroupCache([1, 2], world_size=world_size, rank=rank)
    config = EngineConfig(
        model=model_dir, block_size=4, num_kv_blocks=96, max_model_len=96, tp_comm="process_group"
    )
    calls: list[tuple[str, Any]] = []
    undo = _recording(calls)
    try:
        engine = Engine(config, groups.layout(1), groups)
        start_up = list(calls)
        calls.clear()
        g = torch.Generator().manual_seed(rank)
        for i in range(3):
            prompt = torch.randint(0, 250, (5 + 3 * i,), generator=g).tolist()
            engine.add_request(prompt, GREEDY, request_id=f"r{rank}-{i}")
        for _ in range(4):
            engine.step()
        report = reconfigure(engine, 2, "migrate")
        during_fold = list(calls)
    finally:
        undo()
    while engine.has_unfinished():
        engine.step()
    # asleep at the folded layout: the shards and the full weights the fold kept all leave
    probe = [[5, 6, 7, 8], [9, 10, 11]]
    before = [c.token_ids for o in engine.generate(probe, GREEDY) for c in o.outputs]
    kept = kept_tensors(engine.model)
    held = [*engine.model.parameters(), *kept]
    snapshot = [t.detach().clone() for t in held]
    engine.sleep(level=2)
    emptied = all(t.untyped_storage().nbytes() == 0 for t in held)
    engine.wake_up()
    after = [c.token_ids for o in engine.generate(probe, GREEDY) for c in o.outputs]
    dist.barrier()
    member = [groups.layout(1).dp_group, groups.layout(2).tp_group, groups.layout(2).dp_group]
    connected = [group for name, group in start_up if name == "all_reduce"]
    return {
        "start_up": [name for name, _ in start_up],
        "connected_in_order": connected == member,
        "fold_names": sorted({name for name, _ in during_fold}),
        "fold_groups_connected": all(any(g is m for m in member) for _, g in during_fold),
        "migrated": report.num_migrated,
        "kept": len(kept),
        "emptied": emptied,
        "restored": all(torch.equal(a, b) for a, b in zip(held, snapshot, strict=True)),
        "same_tokens": before == after,
    }


def test_a_fold_uses_only_communicators_made_at_start_up(llama_dir: Path) -> None:
    # 4 ranks, tp 1 -> 2: each rank is in the world group, its tp-2 group and its tp-2 DP group
    for r in run_ranks(_fold, 4, args=(str(llama_dir),), timeout_s=400):
        assert r["start_up"] == ["all_reduce"] * 3  # connect: one per group, made in order
        assert r["connected_in_order"]
        assert r["migrated"] > 0
        # the KV moved as batches on the exchange group; no single send, no new group
        assert "batch_isend_irecv" in r["fold_names"]
        assert not {"new_group", "isend", "irecv", "send", "recv"} & set(r["fold_names"])
        assert r["fold_groups_connected"]
        assert r["kept"] > 0 and r["emptied"] and r["restored"] and r["same_tokens"]
