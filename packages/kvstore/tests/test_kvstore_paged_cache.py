"""PagedKVCache: writes land where gathers read, and export/import is bit-identical."""

from __future__ import annotations

import pytest
import torch

from patrl.kvstore import KVCacheSpec, PagedKVCache, SequenceKV


def make_cache(
    block_size: int = 4, heads: int = 4, num_blocks: int = 32, **kw: object
) -> PagedKVCache:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=heads, head_dim=8, block_size=block_size)
    return PagedKVCache(spec, num_blocks, **kw)  # type: ignore[arg-type]


def fill(cache: PagedKVCache, seq: int, tokens: list[int], computed: int | None = None) -> None:
    """Allocate and write random KV for the first `computed` tokens (all by default)."""
    start = cache.blocks.allocate(seq, tokens)
    end = len(tokens) if computed is None else computed
    slots = torch.tensor(cache.blocks.slot_mapping(seq, start, end), dtype=torch.long)
    g = torch.Generator().manual_seed(seq)
    for layer in range(cache.spec.num_layers):
        shape = (end - start, cache.spec.num_kv_heads, cache.spec.head_dim)
        cache.write(layer, slots, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    cache.blocks.mark_computed(seq, end - start)


def test_write_then_gather_and_padded_gather_agree() -> None:
    cache = make_cache()
    fill(cache, 0, list(range(10)))
    fill(cache, 1, list(range(100, 103)))
    tables = [cache.blocks.block_table(0), cache.blocks.block_table(1)]
    ks, vs = cache.gather(1, tables, [10, 3])
    padded = torch.tensor([tables[0], tables[1] + [0] * (len(tables[0]) - len(tables[1]))])
    kp, vp = cache.gather_padded(1, padded)
    assert torch.equal(kp[0, :10], ks[0]) and torch.equal(kp[1, :3], ks[1])
    assert torch.equal(vp[0, :10], vs[0]) and torch.equal(vp[1, :3], vs[1])


def test_padded_gathers_reuse_one_buffer_and_each_is_right_when_made() -> None:
    """On CPU gather_padded writes into buffers kept across calls: a larger batch grows them,
    a smaller one reuses them, and every result equals a fresh gather when it is returned."""
    cache = make_cache()
    for seq, n in enumerate((10, 3, 7)):
        fill(cache, seq, list(range(100 * seq, 100 * seq + n)))
    tables = [cache.blocks.block_table(s) for s in range(3)]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    heads, dim = cache.spec.num_kv_heads, cache.spec.head_dim
    for layer, rows in [(0, [1]), (1, [0, 1, 2]), (0, [2, 0]), (1, [0])]:
        k, v = cache.gather_padded(layer, padded[rows])
        want = cache.k[layer][padded[rows]].reshape(len(rows), -1, heads, dim)
        assert torch.equal(k, want)
        assert torch.equal(v, cache.v[layer][padded[rows]].reshape(len(rows), -1, heads, dim))
    buffer = k.untyped_storage().data_ptr()
    k2, _ = cache.gather_padded(0, padded[[2]])
    assert k2.untyped_storage().data_ptr() == buffer  # kept, not made again


def test_slot_minus_one_is_skipped_and_past_capacity_is_an_error() -> None:
    cache = make_cache(num_blocks=2)
    k = torch.ones(2, 4, 8)
    cache.write(0, torch.tensor([-1, 3]), k, k)
    assert cache.k[0].view(-1, 4, 8)[3].eq(1).all() and cache.k[0].abs().sum() == 32
    with pytest.raises(IndexError, match="slot 8 is past the cache's 8 slots"):
        cache.write(0, torch.tensor([8]), k[:1], k[:1])


def test_unchecked_write_slots_equals_the_checked_write() -> None:
    checked, unchecked = make_cache(num_blocks=4), make_cache(num_blocks=4)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(5, 4, 8, generator=g), torch.randn(5, 4, 8, generator=g)
    slots = torch.tensor([7, 0, 15, 3, 9])
    for layer in range(3):
        checked.write(layer, slots, k + layer, v)
        unchecked.write_slots(layer, slots, k + layer, v)
    assert torch.equal(checked.pool, unchecked.pool)


def test_copy_on_write_moves_kv_with_the_block() -> None:
    cache = make_cache()
    fill(cache, 0, list(range(6)))
    cache.blocks.fork(0, [1])
    cache.copy_blocks(cache.blocks.append(1, [42]))
    k0, _ = cache.gather(2, [cache.blocks.block_table(0)], [6])
    k1, _ = cache.gather(2, [cache.blocks.block_table(1)], [6])
    assert cache.blocks.block_table(0)[-1] != cache.blocks.block_table(1)[-1]
    assert torch.equal(k0[0], k1[0])


@pytest.mark.parametrize("dst_block_size", [4, 1, 3, 16])
def test_export_import_round_trip_is_bit_identical(dst_block_size: int) -> None:
    src = make_cache(block_size=4)
    tokens = list(range(23))
    fill(src, 0, tokens, computed=21)  # two tokens have slots but no KV yet
    exported = src.export(0)
    assert exported.num_computed == 21 and exported.token_ids == tuple(tokens)
    dst = make_cache(block_size=dst_block_size, num_blocks=64)
    fill(dst, 7, [5, 5, 5, 5, 5])  # the destination is not empty
    dst.import_(0, exported)
    assert dst.blocks.num_uncomputed(0) == 2
    # The all-layer export and import agree with the per-layer gathers (their slow twin).
    for cache in (src, dst):
        for layer in range(3):
            ks, vs = cache.gather(layer, [cache.blocks.block_table(0)], [21])
            assert torch.equal(ks[0], exported.k[layer]) and torch.equal(vs[0], exported.v[layer])
    again = dst.export(0)
    assert torch.equal(again.k, exported.k) and torch.equal(again.v, exported.v)
    assert again.token_ids == exported.token_ids
    dst.blocks.check_integrity()


def test_import_of_a_head_slice() -> None:
    src = make_cache(heads=4)
    fill(src, 0, list(range(9)))
    full = src.export(0)
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=2)
    dst = PagedKVCache(spec, 16, head_start=2, num_total_kv_heads=4)
    dst.import_(0, full.heads(2, 4))
    got = dst.export(0)
    assert (got.head_start, got.num_heads) == (2, 2)
    assert torch.equal(got.k, full.k[:, :, 2:4]) and torch.equal(got.v, full.v[:, :, 2:4])
    assert torch.equal(SequenceKV.concat_heads([full.heads(0, 2), got]).k, full.k)
    with pytest.raises(ValueError, match=r"cannot import KV heads \[0, 4\).*holds heads \[2, 4\)"):
        dst.import_(1, full)


@pytest.mark.parametrize(
    ("field", "spec_kwargs"),
    [
        ("num_layers", {"num_layers": 2}),
        ("head_dim", {"head_dim": 16}),
        ("dtype", {"dtype": torch.bfloat16}),
    ],
)
def test_import_refuses_a_mismatched_spec(field: str, spec_kwargs: dict[str, object]) -> None:
    src = make_cache()
    fill(src, 0, list(range(5)))
    base: dict[str, object] = {"num_layers": 3, "num_kv_heads": 4, "head_dim": 8, "block_size": 4}
    dst = PagedKVCache(KVCacheSpec(**{**base, **spec_kwargs}), 16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"cannot import KV with {field}="):
        dst.import_(0, src.export(0))


def test_import_without_room_is_refused_before_touching_anything() -> None:
    src = make_cache()
    fill(src, 0, list(range(20)))
    dst = make_cache(num_blocks=3)
    assert not dst.can_import(src.export(0))
    with pytest.raises(RuntimeError, match="check can_import first"):
        dst.import_(0, src.export(0))
    assert dst.blocks.num_free_blocks == 3 and not dst.blocks.has(0)


def _written_kv(cache: PagedKVCache, seqs: dict[int, list[int]]) -> list[torch.Tensor]:
    out = []
    for seq, tokens in seqs.items():
        table = [cache.blocks.block_table(seq)]
        for layer in range(cache.spec.num_layers):
            ks, vs = cache.gather(layer, table, [len(tokens)])
            out += [ks[0], vs[0]]
    return out


def test_a_new_layout_takes_over_a_large_enough_pool_and_works_like_a_fresh_cache() -> None:
    old = make_cache(heads=4, num_blocks=32)
    fill(old, 0, list(range(40)))  # stale KV the new cache must not need zeroed
    pool = old.pool.data_ptr()
    spec = old.spec.with_heads(2)  # tp 1 -> 2: half the heads, twice the blocks, same bytes
    new = PagedKVCache(spec, 64, head_start=2, num_total_kv_heads=4, reuse=old)
    assert new.pool.data_ptr() == pool and new.nbytes == new.pool.nbytes
    assert old.k == [] and old.v == [] and old.pool.numel() == 0  # unusable, not aliased
    twin = PagedKVCache(spec, 64, head_start=2, num_total_kv_heads=4)  # fresh zeros
    seqs = {1: list(range(7)), 2: list(range(100, 123))}
    for cache in (new, twin):
        for seq, tokens in seqs.items():
            fill(cache, seq, tokens)
    assert all(map(torch.equal, _written_kv(new, seqs), _written_kv(twin, seqs)))
    assert all(t.isfinite().all() for t in (*new.k, *new.v))


def test_a_smaller_pool_fits_in_a_taken_over_one_and_a_larger_is_fresh_zeros() -> None:
    old = make_cache(heads=4, num_blocks=32)
    fill(old, 0, list(range(40)))
    ptr, numel = old.pool.data_ptr(), old.pool.numel()
    small = PagedKVCache(old.spec.with_heads(2), 32, head_start=0, num_total_kv_heads=4, reuse=old)
    assert small.pool.data_ptr() == ptr and small.nbytes == small.pool.nbytes // 2
    fill(small, 3, list(range(9)))
    big = PagedKVCache(small.spec.with_heads(4), 64, reuse=small)  # needs more than the pool
    # A fresh pool of exactly its size (the freed one's address may well be reused), zeroed.
    assert big.pool.numel() == 2 * numel and small.pool.numel() == 0
    assert all(t.eq(0).all() for t in (*big.k, *big.v))


def test_kv_sent_without_its_prompt_imports_only_onto_a_cache_holding_the_prompt() -> None:
    """A SequenceKV whose first 8 rows were not sent (`first=8`) imports where the prefix
    cache holds those 8 tokens (another sample of the prompt, imported first), reading only
    the rows it has; elsewhere can_import is False and import_ names the shortfall."""
    src = make_cache()
    prompt = list(range(10))
    fill(src, 0, [*prompt, 50, 51])
    fill(src, 1, [*prompt, 60, 61])
    base, other = src.export(0), src.export(1)
    hole = SequenceKV(
        other.token_ids,
        torch.cat([torch.full_like(other.k[:, :8], float("nan")), other.k[:, 8:]], 1),
        torch.cat([torch.full_like(other.v[:, :8], float("nan")), other.v[:, 8:]], 1),
        other.head_start,
        other.num_total_kv_heads,
        first=8,
    )
    empty = make_cache()
    assert not empty.can_import(hole)
    with pytest.raises(ValueError, match="starts at token 8 and this cache holds only 0"):
        empty.import_("x", hole)
    dst = make_cache()
    dst.import_("a", base)
    assert dst.can_import(hole)
    dst.import_("b", hole)
    got = dst.export("b")
    assert torch.equal(got.k, other.k) and torch.equal(got.v, other.v)
    with pytest.raises(ValueError, match="first=13 is not within its 12 computed tokens"):
        SequenceKV(other.token_ids, other.k, other.v, 0, other.num_total_kv_heads, first=13)
