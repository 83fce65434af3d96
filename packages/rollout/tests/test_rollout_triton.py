"""patrl's Triton kernels and the triton backend against their twin, sdpa.

On CPU the kernels run under triton's interpreter (small shapes: it is slow); the `gpu` tests
run them compiled at realistic shapes. Skipped where triton is not installed.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from rollout_testkit import random_paged_batch

from patrl.kvstore import PagedKVCache
from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.layers.attention.context import AttentionContext
from patrl.rollout.layers.attention.registry import create_attention_backend
from patrl.rollout.layers.attention.sdpa import SdpaBackend
from patrl.rollout.sampler import SamplingParams
from patrl_testkit.models import save_hf_model, tiny_hf_model

pytest.importorskip("triton", reason="the Triton kernels need triton (pip install triton)")
KERNELS = "patrl.rollout.layers.attention.triton_kernels"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    """The kernels module; on CPU, interpreted (the conftests set TRITON_INTERPRET=1 before
    anything imports triton, which reads it at import, at decoration and while kernels run)."""
    module = importlib.import_module(KERNELS)
    if not torch.cuda.is_available() and not module.INTERPRETED:
        pytest.fail(
            "no CUDA and the Triton kernels are not interpreted: TRITON_INTERPRET=1 must be set "
            f"before triton is imported (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r})"
        )
    return module


def paged_case(
    query_lens: list[int],
    context_lens: list[int],
    q_heads: int,
    kv_heads: int,
    dtype: torch.dtype,
    **kwargs: Any,
) -> tuple[AttentionContext, torch.Tensor, torch.Tensor, torch.Tensor]:
    return random_paged_batch(
        query_lens, context_lens, q_heads, kv_heads, dtype, device=DEVICE, **kwargs
    )


def assert_near(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32 to rounding; half precision to its resolution (both sides round differently)."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Contexts cross block boundaries (block_size 4) and end in partial blocks; one is 1 token;
# with 3 splits of 16-token tiles, 37 tokens use all three, the short ones leave splits empty.
DECODE_LENS = [9, 2, 37, 1, 20]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(2, 2), (8, 2)])
def test_paged_decode_matches_sdpa(
    kernels: ModuleType, q_heads: int, kv_heads: int, dtype: torch.dtype, splits: int
) -> None:
    ctx, q, _, _ = paged_case([1] * len(DECODE_LENS), DECODE_LENS, q_heads, kv_heads, dtype)
    k_cache, v_cache = ctx.paged_blocks(0)
    out = kernels.paged_decode(
        q, k_cache, v_cache, ctx.block_table_tensor(), ctx.context_lens_tensor(),
        block_n=16, num_splits=splits,
    )  # fmt: skip
    expected = SdpaBackend.decode(q, 0, ctx, None)
    assert out.dtype == dtype and out.shape == q.shape
    assert_near(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(2, 2), (8, 2)])
def test_paged_prefill_matches_sdpa(
    kernels: ModuleType, q_heads: int, kv_heads: int, dtype: torch.dtype
) -> None:
    """A whole prompt, a chunk after a cached prefix longer than one query tile, decodes."""
    query_lens, context_lens = [7, 21, 1, 3, 1], [7, 26, 6, 11, 1]
    ctx, q, k, v = paged_case(query_lens, context_lens, q_heads, kv_heads, dtype, seed=1)
    expected = SdpaBackend().forward(q, k, v, 0, ctx)  # also stores the new K/V
    k_cache, v_cache = ctx.paged_blocks(0)
    out = kernels.paged_prefill(
        q, k_cache, v_cache, ctx.block_table_tensor(), ctx.cu_seqlens_q,
        ctx.context_lens_tensor(), ctx.max_query_len, block_m=16, block_n=16,
    )  # fmt: skip
    assert_near(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_write_slots(kernels: ModuleType, dtype: torch.dtype) -> None:
    """Rows land where PagedKVCache.write_slots puts them, cast to the cache's dtype, and
    nothing else changes; `rows` picks the rows to write (the context's write_rows)."""
    ctx, _, k, v = paged_case([3, 1, 2], [3, 6, 9], 4, 2, dtype, seed=2)
    cache = ctx.kv_cache
    assert isinstance(cache, PagedKVCache) and ctx.slot_mapping is not None
    twin = PagedKVCache(cache.spec, cache.num_blocks)
    k_cache, v_cache = ctx.paged_blocks(0)
    twin.k[0].copy_(k_cache)
    twin.v[0].copy_(v_cache)
    kernels.write_kv(k_cache, v_cache, k.float(), v.float(), ctx.slot_mapping)
    twin.write_slots(0, ctx.slot_mapping, k.float(), v.float())
    assert torch.equal(k_cache, twin.k[0]) and torch.equal(v_cache, twin.v[0])
    rows = torch.tensor([4, 0], device=DEVICE)
    slots = torch.tensor([1, 30], device=DEVICE)
    kernels.write_kv(k_cache, v_cache, k, -v, slots, rows)
    twin.write_slots(0, slots, k[rows], -v[rows])
    assert torch.equal(k_cache, twin.k[0]) and torch.equal(v_cache, twin.v[0])


def test_write_kv_reads_rows_past_two_to_the_31_elements(kernels: ModuleType) -> None:
    """Row 2 of k starts 2**31 + 128 elements in (as row ~200k of a wide qkv output does):
    its address needs int64, where int32 wraps to 2**31 elements before k. k lies 2**31
    elements into an 8 GiB allocation of which only the rows written are touched (an
    untouched page costs no memory), so a wrapped address reads zeros, not out of bounds."""
    heads, dim, rows = 2, 16, 3
    stride = (1 << 30) + 64
    pad = 1 << 31
    base = torch.empty(pad + (rows - 1) * stride + heads * dim, dtype=torch.float16, device=DEVICE)
    k = base.as_strided((rows, heads, dim), (stride, dim, 1), pad)
    for r in range(rows):
        k[r] = torch.arange(heads * dim, dtype=torch.float16, device=DEVICE).view(heads, dim) + r
    k_cache = torch.zeros(2, 4, heads, dim, dtype=torch.float32, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    kernels.write_kv(k_cache, v_cache, k, k, torch.tensor([5, 0, 2], device=DEVICE))
    flat = k_cache.flatten(0, 1)
    for r, slot in enumerate([5, 0, 2]):
        assert torch.equal(flat[slot], k[r].float()), f"row {r}"
    assert torch.equal(v_cache, k_cache)


def test_kernels_reject_a_head_count_that_is_not_a_multiple(kernels: ModuleType) -> None:
    ctx, q, _, _ = paged_case([1], [3], 3, 2, torch.float32)
    k_cache, v_cache = ctx.paged_blocks(0)
    with pytest.raises(ValueError, match="q_heads=3 is not a multiple of kv_heads=2"):
        kernels.paged_decode(
            q, k_cache, v_cache, ctx.block_table_tensor(), ctx.context_lens_tensor()
        )


@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [([1, 1, 1], [9, 2, 13]), ([5, 3, 1, 1], [5, 8, 4, 7]), ([4, 6], [4, 6])],
)
def test_triton_backend_matches_sdpa(
    kernels: ModuleType, query_lens: list[int], context_lens: list[int]
) -> None:
    """Decode, mixed and whole-prompt steps through the backend: output and the cache's
    contents equal sdpa's (which writes with index_copy_)."""
    ctx, q, k, v = paged_case(query_lens, context_lens, 4, 2, torch.float32, seed=3)
    twin, _, _, _ = paged_case(query_lens, context_lens, 4, 2, torch.float32, seed=3)
    out = create_attention_backend("triton").forward(q, k, v, 0, ctx)
    expected = SdpaBackend().forward(q, k, v, 0, twin)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert all(map(torch.equal, ctx.paged_blocks(0), twin.paged_blocks(0)))


def test_triton_backend_without_a_cache_goes_through_sdpa(kernels: ModuleType) -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(9, h, 16, generator=g).to(DEVICE) for h in (4, 2, 2))
    ctx = AttentionContext.build([4, 5], device=DEVICE)
    out = create_attention_backend("triton").forward(q, k, v, 0, ctx)
    torch.testing.assert_close(out, SdpaBackend().forward(q, k, v, 0, ctx))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_triton_backend_refuses_clearly_on_cpu_without_the_interpreter() -> None:
    """A fresh process without TRITON_INTERPRET: compiled kernels cannot take CPU tensors."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "from patrl.rollout.layers.attention.registry import create_attention_backend\n"
        "create_attention_backend('triton')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "the triton attention backend needs CUDA; use 'sdpa' on CPU" in done.stderr


def generate(
    model_dir: Path, backend: str, block_size: int, count: int, max_tokens: int
) -> list[list[int]]:
    """Greedy tokens in fp32 (an fp32 checkpoint's engine dtype on CUDA would be bf16, where
    two attention kernels' roundings flip near-tie tokens from the first one on)."""
    engine = Engine(
        EngineConfig(
            model=str(model_dir), attention_backend=backend, block_size=block_size,
            num_kv_blocks=4096 // block_size, max_model_len=256, device=DEVICE, dtype="float32",
        )
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (int(n),), generator=g).tolist() for n in (5, 11, 3)][:count]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]


def test_engine_generates_the_same_tokens_with_triton_as_with_sdpa(
    kernels: ModuleType, tmp_path: Path
) -> None:
    """Greedy decoding of a tiny random model: prefill, then decode steps across a block
    boundary (block_size 4), token for token the same as sdpa."""
    model_dir = save_hf_model(tiny_hf_model("llama", num_hidden_layers=1), tmp_path)
    ours = generate(model_dir, "triton", 4, 3, 6)
    assert ours == generate(model_dir, "sdpa", 4, 3, 6)


@pytest.mark.gpu
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(32, 8), (16, 16)])
def test_kernels_match_sdpa_at_realistic_shapes_on_cuda(
    kernels: ModuleType, q_heads: int, kv_heads: int
) -> None:
    """bf16, head_dim 128, 64 sequences with contexts up to a few thousand tokens, block 16."""
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 3000, (64,), generator=g).tolist()
    ctx, q, _, _ = paged_case(
        [1] * 64, lens, q_heads, kv_heads, torch.bfloat16, block_size=16, head_dim=128
    )
    k_cache, v_cache = ctx.paged_blocks(0)
    out = kernels.paged_decode(
        q, k_cache, v_cache, ctx.block_table_tensor(), ctx.context_lens_tensor()
    )
    torch.testing.assert_close(
        out.float(), SdpaBackend.decode(q, 0, ctx, None).float(), rtol=2e-2, atol=2e-2
    )
    query_lens = torch.randint(1, 300, (16,), generator=g).tolist()
    context_lens = [
        n + int(c)
        for n, c in zip(query_lens, torch.randint(0, 2000, (16,), generator=g), strict=True)
    ]
    ctx, q, k, v = paged_case(
        query_lens, context_lens, q_heads, kv_heads, torch.bfloat16, block_size=16, head_dim=128
    )
    expected = SdpaBackend().forward(q, k, v, 0, ctx)
    k_cache, v_cache = ctx.paged_blocks(0)
    out = kernels.paged_prefill(
        q, k_cache, v_cache, ctx.block_table_tensor(), ctx.cu_seqlens_q,
        ctx.context_lens_tensor(), ctx.max_query_len,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_split_decode_of_a_small_batch_matches_sdpa_on_cuda(kernels: ModuleType) -> None:
    """Two long contexts: split automatically (into several chunks on a many-SM GPU), the
    decode equals sdpa and the unsplit kernel."""
    ctx, q, _, _ = paged_case(
        [1, 1], [4000, 2500], 32, 8, torch.bfloat16, block_size=16, head_dim=128
    )
    k_cache, v_cache = ctx.paged_blocks(0)
    table, lens = ctx.block_table_tensor(), ctx.context_lens_tensor()
    out = kernels.paged_decode(q, k_cache, v_cache, table, lens)
    single = kernels.paged_decode(q, k_cache, v_cache, table, lens, num_splits=1)
    expected = SdpaBackend.decode(q, 0, ctx, None)
    assert_near(out, expected, torch.bfloat16)
    assert_near(single, expected, torch.bfloat16)


@pytest.mark.gpu
def test_engine_triton_twin_on_cuda(kernels: ModuleType, tmp_path: Path) -> None:
    """On a GPU: greedy tokens of the triton backend (default block size) equal sdpa's, in
    fp32 (the triton kernels' dot products are then exact fp32, "ieee", not tf32)."""
    model_dir = save_hf_model(tiny_hf_model("llama"), tmp_path)
    assert generate(model_dir, "triton", 16, 3, 40) == generate(model_dir, "sdpa", 16, 3, 40)
