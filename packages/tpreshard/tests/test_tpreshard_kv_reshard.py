"""reshard_kv against its slow twin: each sequence's full KV sliced directly for the new layout."""

from __future__ import annotations

import pytest
import torch

from patrl.tpreshard import (
    GroupCache,
    KVReshardStats,
    KVShape,
    SequenceMove,
    head_range,
    reshard_kv,
)
from patrl_testkit.multirank import run_ranks

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
    shape = KVShape(LAYERS, num_kv, HEAD_DIM, torch.float32, torch.device("cpu"))
    stats = KVReshardStats()
    out = reshard_kv(local, moves, src, dst, shape, stats)
    expected = {
        m.key: (m.skip, _heads(_full(m.key, num_kv), num_kv, dst.tp_rank, dst_tp))
        for m in moves
        if m.dst_replica == rank // dst_tp
    }
    assert set(out) == set(expected)
    for key, (skip, (k, v)) in expected.items():
        tokens = out[key][0].shape[1]
        assert out[key][0].shape == (LAYERS, tokens, k.shape[2], HEAD_DIM)
        # Bit-equal: a reshard only copies KV (no arithmetic), so every value arrives as sent.
        torch.testing.assert_close(out[key][0][:, skip:], k[:, skip:tokens], rtol=0, atol=0)
        torch.testing.assert_close(out[key][1][:, skip:], v[:, skip:tokens], rtol=0, atol=0)
    # out of TP 1 a rank holds every head of its own sequences: what it keeps is a view
    kept = [key for key in out if src_tp == 1 and key in local]
    for key in kept:
        assert (
            out[key][0].untyped_storage().data_ptr() == local[key][0].untyped_storage().data_ptr()
        )
    return sorted(out), (stats.bytes_sent, stats.bytes_received), len(kept)


@pytest.mark.multirank
@pytest.mark.parametrize("num_kv", [4, 1], ids=["kv_heads>=tp", "kv_heads<tp_replicated"])
def test_reshard_kv_grow_and_shrink_match_a_fresh_slice(num_kv: int) -> None:
    grow = run_ranks(_reshard, world_size=2, args=(1, 2, num_kv, 1 << 20), timeout_s=120)
    assert grow[0][0] == grow[1][0] and len(grow[0][0]) == 10  # the merged replica holds all ten
    assert all(g[2] == 5 for g in grow)  # each rank's own five sequences: views, not copies
    shrink = run_ranks(_reshard, world_size=2, args=(2, 1, num_kv, 64), timeout_s=120)
    assert sorted(shrink[0][0] + shrink[1][0]) == [(0, i) for i in range(5)]  # split, none lost
    for results in (grow, shrink):
        sent, received = (sum(r[1][i] for r in results) for i in (0, 1))
        assert sent == received  # every byte sent is received once
    assert sum(r[1][0] for r in grow) > 0  # a merge sends the other replica's sequences


def _routes(j_old: int, j_new: int, src_tp: int, dst_tp: int, kv: int) -> list[tuple[int, ...]]:
    from patrl.tpreshard.kv_reshard import _routes

    move = SequenceMove(("r", 0), j_old, j_new, 1)
    return [(r.src, r.dst, r.lo, r.hi) for r in _routes(move, src_tp, dst_tp, kv)]


def test_kv_routes_keep_what_a_rank_holds_and_send_the_rest() -> None:
    # Merge tp1 -> tp2 (2 KV heads): the old replica at position 1 keeps head 1, sends head 0.
    assert _routes(1, 0, 1, 2, 2) == [(1, 0, 0, 1), (1, 1, 1, 2)]
    # Split tp2 -> tp1: the new replica at position 1 gathers head 0 from position 0.
    assert _routes(0, 1, 2, 1, 2) == [(0, 1, 0, 1), (1, 1, 1, 2)]
    # Grow tp2 -> tp4 with 2 KV heads: each head is replicated onto two ranks.
    assert _routes(0, 0, 2, 4, 2) == [(0, 0, 0, 1), (0, 1, 0, 1), (1, 2, 1, 2), (1, 3, 1, 2)]
    # Grow tp1 -> tp4 with 8 heads, old replica at position 2: two heads each, all from 2.
    assert _routes(2, 0, 1, 4, 8) == [(2, t, 2 * t, 2 * t + 2) for t in range(4)]


def test_reshard_kv_refuses_layouts_that_do_not_nest() -> None:
    from patrl.tpreshard import single_process_layout

    one = single_process_layout()
    shape = KVShape(LAYERS, 4, HEAD_DIM, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="src tp_size=1, dst tp_size=1"):
        reshard_kv({}, [], one, one, shape)
