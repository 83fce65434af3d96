"""BlockManager.truncate: rolling back rejected speculative tokens next to forks, the prefix
cache and copy-on-write, with every invariant checked after each operation."""

from __future__ import annotations

import random

import pytest

from patrl.kvstore import BlockManager


def prefilled(bm: BlockManager, seq: int, tokens: list[int]) -> None:
    bm.allocate(seq, tokens)
    bm.mark_computed(seq, bm.num_uncomputed(seq))


def verify_step(bm: BlockManager, seq: int, tokens: list[int], accepted: int) -> None:
    """What the engine does with a draft: slots for 1 + d tokens, all computed by the verify
    forward, then the rejected d - accepted rolled back."""
    bm.append(seq, tokens)
    bm.mark_computed(seq, len(tokens))
    bm.truncate(seq, len(tokens) - 1 - accepted)
    bm.check_integrity()


def test_truncate_in_a_forked_sequence_leaves_the_shared_prefix_alone() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    prefilled(bm, 0, [1, 2, 3, 4, 5, 6])  # a full block and a partial one
    bm.fork(0, [1, 2])
    shared = bm.block_table(0)
    assert [bm.ref_count(b) for b in shared] == [3, 3]
    # the child's drafts go to its own copy of the partial block (copy-on-write) and beyond
    copies = bm.append(1, [7, 8, 9, 10, 11])
    assert copies == [(shared[1], bm.block_table(1)[1])]
    bm.mark_computed(1, 5)
    bm.truncate(1, 4)  # keep 7 only
    bm.check_integrity()
    assert bm.token_ids(1) == [1, 2, 3, 4, 5, 6, 7]
    assert bm.num_computed(1) == 7
    assert bm.block_table(1)[0] == shared[0] and bm.block_table(1)[1] != shared[1]
    assert bm.block_table(0) == shared and bm.block_table(2) == shared
    assert bm.token_ids(0) == [1, 2, 3, 4, 5, 6]
    # the parent still shares its partial block with child 2: refcount 2, not freed
    assert bm.ref_count(shared[1]) == 2
    for s in (0, 1, 2):
        bm.free(s)
    bm.check_integrity()
    assert bm.num_used_blocks == 0


def test_truncate_into_a_block_shared_after_dedup_copies_it_on_the_next_append() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    prefilled(bm, 0, [1, 2, 3, 4, 5, 6, 7, 8])
    prefilled(bm, 1, [1, 2, 3, 4])
    bm.append(1, [5, 6, 7, 8])
    bm.mark_computed(1, 4)
    assert bm.block_table(1) == bm.block_table(0)  # held once
    shared = bm.block_table(0)[1]
    bm.truncate(1, 2)  # 5, 6 accepted: the new end falls inside the shared block
    bm.check_integrity()
    assert bm.ref_count(shared) == 2
    assert bm.num_cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8  # seq 0's block: findable
    copies = bm.append(1, [42])
    assert copies == [(shared, bm.block_table(1)[1])]
    bm.mark_computed(1, 1)
    bm.check_integrity()
    assert bm.token_ids(0) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert bm.num_cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8


def test_a_rewritten_block_is_never_a_prefix_hit_for_its_old_tokens() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    prefilled(bm, 0, [1, 2, 3])
    bm.append(0, [4, 5, 6, 7])  # [1..7]: block 0 full, registered after the forward
    bm.mark_computed(0, 4)
    assert bm.num_cached_prefix([1, 2, 3, 4, 0]) == 4
    bm.truncate(0, 2)  # [1, 2, 3, 4, 5]: the second block keeps 5 only
    bm.append(0, [50, 60, 70, 80])
    bm.mark_computed(0, 4)
    bm.check_integrity()
    assert bm.num_cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 4  # the old draft is gone
    assert bm.num_cached_prefix([1, 2, 3, 4, 5, 50, 60, 70, 0]) == 8


def test_truncating_the_whole_sequence_or_a_negative_count_is_an_error() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    prefilled(bm, 0, [1, 2, 3])
    with pytest.raises(ValueError, match=r"cannot truncate 3 of the 3 tokens .* 0 to 2"):
        bm.truncate(0, 3)
    with pytest.raises(ValueError, match="cannot truncate -1"):
        bm.truncate(0, -1)


@pytest.mark.parametrize("caching", [True, False])
def test_a_long_run_of_verify_steps_leaks_no_slot(caching: bool) -> None:
    """Random prompts from a small alphabet (so prefixes repeat and dedup happens), forks,
    drafts of random length with random acceptance, finishes; invariants after every step
    and every block back at the end."""
    rng = random.Random(0)
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=caching)
    live: dict[int, list[int]] = {}  # seq -> its tokens as the engine knows them
    next_id = 0
    for _ in range(600):
        op = rng.random()
        if op < 0.15 and len(live) < 8:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
            if bm.can_allocate(prompt):
                prefilled(bm, next_id, prompt)
                live[next_id] = list(prompt)
                children = list(range(next_id + 1, next_id + 1 + rng.randrange(3)))
                bm.fork(next_id, children)
                for c in [next_id, *children]:
                    live[c] = list(prompt)
                next_id += 1 + len(children)
        elif op < 0.25 and live:
            seq = rng.choice(sorted(live))
            bm.free(seq)
            del live[seq]
        elif live:
            seq = rng.choice(sorted(live))
            d = rng.randrange(5)
            new = [rng.randrange(3) for _ in range(1 + d)]
            if bm.can_append(seq, len(new)):
                accepted = rng.randrange(d + 1)
                verify_step(bm, seq, new, accepted)
                live[seq] += new[: 1 + accepted]
        bm.check_integrity()
        for seq, tokens in live.items():
            assert bm.token_ids(seq) == tokens
            assert bm.num_computed(seq) == len(tokens)
    for seq in list(live):
        bm.free(seq)
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks
