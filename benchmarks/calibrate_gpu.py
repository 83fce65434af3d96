"""Refit the calibrated roofline's constants from the published measurements it cites.

    OMP_NUM_THREADS=1 python benchmarks/calibrate_gpu.py

The points are `patrl.lenpredict.calibration.POINTS` (sources there and in
benchmarks/README.md). Three fits, each on its own points, by Nelder-Mead on the log error
(an L4 norm, so that the worst point weighs most: the target is every point within 15%):

1. the GEMM constants of both GPUs (HBM efficiency, kernel floor per GPU; compute efficiency,
   its width and token half-points and the bend's sharpness shared) on Vidur's per-layer
   kernel times at TP 1/2/4/8;
2. the all-reduce latency and bus bandwidth at the group sizes the links cite, by least
   squares on (bytes, seconds);
3. vLLM 0.7.2's per-step and per-sequence overhead on its end-to-end steps (vllm#16300), the
   GPU constants of fit 1 held.

Prints the constants (the ones in patrl.lenpredict.roofline were copied from this output,
rounded) and every point's error under the constants in the source, and writes
benchmarks/results/calibrate_gpu.json. Takes a few seconds.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from patrl.lenpredict.calibration import NODES, POINTS, Point, fit_report, predict
from patrl.lenpredict.roofline import NodeSpec

RESULTS = Path(__file__).parent / "results"


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, iters: int = 3000) -> np.ndarray:
    """Minimise f from x0 (a plain Nelder-Mead; a few restarts from the best point)."""
    best = np.asarray(x0, dtype=float)
    for _ in range(6):
        simplex = [best] + [
            best * np.where(np.arange(len(best)) == i, 1.2, 1.0) for i in range(len(best))
        ]
        values = [f(x) for x in simplex]
        for _ in range(iters):
            order = np.argsort(values)
            simplex = [simplex[i] for i in order]
            values = [values[i] for i in order]
            centre = np.mean(simplex[:-1], axis=0)
            reflected = centre + (centre - simplex[-1])
            fr = f(reflected)
            if fr < values[0]:
                expanded = centre + 2 * (centre - simplex[-1])
                fe = f(expanded)
                simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
            elif fr < values[-2]:
                simplex[-1], values[-1] = reflected, fr
            else:
                contracted = centre + 0.5 * (simplex[-1] - centre)
                fc = f(contracted)
                if fc < values[-1]:
                    simplex[-1], values[-1] = contracted, fc
                else:
                    simplex = [simplex[0]] + [
                        simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]
                    ]
                    values = [f(x) for x in simplex]
        best = simplex[int(np.argmin(values))]
    return best


def log_error_norm(points: list[Point], nodes: dict[str, NodeSpec]) -> float:
    errors = [np.log(predict(p, nodes[p.gpu]) / p.seconds) for p in points]
    return float(np.mean(np.abs(errors) ** 4) ** 0.25)


def fit_gemm() -> dict[str, dict[str, float]]:
    points = [p for p in POINTS if p.kind == "layer_linear"]
    h100, a100 = NODES["H100"].gpu, NODES["A100"].gpu

    def nodes_for(x: np.ndarray) -> dict[str, NodeSpec]:
        shared = dict(
            gemm_efficiency=x[4],
            gemm_width_half=x[5] * 1e6,
            gemm_tokens_half=x[6],
            gemm_sharpness=x[7],
        )
        gpus = {
            "H100": dataclasses.replace(
                h100, hbm_efficiency=x[0], kernel_floor_s=x[2] * 1e-6, **shared
            ),
            "A100": dataclasses.replace(
                a100, hbm_efficiency=x[1], kernel_floor_s=x[3] * 1e-6, **shared
            ),
        }
        return {k: dataclasses.replace(NODES[k], gpu=g) for k, g in gpus.items()}

    def loss(x: np.ndarray) -> float:
        if (x <= 0).any() or x[0] > 1 or x[1] > 1 or x[4] > 1:
            return 1e9
        return log_error_norm(points, nodes_for(x))

    x0 = np.array([0.9, 0.85, 5.5, 6.5, 0.8, 10.0, 12.0, 1.7])
    x = nelder_mead(loss, x0)
    fitted = nodes_for(x)
    return {
        k: {
            f: getattr(n.gpu, f)
            for f in (
                "hbm_efficiency",
                "kernel_floor_s",
                "gemm_efficiency",
                "gemm_width_half",
                "gemm_tokens_half",
                "gemm_sharpness",
            )
        }
        for k, n in fitted.items()
    }


def fit_links() -> dict[str, list[dict[str, float]]]:
    """Per (gpu, group): latency and bus bandwidth through the cited (bytes, seconds)."""
    out: dict[str, list[dict[str, float]]] = {}
    for gpu in ("H100", "A100"):
        rows = []
        for group in sorted({p.tp for p in POINTS if p.kind == "allreduce" and p.gpu == gpu}):
            mine = [p for p in POINTS if p.kind == "allreduce" and p.gpu == gpu and p.tp == group]
            bus = np.array([p.nbytes * 2 * (group - 1) / group for p in mine], dtype=float)
            t = np.array([p.seconds for p in mine])
            if len(mine) > 1 and bus.max() > bus.min() * 10:
                x = np.stack([np.ones_like(bus), bus], axis=1)
                (alpha, per_byte), *_ = np.linalg.lstsq(x / t[:, None], np.ones_like(t), rcond=None)
                rows.append(
                    {
                        "group": group,
                        "latency_s": float(alpha),
                        "bus_bytes_per_s": float(1 / per_byte),
                    }
                )
            else:
                rows.append(
                    {"group": group, "latency_s": float(t.min()), "bus_bytes_per_s": float("nan")}
                )
        out[gpu] = rows
    return out


def fit_engine() -> dict[str, float]:
    points = [p for p in POINTS if p.kind == "decode_step"]
    node = NODES["A100"]

    def loss(x: np.ndarray) -> float:
        if (x < 0).any():
            return 1e9
        engine = dataclasses.replace(
            node.engine, step_overhead_s=x[0] * 1e-3, per_seq_overhead_s=x[1] * 1e-3
        )
        return log_error_norm(points, {"A100": dataclasses.replace(node, engine=engine)})

    x = nelder_mead(loss, np.array([5.0, 0.2]))
    return {"step_overhead_s": x[0] * 1e-3, "per_seq_overhead_s": x[1] * 1e-3}


def main() -> None:
    gemm, links, engine = fit_gemm(), fit_links(), fit_engine()
    print("GEMM constants (fit 1):")
    for gpu, constants in gemm.items():
        print(f"  {gpu}: " + ", ".join(f"{k}={v:.4g}" for k, v in constants.items()))
    print("all-reduce (fit 2):")
    for gpu, rows in links.items():
        for r in rows:
            print(
                f"  {gpu} g={r['group']}: latency {r['latency_s'] * 1e6:.2f} us, busbw {r['bus_bytes_per_s'] / 1e9:.0f} GB/s"
            )
    print(
        f"vLLM 0.7.2 engine (fit 3): step {engine['step_overhead_s'] * 1e3:.2f} ms, per sequence {engine['per_seq_overhead_s'] * 1e3:.3f} ms"
    )
    report = fit_report()
    print(
        "\nevery cited point under the constants in patrl.lenpredict.roofline (error = model / measured - 1):"
    )
    worst = max(abs(row["error"]) for row in report)
    for row in report:
        print(
            f"  {row['source']:<15} {row['kind']:<13} {row['gpu']} {row['model']:<13} "
            f"tp{row['tp']} tokens={row['tokens']:<5} bytes={row['nbytes']:<8} measured "
            f"{row['measured_s']:.4g} s model {row['predicted_s']:.4g} s  {100 * row['error']:+.1f}%"
        )
    print(f"worst |error|: {100 * worst:.1f}% over {len(report)} points")
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "gemm": gemm,
        "links": links,
        "engine": engine,
        "report": report,
        "worst_error": worst,
    }
    (RESULTS / "calibrate_gpu.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
