"""BlockManager: the known failure cases of compact engines, fork, eviction and bad input."""

from __future__ import annotations

import pytest

from patrl.kvstore import BlockManager, KVCacheSpec


def computed(bm: BlockManager, seq: int, tokens: list[int]) -> int:
    """Allocate and pretend the forward ran: what the engine does for a prefill."""
    cached = bm.allocate(seq, tokens)
    bm.mark_computed(seq, bm.num_uncomputed(seq))
    return cached


def test_spec_bytes_and_budget() -> None:
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=8, block_size=16)
    assert spec.bytes_per_token == 2 * 4 * 2 * 8 * 4
    assert spec.bytes_per_block == 16 * spec.bytes_per_token
    assert spec.num_blocks_for(10 * spec.bytes_per_block + 1) == 10


@pytest.mark.parametrize("bad", [0, -16])
def test_bad_block_size_names_the_value(bad: int) -> None:
    with pytest.raises(ValueError, match=f"block_size must be a positive int, got {bad}"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, block_size=bad)
    with pytest.raises(ValueError, match=f"block_size must be a positive int, got {bad}"):
        BlockManager(num_blocks=4, block_size=bad)


@pytest.mark.parametrize("length", [32, 48, 33])
def test_full_prefix_hit_still_computes_the_last_token(length: int) -> None:
    bm = BlockManager(num_blocks=16, block_size=16)
    prompt = list(range(length))
    computed(bm, 0, prompt)
    cached = bm.allocate(1, prompt)
    assert cached == ((length - 1) // 16) * 16
    assert bm.num_uncomputed(1) >= 1
    # The tokens to compute sit in a block of their own: writing them cannot touch seq 0's KV.
    bm.check_integrity()
    assert bm.block_table(1)[: cached // 16] == bm.block_table(0)[: cached // 16]
    assert bm.block_table(1)[-1] != bm.block_table(0)[-1]


def test_prefix_hit_after_preemption() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6]
    computed(bm, 0, prompt)
    for token in [7, 8, 9]:  # three decode steps
        bm.append(0, [token])
        bm.mark_computed(0, 1)
    everything = bm.token_ids(0).copy()
    bm.free(0)  # preempted by recompute
    computed(bm, 1, [1, 2, 3, 4, 50])  # other work in between reuses free blocks, not cached ones
    cached = bm.allocate(0, everything)
    # Full blocks [1..4] and [5..8] are still cached; the scheduler must take the count from
    # allocate itself, because it changed during the call.
    assert cached == 8
    assert bm.num_uncomputed(0) == 1
    assert len(bm.slot_mapping(0, cached, len(everything))) == 1
    bm.check_integrity()


def test_same_new_prefix_twice_in_one_step_is_held_once() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(13))  # 3 full blocks + 1 token
    assert bm.allocate(0, prompt) == 0
    assert bm.allocate(1, prompt) == 0  # same step: nothing computed yet, so no hit
    bm.mark_computed(0, 13)
    bm.mark_computed(1, 13)
    assert bm.block_table(0)[:3] == bm.block_table(1)[:3]
    assert bm.num_used_blocks == 3 + 2
    bm.check_integrity()
    assert bm.allocate(2, prompt) == 12
    assert bm.block_table(2)[:3] == bm.block_table(0)[:3]
    for seq in (0, 1, 2):
        bm.free(seq)
    bm.check_integrity()
    assert bm.num_cached_free_blocks == 3


def test_fork_of_a_long_prompt_shares_its_blocks() -> None:
    bm = BlockManager(num_blocks=200, block_size=16)
    computed(bm, 0, list(range(1000)))
    prompt_blocks = bm.num_used_blocks
    assert prompt_blocks == 63
    bm.fork(0, range(1, 8))
    assert bm.num_used_blocks == 63  # 8 samples, the prompt's blocks once
    copies = []
    for seq in range(8):
        copies += bm.append(seq, [2000 + seq])
    # The shared partial last block is copied for 7 samples; the last one keeps the original.
    assert len(copies) == 7
    assert bm.num_used_blocks == 63 + 7
    tails = {bm.block_table(seq)[-1] for seq in range(8)}
    assert len(tails) == 8  # diverging continuations never write into a sibling's block
    for seq in range(8):
        assert bm.token_ids(seq)[-1] == 2000 + seq
        assert bm.block_table(seq)[:62] == bm.block_table(0)[:62]
    bm.check_integrity()


def test_hash_collision_after_another_prefix_is_not_a_hit() -> None:
    # Every block hashes by its token sum, so [0, 3] and [1, 2] collide, and so do their children.
    bm = BlockManager(num_blocks=16, block_size=2, hash_fn=lambda prev, t: prev * 31 + sum(t))
    computed(bm, 0, [0, 3, 9])  # registers [0,3]
    computed(bm, 1, [1, 2, 5, 5, 9])  # [1,2] collides with [0,3]; [5,5] is registered under it
    computed(bm, 2, [0, 3, 4, 6, 9])  # [4,6] has the same hash as [5,5] after the same parent hash
    # A sequence [0,3,5,5,...] matches [0,3]; the indexed [5,5] was computed after [1,2], not
    # after [0,3], so it must not be reused.
    cached = bm.allocate(3, [0, 3, 5, 5, 9])
    assert cached == 2
    bm.check_integrity()


def test_cached_free_blocks_are_evicted_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=7, block_size=2)
    computed(bm, 0, [1, 1, 1])  # [1,1] registered + a partial block
    computed(bm, 1, [2, 2, 2])
    bm.free(0)
    bm.free(1)
    assert (bm.num_cached_free_blocks, bm.num_free_blocks) == (2, 7)
    # 6 blocks: the 5 never-registered ones first, then the least recently freed prefix, [1,1].
    computed(bm, 2, [9] * 11)
    assert bm.num_cached_free_blocks == 1
    bm.free(2)
    assert bm.allocate(3, [2, 2, 2]) == 2  # seq 1's prefix, freed later, survived
    assert bm.allocate(4, [1, 1, 1]) == 0  # seq 0's was evicted
    assert bm.prefix_hit_tokens == 2
    bm.check_integrity()


def test_running_out_of_blocks_is_a_question_not_an_error() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.can_allocate(list(range(8)))
    assert not bm.can_allocate(list(range(9)))
    computed(bm, 0, list(range(8)))
    assert not bm.can_append(0, 1)
    with pytest.raises(RuntimeError, match="check can_append first"):
        bm.append(0, [1])
    with pytest.raises(RuntimeError, match="check can_allocate first"):
        bm.allocate(1, [1])


def test_bad_calls_name_the_sequence() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", [1, 2, 3])
    with pytest.raises(ValueError, match="'a' is already allocated"):
        bm.allocate("a", [1])
    with pytest.raises(ValueError, match="3 of its tokens are not computed"):
        bm.fork("a", ["b"])
    with pytest.raises(
        IndexError, match=r"tokens \[2, 5\) of sequence 'a' are outside its allocation of 3"
    ):
        bm.slot_mapping("a", 2, 5)
    with pytest.raises(ValueError, match="cannot mark 4 tokens computed"):
        bm.mark_computed("a", 4)
    with pytest.raises(ValueError, match="no tokens"):
        bm.allocate("empty", [])
    bm.free("a")
    with pytest.raises(KeyError, match="freed twice"):
        bm.free("a")


def test_reset_prefix_cache_forgets_stale_kv_and_stops_registering_old_sequences() -> None:
    bm = BlockManager(num_blocks=16, block_size=2)
    computed(bm, 0, [1, 2, 3, 4, 5])
    computed(bm, 1, [7, 7, 7])
    bm.free(1)
    bm.reset_prefix_cache()  # new weights
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 16 - 3
    bm.append(0, [6, 8])
    bm.mark_computed(0, 2)  # seq 0's KV now mixes weights: it must not be registered
    assert bm.allocate(2, [1, 2, 3, 4, 5, 6, 8, 9]) == 0
    assert bm.allocate(3, [7, 7, 7]) == 0
    bm.mark_computed(3, 3)
    assert bm.allocate(4, [7, 7, 7]) == 2  # KV computed after the reset is shared again
    bm.check_integrity()
