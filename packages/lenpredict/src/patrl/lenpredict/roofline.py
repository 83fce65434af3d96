"""Calibrated step-latency profiles for GPU nodes no machine here can run (8xH100, 8xA100).

A decode step of a replica of `tp` ranks runs, per decoder layer, four GEMMs (qkv, o,
gate_up, down), the attention over the KV its ranks hold, a few elementwise kernels and two
all-reduces of the hidden states; then the LM head, and the engine's own per-step work. A GEMM
layer costs a smooth maximum of reading its weight shard and computing its tokens, plus a
kernel floor each GEMM pays however little it does; its compute efficiency falls as TP makes
the per-GPU GEMMs narrower and as fewer tokens go through them. That width term is what a plain
roofline leaves out: at TP 8 a large batch runs well below the peak a TP 1 replica reaches.

Every constant is either a datasheet figure or fitted to published measurements; its source
is in `SOURCES` (copied into a profile's notes) and in the table of benchmarks/README.md, and
`patrl.lenpredict.calibration` holds the cited measurements the model reproduces. Constants
with no measurement to fit are marked ASSUMPTION. Every number a profile from here yields is
SIMULATED.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from patrl.lenpredict.profile_schema import (
    DTYPE_BYTES,
    CollectiveRow,
    DecodeRow,
    Dtype,
    HardwareInfo,
    ModelInfo,
    PrefillRow,
    Profile,
    VerifyRow,
)


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU: datasheet figures and the kernel constants fitted to its measurements."""

    name: str
    memory_bytes: int
    peak_flops: float  # dense BF16 tensor FLOP/s
    hbm_bytes_per_s: float
    hbm_efficiency: float  # fraction of HBM bandwidth weight and KV reads reach
    kernel_floor_s: float  # what every GEMM / attention kernel costs however little it does
    gemm_efficiency: float  # fraction of peak a wide GEMM of many tokens reaches
    # the per-GPU GEMM width (parameters of one layer on one GPU) and token count at which
    # compute efficiency halves: eff = gemm_efficiency · w/(w + width_half) · m/(m + tokens_half)
    gemm_width_half: float
    gemm_tokens_half: float
    # t = (memory^s + compute^s)^(1/s): GEMMs leave the memory-bound regime gradually
    gemm_sharpness: float


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """The GPUs' interconnect: all-reduce time α(g) + bytes · 2(g−1)/g / busbw(g) for a group
    of g GPUs at decode message sizes (≤ a few MB), linear in g between the given sizes; and
    point-to-point copies for KV migration and weight gathers."""

    name: str
    allreduce_latency_s: tuple[tuple[int, float], ...]
    allreduce_bus_bytes_per_s: tuple[tuple[int, float], ...]
    p2p_latency_s: float
    p2p_bytes_per_s: float

    def _at(self, table: tuple[tuple[int, float], ...], group: int) -> float:
        sizes, values = zip(*table, strict=True)
        return float(np.interp(group, sizes, values))

    def allreduce(self, nbytes: float, group: int) -> float:
        if group == 1:
            return 0.0
        bus = nbytes * 2 * (group - 1) / group
        latency = self._at(self.allreduce_latency_s, group)
        return latency + bus / self._at(self.allreduce_bus_bytes_per_s, group)

    def all_gather(self, nbytes: float, group: int) -> float:
        """`nbytes`: the gathered result each rank holds."""
        if group == 1:
            return 0.0
        latency = self._at(self.allreduce_latency_s, group)
        return latency + nbytes * (group - 1) / group / self.p2p_bytes_per_s

    def p2p(self, nbytes: float) -> float:
        return self.p2p_latency_s + nbytes / self.p2p_bytes_per_s


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """The serving engine's own cost per decode step: fixed (scheduling, sampling, graph
    launch) and per running sequence (host-side bookkeeping not overlapped with the GPU), and
    the elementwise kernels of a layer (fused norms, activation) each paying the kernel floor."""

    name: str
    step_overhead_s: float
    per_seq_overhead_s: float
    layer_kernels: int


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    gpu: GpuSpec
    link: LinkSpec
    engine: EngineSpec
    num_devices: int


H100_SXM = GpuSpec(
    name="H100-SXM5-80GB",
    memory_bytes=80 * 10**9,
    peak_flops=989.4e12,
    hbm_bytes_per_s=3.35e12,
    hbm_efficiency=0.929,
    kernel_floor_s=5.49e-6,
    gemm_efficiency=0.814,
    gemm_width_half=9.56e6,
    gemm_tokens_half=13.6,
    gemm_sharpness=1.70,
)

A100_SXM = replace(
    H100_SXM,
    name="A100-SXM4-80GB",
    peak_flops=312e12,
    hbm_bytes_per_s=2.039e12,
    hbm_efficiency=0.860,
    kernel_floor_s=6.69e-6,
)

# 8 H100 on NVSwitch (NVLink 4). TP 2: CUDA-graph all-reduce measured; TP 8: eager NCCL
# measured (no graph-mode 8-GPU point found): an upper bound on what a graph-captured
# custom all-reduce costs there.
NVLINK4_8X = LinkSpec(
    name="NVLink4 + NVSwitch",
    allreduce_latency_s=((2, 5.98e-6), (8, 20.55e-6)),
    allreduce_bus_bytes_per_s=((2, 239e9), (8, 180e9)),
    p2p_latency_s=5.98e-6,
    p2p_bytes_per_s=370e9,
)

# 8 A100 on NVSwitch (NVLink 3), eager NCCL ring latencies
NVLINK3_8X = LinkSpec(
    name="NVLink3 + NVSwitch",
    allreduce_latency_s=((2, 10.0e-6), (4, 16.88e-6), (8, 33.7e-6)),
    allreduce_bus_bytes_per_s=((2, 112e9), (8, 112e9)),
    p2p_latency_s=10.0e-6,
    p2p_bytes_per_s=230e9,
)

# ASSUMPTION: an engine with CUDA graphs and a scheduler overlapped with the GPU (SGLang's,
# vLLM V1's): a small fixed cost a step, nothing per sequence
GRAPH_ENGINE = EngineSpec(
    name="CUDA-graph engine, overlapped scheduler (assumed)",
    step_overhead_s=1.0e-3,
    per_seq_overhead_s=0.0,
    layer_kernels=3,
)

# vLLM 0.7.2 (V0 engine), fitted to its benchmark_latency steps in vllm#16300 (it
# detokenises and schedules on the host between steps)
VLLM_V0_ENGINE = replace(
    GRAPH_ENGINE,
    name="vLLM 0.7.2 V0 (fitted)",
    step_overhead_s=4.30e-3,
    per_seq_overhead_s=0.162e-3,
)

H100_SXM_NODE = NodeSpec(
    name="8xH100-SXM5-80GB NVLink4 (calibrated roofline)",
    gpu=H100_SXM,
    link=NVLINK4_8X,
    engine=GRAPH_ENGINE,
    num_devices=8,
)

A100_SXM_NODE = NodeSpec(
    name="8xA100-SXM4-80GB NVLink3 (calibrated roofline)",
    gpu=A100_SXM,
    link=NVLINK3_8X,
    engine=VLLM_V0_ENGINE,
    num_devices=8,
)

_VIDUR = "microsoft/vidur data/profiling/compute/<gpu>/<model>/mlp.csv (see calibration.py)"

# Where each constant comes from; copied into a profile's notes and into benchmarks/README.md.
SOURCES = {
    "gpu.memory_bytes": "80 GB HBM: NVIDIA H100 SXM5 / A100 SXM4 80GB datasheets",
    "gpu.peak_flops": "dense BF16 tensor: 989.4 TFLOP/s (H100 SXM5), 312 TFLOP/s (A100): datasheets",
    "gpu.hbm_bytes_per_s": "3.35 TB/s (H100 SXM5), 2.039 TB/s (A100 80GB): datasheets",
    "gpu.hbm_efficiency": f"fitted: per-layer GEMM kernel times at 1-16 tokens, TP 1/2/4/8, {_VIDUR}",
    "gpu.kernel_floor_s": f"fitted: the same points (what TP 8's narrow GEMMs keep paying), {_VIDUR}",
    "gpu.gemm_efficiency": f"fitted: per-layer GEMM kernel times at 128-512 tokens, TP 1-8, {_VIDUR}",
    "gpu.gemm_width_half": f"fitted: the same points (TP 8's GEMMs run further below peak), {_VIDUR}",
    "gpu.gemm_tokens_half": f"fitted: the same points, {_VIDUR}",
    "gpu.gemm_sharpness": f"fitted: the same points (the bend between regimes), {_VIDUR}",
    "link.allreduce_latency_s": "H100 TP 2: 5.98 us, graph-captured all-reduce (one-shot in "
    "flagos-ai/FlagGems-vllm#773, NVLS in NVIDIA/nccl#1259); H100 TP 8: 20.55 us eager "
    "NCCL, 8xH100 (ByteDance-Seed/Triton-distributed#57); A100 2/4/8: 10/16.9/33.7 us eager "
    "ring (NVIDIA/nccl-tests#123); TP 4 on H100: ASSUMPTION, linear between 2 and 8",
    "link.allreduce_bus_bytes_per_s": "H100 TP 2: 239 GB/s (128 B -> 1.7 MB, nccl#1259 and "
    "FlagGems-vllm#773); TP 8: 180 GB/s (128 B -> 4 MB, Triton-distributed#57); A100: "
    "112 GB/s (4 MB, 8 GPUs, microsoft/vidur data/profiling/network/a100_dgx/all_reduce.csv)",
    "link.p2p_bytes_per_s": "~370 GB/s effective NVLink4 per direction (NVIDIA/nccl-tests#212); "
    "A100: ASSUMPTION 230 GB/s",
    "link.p2p_latency_s": "ASSUMPTION: the 2-GPU all-reduce latency",
    "engine.step_overhead_s": "H100 node: ASSUMPTION 1 ms (CUDA graphs, overlapped scheduler); "
    "A100 node: 4.30 ms fitted to vLLM 0.7.2 steps at TP 2/4/8, batch 1/16/128 (vllm-project/vllm#16300)",
    "engine.per_seq_overhead_s": "H100 node: ASSUMPTION 0; A100 node: 0.162 ms fitted to the "
    "same vLLM 0.7.2 steps (vllm#16300)",
    "engine.layer_kernels": "ASSUMPTION: 3 elementwise kernels a layer (2 fused add+norm, "
    "1 activation; rope inside attention)",
}


def count_params(
    *,
    num_layers: int,
    hidden_size: int,
    intermediate_size: int,
    num_attention_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    tied_embeddings: bool,
    qk_norm: bool,
) -> int:
    """Parameters of a Llama/Qwen decoder (no biases), from its config."""
    attn = hidden_size * head_dim * (2 * num_attention_heads + 2 * num_kv_heads)
    mlp = 3 * hidden_size * intermediate_size
    norms = 2 * hidden_size + (2 * head_dim if qk_norm else 0)
    embed = vocab_size * hidden_size * (1 if tied_embeddings else 2)
    return num_layers * (attn + mlp + norms) + embed + hidden_size


def decoder_info(name: str, *, tied_embeddings: bool, qk_norm: bool, **shape: int) -> ModelInfo:
    """A ModelInfo whose parameter count is derived from the same shape it records."""
    return ModelInfo(
        name=name,
        num_params=count_params(tied_embeddings=tied_embeddings, qk_norm=qk_norm, **shape),
        **shape,
    )


# config.json of meta-llama/Llama-3.1-8B
LLAMA31_8B = decoder_info(
    "Llama-3.1-8B",
    num_layers=32,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=128256,
    tied_embeddings=False,
    qk_norm=False,
)

# config.json of Qwen/Qwen3-14B (untied embeddings, q/k RMSNorm)
QWEN3_14B = decoder_info(
    "Qwen3-14B",
    num_layers=40,
    hidden_size=5120,
    intermediate_size=17408,
    num_attention_heads=40,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=151936,
    tied_embeddings=False,
    qk_norm=True,
)


def layer_params(model: ModelInfo) -> int:
    """GEMM parameters of one decoder layer (attention projections and MLP)."""
    attn = (
        model.hidden_size
        * model.head_dim
        * (2 * model.num_attention_heads + 2 * model.num_kv_heads)
    )
    return attn + 3 * model.hidden_size * model.intermediate_size


@dataclass(frozen=True, slots=True)
class StepModel:
    """The calibrated latency of one replica's steps: `node` runs `model` in `dtype`."""

    node: NodeSpec
    model: ModelInfo
    dtype: str

    @property
    def elem(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def gemm(self, params: float, tp: int, tokens: float) -> float:
        """One GEMM layer of `params` weights cut over `tp` ranks, `tokens` rows through it."""
        g = self.node.gpu
        width = params / tp
        memory = width * self.elem / (g.hbm_bytes_per_s * g.hbm_efficiency)
        efficiency = (
            g.gemm_efficiency
            * width / (width + g.gemm_width_half)
            * tokens / (tokens + g.gemm_tokens_half)
        )  # fmt: skip
        compute = 2 * width * tokens / (g.peak_flops * efficiency)
        s = g.gemm_sharpness
        return float((memory**s + compute**s) ** (1 / s))

    def layer_linear(self, tp: int, tokens: float) -> float:
        """A decoder layer's four GEMMs, each paying the kernel floor."""
        return self.gemm(layer_params(self.model), tp, tokens) + 4 * self.node.gpu.kernel_floor_s

    def kv_read(self, tp: int, context_tokens: float) -> float:
        """One layer's attention over `context_tokens` on one rank: its share of the KV heads
        (replicated past num_kv_heads ranks), streamed from HBM."""
        m, g = self.model, self.node.gpu
        per_token = 2 * m.head_dim * m.kv_heads_per_rank(tp) * self.elem
        return (
            context_tokens * per_token / (g.hbm_bytes_per_s * g.hbm_efficiency) + g.kernel_floor_s
        )

    def lm_head(self, tp: int, tokens: float) -> float:
        m = self.model
        gather = self.node.link.all_gather(tokens * m.vocab_size * 4, tp)  # fp32 logits
        return self.gemm(m.vocab_size * m.hidden_size, tp, tokens) + gather

    def decode_step(self, tp: int, batch: int, context_tokens: float) -> float:
        m, n = self.model, self.node
        hidden = batch * m.hidden_size * self.elem
        layer = (
            self.layer_linear(tp, batch)
            + self.kv_read(tp, context_tokens)
            + n.engine.layer_kernels * n.gpu.kernel_floor_s
            + 2 * n.link.allreduce(hidden, tp)
        )
        engine = n.engine.step_overhead_s + n.engine.per_seq_overhead_s * batch
        return m.num_layers * layer + self.lm_head(tp, batch) + engine

    def verify_step(self, tp: int, batch: int, query_len: int, context_tokens: float) -> float:
        """A speculative verify step: `batch` sequences of `query_len` query tokens each
        through the GEMMs, the LM head and the all-reduces (batch · query_len rows), each
        sequence's KV read once (ASSUMPTION: a multi-query decode kernel reads a sequence's
        blocks once for all its queries) and the engine's per-sequence work as in decode
        (ASSUMPTION: acceptance is vectorised over a sequence's tokens)."""
        m, n = self.model, self.node
        rows = batch * query_len
        hidden = rows * m.hidden_size * self.elem
        layer = (
            self.layer_linear(tp, rows)
            + self.kv_read(tp, context_tokens)
            + n.engine.layer_kernels * n.gpu.kernel_floor_s
            + 2 * n.link.allreduce(hidden, tp)
        )
        engine = n.engine.step_overhead_s + n.engine.per_seq_overhead_s * batch
        return m.num_layers * layer + self.lm_head(tp, rows) + engine

    def prefill(self, tp: int, tokens: int) -> float:
        """One sequence of `tokens` prompt tokens: GEMMs over all of them, causal attention
        (computed at the wide-GEMM efficiency), the LM head of the last one."""
        m, n = self.model, self.node
        attn_flops = 2 * m.num_attention_heads * m.head_dim * tokens * tokens / tp
        attn = attn_flops / (n.gpu.peak_flops * n.gpu.gemm_efficiency) + n.gpu.kernel_floor_s
        hidden = tokens * m.hidden_size * self.elem
        layer = (
            self.layer_linear(tp, tokens)
            + attn
            + n.engine.layer_kernels * n.gpu.kernel_floor_s
            + 2 * n.link.allreduce(hidden, tp)
        )
        return m.num_layers * layer + self.lm_head(tp, 1) + n.engine.step_overhead_s

    def collective(self, op: str, nbytes: int, group: int) -> float:
        if op == "all_reduce":
            return self.node.link.allreduce(nbytes, group)
        if op == "all_gather":
            return self.node.link.all_gather(nbytes, group)
        return self.node.link.p2p(nbytes)  # broadcast and send: one copy over one link


DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
CONTEXTS_PER_SEQ = (256, 1024, 4096, 8192, 16384, 32768)


def roofline_profile(
    model: ModelInfo,
    node: NodeSpec = H100_SXM_NODE,
    dtype: Dtype = "bfloat16",
    tp_sizes: tuple[int, ...] = (1, 2, 4, 8),
    memory_utilization: float = 0.9,
    query_lens: tuple[int, ...] = (),
) -> Profile:
    """A profile on the grid a measured one would cover: batch 1..4096 sequences of 256..32768
    tokens each, rows that would not fit in the replica's KV memory left out. `query_lens`
    (each > 1): verify rows too, at batches up to 64 (`StepModel.verify_step`), which price
    a speculating tail (patrl.lenpredict.speculation); () keeps the profile as it was."""
    step = StepModel(node=node, model=model, dtype=dtype)
    decode, prefill, verify = [], [], []
    for tp in tp_sizes:
        weights = model.weight_bytes(dtype) / tp
        per_token = (
            model.kv_bytes_per_token(dtype) * model.kv_heads_per_rank(tp) / model.num_kv_heads
        )
        capacity = (node.gpu.memory_bytes * memory_utilization - weights) / per_token
        for batch in DECODE_BATCHES:
            for per_seq in CONTEXTS_PER_SEQ:
                context = batch * per_seq
                if context > capacity:
                    continue
                seconds = step.decode_step(tp, batch, context)
                decode.append(
                    DecodeRow(tp=tp, batch=batch, context_tokens=context, seconds=seconds)
                )
                for q in query_lens if batch <= 64 else ():
                    verify.append(
                        VerifyRow(
                            tp=tp,
                            batch=batch,
                            query_len=q,
                            context_tokens=context,
                            seconds=step.verify_step(tp, batch, q, context),
                        )
                    )
        for tokens in (128, 512, 1024, 2048, 4096, 8192, 16384):
            prefill.append(PrefillRow(tp=tp, tokens=tokens, seconds=step.prefill(tp, tokens)))
    collectives = []
    for op in ("all_reduce", "all_gather", "broadcast", "send"):
        for group in (2, 4, 8):
            for nbytes in np.logspace(12, 30, 10, base=2).astype(int).tolist():
                seconds = step.collective(op, nbytes, group)
                collectives.append(
                    CollectiveRow(op=op, nbytes=nbytes, group_size=group, seconds=seconds)
                )
    notes = {f"gpu.{k}": str(getattr(node.gpu, k)) for k in GpuSpec.__dataclass_fields__}
    notes |= {f"link.{k}": str(getattr(node.link, k)) for k in LinkSpec.__dataclass_fields__}
    notes |= {f"engine.{k}": str(getattr(node.engine, k)) for k in EngineSpec.__dataclass_fields__}
    notes |= {f"source.{key}": text for key, text in SOURCES.items()}
    notes["label"] = "SIMULATED: calibrated roofline model, not a measurement"
    return Profile(
        source="roofline",
        hardware=HardwareInfo(
            name=node.name,
            device=node.gpu.name,
            num_devices=node.num_devices,
            memory_bytes_per_device=node.gpu.memory_bytes,
            interconnect=node.link.name,
        ),
        model=model,
        dtype=dtype,
        decode=decode,
        prefill=prefill,
        verify=verify,
        collectives=collectives,
        notes=notes,
    )
