"""Shard math: every cut checked against a slow twin written from the definition."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from patrl.tpreshard import (
    ParallelLayout,
    ShardPart,
    ShardSpec,
    head_range,
    load_full,
    shard_part,
    shard_tensor,
    single_process_layout,
    vocab_range,
)


def _layout(tp_rank: int, tp_size: int) -> ParallelLayout:
    # Shard math never communicates; a placeholder group satisfies the layout's check.
    group = None if tp_size == 1 else object()
    return ParallelLayout(tp_size=tp_size, tp_rank=tp_rank, tp_group=group)  # type: ignore[arg-type]


def _heads_of_rank(num_heads: int, tp_rank: int, tp_size: int) -> list[int]:
    per = num_heads // tp_size
    return list(range(tp_rank * per, (tp_rank + 1) * per))


def _kv_heads_of_rank(num_heads: int, num_kv: int, tp_rank: int, tp_size: int) -> list[int]:
    """Slow twin: the kv heads the rank's q heads attend with (GQA groups of H/kv q heads)."""
    group = num_heads // num_kv
    return sorted({h // group for h in _heads_of_rank(num_heads, tp_rank, tp_size)})


def _qkv_twin(
    full: torch.Tensor, num_heads: int, num_kv: int, hd: int, tp_rank: int, tp_size: int
) -> torch.Tensor:
    q, k, v = full.split([num_heads * hd, num_kv * hd, num_kv * hd])
    qh = q.view(num_heads, hd, *q.shape[1:])
    kh = k.view(num_kv, hd, *k.shape[1:])
    vh = v.view(num_kv, hd, *v.shape[1:])
    q_idx = _heads_of_rank(num_heads, tp_rank, tp_size)
    kv_idx = _kv_heads_of_rank(num_heads, num_kv, tp_rank, tp_size)
    rows = [qh[h] for h in q_idx] + [kh[h] for h in kv_idx] + [vh[h] for h in kv_idx]
    return torch.cat(rows)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_column_and_row_shards_concatenate_back_to_full(tp_size: int) -> None:
    full = torch.randn(8, 12)
    col = [shard_tensor(full, ShardSpec.column(), r, tp_size) for r in range(tp_size)]
    row = [shard_tensor(full, ShardSpec.row(), r, tp_size) for r in range(tp_size)]
    assert torch.equal(torch.cat(col, dim=0), full)
    assert torch.equal(torch.cat(row, dim=1), full)
    assert col[0].shape == (8 // tp_size, 12)
    assert row[0].shape == (8, 12 // tp_size)


def test_replicated_is_the_full_tensor_on_every_rank() -> None:
    full = torch.randn(5)
    for r in range(3):
        assert torch.equal(shard_tensor(full, ShardSpec.replicated(), r, 3), full)


def test_vocab_shard_pads_the_last_rank_with_zeros() -> None:
    full = torch.arange(10 * 2, dtype=torch.float32).view(10, 2)
    shards = [shard_tensor(full, ShardSpec.vocab(), r, 4) for r in range(4)]
    assert [s.shape[0] for s in shards] == [3, 3, 3, 3]
    assert [vocab_range(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert torch.equal(torch.cat(shards)[:10], full)
    assert torch.equal(shards[3][1:], torch.zeros(2, 2))
    assert ShardSpec.vocab().local_shape((10, 2), 4) == (3, 2)


def test_vocab_range_when_ranks_outnumber_rows() -> None:
    assert [vocab_range(3, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert torch.equal(shard_tensor(torch.ones(3, 1), ShardSpec.vocab(), 3, 4), torch.zeros(1, 1))


def test_qkv_is_split_per_part_then_sharded() -> None:
    heads, kv, hd, tp = 4, 2, 3, 2
    spec = ShardSpec.qkv(heads, kv, hd)
    full = torch.randn((heads + 2 * kv) * hd, 5)
    for r in range(tp):
        local = shard_tensor(full, spec, r, tp)
        assert torch.equal(local, _qkv_twin(full, heads, kv, hd, r, tp))
    # rank 0 holds q heads 0,1 and kv head 0 (not a naive chunk of the fused rows)
    assert not torch.equal(shard_tensor(full, spec, 0, tp), full.chunk(tp)[0])


def test_kv_heads_are_replicated_when_fewer_than_ranks() -> None:
    heads, kv, hd, tp = 8, 2, 2, 4
    spec = ShardSpec.qkv(heads, kv, hd)
    full = torch.randn((heads + 2 * kv) * hd)
    locals_ = [shard_tensor(full, spec, r, tp) for r in range(tp)]
    k = full[heads * hd : (heads + kv) * hd].view(kv, hd)
    for r, local in enumerate(locals_):
        assert local.shape == ((heads // tp + 2) * hd,)
        assert _kv_heads_of_rank(heads, kv, r, tp) == [r // 2]
        assert torch.equal(local[heads // tp * hd : (heads // tp + 1) * hd], k[r // 2])
        assert torch.equal(local, _qkv_twin(full, heads, kv, hd, r, tp))


@settings(max_examples=60, deadline=None)
@given(
    kv=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 4]),
    hd=st.integers(1, 4),
    tp=st.sampled_from([1, 2, 4, 8]),
    cols=st.integers(0, 3),
)
def test_qkv_matches_twin_for_any_valid_gqa(
    kv: int, group: int, hd: int, tp: int, cols: int
) -> None:
    heads = kv * group
    if heads % tp:
        return  # q heads must split evenly; covered by the error test
    spec = ShardSpec.qkv(heads, kv, hd)
    shape = ((heads + 2 * kv) * hd,) + ((cols,) if cols else ())
    full = torch.randn(shape)
    for r in range(tp):
        local = shard_tensor(full, spec, r, tp)
        assert local.shape == spec.local_shape(shape, tp)
        assert torch.equal(local, _qkv_twin(full, heads, kv, hd, r, tp))


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_gate_up_parts_are_sharded_separately(tp_size: int) -> None:
    inter, hidden = 8, 3
    spec = ShardSpec.column(ShardPart("gate", inter), ShardPart("up", inter))
    gate, up = torch.randn(inter, hidden), torch.randn(inter, hidden)
    full = torch.cat([gate, up])
    for r in range(tp_size):
        expected = torch.cat([gate.chunk(tp_size)[r], up.chunk(tp_size)[r]])
        assert torch.equal(shard_tensor(full, spec, r, tp_size), expected)


@pytest.mark.parametrize(("heads", "kv", "tp"), [(4, 2, 2), (8, 2, 4), (4, 4, 1)])
def test_loading_parts_one_by_one_equals_loading_the_fused_tensor(
    heads: int, kv: int, tp: int
) -> None:
    hd, hidden = 2, 3
    spec = ShardSpec.qkv(heads, kv, hd)
    q, k, v = (
        torch.randn(heads * hd, hidden),
        torch.randn(kv * hd, hidden),
        torch.randn(kv * hd, hidden),
    )
    full = torch.cat([q, k, v])
    for r in range(tp):
        layout = _layout(r, tp)
        by_parts = torch.full(spec.local_shape(tuple(full.shape), tp), float("nan"))
        for name, t in (("v", v), ("q", q), ("k", k)):
            load_full(by_parts, t, spec, layout, part=name)
        fused = torch.empty_like(by_parts)
        load_full(fused, full, spec, layout)
        assert torch.equal(by_parts, fused)
        k_local = shard_part(k, spec, "k", r, tp)
        start = spec.part_offset("k", tp)
        assert torch.equal(k_local, fused[start : start + k_local.shape[0]])


def test_load_full_converts_dtype_and_checks_shape() -> None:
    param = torch.nn.Parameter(torch.zeros(2, 4, dtype=torch.bfloat16))
    full = torch.randn(4, 4)
    load_full(param, full, ShardSpec.column(), _layout(1, 2))
    assert param.dtype == torch.bfloat16
    assert torch.equal(param.data, full[2:].to(torch.bfloat16))
    with pytest.raises(
        ValueError, match=r"holds shape \(2, 4\).*cut of the given tensor \(6, 4\) is \(3, 4\)"
    ):
        load_full(param, torch.randn(6, 4), ShardSpec.column(), _layout(0, 2))


def test_errors_name_the_offending_values() -> None:
    with pytest.raises(ValueError, match=r"size 6 cannot be split across tp_size=4"):
        shard_tensor(torch.randn(6, 2), ShardSpec.column(), 0, 4)
    with pytest.raises(ValueError, match=r"3 heads cannot be replicated over tp_size=4"):
        shard_tensor(torch.randn((12 + 2 * 3) * 2), ShardSpec.qkv(12, 3, 2), 0, 4)
    with pytest.raises(ValueError, match=r"6 heads cannot be split across tp_size=4"):
        shard_tensor(torch.randn((6 + 2 * 6) * 2), ShardSpec.qkv(6, 6, 2), 0, 4)
    with pytest.raises(ValueError, match=r"sum to 12, but the full tensor has 10"):
        shard_tensor(torch.randn(10), ShardSpec.qkv(2, 2, 2), 0, 1)
    with pytest.raises(ValueError, match=r"kind 'diagonal' is not one of"):
        ShardSpec("diagonal")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tp_rank=2, tp_size=2"):
        shard_tensor(torch.randn(4), ShardSpec.column(), 2, 2)
    with pytest.raises(KeyError, match=r"no part 'x'; this spec has parts \['q', 'k', 'v'\]"):
        ShardSpec.qkv(2, 2, 2).part("x")
    with pytest.raises(ValueError, match=r"row spec splits dim 1, tensor of shape \(4,\)"):
        shard_tensor(torch.randn(4), ShardSpec.row(), 0, 2)


def test_parallel_layout_checks_its_coordinates() -> None:
    one = single_process_layout()
    assert (one.tp_size, one.tp_rank, one.tp_group, one.dp_size) == (1, 0, None, 1)
    assert one.is_tp_first
    with pytest.raises(ValueError, match=r"tp_group is required when tp_size=2"):
        ParallelLayout(tp_size=2, tp_rank=0, tp_group=None)
    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, tp_size=2\), got 2"):
        ParallelLayout(tp_size=2, tp_rank=2, tp_group=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dp_size must be >= 1, got 0"):
        ParallelLayout(tp_size=1, tp_rank=0, tp_group=None, dp_size=0)


@pytest.mark.parametrize(("heads", "tp"), [(8, 1), (8, 2), (8, 4), (8, 8), (2, 4), (1, 4), (4, 8)])
def test_head_range_is_the_twin_rule(heads: int, tp: int) -> None:
    # Fewer heads than ranks: the twin asks which kv head the rank's q heads (8 per kv head) use.
    for r in range(tp):
        start, count = head_range(heads, r, tp)
        if heads >= tp:
            assert list(range(start, start + count)) == _heads_of_rank(heads, r, tp)
        else:
            assert [start] == _kv_heads_of_rank(8 * heads, heads, r, tp) and count == 1
