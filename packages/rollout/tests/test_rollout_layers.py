"""Attention backends, their context, rotary embeddings: each against a slow twin or HF."""

from __future__ import annotations

import importlib.machinery
import sys

import pytest
import torch
from rollout_testkit import PagedKVCache, random_paged_batch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import patrl.kvstore as kvstore
from patrl.kvstore import KVCacheSpec
from patrl.rollout.config import EngineConfig
from patrl.rollout.layers.attention.context import AttentionContext
from patrl.rollout.layers.attention.registry import (
    attention_backend_names,
    create_attention_backend,
    resolve_attention_backend,
)
from patrl.rollout.layers.attention.sdpa import SdpaBackend
from patrl.rollout.layers.rotary import RotaryEmbedding
from patrl.rollout.model_config import ModelArch

HQ, HK, D = 4, 2, 8


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Slow twin, from the definition: query j of Q new tokens sees keys 0 .. L - Q + j."""
    n_q, n_k = q.shape[0], k.shape[0]
    out = torch.empty_like(q)
    for j in range(n_q):
        last = n_k - n_q + j
        for h in range(HQ):
            kv = h // (HQ // HK)
            scores = (k[: last + 1, kv] @ q[j, h]) / D**0.5
            out[j, h] = scores.softmax(0) @ v[: last + 1, kv]
    return out


def _paged_batch(
    query_lens: list[int], context_lens: list[int], seed: int = 0
) -> tuple[AttentionContext, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A cache holding each sequence's cached prefix; q/k/v of the new tokens; full K/V."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, 64, 4, HK, D, torch.float32)
    free = torch.randperm(64, generator=g).tolist()
    tables, new_slots, full_k, full_v = [], [], [], []
    for q_len, ctx_len in zip(query_lens, context_lens, strict=True):
        table = [free.pop() for _ in range(-(-ctx_len // 4))]
        slots = [table[p // 4] * 4 + p % 4 for p in range(ctx_len)]
        k, v = torch.randn(ctx_len, HK, D, generator=g), torch.randn(ctx_len, HK, D, generator=g)
        cached = ctx_len - q_len
        cache.write(0, torch.tensor(slots[:cached], dtype=torch.long), k[:cached], v[:cached])
        tables.append(table)
        new_slots += slots[cached:]
        full_k.append(k)
        full_v.append(v)
    ctx = AttentionContext.build(
        query_lens, context_lens, slot_mapping=new_slots, block_tables=tables, kv_cache=cache
    )
    q = torch.randn(sum(query_lens), HQ, D, generator=g)
    k_new = torch.cat(
        [k[c - n :] for k, n, c in zip(full_k, query_lens, context_lens, strict=True)]
    )
    v_new = torch.cat(
        [v[c - n :] for v, n, c in zip(full_v, query_lens, context_lens, strict=True)]
    )
    twin = [
        naive_attention(qi, k, v)
        for qi, k, v in zip(q.split(query_lens), full_k, full_v, strict=True)
    ]
    return ctx, q, k_new, v_new, twin


@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [
        ([5, 3, 1, 1, 1], [5, 8, 4, 7, 1]),  # prefill, chunk after a cached prefix, decodes
        ([1, 1, 1], [9, 2, 13]),  # decode only (the batched path)
        ([1], [6]),  # one decode (the per-sequence path)
        ([6, 2], [6, 10]),
        ([5, 1, 3, 2], [21, 9, 3, 14]),  # a verify step: 1 + d queries over cached context
        ([70, 2, 1, 4], [70, 9, 5, 30]),  # a query too long to batch beside small ones
    ],
)
@pytest.mark.parametrize("max_batched_query", [65, 1])
def test_sdpa_over_a_paged_cache_matches_the_naive_twin(
    query_lens: list[int], context_lens: list[int], max_batched_query: int
) -> None:
    """Both the padded batched path (65: every query up to a verify step's 1 + 64) and the
    per-sequence path (1: only decodes batched) against the definition."""
    ctx, q, k, v, twin = _paged_batch(query_lens, context_lens)
    out = SdpaBackend(max_batched_query).forward(q, k, v, 0, ctx)
    torch.testing.assert_close(out, torch.cat(twin), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_batched_small_queries_equal_the_per_sequence_path(dtype: torch.dtype) -> None:
    """A verify-shaped batch on a real PagedKVCache (every slot random, tables with a padded
    tail) through the padded path equals the per-sequence path it replaces, within rounding
    (1e-5 in fp32, 2e-2 in bf16: the calls reduce in different orders), for three seeds; a
    second call on the same context (a model's next layer) reuses its kept layout."""
    lens, ctxs = [5, 1, 3, 2, 5], [37, 12, 4, 19, 5]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for seed in range(3):
        ctx, q, k, v = random_paged_batch(lens, ctxs, HQ, HK, dtype, seed=seed)
        fast = SdpaBackend().forward(q, k, v, 0, ctx)
        ctx2, *_ = random_paged_batch(lens, ctxs, HQ, HK, dtype, seed=seed)
        slow = SdpaBackend(max_batched_query=1).forward(q, k, v, 0, ctx2)
        torch.testing.assert_close(fast, slow, rtol=tol, atol=tol)
        again = SdpaBackend().forward(q, k, v, 0, ctx)  # the kept layout
        assert torch.equal(again, fast)  # same inputs, same calls: bit for bit


def test_sdpa_rejects_a_batched_query_limit_below_one() -> None:
    with pytest.raises(ValueError, match="max_batched_query must be >= 1, got 0"):
        SdpaBackend(0)


def test_sdpa_writes_the_new_tokens_into_the_cache() -> None:
    ctx, q, k, v, _ = _paged_batch([2, 1], [5, 3])
    SdpaBackend().forward(q, k, v, 0, ctx)
    assert ctx.kv_cache is not None and ctx.block_tables is not None
    ks, vs = ctx.kv_cache.gather(0, ctx.block_tables, ctx.context_lens)
    assert torch.equal(torch.cat([ks[0][3:], ks[1][2:]]), k)
    assert torch.equal(torch.cat([vs[0][3:], vs[1][2:]]), v)


def test_sdpa_without_a_cache_is_causal_within_each_sequence() -> None:
    g = torch.Generator().manual_seed(1)
    lens = [4, 1, 6]
    q = torch.randn(11, HQ, D, generator=g)
    k, v = torch.randn(11, HK, D, generator=g), torch.randn(11, HK, D, generator=g)
    out = SdpaBackend().forward(q, k, v, 0, AttentionContext.build(lens))
    twin = [
        naive_attention(*xs) for xs in zip(q.split(lens), k.split(lens), v.split(lens), strict=True)
    ]
    torch.testing.assert_close(out, torch.cat(twin), rtol=1e-5, atol=1e-5)


def test_context_derives_positions_and_offsets() -> None:
    ctx = AttentionContext.build(
        [3, 1, 2], [3, 7, 5], slot_mapping=list(range(6)), block_tables=[[0], [1, 2], [3, 4]],
        kv_cache=PagedKVCache(1, 8, 4, HK, D, torch.float32),
    )  # fmt: skip
    assert ctx.positions.tolist() == [0, 1, 2, 6, 3, 4]
    assert ctx.cu_seqlens_q.tolist() == [0, 3, 4, 6]
    assert ctx.cu_seqlens_k.tolist() == [0, 3, 10, 15]
    assert ctx.last_token_indices().tolist() == [2, 3, 5]
    assert (ctx.max_query_len, ctx.max_context_len, ctx.num_seqs) == (3, 7, 3)
    assert ctx.block_table_tensor().tolist() == [[0, 0], [1, 2], [3, 4]]


def test_context_rejects_inconsistent_metadata() -> None:
    cache = PagedKVCache(1, 8, 4, HK, D, torch.float32)
    with pytest.raises(
        ValueError, match=r"sequence 1: need 1 <= query_len <= context_len, got query_len=0"
    ):
        AttentionContext.build(
            [2, 0], [2, 4], slot_mapping=[0, 1], block_tables=[[0], [1]], kv_cache=cache
        )
    with pytest.raises(ValueError, match=r"query_len=5, context_len=3"):
        AttentionContext.build([5], [3], slot_mapping=[0] * 5, block_tables=[[0]], kv_cache=cache)
    with pytest.raises(ValueError, match=r"without a kv_cache every token must be new"):
        AttentionContext.build([1], [4])
    with pytest.raises(ValueError, match=r"slot_mapping has shape \(2,\), expected \(3,\)"):
        AttentionContext.build([3], [3], slot_mapping=[0, 1], block_tables=[[0]], kv_cache=cache)
    with pytest.raises(ValueError, match=r"needs both slot_mapping and block_tables"):
        AttentionContext.build([3], [3], kv_cache=cache)
    with pytest.raises(ValueError, match=r"2 block tables for 1 sequences"):
        AttentionContext.build([1], [1], slot_mapping=[0], block_tables=[[0], [1]], kv_cache=cache)


def test_context_checks_slots_on_the_host_and_skips_minus_one() -> None:
    """build() drops -1 slots and rejects one past the cache, so a layer's write is unchecked."""
    cache = kvstore.PagedKVCache(KVCacheSpec(1, HK, D, block_size=4), num_blocks=2)
    with pytest.raises(IndexError, match="slot 8 is past the cache's 8 slots"):
        AttentionContext.build([2], [2], slot_mapping=[0, 8], block_tables=[[0]], kv_cache=cache)
    with pytest.raises(IndexError, match="slot -2 is negative"):
        AttentionContext.build([2], [2], slot_mapping=[0, -2], block_tables=[[0]], kv_cache=cache)
    ctx = AttentionContext.build(
        [3], [3], slot_mapping=[-1, 3, -1], block_tables=[[0]], kv_cache=cache
    )
    assert ctx.slot_mapping is not None and ctx.write_rows is not None
    assert (ctx.slot_mapping.tolist(), ctx.write_rows.tolist()) == ([3], [1])
    k = torch.arange(3.0)[:, None, None].expand(3, HK, D)
    ctx.store_kv(0, k, -k)
    twin = kvstore.PagedKVCache(KVCacheSpec(1, HK, D, block_size=4), num_blocks=2)
    twin.write(0, torch.tensor([-1, 3, -1]), k, -k)  # the checked write, its slow twin
    assert torch.equal(cache.k[0], twin.k[0]) and torch.equal(cache.v[0], twin.v[0])
    assert cache.k[0].view(-1, HK, D)[3].eq(1).all() and cache.k[0].abs().sum() == HK * D


@pytest.mark.parametrize(
    "rope",
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    ],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_transformers(rope: dict | None, dtype: torch.dtype) -> None:
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=500000.0, rope_scaling=rope,
    )  # fmt: skip
    positions = torch.tensor([0, 1, 2, 31, 32, 100, 255])
    q = torch.randn(len(positions), 4, 16).to(dtype)
    k = torch.randn(len(positions), 2, 16).to(dtype)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ours = RotaryEmbedding(16, ModelArch.from_hf(config).rope, 256)
    q_out, k_out = ours(positions, q, k)
    assert torch.equal(q_out, q_ref[0].transpose(0, 1))
    assert torch.equal(k_out, k_ref[0].transpose(0, 1))


def test_auto_picks_sdpa_on_cpu_without_importing_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "patrl.rollout.layers.attention.flash", raising=False)
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert resolve_attention_backend("auto") == "sdpa"
    assert isinstance(create_attention_backend("auto"), SdpaBackend)
    assert "patrl.rollout.layers.attention.flash" not in sys.modules
    assert "flash_attn" not in sys.modules


def test_unknown_backend_lists_the_known_ones() -> None:
    assert attention_backend_names() == ["sdpa", "flash", "triton", "auto"]
    with pytest.raises(
        ValueError,
        match=r"unknown attention backend 'xformers'; choose one of "
        r"\['sdpa', 'flash', 'triton', 'auto'\]",
    ):
        create_attention_backend("xformers")


def _pretend_installed(monkeypatch: pytest.MonkeyPatch, flash: bool, triton: bool) -> None:
    """flash_attn / triton importable or not, as importlib.util.find_spec sees them."""
    for name, present in (("flash_attn", flash), ("triton", triton)):
        fake = type(sys)(name)
        fake.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, fake if present else None)


@pytest.mark.parametrize(
    ("cuda", "flash", "triton", "block_size", "expected"),
    [
        (True, True, True, None, "flash"),
        (True, True, True, 512, "flash"),
        (True, True, True, 16, "triton"),  # flash cannot page 16-token blocks: auto skips it
        (True, False, True, None, "triton"),
        (True, False, False, None, "sdpa"),
        (False, True, True, None, "sdpa"),
    ],
)
def test_auto_order_is_flash_then_triton_then_sdpa(
    cuda: bool,
    flash: bool,
    triton: bool,
    block_size: int | None,
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _pretend_installed(monkeypatch, flash, triton)
    assert resolve_attention_backend("auto", block_size, cuda=cuda) == expected


def test_engine_config_resolves_auto_and_the_block_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """After validation both are concrete: the backend this machine runs, its block size."""
    cpu = EngineConfig(model="m", device="cpu")
    assert (cpu.attention_backend, cpu.block_size) == ("sdpa", 16)
    assert EngineConfig(model="m", attention_backend="flash").block_size == 256
    assert EngineConfig(model="m", attention_backend="triton").block_size == 16
    assert EngineConfig(model="m", block_size=8).block_size == 8
    _pretend_installed(monkeypatch, flash=True, triton=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu = EngineConfig(model="m")
    assert (on_gpu.attention_backend, on_gpu.block_size) == ("flash", 256)
    small = EngineConfig(model="m", block_size=16)
    assert (small.attention_backend, small.block_size) == ("triton", 16)
    on_cpu = EngineConfig(model="m", device="cpu")
    assert (on_cpu.attention_backend, on_cpu.block_size) == ("sdpa", 16)
    with pytest.raises(
        ValueError,
        match=r"attention_backend='flash' cannot use block_size=16: it takes a positive "
        r"multiple of 256 \(flash-attn's paged KV needs a multiple of 256; its default is 256\)",
    ):
        EngineConfig(model="m", attention_backend="flash", block_size=16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_flash_refuses_clearly_without_cuda() -> None:
    with pytest.raises(RuntimeError, match=r"the flash attention backend needs CUDA; use 'sdpa'"):
        create_attention_backend("flash")


def _fake_flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash_attn_varlen_func's documented semantics, naively: varlen K/V or paged K/V
    ([num_blocks, block_size, H, D] read through block_table), causal aligned lower-right."""
    assert causal and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = cu_seqlens_q[i].item(), cu_seqlens_q[i + 1].item()
        n_k = (cu_seqlens_k[i + 1] - cu_seqlens_k[i]).item()
        if block_table is None:
            ks, vs = (
                k[cu_seqlens_k[i] : cu_seqlens_k[i + 1]],
                v[cu_seqlens_k[i] : cu_seqlens_k[i + 1]],
            )
        else:
            assert block_table.dtype == torch.int32
            ks = k[block_table[i].long()].flatten(0, 1)[:n_k]
            vs = v[block_table[i].long()].flatten(0, 1)[:n_k]
        assert qe - qs <= max_seqlen_q and n_k <= max_seqlen_k
        out[qs:qe] = naive_attention(q[qs:qe], ks, vs)
    _FLASH_CALLS.append("varlen")
    return out


def _fake_flash_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    causal: bool = False,
) -> torch.Tensor:
    """flash_attn_with_kvcache's documented paged semantics, naively, checking its argument
    contract: q [B, S, Hq, D], caches [num_blocks, block_size, Hk, D], int32 cache_seqlens [B]
    and block_table [B, max_blocks] whose blocks hold every cached token."""
    b, s, hq, d = q.shape
    assert causal and s == 1 and hq % k_cache.shape[2] == 0 and k_cache.shape[3] == d
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype == q.dtype
    assert cache_seqlens.dtype == block_table.dtype == torch.int32
    assert cache_seqlens.shape == (b,) and block_table.shape[0] == b and block_table.dim() == 2
    assert bool((cache_seqlens <= block_table.shape[1] * k_cache.shape[1]).all())
    out = torch.empty_like(q)
    for i in range(b):
        n_k = int(cache_seqlens[i])
        ks = k_cache[block_table[i].long()].flatten(0, 1)[:n_k]
        vs = v_cache[block_table[i].long()].flatten(0, 1)[:n_k]
        out[i] = naive_attention(q[i], ks, vs)
    _FLASH_CALLS.append("with_kvcache")
    return out


_FLASH_CALLS: list[str] = []


@pytest.mark.parametrize(
    ("case", "call"),
    [("mixed", "varlen"), ("decode", "with_kvcache"), ("uncached", "varlen")],
)
def test_flash_backend_passes_flash_the_right_metadata(
    case: str, call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No GPU here: flash_attn is replaced by its semantics; the backend must equal sdpa, and
    a pure decode step must go through flash_attn_with_kvcache."""
    fake = type(sys)("flash_attn")
    fake.flash_attn_varlen_func = _fake_flash_varlen  # type: ignore[attr-defined]
    fake.flash_attn_with_kvcache = _fake_flash_with_kvcache  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    flash = create_attention_backend("flash")
    assert flash.name == "flash"
    if case == "mixed":
        ctx, q, k, v, twin = _paged_batch([5, 3, 1, 1], [5, 8, 4, 7], seed=3)
        expected = torch.cat(twin)
    elif case == "decode":
        ctx, q, k, v, twin = _paged_batch([1, 1, 1], [9, 2, 13], seed=4)
        expected = torch.cat(twin)
    else:
        g = torch.Generator().manual_seed(2)
        ctx = AttentionContext.build([4, 1, 6])
        q = torch.randn(11, HQ, D, generator=g)
        k, v = torch.randn(11, HK, D, generator=g), torch.randn(11, HK, D, generator=g)
        expected = SdpaBackend().forward(q, k, v, 0, ctx)
    _FLASH_CALLS.clear()
    torch.testing.assert_close(flash.forward(q, k, v, 0, ctx), expected, rtol=1e-5, atol=1e-5)
    assert [call] == _FLASH_CALLS


LONG_DECODES: list[int] = torch.randint(
    1, 3000, (32,), generator=torch.Generator().manual_seed(7)
).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [([1] * 32, LONG_DECODES), ([300, 1, 40], [300, 900, 2000])],
)
def test_flash_matches_sdpa_on_cuda(query_lens: list[int], context_lens: list[int]) -> None:
    """Real flash-attn (where installed) at block_size 256, bf16, head_dim 128: a decode step
    (flash_attn_with_kvcache) and a mixed one (varlen with block_table) equal sdpa."""
    pytest.importorskip("flash_attn", reason="the flash backend needs flash-attn")
    ctx, q, k, v = random_paged_batch(
        query_lens, context_lens, 32, 8, torch.bfloat16, block_size=256, head_dim=128,
        device="cuda",
    )  # fmt: skip
    twin, _, _, _ = random_paged_batch(
        query_lens, context_lens, 32, 8, torch.bfloat16, block_size=256, head_dim=128,
        device="cuda",
    )  # fmt: skip
    out = create_attention_backend("flash").forward(q, k, v, 0, ctx)
    expected = SdpaBackend().forward(q, k, v, 0, twin)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
