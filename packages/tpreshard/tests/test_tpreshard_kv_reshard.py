"""reshard_kv against its slow twin: each sequence's full KV sliced directly for the new layout."""

from __future__ import annotations

import pytest
import torch
from multirank import run_ranks

from patrl.tpreshard import GroupCache, KVShape, SequenceMove, head_range, reshard_kv

LAYERS, TOKENS, HEAD_DIM = 2, 7, 3


def _full(key: tuple[int, int], num_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * key[0] + key[1])
    size = (LAYERS, TOKENS, num_kv, HEAD_DIM)
    return torch.randn(size, generator=g), torch.randn(size, generator=g)


def _heads(kv: tuple[torch.Tensor, torch.Tensor], num_kv: int, rank: int, tp: int):
    start, count = head_range(num_kv, rank, tp)
    return tuple(t[:, :, start : start + count] for t in kv)


def _reshard(rank: int, world_size: int, src_tp: int, dst_tp: int, num_kv: int, chunk: int):
    import patrl.tpreshard.kv_reshard as kv_reshard

    kv_reshard._CHUNK_BYTES = chunk
    cache = GroupCache([1, 2], world_size=world_size, rank=rank, tp_comm="process_group")
    src, dst = cache.layout(src_tp), cache.layout(dst_tp)
    big = max(src_tp, dst_tp)
    old_replicas, new_replicas = big // src_tp, big // dst_tp
    moves = [
        SequenceMove((j, i), j, (i + j) % new_replicas, TOKENS - i % 3, skip=2 if i == 3 else 0)
        for j in range(old_replicas)
        for i in range(5)
    ]
    mine = rank // src_tp
    local = {
        m.key: _heads(_full(m.key, num_kv), num_kv, src.tp_rank, src_tp)
        for m in moves
        if m.src_replica == mine
    }
    shape = KVShape(LAYERS, num_kv, HEAD_DIM, torch.float32)
    out = reshard_kv(local, moves, src, dst, shape)
    expected = {
        m.key: (m.skip, _heads(_full(m.key, num_kv), num_kv, dst.tp_rank, dst_tp))
        for m in moves
        if m.dst_replica == rank // dst_tp
    }
    assert set(out) == set(expected)
    for key, (skip, (k, v)) in expected.items():
        tokens = out[key][0].shape[1]
        assert out[key][0].shape == (LAYERS, tokens, k.shape[2], HEAD_DIM)
        torch.testing.assert_close(out[key][0][:, skip:], k[:, skip:tokens], rtol=0, atol=0)
        torch.testing.assert_close(out[key][1][:, skip:], v[:, skip:tokens], rtol=0, atol=0)
    return sorted(out)


@pytest.mark.multirank
@pytest.mark.parametrize("num_kv", [4, 1], ids=["kv_heads>=tp", "kv_heads<tp_replicated"])
def test_reshard_kv_grow_and_shrink_match_a_fresh_slice(num_kv: int) -> None:
    grow = run_ranks(_reshard, world_size=2, args=(1, 2, num_kv, 1 << 20), timeout_s=120)
    assert grow[0] == grow[1] and len(grow[0]) == 10  # the merged replica holds all ten
    shrink = run_ranks(_reshard, world_size=2, args=(2, 1, num_kv, 64), timeout_s=120)
    assert sorted(shrink[0] + shrink[1]) == [(0, i) for i in range(5)]  # split, none lost


def test_reshard_kv_refuses_layouts_that_do_not_nest() -> None:
    from patrl.tpreshard import single_process_layout

    one = single_process_layout()
    shape = KVShape(LAYERS, 4, HEAD_DIM, torch.float32)
    with pytest.raises(ValueError, match="src tp_size=1, dst tp_size=1"):
        reshard_kv({}, [], one, one, shape)
