"""Test helpers for patrl.rollout: two slow KV caches, a step driver, HF-parity checks.

The caches implement the KVCache interface the attention backends use (the one
patrl.kvstore.PagedKVCache provides), written for obviousness, not speed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

import patrl.kvstore as kvstore
from patrl.kvstore import KVCacheSpec
from patrl.rollout.layers.attention.context import AttentionContext
from patrl.rollout.loader import load_model
from patrl.rollout.models.causal_lm import CausalLM
from patrl.tpreshard import ParallelLayout


class DenseKVCache:
    """One contiguous [max_len] KV buffer per sequence: block table [[i]], slot = i*max_len + pos."""

    def __init__(
        self, layers: int, seqs: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> None:
        self.block_size = max_len
        self.capacity_tokens = seqs * max_len
        self.k = torch.zeros(layers, seqs, max_len, kv_heads, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        for row, slot in enumerate(slot_mapping.tolist()):
            if slot >= 0:
                seq, pos = divmod(slot, self.block_size)
                self.k[layer, seq, pos] = k[row]
                self.v[layer, seq, pos] = v[row]

    write_slots = write  # the slow twin checks nothing either

    def gather(
        self, layer: int, block_tables: Sequence[Sequence[int]], context_lens: Sequence[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ks = [self.k[layer, t[0], :n] for t, n in zip(block_tables, context_lens, strict=True)]
        vs = [self.v[layer, t[0], :n] for t, n in zip(block_tables, context_lens, strict=True)]
        return ks, vs

    def gather_padded(
        self, layer: int, block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _gather_padded(self, layer, block_tables)


def _gather_padded(
    cache: Any, layer: int, block_tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow twin of a padded gather: whole blocks of every table, through `gather`."""
    width = block_tables.shape[1] * cache.block_size
    tables = block_tables.tolist()
    ks, vs = cache.gather(layer, tables, [min(width, len(t) * cache.block_size) for t in tables])
    # Unwritten slots read as zeros, like patrl.kvstore's zero-initialised blocks: the caller
    # masks them, and a masked NaN would still poison the output (0 * NaN).
    return torch.stack(ks).nan_to_num(0.0), torch.stack(vs).nan_to_num(0.0)


class PagedKVCache:
    """Small blocks handed out in shuffled order, so block tables are never contiguous."""

    def __init__(
        self,
        layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        self.block_size = block_size
        self.capacity_tokens = num_blocks * block_size
        shape = (num_blocks, block_size, kv_heads, head_dim)
        # NaN in unwritten slots: reading one would poison the logits, not pass silently.
        self.k = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(layers)]
        self.v = [torch.full_like(x, float("nan")) for x in self.k]

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        for row, slot in enumerate(slot_mapping.tolist()):
            if slot >= 0:
                block, offset = divmod(slot, self.block_size)
                self.k[layer][block, offset] = k[row]
                self.v[layer][block, offset] = v[row]

    write_slots = write  # the slow twin checks nothing either

    def gather(
        self, layer: int, block_tables: Sequence[Sequence[int]], context_lens: Sequence[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ks, vs = [], []
        for table, n in zip(block_tables, context_lens, strict=True):
            rows = [divmod(pos, self.block_size) for pos in range(n)]
            ks.append(torch.stack([self.k[layer][table[b], o] for b, o in rows]))
            vs.append(torch.stack([self.v[layer][table[b], o] for b, o in rows]))
        return ks, vs

    def gather_padded(
        self, layer: int, block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _gather_padded(self, layer, block_tables)


def random_paged_batch(
    query_lens: list[int],
    context_lens: list[int],
    q_heads: int,
    kv_heads: int,
    dtype: torch.dtype,
    *,
    block_size: int = 4,
    head_dim: int = 32,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[AttentionContext, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A real patrl.kvstore.PagedKVCache of one layer full of random KV (every slot, so stale
    data would show), shuffled block tables with one extra zero entry (a padded tail), and the
    new tokens' q, k, v: the context and inputs of a fused paged kernel's twin test."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 3
    spec = KVCacheSpec(1, kv_heads, head_dim, block_size, dtype, torch.device(device))
    cache = kvstore.PagedKVCache(spec, num_blocks, enable_prefix_caching=False)
    for blocks in (cache.k[0], cache.v[0]):
        blocks.copy_(torch.randn(blocks.shape, generator=g).to(dtype))
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots = [], []
    for q_len, ctx_len in zip(query_lens, context_lens, strict=True):
        table = [free.pop() for _ in range(-(-ctx_len // block_size))]
        slots += [
            table[p // block_size] * block_size + p % block_size
            for p in range(ctx_len - q_len, ctx_len)
        ]
        tables.append([*table, 0])
    ctx = AttentionContext.build(
        query_lens, context_lens, slot_mapping=slots, block_tables=tables, kv_cache=cache,
        device=device,
    )  # fmt: skip
    total = sum(query_lens)
    q = torch.randn(total, q_heads, head_dim, generator=g).to(dtype).to(device)
    k = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype).to(device)
    v = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype).to(device)
    return ctx, q, k, v


class Driver:
    """Feeds chunks of tokens to a model sequence by sequence, keeping the cache bookkeeping."""

    def __init__(self, model: CausalLM, num_seqs: int, cache: str, max_len: int = 64) -> None:
        c = model.config
        kv_heads = max(1, c.num_kv_heads // model.layout.tp_size)
        dtype = model.lm_head.weight.dtype
        self.model = model
        self.lens = [0] * num_seqs
        self.cache: DenseKVCache | PagedKVCache | kvstore.PagedKVCache
        if cache == "kvstore":
            # The real store's tensors, driven by this test's own block allocation.
            spec = KVCacheSpec(c.num_layers, kv_heads, c.head_dim, block_size=4, dtype=dtype)
            blocks = num_seqs * -(-max_len // 4)
            self.cache = kvstore.PagedKVCache(spec, blocks, enable_prefix_caching=False)
            self.free = list(range(blocks))
            random.Random(1).shuffle(self.free)
            self.tables = [[] for _ in range(num_seqs)]
        elif cache == "dense":
            self.cache = DenseKVCache(c.num_layers, num_seqs, max_len, kv_heads, c.head_dim, dtype)
            self.tables = [[i] for i in range(num_seqs)]
        else:
            block = 4
            blocks = num_seqs * -(-max_len // block)
            self.cache = PagedKVCache(c.num_layers, blocks, block, kv_heads, c.head_dim, dtype)
            self.free = list(range(blocks))
            random.Random(0).shuffle(self.free)
            self.tables = [[] for _ in range(num_seqs)]

    @property
    def block_size(self) -> int:
        cache = self.cache
        return (
            cache.spec.block_size if isinstance(cache, kvstore.PagedKVCache) else cache.block_size
        )

    def step(self, chunks: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Append chunks[i] (may be empty: sequence i sits out) -> logits per new token, per seq."""
        active = [i for i, c in enumerate(chunks) if c]
        slots: list[int] = []
        for i in active:
            for pos in range(self.lens[i], self.lens[i] + len(chunks[i])):
                block, offset = divmod(pos, self.block_size)
                while len(self.tables[i]) <= block:
                    self.tables[i].append(self.free.pop())
                slots.append(self.tables[i][block] * self.block_size + offset)
            self.lens[i] += len(chunks[i])
        ctx = AttentionContext.build(
            [len(chunks[i]) for i in active],
            [self.lens[i] for i in active],
            slot_mapping=slots,
            block_tables=[self.tables[i] for i in active],
            kv_cache=self.cache,
        )
        ids = torch.tensor([t for i in active for t in chunks[i]])
        logits = self.model.compute_logits(self.model(ids, ctx))
        out = [torch.empty(0)] * len(chunks)
        for i, part in zip(active, logits.split(ctx.query_lens), strict=True):
            out[i] = part
        return out


def workload(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts of different lengths and 10 continuation tokens each."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 13, 3)]
    conts = [torch.randint(0, vocab, (10,), generator=g).tolist() for _ in prompts]
    return prompts, conts


@torch.no_grad()
def hf_reference(hf: Any, prompts: list[list[int]], conts: list[list[int]]) -> list[torch.Tensor]:
    """HF logits of every position of prompt + continuation, one sequence at a time."""
    return [hf(torch.tensor([p + c])).logits[0] for p, c in zip(prompts, conts, strict=True)]


def max_diff_prefill_and_decode(
    model: CausalLM,
    refs: list[torch.Tensor],
    prompts: list[list[int]],
    conts: list[list[int]],
    cache: str,
) -> float:
    """Prefill (in two chunks with the paged cache), then 10 decode steps; worst |logit diff|."""
    driver = Driver(model, len(prompts), cache)
    worst = 0.0
    if cache != "dense":
        # Chunked prefill: the second chunk attends to a cached first chunk (lower-right mask).
        # The third sequence prefills whole in the second step, beside the others' chunks.
        cut = [len(p) // 2 if len(p) > 4 else 0 for p in prompts]
        first = driver.step([p[:c] for p, c in zip(prompts, cut, strict=True)])
        second = driver.step([p[c:] for p, c in zip(prompts, cut, strict=True)])
        for i, c in enumerate(cut):
            got = torch.cat([first[i], second[i]]) if c else second[i]
            worst = max(worst, (got - refs[i][: len(prompts[i])]).abs().max().item())
    else:
        out = driver.step(prompts)
        for i, p in enumerate(prompts):
            worst = max(worst, (out[i] - refs[i][: len(p)]).abs().max().item())
    for j in range(10):
        out = driver.step([[c[j]] for c in conts])
        for i, p in enumerate(prompts):
            worst = max(worst, (out[i][0] - refs[i][len(p) + j]).abs().max().item())
    return worst


def tp_parity_body(rank: int, world_size: int, cases: list[tuple[Any, ...]]) -> list[float]:
    """Rank body: load each (path, prompts, conts, refs, cache) case at TP=world_size."""
    tp_group = dist.new_group(list(range(world_size)))
    layout = ParallelLayout(tp_size=world_size, tp_rank=rank, tp_group=tp_group)
    diffs = []
    for path, prompts, conts, refs, cache in cases:
        model = load_model(path, layout, attention="sdpa", dtype=torch.float32)
        diffs.append(max_diff_prefill_and_decode(model, refs, prompts, conts, cache))
    return diffs
