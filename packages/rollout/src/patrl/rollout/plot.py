"""A rollout's timeline as a picture: running samples over time, shaded by TP size, with every
planner switch and every speculative verify step marked. matplotlib is imported only when a
plot is drawn."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def plot_timeline(
    timeline: Sequence[Mapping[str, Any]],
    decisions: Sequence[Mapping[str, Any]],
    path: str | Path,
    title: str = "generation timeline",
) -> Path:
    """Write a PNG of `Engine.stats()["timeline"]` and `["tp_decisions"]` to `path`; verify
    steps (`drafted` > 0) are dots on the running line, their accepted / drafted tokens in the
    legend."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(
            "plot_timeline needs matplotlib: pip install 'patrl-rollout[plot]'"
        ) from err

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, (ax, ax_tp) = plt.subplots(
        2, 1, figsize=(9, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    t = [r["t"] + r["duration_s"] for r in timeline]
    ax.plot(t, [r["running"] for r in timeline], drawstyle="steps-post", label="running samples")
    verify = [(end, r) for end, r in zip(t, timeline, strict=True) if r.get("drafted", 0)]
    if verify:
        drafted = sum(r["drafted"] for _, r in verify)
        accepted = sum(r["accepted"] for _, r in verify)
        ax.plot(
            [end for end, _ in verify],
            [r["running"] for _, r in verify],
            ".",
            color="tab:purple",
            markersize=3,
            label=f"verify steps ({len(verify)}): {accepted}/{drafted} drafted tokens accepted",
        )
    ax_tp.plot(t, [r["tp_size"] for r in timeline], drawstyle="steps-post", color="tab:green")
    for d in decisions:
        if d["action"] != "switch":
            continue
        label = f"tp {d['current_tp']}->{d['target_tp']}"
        for a in (ax, ax_tp):
            a.axvline(d["t"], color="red", linestyle="--", alpha=0.6)
        ax.annotate(
            f"{label}\npred. gain {d['predicted_gain_s']:.3g}s",
            (d["t"], ax.get_ylim()[1] * 0.9),
            fontsize=8,
            color="red",
        )
    ax.set_ylabel("running samples")
    ax.set_title(f"{title}; red: TP switches")
    ax.legend(fontsize=8)
    ax_tp.set_ylabel("TP size")
    ax_tp.set_xlabel("seconds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)  # never a half-written picture
    return path
