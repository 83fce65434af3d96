"""reshard_: in-place re-cutting between layouts equals a fresh cut of the full tensor, bit for bit."""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from patrl.tpreshard import (
    GroupCache,
    ParallelLayout,
    ShardSpec,
    ShmComm,
    index_map,
    reshard_,
    shard_tensor,
)
from patrl.tpreshard import reshard as reshard_module
from patrl.tpreshard.reshard import copy_plan
from patrl.tpreshard.shard import ShardPart, is_input_major
from patrl_testkit.multirank import run_ranks

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 7, 8, 4, 2, 2


def _specs() -> dict[str, tuple[ShardSpec, tuple[int, ...]]]:
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return {
        "qkv": (ShardSpec.qkv(HEADS, KV_HEADS, HEAD_DIM), (qkv_rows, HIDDEN)),
        "gate_up": (ShardSpec.column(ShardPart("gate", 8), ShardPart("up", 8)), (16, HIDDEN)),
        "row": (ShardSpec.row(), (HIDDEN, 8)),
        "embed": (ShardSpec.vocab(), (VOCAB, HIDDEN)),  # 7 rows: the last rank is padded
        "norm": (ShardSpec.replicated(), (HIDDEN,)),
        # Stored transposed, as the engine stores its matmul weights on CPU (input-major).
        "gate_up_t": (ShardSpec.column(ShardPart("gate", 8), ShardPart("up", 8)), (16, HIDDEN)),
        "row_t": (ShardSpec.row(), (HIDDEN, 8)),
        "head_t": (ShardSpec.vocab(), (VOCAB, HIDDEN)),
    }


def _full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


class _Toy(nn.Module):
    """Parameters cut like the engine's layers, with a `layout` and `vocab_size` like them."""

    def __init__(self, layout: ParallelLayout) -> None:
        super().__init__()
        self.layout = layout
        self.vocab_size = VOCAB
        for name, (spec, shape) in _specs().items():
            local = shard_tensor(_full(name, shape), spec, layout.tp_rank, layout.tp_size)
            data = local.t().contiguous().t() if name.endswith("_t") else local.clone()
            p = nn.Parameter(data, requires_grad=False)
            p.shard_spec = spec  # type: ignore[attr-defined]
            self.register_parameter(name, p)


def _expected(layout: ParallelLayout) -> dict[str, torch.Tensor]:
    return {
        n: shard_tensor(_full(n, shape), spec, layout.tp_rank, layout.tp_size)
        for n, (spec, shape) in _specs().items()
    }


def _input_major_kept(toy: nn.Module) -> bool:
    """The transposed parameters are still transposed views of contiguous storage."""
    return all(
        p.t().is_contiguous() and not p.is_contiguous()
        for n, p in toy.named_parameters()
        if n.endswith("_t")
    )


def _walk(
    rank: int, world_size: int, path: list[int], tp_comm: str, slot_bytes: int | None
) -> list[bool]:
    groups = GroupCache([1, 2, 4], world_size=world_size, rank=rank, tp_comm=tp_comm)
    created = groups.num_created
    layouts = {tp: groups.layout(tp) for tp in (1, 2, 4)}
    if slot_bytes is not None:  # a few rows a round: the streamed gather's blocks and runs meet
        for tp in (2, 4):
            small = ShmComm(layouts[tp].tp_group, slot_bytes=slot_bytes, name=f"walk{tp}")
            layouts[tp] = dataclasses.replace(layouts[tp], tp_comm=small)
    toy = _Toy(layouts[path[0]])
    norm_ptr = toy.norm.data_ptr()
    results = []
    for src_tp, dst_tp in itertools.pairwise(path):
        src, dst = layouts[src_tp], layouts[dst_tp]
        stats = reshard_(toy, src, dst)
        want = _expected(dst)
        exact = all(torch.equal(p.data, want[n]) for n, p in toy.named_parameters())
        # Peak: the larger layout's weights + one full parameter (+ vocab padding of a shard).
        largest = max(_full(n, shape).nbytes for n, (_, shape) in _specs().items())
        bound = max(stats.bytes_before, stats.bytes_after) + largest + 4 * HIDDEN
        results.append(exact and stats.peak_bytes <= bound and _input_major_kept(toy))
        assert toy.layout is dst
    assert groups.num_created == created
    assert toy.norm.data_ptr() == norm_ptr  # replicated parameters are not copied
    dist.barrier()
    return results


@pytest.mark.multirank
@pytest.mark.parametrize(
    "tp_comm,slot_bytes",
    [
        ("auto", None),  # shared memory: shards stream into place, one round per parameter
        ("auto", 64),  # two 8-float rows a round: runs cut across blocks
        ("process_group", None),  # gloo: gathered whole, then re-cut (the slow twin)
    ],
)
def test_reshard_walks_1_2_4_2_1_bit_exact_on_four_ranks(tp_comm: str, slot_bytes: int | None):
    per_rank = run_ranks(
        _walk, world_size=4, args=([1, 2, 4, 2, 1], tp_comm, slot_bytes), timeout_s=300
    )
    assert per_rank == [[True] * 4] * 4


def test_a_tp_that_does_not_divide_the_heads_fails_and_changes_nothing() -> None:
    src = ParallelLayout(tp_size=1, tp_rank=0, tp_group=None)
    toy = _Toy(src)
    before = {n: p.data.clone() for n, p in toy.named_parameters()}
    bad = ParallelLayout(tp_size=3, tp_rank=0, tp_group=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tp_size=3"):
        reshard_(toy, src, bad)
    assert toy.layout is src
    assert all(torch.equal(p.data, before[n]) for n, p in toy.named_parameters())


def test_growing_from_tp1_narrows_without_communication() -> None:
    # tp_group is never touched on a narrowing move: a group that would fail on use proves it.
    src = ParallelLayout(tp_size=1, tp_rank=0, tp_group=None)
    toy = _Toy(src)
    for rank in (0, 1):
        toy = _Toy(src)
        dst = ParallelLayout(tp_size=2, tp_rank=rank, tp_group=object())  # type: ignore[arg-type]
        stats = reshard_(toy, src, dst)
        want = _expected(dst)
        assert all(torch.equal(p.data, want[n]) for n, p in toy.named_parameters())
        assert stats.bytes_received == 0 and stats.bytes_after < stats.bytes_before
        assert _input_major_kept(toy)


def _slow_plan(
    spec: ShardSpec, rows: int, src_tp: int, dst_rank: int, dst_tp: int
) -> list[tuple[int, int, int, int]]:
    """The per-row twin of copy_plan: each local row's owner, then a walk that extends a run
    while the next row is the next row of the same source."""
    owner = []
    for d in index_map(spec, rows, dst_rank, dst_tp).tolist():
        found = (-1, -1)
        for r in reversed(range(src_tp)):  # the lowest rank holding the row wins
            local = index_map(spec, rows, r, src_tp).tolist()
            if d >= 0 and d in local:
                found = (r, local.index(d))
        owner.append(found)
    runs, i = [], 0
    while i < len(owner):
        r, w = owner[i]
        n = 1
        while i + n < len(owner) and owner[i + n] == (r, w + n):
            n += 1
        if r >= 0:
            runs.append((i, r, w, n))
        i += n
    return runs


def _plan_cases() -> list[tuple[str, ShardSpec, int]]:
    cases = [
        (n, spec, shape[spec.dim]) for n, (spec, shape) in _specs().items() if spec.dim is not None
    ]
    return [
        *cases,
        ("gqa_qkv", ShardSpec.qkv(16, 4, 8), (16 + 2 * 4) * 8),  # kv replicated at tp 8
        ("vocab_odd", ShardSpec.vocab(), 1001),  # padding on the last rank at every tp > 1
    ]


@pytest.mark.parametrize(("name", "spec", "rows"), _plan_cases(), ids=[c[0] for c in _plan_cases()])
def test_copy_plan_equals_the_per_row_walk(name: str, spec: ShardSpec, rows: int) -> None:
    sizes = [1, 2, 4, 8] if name in ("gqa_qkv", "vocab_odd") else [1, 2, 4]
    for src_tp, dst_tp in itertools.permutations(sizes, 2):
        for dst_rank in range(dst_tp):
            fast = copy_plan(spec, rows, src_tp, dst_rank, dst_tp)
            assert list(fast) == _slow_plan(spec, rows, src_tp, dst_rank, dst_tp), (src_tp, dst_tp)


@pytest.mark.parametrize("transposed", [False, True])
def test_copying_by_the_plan_equals_a_fresh_cut(transposed: bool) -> None:
    # The twin's plan applied row by row from the source shards gives the destination's cut,
    # for every spec kind, row-major or input-major (the planner and the copy agree).
    for name, spec, rows in _plan_cases():
        dim = spec.dim
        assert dim is not None
        shape = (rows, 6) if dim == 0 else (6, rows)
        full = _full(name, shape)
        for src_tp, dst_tp in itertools.permutations([1, 2, 4], 2):
            shards = [shard_tensor(full, spec, r, src_tp) for r in range(src_tp)]
            for dst_rank in range(dst_tp):
                want = shard_tensor(full, spec, dst_rank, dst_tp)
                got = torch.zeros(want.shape[::-1]).t() if transposed else torch.zeros(want.shape)
                for i, r, w, n in copy_plan(spec, rows, src_tp, dst_rank, dst_tp):
                    for k in range(n):
                        got.select(dim, i + k).copy_(shards[r].select(dim, w + k))
                assert torch.equal(got, want), (name, src_tp, dst_tp, dst_rank)


def _grow(toy: nn.Module, dst_tp: int, rank: int) -> None:
    src = ParallelLayout(tp_size=1, tp_rank=0, tp_group=None)
    dst = ParallelLayout(tp_size=dst_tp, tp_rank=rank, tp_group=object())  # type: ignore[arg-type]
    reshard_(toy, src, dst)


@pytest.mark.parametrize("dst_tp", [2, 4])
def test_growing_from_tp1_cuts_inside_the_old_storage(
    dst_tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fast path (the shard cut in place in the parameter's own storage) against its twin
    # (a fresh shard allocated and copied): the same bits, every spec, every rank, padding
    # included (VOCAB=7 pads the last rank at tp 2 and 4); the fast path allocates nothing.
    src = ParallelLayout(tp_size=1, tp_rank=0, tp_group=None)
    for rank in range(dst_tp):
        toy = _Toy(src)
        storages = {n: p.untyped_storage().data_ptr() for n, p in toy.named_parameters()}
        _grow(toy, dst_tp, rank)
        with monkeypatch.context() as m:
            m.setattr(reshard_module, "_can_release", lambda: False)
            twin = _Toy(src)
            _grow(twin, dst_tp, rank)
        want = _expected(ParallelLayout(tp_size=dst_tp, tp_rank=rank, tp_group=object()))  # type: ignore[arg-type]
        for n, p in toy.named_parameters():
            assert torch.equal(p.data, want[n]), (n, rank)
            assert torch.equal(p.data, dict(twin.named_parameters())[n].data), (n, rank)
            assert p.untyped_storage().data_ptr() == storages[n], f"{n} was reallocated"
            other = dict(twin.named_parameters())[n]
            if n != "norm":
                assert other.untyped_storage().data_ptr() != storages[n]
        assert _input_major_kept(toy) and _input_major_kept(twin)


def test_a_parameter_sharing_its_storage_is_not_cut_in_place() -> None:
    # Two views of one buffer: cutting one inside the buffer would overwrite the other.
    src = ParallelLayout(tp_size=1, tp_rank=0, tp_group=None)
    toy = _Toy(src)
    shared = torch.randn(2, *toy.row.shape)
    toy.row.data = shared[1]
    neighbour = shared[0].clone()
    _grow(toy, 2, 1)
    assert torch.equal(shared[0], neighbour)
    assert toy.row.untyped_storage().data_ptr() != shared.untyped_storage().data_ptr()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
@pytest.mark.parametrize("name", ["embed", "head_t", "gate_up"])
def test_growing_in_place_returns_the_dropped_half_to_the_os(name: str) -> None:
    # One 64 MB parameter grown to tp 2 on rank 1, by each in-place path: one run along rows
    # (a view), a column slice of input-major storage (rows compacted in growing blocks), fused
    # parts along rows (runs moved forward): the process gives back about half of it.
    spec = _specs()[name][0]
    if name == "gate_up":
        spec = ShardSpec.column(ShardPart("gate", 2048), ShardPart("up", 2048))
    full = torch.randn(4096, 4096).t() if name.endswith("_t") else torch.randn(4096, 4096)

    class One(nn.Module):
        def __init__(self, weight: torch.Tensor) -> None:
            super().__init__()
            self.layout = ParallelLayout(tp_size=1, tp_rank=0, tp_group=None)
            self.vocab_size = 4096
            self.w = nn.Parameter(weight, requires_grad=False)
            self.w.shard_spec = spec  # type: ignore[attr-defined]

    module = One(full)
    del full
    want = shard_tensor(module.w.data, spec, 1, 2).clone()
    before = _rss_bytes()
    dst = ParallelLayout(tp_size=2, tp_rank=1, tp_group=object())  # type: ignore[arg-type]
    reshard_(module, module.layout, dst)
    freed = before - _rss_bytes()
    assert torch.equal(module.w.data, want)
    assert freed > 0.45 * 64 * 2**20, f"only {freed} bytes returned"


def test_keeping_the_full_tensors_cuts_views_where_it_can() -> None:
    # keep_full from tp 1: the same bits as a fresh cut, every spec and rank (padding too);
    # a shard that is one contiguous block of its full tensor's storage is a view of it, which
    # stays as it was; the others (fused parts, padding, a column block) are copies beside it,
    # and the bytes after the move count them.
    src = ParallelLayout(tp_size=1, tp_rank=0, tp_group=None)
    for dst_tp in (2, 4):
        for rank in range(dst_tp):
            toy = _Toy(src)
            fulls = {n: p.data for n, p in toy.named_parameters()}
            copies = {n: p.data.clone() for n, p in toy.named_parameters()}
            dst = ParallelLayout(tp_size=dst_tp, tp_rank=rank, tp_group=object())  # type: ignore[arg-type]
            stats = reshard_(toy, src, dst, keep_full=True)
            want = _expected(dst)
            copied = []
            for n, p in toy.named_parameters():
                assert torch.equal(p.data, want[n]), (n, dst_tp, rank)
                assert torch.equal(fulls[n], copies[n]), f"{n}'s full tensor changed"
                if p.untyped_storage().data_ptr() != fulls[n].untyped_storage().data_ptr():
                    copied.append(n)
            # contiguous: row_t (input-major: the input dimension is its storage's rows) and
            # the embedding's rows on a rank without padding; strided: row (columns of its
            # storage), head_t (the vocabulary is its storage's columns)
            padded = rank == dst_tp - 1
            want_copied = {"qkv", "gate_up", "gate_up_t", "row", "head_t"} | (
                {"embed"} if padded else set()
            )
            assert set(copied) == want_copied, (copied, dst_tp, rank)
            assert stats.bytes_received == 0
            held = stats.bytes_before + sum(dict(toy.named_parameters())[n].nbytes for n in copied)
            assert stats.bytes_after == held
            assert reshard_module.has_full(toy)
            assert all(is_input_major(p) for n, p in toy.named_parameters() if n.endswith("_t"))
    with pytest.raises(ValueError, match="keep_full needs a move out of TP 1"):
        two = ParallelLayout(tp_size=2, tp_rank=0, tp_group=object())  # type: ignore[arg-type]
        reshard_(_Toy(two), two, src, keep_full=True)


def _fold_and_back(rank: int, world_size: int, forget: bool) -> list[Any]:
    """tp 1 -> 2 keeping the full tensors, then back (twice): the way back is free and gives
    every parameter its old storage, unless the full tensors were forgotten in between (a
    write into the shards), when it gathers, exactly as without them."""
    groups = GroupCache([1, 2], world_size=world_size, rank=rank)
    one, two = groups.layout(1), groups.layout(2)
    toy = _Toy(one)
    storages = {n: p.untyped_storage().data_ptr() for n, p in toy.named_parameters()}
    out: list[Any] = []
    shards: list[dict[str, int]] = []
    for _ in range(2):
        reshard_(toy, one, two, keep_full=True)
        assert all(torch.equal(p.data, _expected(two)[n]) for n, p in toy.named_parameters())
        shards.append({n: p.untyped_storage().data_ptr() for n, p in toy.named_parameters()})
        if forget:
            reshard_module.forget_full(toy)
        stats = reshard_(toy, two, one)
        want = _expected(one)
        exact = all(torch.equal(p.data, want[n]) for n, p in toy.named_parameters())
        same = {n: p.untyped_storage().data_ptr() == storages[n] for n, p in toy.named_parameters()}
        out.append((exact, stats.restored, stats.bytes_received > 0, all(same.values())))
        out.append(not reshard_module.has_full(toy) and _input_major_kept(toy))
        storages = {n: p.untyped_storage().data_ptr() for n, p in toy.named_parameters()}
    if not forget:  # the second fold copied into the first one's shards, kept at tp 1 for it
        out.append(shards[0] == shards[1])
    dist.barrier()
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("forget", [False, True])
def test_the_way_back_to_tp1_is_free_while_the_full_tensors_are_kept(forget: bool) -> None:
    per_rank = run_ranks(_fold_and_back, world_size=2, args=(forget,), timeout_s=120)
    if forget:  # gathered: exact, new storage (the shards grew back into fresh tensors)
        want = [(True, False, True, False), True] * 2
    else:  # restored: exact, no bytes received, the very storage the parameters had at tp 1
        want = [(True, True, False, True), True] * 2 + [True]
    assert per_rank == [want, want]
