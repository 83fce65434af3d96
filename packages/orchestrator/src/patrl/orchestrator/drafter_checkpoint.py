"""The speculation drafter's history in run checkpoints (`drafter.pt`): every replica's, so a
resumed run drafts from the earlier responses the one that never stopped had. The sync
schedule gathers it from its ranks; the async schedule's trainer keeps the history of the
groups it trained (`remember_samples`) and its rollout ranks restore it when the run resumes.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from patrl.orchestrator.distributed import World, all_gather_objects
from patrl.orchestrator.scoring import Sample
from patrl.rollout.drafter import Drafter, history_key

__all__ = ["DRAFTER_FILE", "gather_drafter", "load_drafter", "remember_samples", "save_drafter"]

DRAFTER_FILE = "drafter.pt"  # the speculation drafter's history, in each checkpoint


def gather_drafter(drafter: Drafter | None, world: World) -> dict[str, Any] | None:
    """Every rank's drafter history, for a checkpoint (a collective; None without
    speculation): `replicas`, each distinct history once (the ranks of a TP group hold the
    same one), `rank_replica`, each rank's index into them, and `history`, all of them merged
    in rank order (`Drafter.merged_state`) for a run resumed on another layout."""
    if drafter is None:
        return None
    replicas: list[dict[str, Any]] = []
    rank_replica = []
    for state in all_gather_objects(world, drafter.state_dict()):
        if state not in replicas:
            replicas.append(state)
        rank_replica.append(replicas.index(state))
    history = drafter.merged_state(replicas)["history"]
    return {"history": history, "replicas": replicas, "rank_replica": rank_replica}


def save_drafter(state: dict[str, Any] | None, staging: Path) -> None:
    """Write `gather_drafter`'s state (plain lists) into a checkpoint being staged; nothing
    without one."""
    if state is not None:
        torch.save(state, staging / DRAFTER_FILE)


def load_drafter(
    drafter: Drafter | None,
    checkpoint: Path,
    rank: int = 0,
    world_size: int = 1,
    tp_size: int = 1,
) -> None:
    """Restore the history `save_drafter` wrote into this rank's `drafter` (its engine's TP
    groups: `tp_size` contiguous ranks of `world_size`): the rank's own when the checkpoint
    was saved by as many ranks and every TP group's ranks saved one history (a resumed run
    drafts as the one that never stopped), else every replica's merged, the same on every
    rank; either way a TP group's ranks draft alike, as they must. A file of
    `Drafter.state_dict` alone is read as the merged one. Nothing without speculation or
    without the file (a run saved without speculation starts with none)."""
    path = checkpoint / DRAFTER_FILE
    if drafter is None or not path.is_file():
        return
    saved = torch.load(path, weights_only=True)
    ranks = saved.get("rank_replica", [])
    groups = [ranks[g : g + tp_size] for g in range(0, len(ranks), tp_size)]
    if len(ranks) == world_size and all(len(set(g)) == 1 for g in groups):
        drafter.load_state_dict(saved["replicas"][ranks[rank]])
    else:
        drafter.load_state_dict({"history": saved["history"]})


def remember_samples(drafter: Drafter | None, samples: Iterable[Sample]) -> None:
    """Add the complete responses (finished by a stop or at max_tokens) among `samples` to
    `drafter`'s history under their prompt's token ids, the key an engine's drafter files a
    request without a prompt key under (the async rollout ranks' requests); nothing without
    speculation."""
    if drafter is None:
        return
    for s in samples:
        if s.finish_reason in ("stop", "length"):
            drafter.remember(history_key(None, s.prompt_token_ids), s.token_ids)
