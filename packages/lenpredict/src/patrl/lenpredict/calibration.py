"""The published measurements the calibrated roofline (`roofline.StepModel`) is fitted to and
held against: GEMM kernel times per layer at TP 1/2/4/8, all-reduce latencies at decode message
sizes, end-to-end decode steps and prefills. `fit_report()` prices each with the model;
benchmarks/calibrate_gpu.py refits the constants from them and benchmarks/README.md tabulates
them with their sources.

Kernel times come from Vidur's profiles (microsoft/vidur, data/profiling/compute/<gpu>/<model>/
mlp.csv: kineto kernel times of each projection at num_tokens 1..4096 and TP 1/2/4/8). A point
here is the sum of a layer's four projections (attn_pre_proj, attn_post_proj, mlp_up_proj,
mlp_down_proj), the median over the profiled token counts of a window (1-16, 96-160, 192-320,
448-576 tokens, labelled by their median 4, 128, 256, 512), which smooths cuBLAS's choice of
kernel from one token count to the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from patrl.lenpredict.profile_schema import ModelInfo
from patrl.lenpredict.roofline import (
    A100_SXM_NODE,
    H100_SXM_NODE,
    LLAMA31_8B,
    NodeSpec,
    StepModel,
    decoder_info,
)


@dataclass(frozen=True, slots=True)
class Source:
    url: str
    what: str


SOURCES = {
    "vidur": Source(
        "https://github.com/microsoft/vidur (data/profiling/compute/{h100,a100}/*/mlp.csv)",
        "kineto GEMM kernel times per layer, num_tokens 1-4096, TP 1/2/4/8",
    ),
    "vllm-16300": Source(
        "https://github.com/vllm-project/vllm/issues/16300",
        "vLLM 0.7.2 benchmark_latency, QwQ-32B on 8xA100-80GB, input 1, output 200: seconds "
        "per request over 200 steps, TP 2/4/8, batch 1/16/128",
    ),
    "nccl-tests-123": Source(
        "https://github.com/NVIDIA/nccl-tests/issues/123",
        "all_reduce_perf, DGX-A100, NCCL_ALGO=Ring, 1 channel, 8-128 B, no CUDA graphs: "
        "10 / 16.88 / 33.7 us on 2 / 4 / 8 GPUs",
    ),
    "nccl-1259": Source(
        "https://github.com/NVIDIA/nccl/issues/1259",
        "all_reduce_perf with CUDA graphs, 2x H100 NVLS, 128 B: 5.56 us",
    ),
    "flaggems-773": Source(
        "https://github.com/flagos-ai/FlagGems-vllm/pull/773",
        "vLLM 0.28 TRT-LLM one-shot all-reduce (+RMSNorm), CUDA graph, TP 2 on 8xH100, "
        "BF16 [M, 6144]: 6.98 us (M=6), 12.98 us (M=138)",
    ),
    "triton-dist-57": Source(
        "https://github.com/ByteDance-Seed/Triton-distributed/issues/57",
        "torch.distributed NCCL all-reduce (no CUDA graph), 8xH100 intra-node, 128 B-16 MB",
    ),
    "vidur-net": Source(
        "https://github.com/microsoft/vidur (data/profiling/network/a100_dgx/all_reduce.csv)",
        "NCCL all-reduce kernel time, 8xA100 DGX, 4 MB: 99 us (median)",
    ),
    "trtllm-perf": Source(
        "https://github.com/NVIDIA/TensorRT-LLM docs/source/performance.md (v0.5 low-latency "
        "table)",
        "first-token latency, batch 1, A100 FP16: LLaMA 7B TP 1 and LLaMA 70B TP 4, 2048 tokens",
    ),
}

Kind = Literal["layer_linear", "allreduce", "decode_step", "prefill"]


@dataclass(frozen=True, slots=True)
class Point:
    """One cited measurement. `tokens`: GEMM rows (layer_linear), batch (decode_step) or
    prompt tokens (prefill); `context`: tokens per sequence of a decode step."""

    source: str
    kind: Kind
    gpu: Literal["H100", "A100"]
    seconds: float
    model: str = ""
    tp: int = 1
    tokens: int = 0
    context: int = 0
    nbytes: int = 0


def _vidur_model(
    name: str, layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int
) -> ModelInfo:
    return decoder_info(
        name,
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_kv_heads=kv,
        head_dim=hidden // heads,
        vocab_size=vocab,
        tied_embeddings=False,
        qk_norm=False,
    )


MODELS = {
    "Llama-2-7B": _vidur_model("Llama-2-7B", 32, 4096, 11008, 32, 32, 32000),
    "Llama-2-70B": _vidur_model("Llama-2-70B", 80, 8192, 28672, 64, 8, 32000),
    "InternLM-20B": _vidur_model("InternLM-20B", 60, 5120, 13824, 40, 40, 103168),
    "Llama-3-8B": LLAMA31_8B.model_copy(update={"name": "Llama-3-8B"}),
    # config.json of Qwen/QwQ-32B
    "QwQ-32B": _vidur_model("QwQ-32B", 64, 5120, 27648, 40, 8, 152064),
}

NODES = {"H100": H100_SXM_NODE, "A100": A100_SXM_NODE}

# (gpu, model, tokens window median, [us at TP 1, 2, 4, 8]) from Vidur's mlp.csv
_VIDUR_LAYER_US = [
    ("H100", "Llama-2-7B", 4, [152.0, 84.0, 50.5, 34.5]),
    ("H100", "Llama-2-7B", 128, [204.0, 113.0, 63.5, 45.0]),
    ("H100", "Llama-2-7B", 256, [260.5, 127.0, 77.0, 53.5]),
    ("H100", "Llama-2-7B", 512, [347.5, 192.0, 114.0, 71.5]),
    ("H100", "Llama-2-70B", 4, [581.0, 296.0, 160.5, 87.0]),
    ("H100", "Llama-2-70B", 128, [654.5, 326.0, 179.0, 110.0]),
    ("H100", "Llama-2-70B", 256, [783.0, 396.0, 219.0, 141.0]),
    ("H100", "Llama-2-70B", 512, [1254.0, 711.0, 335.5, 196.5]),
    ("H100", "InternLM-20B", 4, [230.0, 123.0, 70.0, 47.0]),
    ("H100", "InternLM-20B", 128, [264.5, 139.5, 86.0, 60.0]),
    ("H100", "InternLM-20B", 256, [325.0, 168.5, 101.5, 71.0]),
    ("H100", "InternLM-20B", 512, [531.0, 294.5, 148.0, 96.0]),
    ("A100", "Llama-3-8B", 4, [280.0, 162.5, 87.0, 57.0]),
    ("A100", "Llama-3-8B", 128, [377.0, 215.5, 122.0, 80.0]),
    ("A100", "Llama-3-8B", 256, [556.0, 329.0, 205.0, 112.0]),
    ("A100", "Llama-3-8B", 512, [1021.5, 527.0, 316.0, 165.0]),
    ("A100", "Llama-2-70B", 4, [1086.0, 536.0, 290.5, 155.0]),
    ("A100", "Llama-2-70B", 128, [1348.0, 734.0, 383.0, 205.0]),
    ("A100", "Llama-2-70B", 256, [2116.5, 1071.0, 588.0, 335.5]),
    ("A100", "Llama-2-70B", 512, [3997.0, 2062.5, 1089.5, 585.5]),
]

POINTS: list[Point] = [
    Point("vidur", "layer_linear", gpu, us * 1e-6, model, tp, tokens)  # type: ignore[arg-type]
    for gpu, model, tokens, row in _VIDUR_LAYER_US
    for tp, us in zip((1, 2, 4, 8), row, strict=True)
]
POINTS += [
    Point("nccl-1259", "allreduce", "H100", 5.56e-6, tp=2, nbytes=128),
    Point("flaggems-773", "allreduce", "H100", 6.98e-6, tp=2, nbytes=6 * 6144 * 2),
    Point("flaggems-773", "allreduce", "H100", 12.98e-6, tp=2, nbytes=138 * 6144 * 2),
    *(
        Point("triton-dist-57", "allreduce", "H100", us * 1e-6, tp=8, nbytes=n)
        for n, us in (
            (128, 19.19),
            (16 << 10, 20.71),
            (256 << 10, 24.76),
            (1 << 20, 32.42),
            (4 << 20, 59.43),
        )
    ),
    *(
        Point("nccl-tests-123", "allreduce", "A100", us * 1e-6, tp=g, nbytes=128)
        for g, us in ((2, 10.0), (4, 16.88), (8, 33.7))
    ),
    Point("vidur-net", "allreduce", "A100", 99e-6, tp=8, nbytes=4 << 20),
    # benchmark_latency: input 1, output 200 -> ~101 tokens per sequence on average
    *(
        Point("vllm-16300", "decode_step", "A100", total / 200, "QwQ-32B", tp, batch, 101)
        for batch, tp, total in (
            (1, 2, 5.50),
            (1, 4, 3.91),
            (1, 8, 3.15),
            (16, 2, 6.07),
            (16, 4, 4.77),
            (16, 8, 4.25),
            (128, 2, 11.34),
        )
    ),
    Point("trtllm-perf", "prefill", "A100", 133e-3, "Llama-2-7B", 1, 2048),
    Point("trtllm-perf", "prefill", "A100", 377e-3, "Llama-2-70B", 4, 2048),
]


def predict(point: Point, node: NodeSpec | None = None) -> float:
    """Seconds the calibrated model gives for what `point` measured."""
    node = node or NODES[point.gpu]
    if point.kind == "allreduce":
        return node.link.allreduce(point.nbytes, point.tp)
    step = StepModel(node=node, model=MODELS[point.model], dtype="bfloat16")
    if point.kind == "layer_linear":
        return step.layer_linear(point.tp, point.tokens)
    if point.kind == "decode_step":
        return step.decode_step(point.tp, point.tokens, point.tokens * point.context)
    return step.prefill(point.tp, point.tokens)


def fit_report(points: list[Point] | None = None) -> list[dict[str, Any]]:
    """Every point with the model's prediction and relative error (prediction / measured − 1)."""
    rows = []
    for p in POINTS if points is None else points:
        predicted = predict(p)
        rows.append(
            {
                "source": p.source,
                "kind": p.kind,
                "gpu": p.gpu,
                "model": p.model,
                "tp": p.tp,
                "tokens": p.tokens,
                "nbytes": p.nbytes,
                "measured_s": p.seconds,
                "predicted_s": predicted,
                "error": predicted / p.seconds - 1,
            }
        )
    return rows
