"""Roofline latency profiles for GPU nodes no machine here can run (8×H100 NVLink).

A decode step on one TP rank costs max(memory time, compute time) + its collectives + a host
overhead, where memory time reads the rank's weight shard and its share of the KV cache. Every
constant carries its source; the ones marked ASSUMPTION are engineering guesses stated so a
reader can change them. The output is a `Profile` with source="roofline", fitted like a
measured one, and every number derived from it is SIMULATED.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

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
)


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    device: str
    num_devices: int
    # 80 GB HBM3 per H100 SXM5 (NVIDIA H100 datasheet; glennklockwood.com/garden/processors/h100)
    memory_bytes: int
    # 989.4 TFLOP/s dense BF16 tensor (same sources)
    peak_flops: float
    # 3.35 TB/s HBM3 (same sources)
    hbm_bytes_per_s: float
    # ASSUMPTION: decode GEMV/GEMM kernels reach 80% of HBM bandwidth
    hbm_efficiency: float
    # ASSUMPTION: 50% of peak for small-M decode GEMMs, 60% for prefill
    decode_mfu: float
    prefill_mfu: float
    # NCCL all-reduce with NVLink SHARP on 8 H100: peak busBw ~480 GB/s; other ops ~370 GB/s
    # effective of the 450 GB/s per-direction NVLink 4 line rate (NCCL maintainer in
    # NVIDIA/nccl-tests#212)
    allreduce_bus_bytes_per_s: float
    p2p_bytes_per_s: float
    # small-message all-reduce latency by TP size; it grows with the GPU count (H100_SOURCES)
    collective_latency_s: tuple[tuple[int, float], ...]
    # ASSUMPTION: scheduler + sampling + launch overhead per decode step with CUDA graphs
    step_overhead_s: float


# Where each constant of H100_SXM_NODE comes from; copied into the profile's notes.
H100_SOURCES = {
    "memory_bytes": "80 GB HBM3: NVIDIA H100 SXM5 datasheet (glennklockwood.com/garden/processors/h100)",
    "peak_flops": "989.4 TFLOP/s dense BF16 tensor: same sources",
    "hbm_bytes_per_s": "3.35 TB/s HBM3: same sources",
    "hbm_efficiency": "ASSUMPTION: 80% of HBM bandwidth reached by decode kernels",
    "decode_mfu": "ASSUMPTION: 50% of peak for small-M decode GEMMs",
    "prefill_mfu": "ASSUMPTION: 60% of peak for prefill GEMMs",
    "allreduce_bus_bytes_per_s": "~480 GB/s NVLS all-reduce busBw on 8 H100: NVIDIA/nccl-tests#212",
    "p2p_bytes_per_s": "~370 GB/s effective NVLink4 per direction: NVIDIA/nccl-tests#212",
    "collective_latency_s": "~6 us at 2 GPUs (NVLS, CUDA graphs): NVIDIA/nccl#1259; ASSUMPTION 8/10 us at 4/8",
    "step_overhead_s": "ASSUMPTION: 0.5 ms scheduler + sampling + launch per decode step",
}

H100_SXM_NODE = NodeSpec(
    name="8xH100-SXM5-80GB NVLink4 (roofline)",
    device="H100-SXM5-80GB",
    num_devices=8,
    memory_bytes=80 * 10**9,
    peak_flops=989.4e12,
    hbm_bytes_per_s=3.35e12,
    hbm_efficiency=0.8,
    decode_mfu=0.5,
    prefill_mfu=0.6,
    allreduce_bus_bytes_per_s=480e9,
    p2p_bytes_per_s=370e9,
    collective_latency_s=((2, 6e-6), (4, 8e-6), (8, 10e-6)),
    step_overhead_s=0.5e-3,
)


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


@dataclass(frozen=True, slots=True)
class Roofline:
    node: NodeSpec
    model: ModelInfo
    dtype: str

    @property
    def elem(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def latency(self, group: int) -> float:
        return dict(self.node.collective_latency_s)[group]

    def all_reduce(self, nbytes: float, group: int) -> float:
        if group == 1:
            return 0.0
        bus = nbytes * 2 * (group - 1) / group
        return self.latency(group) + bus / self.node.allreduce_bus_bytes_per_s

    def all_gather(self, nbytes: float, group: int) -> float:
        if group == 1:
            return 0.0
        return self.latency(group) + nbytes * (group - 1) / group / self.node.p2p_bytes_per_s

    def p2p(self, nbytes: float, group: int) -> float:
        return self.latency(group) + nbytes / self.node.p2p_bytes_per_s

    def layer_collectives(self, tokens: float, tp: int) -> float:
        """Two all-reduces per layer (after o_proj and down_proj) of the hidden states, plus the
        vocab-parallel logits gather of the last tokens."""
        hidden = tokens * self.model.hidden_size * self.elem
        per_layer = 2 * self.all_reduce(hidden, tp)
        return self.model.num_layers * per_layer

    def decode_step(self, tp: int, batch: int, context_tokens: int) -> float:
        m, n = self.model, self.node
        kv_rank = context_tokens * m.kv_bytes_per_token(self.dtype) * m.kv_heads_per_rank(tp)
        kv_rank /= m.num_kv_heads
        mem = (m.weight_bytes(self.dtype) / tp + kv_rank) / (n.hbm_bytes_per_s * n.hbm_efficiency)
        attn_flops = 4 * m.num_layers * m.num_attention_heads * m.head_dim * context_tokens
        flops = (2 * m.num_params * batch + attn_flops) / tp
        compute = flops / (n.peak_flops * n.decode_mfu)
        logits = self.all_gather(batch * m.vocab_size * self.elem, tp)
        comm = self.layer_collectives(batch, tp) + logits
        return max(mem, compute) + comm + n.step_overhead_s

    def prefill(self, tp: int, tokens: int) -> float:
        m, n = self.model, self.node
        attn_flops = 2 * m.num_layers * m.num_attention_heads * m.head_dim * tokens * tokens
        flops = (2 * m.num_params * tokens + attn_flops) / tp
        compute = flops / (n.peak_flops * n.prefill_mfu)
        mem = m.weight_bytes(self.dtype) / tp / (n.hbm_bytes_per_s * n.hbm_efficiency)
        return max(mem, compute) + self.layer_collectives(tokens, tp) + n.step_overhead_s

    def collective(self, op: str, nbytes: int, group: int) -> float:
        if op == "all_reduce":
            return self.all_reduce(nbytes, group)
        if op == "all_gather":
            return self.all_gather(nbytes, group)
        return self.p2p(nbytes, group)  # broadcast and send: one copy over one link


def roofline_profile(
    model: ModelInfo,
    node: NodeSpec = H100_SXM_NODE,
    dtype: Dtype = "bfloat16",
    tp_sizes: tuple[int, ...] = (1, 2, 4, 8),
    memory_utilization: float = 0.9,
) -> Profile:
    """A profile on the grid a measured one would cover: batch 1..512, per-sequence context
    256..32768 tokens, rows that would not fit in the replica's KV memory left out."""
    roof = Roofline(node=node, model=model, dtype=dtype)
    decode, prefill = [], []
    for tp in tp_sizes:
        weights = model.weight_bytes(dtype) / tp
        per_token = (
            model.kv_bytes_per_token(dtype) * model.kv_heads_per_rank(tp) / model.num_kv_heads
        )
        capacity = (node.memory_bytes * memory_utilization - weights) / per_token
        for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
            for per_seq in (256, 1024, 4096, 8192, 16384, 32768):
                context = batch * per_seq
                if context > capacity:
                    continue
                seconds = roof.decode_step(tp, batch, context)
                decode.append(
                    DecodeRow(tp=tp, batch=batch, context_tokens=context, seconds=seconds)
                )
        for tokens in (128, 512, 1024, 2048, 4096, 8192, 16384):
            prefill.append(PrefillRow(tp=tp, tokens=tokens, seconds=roof.prefill(tp, tokens)))
    collectives = []
    for op in ("all_reduce", "all_gather", "broadcast", "send"):
        for group in (2, 4, 8):
            for nbytes in np.logspace(12, 30, 10, base=2).astype(int).tolist():
                seconds = roof.collective(op, nbytes, group)
                collectives.append(
                    CollectiveRow(op=op, nbytes=nbytes, group_size=group, seconds=seconds)
                )
    notes = {key: str(value) for key, value in asdict(node).items()}
    if node == H100_SXM_NODE:
        notes.update({f"source.{key}": text for key, text in H100_SOURCES.items()})
    notes["label"] = "SIMULATED: roofline model, not a measurement"
    return Profile(
        source="roofline",
        hardware=HardwareInfo(
            name=node.name,
            device=node.device,
            num_devices=node.num_devices,
            memory_bytes_per_device=node.memory_bytes,
            interconnect="NVLink4 + NVSwitch",
        ),
        model=model,
        dtype=dtype,
        decode=decode,
        prefill=prefill,
        collectives=collectives,
        notes=notes,
    )
