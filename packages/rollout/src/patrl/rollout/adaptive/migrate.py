"""Cut-and-migrate (RLHFless, RLBoost): move chosen unfinished requests from one DP replica to
another at the same layout, token-level, to rebalance a skewed tail.

Ranks of one DP group hold the same TP rank, so the KV heads a source rank exports are exactly
the heads its peer in the target replica holds: no re-slicing, one object all-gather in the DP
group carries the states (tokens, logprobs, generator state, KV).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from patrl.rollout.engine import Engine
from patrl.rollout.outputs import SequenceState


def cut_and_migrate(
    engine: Engine, request_ids: Sequence[str], src_dp: int, dst_dp: int, with_kv: bool = True
) -> int:
    """Move `request_ids` from replica `src_dp` to `dst_dp`; every rank of the DP group calls
    it with the same arguments. Returns the KV bytes this rank sent or received."""
    layout = engine.layout
    for name, value in (("src_dp", src_dp), ("dst_dp", dst_dp)):
        if not 0 <= value < layout.dp_size:
            raise ValueError(f"{name}={value} is not a replica: dp_size={layout.dp_size}")
    if src_dp == dst_dp:
        raise ValueError(f"src_dp and dst_dp are both {src_dp}")
    if layout.dp_rank == src_dp:
        missing = [r for r in request_ids if r not in engine.request_ids()]
        if missing:
            raise KeyError(f"requests {missing} are not unfinished on replica {src_dp}")
    outgoing = engine.export_requests(request_ids, with_kv) if layout.dp_rank == src_dp else []
    gathered: list[list[SequenceState]] = [[] for _ in range(layout.dp_size)]
    dist.all_gather_object(gathered, outgoing, group=layout.dp_group)
    moved = sum(s.kv.nbytes for s in gathered[src_dp] if s.kv is not None)
    if layout.dp_rank == dst_dp:
        engine.import_requests(gathered[src_dp])
    return moved if layout.dp_rank in (src_dp, dst_dp) else 0
