# mypy: disable-error-code="no-untyped-def"
"""Triton kernels over the paged KV cache: KV write, paged decode, paged prefill (varlen).

The cache is per layer `[num_blocks, block_size, kv_heads, head_dim]`; a context position p of
sequence i lives at block `block_table[i, p // block_size]`, offset `p % block_size`. The
kernels address keys token by token through the block table, so any block size works. Softmax
is online (flash-attention style) in fp32, scale 1 / sqrt(head_dim), causal aligned to the lower
right. Under `TRITON_INTERPRET=1` (set before triton is imported) they run on CPU tensors,
which is how CI tests them against `sdpa`. See docs/attention.md.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)
"""Whether this module's kernels were decorated for the interpreter (CPU tensors) or for GPUs."""

_LOG2E = 1.4426950408889634


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, slots_ptr, rows_ptr, k_cache, v_cache,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    BLOCK_SIZE: tl.constexpr, HEADS: tl.constexpr, DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, HAS_ROWS: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    # int64: row x stride passes 2**31 elements at ~200k tokens of a wide qkv row
    row = (tl.load(rows_ptr + i) if HAS_ROWS else i).to(tl.int64)
    slot = tl.load(slots_ptr + i)
    heads, dims = tl.arange(0, HEADS_PAD), tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < HEADS) & (dims[None, :] < DIM)
    src_k = k_ptr + row * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = v_ptr + row * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co
    dst += heads[:, None] * stride_ch + dims[None, :]
    tl.store(k_cache + dst, tl.load(src_k, mask=mask).to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + dst, tl.load(src_v, mask=mask).to(v_cache.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, k_cache, v_cache, table_row, kv_head, start, end, q_pos,
    stride_cb, stride_co, stride_ch, qk_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr,
):  # fmt: skip
    """Fold context positions [start, start + BLOCK_N) (those < end) into the running
    (acc, m_i, l_i) of queries q [M, DIM_PAD]; causal: key p is seen by query rows with
    q_pos >= p."""
    offs_n = start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, DIM_PAD)
    n_mask = offs_n < end
    block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
    slot = block.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_co
    addr = slot[:, None] + kv_head * stride_ch + dims[None, :]
    kv_mask = n_mask[:, None] & (dims[None, :] < DIM)
    k = tl.load(k_cache + addr, mask=kv_mask, other=0.0).to(COMPUTE)
    v = tl.load(v_cache + addr, mask=kv_mask, other=0.0).to(COMPUTE)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    visible = n_mask[None, :]
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= q_pos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _paged_decode_kernel(
    q_ptr, out_ptr, part_ptr, k_cache, v_cache, table_ptr, lens_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    stride_cb, stride_co, stride_ch, qk_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, kv head, split): its GROUP query heads against split's share
    of the context (one of SPLITS equal chunks). One split writes the output; several write
    each head's (acc, max, sum) to part_ptr [B, q_heads, SPLITS, DIM_PAD + 2] for the reduce."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx_len = tl.load(lens_ptr + seq)
    rows, dims = tl.arange(0, GROUP_PAD), tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + rows
    mask = (rows[:, None] < GROUP) & (dims[None, :] < DIM)
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=mask, other=0.0
    )
    q = q.to(COMPUTE)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * stride_table
    chunk = tl.cdiv(tl.cdiv(ctx_len, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, ctx_len)
    for start in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache, v_cache, table_row, kv_head, start, hi, rows,
            stride_cb, stride_co, stride_ch, qk_scale,
            BLOCK_SIZE, BLOCK_N, DIM, DIM_PAD, COMPUTE, PRECISION, False,
        )  # fmt: skip
    if SPLITS == 1:
        out = acc / l_i[:, None]
        dst = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        width = DIM_PAD + 2
        part = part_ptr + ((seq * GROUP * tl.num_programs(1) + heads) * SPLITS + split) * width
        tl.store(part[:, None] + dims[None, :], acc, mask=rows[:, None] < GROUP)
        tl.store(part + DIM_PAD, m_i, mask=rows < GROUP)
        tl.store(part + DIM_PAD + 1, l_i, mask=rows < GROUP)


@triton.jit
def _reduce_splits_kernel(
    part_ptr, out_ptr, stride_ot, stride_oh,
    SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, query head): merge its SPLITS partial softmaxes. Split 0
    always saw a token, so the overall max is finite; an empty split has max -inf, weight 0."""
    seq, head = tl.program_id(0), tl.program_id(1)
    splits, dims = tl.arange(0, SPLITS_PAD), tl.arange(0, DIM_PAD)
    width = DIM_PAD + 2
    part = part_ptr + ((seq * tl.num_programs(1) + head) * SPLITS + splits) * width
    valid = splits < SPLITS
    m = tl.load(part + DIM_PAD, mask=valid, other=float("-inf"))
    l = tl.load(part + DIM_PAD + 1, mask=valid, other=0.0)  # noqa: E741
    acc = tl.load(part[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
    weight = tl.exp2(m - tl.max(m, 0))
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
    dst = out_ptr + seq * stride_ot + head * stride_oh + dims
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dims < DIM)


@triton.jit
def _paged_prefill_kernel(
    q_ptr, out_ptr, k_cache, v_cache, table_ptr, lens_ptr, cu_q_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    stride_cb, stride_co, stride_ch, qk_scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (tile of BLOCK_M queries, sequence, query head): the tile's queries
    against the context up to the tile's last query, causal aligned to the lower right."""
    tile, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        ctx_len = tl.load(lens_ptr + seq)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, DIM_PAD)
        mask = (offs_m[:, None] < q_len) & (dims[None, :] < DIM)
        tokens = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
            mask=mask,
            other=0.0,
        )
        q = q.to(COMPUTE)
        q_pos = ctx_len - q_len + offs_m
        end = tl.minimum(ctx_len, ctx_len - q_len + (tile + 1) * BLOCK_M)
        acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        table_row = table_ptr + seq.to(tl.int64) * stride_table
        for start in range(0, end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, k_cache, v_cache, table_row, head // GROUP, start, end, q_pos,
                stride_cb, stride_co, stride_ch, qk_scale,
                BLOCK_SIZE, BLOCK_N, DIM, DIM_PAD, COMPUTE, PRECISION, True,
            )  # fmt: skip
        out = acc / l_i[:, None]
        dst = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> None:
    """Store rows `rows` (None = all) of k, v [T, kv_heads, D] at flat `slots` [n] of the block
    tensors [num_blocks, block_size, kv_heads, D], cast to the cache's dtype. Unchecked: every
    slot must lie in [0, num_blocks * block_size) (checked on the host when it was built)."""
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _check_cache(k_cache, v_cache, k.shape[1], k.shape[2])
    n = slots.shape[0] if rows is None else rows.shape[0]
    if n == 0:
        return
    heads, dim = k.shape[1], k.shape[2]
    _write_kv_kernel[(n,)](
        k, v, slots, slots if rows is None else rows, k_cache, v_cache,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3],
        BLOCK_SIZE=k_cache.shape[1], HEADS=heads, DIM=dim,
        HEADS_PAD=triton.next_power_of_2(heads), DIM_PAD=_dim_pad(dim), HAS_ROWS=rows is not None,
    )  # fmt: skip


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    block_n: int = 64,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One query per sequence, q [B, q_heads, D], against its first `context_lens[i]` cached
    tokens read through `block_table` [B, max_blocks] (tail entries past the context are never
    read) -> [B, q_heads, D] in q's dtype. q_heads must be a multiple of kv_heads.

    `num_splits` (None = enough programs to fill the GPU, from the batch alone) cuts each
    context into that many chunks attended in parallel, then merged (flash-decoding): a small
    batch of long contexts would otherwise leave most of the GPU idle. The grid never depends
    on a context length, so the launch can be captured in a CUDA graph."""
    q = _last_dim_contiguous(q)
    batch, q_heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = _group(q_heads, kv_heads)
    _check_cache(k_cache, v_cache, kv_heads, dim)
    splits = num_splits or _auto_splits(q.device, batch * kv_heads)
    out = torch.empty_like(q)
    part = out
    if splits > 1:
        part = torch.empty(batch, q_heads, splits, _dim_pad(dim) + 2, device=q.device)
    compute, precision = _compute_dtype(k_cache.dtype)
    _paged_decode_kernel[(batch, kv_heads, splits)](
        q, out, part, k_cache, v_cache, block_table, context_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        *k_cache.stride()[:3], _LOG2E / math.sqrt(dim),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), SPLITS=splits,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n, DIM=dim, DIM_PAD=_dim_pad(dim),
        COMPUTE=compute, PRECISION=precision,
    )  # fmt: skip
    if splits > 1:
        _reduce_splits_kernel[(batch, q_heads)](
            part, out, out.stride(0), out.stride(1),
            SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), DIM=dim,
            DIM_PAD=_dim_pad(dim),
        )  # fmt: skip
    return out


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Varlen queries q [T, q_heads, D] (sequence i: rows cu_seqlens_q[i] .. [i + 1]) against
    their paged contexts, their own K/V already stored: query j of Q new tokens in a context
    of L sees positions 0 .. L - Q + j. `max_query_len` (a host int) sizes the grid."""
    q = _last_dim_contiguous(q)
    _, q_heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = _group(q_heads, kv_heads)
    _check_cache(k_cache, v_cache, kv_heads, dim)
    out = torch.empty_like(q)
    compute, precision = _compute_dtype(k_cache.dtype)
    block_m = max(16, min(block_m, triton.next_power_of_2(max_query_len)))
    grid = (triton.cdiv(max_query_len, block_m), block_table.shape[0], q_heads)
    _paged_prefill_kernel[grid](
        q, out, k_cache, v_cache, block_table, context_lens, cu_seqlens_q,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        *k_cache.stride()[:3], _LOG2E / math.sqrt(dim),
        GROUP=group, BLOCK_M=block_m,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n, DIM=dim, DIM_PAD=_dim_pad(dim),
        COMPUTE=compute, PRECISION=precision,
    )  # fmt: skip
    return out


def _compute_dtype(cache_dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """The dtype the dot products take, and their precision: the cache's half type on a GPU
    (tensor cores, fp32 accumulation), fp32 exactly ("ieee", not tf32) for an fp32 cache, and
    fp32 for bf16 under the interpreter, whose numpy matmul has no bf16."""
    if cache_dtype == torch.float16:
        return tl.float16, "tf32"
    if cache_dtype == torch.bfloat16 and not INTERPRETED:
        return tl.bfloat16, "tf32"
    if cache_dtype in (torch.bfloat16, torch.float32):
        return tl.float32, "ieee"
    raise ValueError(f"KV cache dtype {cache_dtype} is not supported; use float32/bfloat16/float16")


def _auto_splits(device: torch.device, programs: int) -> int:
    """Splits per context so that about two programs run per streaming multiprocessor, at
    most 16; 1 off CUDA (the interpreter gains nothing from them)."""
    if device.type != "cuda":
        return 1
    sms = _multiprocessors(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    return max(1, min(16, -(-2 * sms // programs)))


@functools.cache
def _multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _group(q_heads: int, kv_heads: int) -> int:
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    return q_heads // kv_heads


def _dim_pad(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, dim: int) -> None:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in "
            "shape or layout"
        )
    if k_cache.dim() != 4 or tuple(k_cache.shape[2:]) != (heads, dim) or k_cache.stride(3) != 1:
        raise ValueError(
            f"cache blocks {tuple(k_cache.shape)} (strides {k_cache.stride()}) must be "
            f"[num_blocks, block_size, {heads}, {dim}] with a contiguous last dimension"
        )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
