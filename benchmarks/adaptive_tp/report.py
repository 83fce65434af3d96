"""Targets and tables: each target against the measured value (`verdicts`), and the printed
report of a results dict (`print_report`), also of a results file written earlier."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from .config import (
    ADAPTIVE,
    POLICIES,
    TARGET_CONTROL,
    TARGET_ELSEWHERE,
    TARGET_LONG_TAIL,
)
from .shapes import shape_role


def verdict(
    shape: str, workload: str, policy: str, metric: str, value: Any, target: str, met: bool
) -> dict[str, Any]:
    return {
        "shape": shape,
        "workload": workload,
        "policy": policy,
        "metric": metric,
        "value": value,
        "target": target,
        "met": bool(met),
    }


def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target, the measured value, and whether it was met. The targets follow the shape's
    role (`shapes.SHAPE_ROLE`), not what its profile turned out to show: a crossover shape
    whose profile has no crossover fails that line and is still held to the long-tail target."""
    out = []
    for shape, res in results["shapes"].items():
        role = shape_role(shape)
        if role == "crossover":
            crossover = res["profile"]["crossover"]
            out.append(
                verdict(shape, "-", "-", "profile has a crossover", crossover, "True", crossover)
            )
        for wname, w in res["workloads"].items():
            for p in ("adaptive_predicted", "adaptive_oracle"):
                ratio = w["policies"][p]["vs_best_static"]
                long_tail = role == "crossover" and wname.startswith("long_tail")
                limit = TARGET_LONG_TAIL if long_tail else TARGET_ELSEWHERE
                ok = ratio <= limit
                line = verdict(shape, wname, p, "adaptive / best static", ratio, f"<= {limit}", ok)
                lockstep = w.get("lockstep_free_switch", {}).get("ratio")
                if lockstep is not None and not ok and lockstep > limit:
                    line["note"] = (
                        f"free switching at every step, lockstep estimate: x{lockstep:.3f}"
                    )
                out.append(line)
                frac = w["policies"][p]["control_fraction"]
                ok = frac is not None and frac < TARGET_CONTROL
                out.append(
                    verdict(shape, wname, p, "control / decode", frac, f"< {TARGET_CONTROL}", ok)
                )
            if role == "none":
                switches = sum(
                    sum(w["policies"][p]["switches"]) for p in ADAPTIVE if p in w["policies"]
                )
                out.append(
                    verdict(shape, wname, "adaptive", "switches", switches, "== 0", switches == 0)
                )
    return out


def print_report(results: dict[str, Any]) -> None:
    """Print every shape's tables, then every target's verdict."""
    for shape, res in results["shapes"].items():
        for section in SECTIONS:
            section(shape, res)
    print_targets(results["verdicts"])


def print_header(shape: str, res: dict[str, Any]) -> None:
    """The shape, its profile's measured steps and fitted model."""
    s = res["shape"]
    print(
        f"\n== shape {shape}: {s['num_params'] / 1e6:.1f}M params, hidden {s['hidden_size']}, "
        f"{s['num_hidden_layers']} layers, fp32; profile {res['profile_s']:.0f} s"
    )
    prof = res["profile"]
    print("profile (measured, shortest context):", fmt_dict(prof["measured"]))
    print("latency model:", fmt_dict(prof["model"]), "| crossover:", prof["crossover"])


def print_latencies(shape: str, res: dict[str, Any]) -> None:
    """Each workload's median seconds per policy, its ratio to the best static, switches."""
    print(f"{'workload':10s} | " + " | ".join(f"{p:>22s}" for p in POLICIES))
    for wname, w in res["workloads"].items():
        cells = []
        for p in POLICIES:
            if p not in w["policies"]:  # a results file from before the policy existed
                cells.append("-")
                continue
            e = w["policies"][p]
            sw = f" sw{sum(e['switches'])}" if "switches" in e else ""
            cells.append(f"{e['median_s']:7.2f}s x{e['vs_best_static']:.3f}{sw:>5s}")
        print(f"{wname:20s} | " + " | ".join(f"{c:>22s}" for c in cells))


def print_paired(shape: str, res: dict[str, Any]) -> None:
    """Each adaptive policy's median of per-repeat ratios to the best static run."""
    print("median of per-repeat ratios to the best static run of the same repeat:")
    for wname, w in res["workloads"].items():
        best = w["policies"][w["best_static"]]["latency_s"]
        paired = {
            p: statistics.median(
                a / b for a, b in zip(w["policies"][p]["latency_s"], best, strict=True)
            )
            for p in ADAPTIVE
            if p in w["policies"]
        }
        print(f"  {wname:20s} " + "  ".join(f"{p}=x{v:.3f}" for p, v in paired.items()))


def print_sync(shape: str, res: dict[str, Any]) -> None:
    """The untimed weight sync before each rollout (results files that record it)."""
    if all("sync_s" in e for w in res["workloads"].values() for e in w["policies"].values()):
        print("weight sync before each rollout, untimed (median s):")
        for wname, w in res["workloads"].items():
            print(
                f"  {wname:20s} "
                + "  ".join(
                    f"{p}={statistics.median(e['sync_s']):.2f}" for p, e in w["policies"].items()
                )
            )


def print_simulated(shape: str, res: dict[str, Any]) -> None:
    """Simulated over measured time per policy."""
    print("simulated / measured (median):")
    for wname, w in res["workloads"].items():
        sims = {p: w["policies"].get(p, {}).get("sim_over_measured") for p in POLICIES}
        print(
            f"  {wname:20s} " + "  ".join(f"{p}={v:.2f}" for p, v in sims.items() if v is not None)
        )


def print_lockstep(shape: str, res: dict[str, Any]) -> None:
    """What switching for free at every step would take, on the latency model."""
    if all("lockstep_free_switch" in w for w in res["workloads"].values()):
        print(
            "switching for free at every step, decode only, replicas in lockstep, on the "
            "latency model (an estimate, not a bound): dp2 / tp2 / free s, free / best"
        )
        for wname, w in res["workloads"].items():
            b = w["lockstep_free_switch"]
            print(
                f"  {wname:20s} {b['dp2_s']:.2f} / {b['tp2_s']:.2f} / {b['free_s']:.2f} s"
                f"  x{b['ratio']:.3f}"
            )


def print_control(shape: str, res: dict[str, Any]) -> None:
    """Control overhead on the critical path per adaptive policy."""
    print(
        "control overhead on the critical path (rollout wall time less switches and the "
        "busiest rank's decode time, summed / the busiest rank's decode time):"
    )
    for wname, w in res["workloads"].items():
        print(
            f"  {wname:20s} "
            + "  ".join(
                f"{p}={w['policies'][p]['control_fraction']:.4f}"
                for p in ADAPTIVE
                if p in w["policies"]
            )
        )


def print_switches(shape: str, res: dict[str, Any]) -> None:
    """Every switch decision, predicted against measured."""
    print(
        "switch decisions: predicted gain / overhead / finish vs measured overhead / finish / net gain"
    )
    for wname, w in res["workloads"].items():
        for p in (p for p in ADAPTIVE if p in w["policies"]):
            for d in w["policies"][p]["switch_decisions"]:
                print(
                    f"  {wname:20s} {p:18s} rep {d['repeat']} t={d['t']:.2f}s {d['tp']} "
                    f"seqs {d['num_seqs']} (mig {d['migrated']}, rc {d['recomputed']}): "
                    f"pred gain {d['predicted_gain_s']:.2f} ovh {d['predicted_overhead_s']:.2f} "
                    f"finish {d['predicted_finish_s']:.2f} | meas ovh {d['measured_overhead_s']:.2f} "
                    f"finish {d['measured_finish_s']:.2f} net {d['measured_net_s']:+.2f} "
                    f"(pred net {d['predicted_net_s']:+.2f})"
                )


def print_targets(verdicts: list[dict[str, Any]]) -> None:
    """Each target, its value, MET or NOT MET."""
    print("\ntargets:")
    for v in verdicts:
        value = "-" if v["value"] is None else f"{v['value']:.4g}"
        print(
            f"  {v['shape']:5s} {v['workload']:20s} {v['policy']:18s} {v['metric']:24s} "
            f"{value:>8s} target {v['target']:8s} {'MET' if v['met'] else 'NOT MET'}"
            + (f"  ({v['note']})" if v.get("note") else "")
        )


SECTIONS = (
    print_header,
    print_latencies,
    print_paired,
    print_sync,
    print_simulated,
    print_lockstep,
    print_control,
    print_switches,
)


def fmt_dict(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())


def reprint(path: Path) -> None:
    """Re-derive the verdicts of the results file at `path`, write it back, print its report."""
    results = json.loads(path.read_text())
    results["verdicts"] = verdicts(results)
    path.write_text(json.dumps(results, indent=1))
    print_report(results)
