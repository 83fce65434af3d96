"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with new inputs.

At small batches (the long tail adaptive TP exists for) a decode step is bound by kernel
launches, not by memory traffic; a graph replays the whole forward with one launch. As in vLLM
and nano-vllm, graphs exist for a fixed list of batch sizes; a batch of n decodes runs in the
smallest bucket >= n, its inputs copied into the bucket's static buffers. The inputs are built
on the host already padded to the bucket (`inputs`) and moved with the step's other indices in
one copy (patrl.rollout.staging); the static buffers then take two device copies: the token
ids, positions, slots, cumulative and plain context lengths as one byte range (the `header`,
laid out per bucket exactly as staged), and the block tables. The padding rows repeat row 0
(same token, position, slot, context and blocks): they write the same K/V to the same slot and
their outputs are dropped, so no scratch block is needed. A static block-table row holds the
real blocks first; the entries past them may be stale block ids of an earlier step, always
valid ids (< the cache's blocks, which the graphs' lifetime fixes), read by no backend past a
row's context (sdpa gathers and masks them). A graph is captured lazily, the
first time its bucket is used, with that real batch (writes are idempotent, so the warm-up run
and the replay agree), and every graph is dropped when the weights' or the KV cache's storage
moves (a reconfigure, a rebuild, a sleep): the graphs read those addresses. A bucket's step
copies the model's output into one static output buffer; the CPU twin (`EagerRuntime`) runs
that same step where CUDA would capture and replay it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from patrl.kvstore import KVCacheSpec, PagedKVCache
from patrl.rollout.layers.attention.context import AttentionContext, HostBatch, table_array
from patrl.rollout.models.causal_lm import CausalLM
from patrl.rollout.staging import ALIGN, Array, Staged, layout, views

SDPA_GATHER_BYTES = 1 << 30
"""The most K and V bytes one layer of a captured `sdpa` decode may gather. A graph's block
table is `max_model_len` wide, and sdpa gathers every row's whole table (the kernels of the
other backends read only each row's context): at 32k tokens x 256 rows that is ~17 GiB per K
and per V, at capture and at every replay."""


def check_graph_gather(backend: str, max_batch: int, max_model_len: int, spec: KVCacheSpec) -> None:
    """Raise ValueError when `backend` is sdpa and a captured decode of `max_batch` rows would
    gather more than SDPA_GATHER_BYTES of one layer's K and V (`max_model_len` tokens a row),
    naming the numbers and what to change."""
    if backend != "sdpa":
        return
    tokens = -(-max_model_len // spec.block_size) * spec.block_size
    gathered = max_batch * tokens * spec.bytes_per_token // spec.num_layers  # K and V
    if gathered <= SDPA_GATHER_BYTES:
        return
    raise ValueError(
        f"attention_backend='sdpa' with CUDA graphs gathers max_model_len={max_model_len} "
        f"tokens of K and V for each of {max_batch} captured rows: {gathered / (1 << 30):.1f} "
        f"GiB a layer, over the {SDPA_GATHER_BYTES / (1 << 30):.0f} GiB limit. Use "
        "attention_backend='triton' or 'auto' (they read each row's own context), set "
        "enforce_eager=True, or lower max_model_len or max_num_seqs"
    )


def header_specs(bucket: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The static inputs of `bucket` a step rewrites, in staging order: token ids, positions,
    slots [bucket] int64, cu_seqlens_k [bucket + 1] int32, context lengths [bucket] int32."""
    rows = (bucket,)
    return [
        (rows, torch.int64),
        (rows, torch.int64),
        (rows, torch.int64),
        ((bucket + 1,), torch.int32),
        (rows, torch.int32),
    ]


def batch_buckets(max_batch: int) -> list[int]:
    """The captured batch sizes for batches of at most `max_batch`: 1, 2, 4, then steps of 8
    (vLLM's list), and `max_batch` itself as the last bucket."""
    sizes = [n for n in (1, 2, 4) if n < max_batch] + list(range(8, max_batch, 8))
    return [*sizes, max_batch]


class CudaRuntime:
    """The CUDA calls behind a decode graph: a warm-up run on a side stream, a capture into a
    graph that shares one memory pool with the other buckets, and a replay; all on `device`
    (made the current device meanwhile: streams and captures belong to the current device,
    and the engine's need not be the process's)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device("cuda" if device is None else device)
        self.pool: Any = None  # a CUDA graph memory pool handle shared by the buckets

    def warm_up(self, step: Callable[[], None]) -> None:
        """Run `step` once, off the graph: it also initialises lazy state (cuBLAS handles,
        NCCL communicators) that a capture must not record."""
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step()
            torch.cuda.current_stream().wait_stream(stream)

    def capture(self, step: Callable[[], None]) -> Any:
        """A graph of `step`'s kernels; `step` itself does not run."""
        with torch.cuda.device(self.device):
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                step()
        return graph

    def replay(self, graph: Any) -> None:
        graph.replay()

    def reset(self) -> None:
        self.pool = None


class EagerRuntime:
    """The CPU twin of CudaRuntime: the same calls in the same order, a "graph" being the step
    itself, run again at each replay."""

    def warm_up(self, step: Callable[[], None]) -> None:
        step()

    def capture(self, step: Callable[[], None]) -> Any:
        return step

    def replay(self, graph: Any) -> None:
        graph()

    def reset(self) -> None:
        pass


class DecodeGraphs:
    """Decode forwards of `model` over `cache` through per-bucket graphs (`capture=True`, CUDA)
    or their CPU twin (`capture=False`). Both take the same tensor path: the batch is copied
    into static input buffers, a bucket's step writes its hidden states into a static output
    buffer, a warm-up run and a capture precede the replays. They differ only in the runtime
    (CudaRuntime or EagerRuntime), so a CPU test runs everything a capture does but the CUDA
    calls. `forward` returns the real rows' hidden states, a view valid until the next call."""

    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        max_batch: int,
        max_model_len: int,
        *,
        capture: bool,
    ) -> None:
        self.model, self.cache, self.capture = model, cache, capture
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = -(-max_model_len // cache.spec.block_size)
        device = cache.spec.device
        n = self.buckets[-1]
        # every bucket's header in one buffer, at its own offsets (one bucket runs at a time)
        size = -(-layout(header_specs(n))[1] // ALIGN) * ALIGN  # `views` takes whole units
        self.header = torch.zeros(size, dtype=torch.uint8, device=device)
        self.block_table = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.out: torch.Tensor | None = None  # [max bucket, hidden], made by the first step
        self.graphs: dict[int, Any] = {}  # bucket -> what runtime.capture returned
        self.runtime: CudaRuntime | EagerRuntime = (
            CudaRuntime(device) if capture else EagerRuntime()
        )
        # the parameters, listed once: walking the modules each step costs more host time
        # than the rest of a step's bookkeeping (a model's parameters are made at load; their
        # storage moves by `.data`, which the signature sees)
        self.params = list(model.parameters())
        self.signature = self._storage_signature()

    def can_run(self, host: HostBatch) -> bool:
        """Whether `host` is a batch the graphs take: every sequence decodes one token, every
        token is stored, and it fits the largest bucket and the block-table width."""
        return (
            host.kv_cache is self.cache
            and host.max_query_len == 1
            and host.write_rows is None
            and host.num_seqs <= self.buckets[-1]
            and host.table_width() <= self.max_blocks
        )

    def bucket(self, n: int) -> int:
        """The smallest bucket of at least `n` rows."""
        return next(b for b in self.buckets if b >= n)

    def inputs(self, host: HostBatch, input_ids: list[int]) -> list[Array]:
        """What a step of `host` (`can_run`) stages first, padded on the host to its bucket
        (rows n .. bucket repeat row 0): the header of `header_specs`, then the block tables
        [bucket, width] int32 (width: the longest table of the batch)."""
        assert host.slots is not None and host.block_tables is not None  # can_run
        bucket = self.bucket(host.num_seqs)
        pad = bucket - host.num_seqs

        def padded(values: list[int]) -> list[int]:
            return values + values[:1] * pad

        lens = padded(host.context_lens)
        return [
            Array(padded(input_ids), torch.int64),
            Array(padded([c - 1 for c in host.context_lens]), torch.int64),
            Array(padded(host.slots), torch.int64),
            Array([0, *itertools.accumulate(lens)], torch.int32),
            Array(lens, torch.int32),
            table_array(host.block_tables, (bucket, host.table_width())),
        ]

    def forward(self, staged: Staged, n: int) -> torch.Tensor:
        """Hidden states [n, hidden] of a batch of n decodes whose `inputs` were staged first
        in `staged`: two device copies into the static buffers, then the bucket's graph."""
        if self._storage_signature() != self.signature:
            self.reset()
        bucket = self.bucket(n)
        specs = header_specs(bucket)
        header = layout(specs)[1]
        self.header[:header].copy_(staged.buffer[:header])
        table = staged.tensors[len(specs)]
        self.block_table[:bucket, : table.shape[1]].copy_(table)
        graph = self.graphs.get(bucket)
        if graph is None:
            self.graphs[bucket] = self._capture(bucket)
        else:
            self.runtime.replay(graph)
        assert self.out is not None  # made by the first capture
        return self.out[:n]

    def reset(self) -> None:
        """Drop every graph (and its memory pool); the next use of a bucket captures anew."""
        self.graphs.clear()
        self.runtime.reset()
        self.out = None
        self.params = list(self.model.parameters())
        self.signature = self._storage_signature()

    def _context(self, bucket: int) -> tuple[torch.Tensor, AttentionContext]:
        """The token ids of `bucket` and a fresh attention context over its static buffers.
        Its host-side lists are placeholders of the right length (contexts at their upper
        bound): a decode layer reads only the device tensors. Fresh views each time, since
        per-forward caches (the rotary cos/sin) are keyed on the positions tensor's identity."""
        longest = self.max_blocks * self.cache.spec.block_size
        ids, positions, slots, cu_k, lens = views(self.header, header_specs(bucket))
        ctx = AttentionContext(
            query_lens=[1] * bucket,
            context_lens=[longest] * bucket,
            positions=positions,
            cu_seqlens_q=self.cu_seqlens_q[: bucket + 1],
            cu_seqlens_k=cu_k,
            slot_mapping=slots,
            block_tables=[[0]] * bucket,
            kv_cache=self.cache,
            _block_table_tensor=self.block_table[:bucket],
            _context_lens_tensor=lens,
        )
        return ids, ctx

    def _capture(self, bucket: int) -> Any:
        """Warm `bucket`'s step up (the real batch: its output is this step's) and capture it
        for the next steps. The step copies the model's output into `out`, a buffer made
        outside inference mode: the model's own output is an inference tensor that nothing
        outside inference mode may write to."""
        if self.out is None:  # on the current stream, outside any graph pool
            weight = self.model.lm_head.weight
            shape = (self.buckets[-1], self.model.config.hidden_size)
            self.out = torch.empty(shape, dtype=weight.dtype, device=weight.device)
        out = self.out[:bucket]

        def step() -> None:
            out.copy_(self.model(*self._context(bucket)))

        self.runtime.warm_up(step)
        return self.runtime.capture(step)

    def _storage_signature(self) -> tuple[int, ...]:
        """Addresses a captured graph reads: every parameter's (of `params`) and every KV
        block tensor's."""
        return (
            *(p.data_ptr() for p in self.params),
            *(t.data_ptr() for t in (*self.cache.k, *self.cache.v)),
        )
