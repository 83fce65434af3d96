"""Step metrics (verl names) to JSONL, TensorBoard, wandb and a live progress bar; plots at the
end."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# What the progress bar and the summary show, in order: (metric, short label).
HEADLINE = (
    ("critic/score/mean", "reward"),
    ("response_length/mean", "len"),
    ("perf/throughput", "tok/s"),
    ("val-core/acc/mean@1", "val"),
)


class MetricsLogger:
    """Writes one JSON line per step to `metrics.jsonl` whatever `loggers` names (it is the run's
    record: a resumed run's history, the summary and the plots are read from it), plus what
    `loggers` asks for: `console` a progress bar, `tensorboard` scalars (with one warning and
    no scalars when the `tensorboard` package is missing), `wandb` rows (likewise)."""

    def __init__(
        self,
        run_dir: Path,
        loggers: Sequence[str],
        total_steps: int,
        start_step: int = 0,
        label: str = "train",
        wandb_init: Mapping[str, Any] | None = None,
    ) -> None:
        """`label`: the console progress bar's name (the job's advantage estimator);
        `wandb_init`: wandb.init's arguments (project, name, config) for the wandb logger."""
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.history: list[dict[str, float]] = _read_history(self.path, start_step)
        # A resumed run rewrites the file from its checkpoint: steps after it will be redone.
        self.path.write_text("".join(json.dumps(h) + "\n" for h in self.history))
        self._tb = _tensorboard(run_dir / "tensorboard") if "tensorboard" in loggers else None
        self._wandb = _wandb(run_dir, wandb_init or {}) if "wandb" in loggers else None
        self._bar = None
        if "console" in loggers:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc=label, unit="step")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": float(step), **{k: float(v) for k, v in metrics.items()}}
        self.history.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if math.isfinite(float(v)):
                    self._tb.add_scalar(k, float(v), step)
            self._tb.flush()
        if self._wandb is not None:
            finite = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
            self._wandb.log(finite, step=step)
        if self._bar is not None:
            if "critic/score/mean" in metrics:
                self._bar.update(1)
            self._bar.set_postfix(
                {label: f"{metrics[k]:.3g}" for k, label in HEADLINE if k in metrics}, refresh=True
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def summary(self) -> str:
        """A table of the headline metrics: first steps, last steps, change."""
        rows = [h for h in self.history if "critic/score/mean" in h]
        if not rows:
            return "no training steps logged"
        lines = [
            f"{'metric':28s} {'first':>10s} {'last':>10s} {'change':>10s}   (means of k logged values)"
        ]
        for key, _ in HEADLINE:
            values = [h[key] for h in self.history if key in h]
            if not values:
                continue
            # Each metric's own k: validation is logged far less often than training.
            k = max(1, min(5, len(values) // 2))
            first, last = float(np.mean(values[:k])), float(np.mean(values[-k:]))
            lines.append(f"{key:28s} {first:10.4g} {last:10.4g} {last - first:+10.4g}   k={k}")
        return "\n".join(lines)


def _read_history(path: Path, upto_step: int) -> list[dict[str, float]]:
    if upto_step == 0 or not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] <= upto_step]


def _tensorboard(log_dir: Path) -> Any:
    """A SummaryWriter into `log_dir`, or None after one warning: tensorboard is an extra."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print(
            "patrl: warning: trainer.logger names tensorboard but the tensorboard package is "
            "not installed, so no TensorBoard scalars are written (metrics.jsonl has every "
            "value): pip install 'patrl-orchestrator[tensorboard]', or leave tensorboard out "
            "of trainer.logger",
            file=sys.stderr,
            flush=True,
        )
        return None
    return SummaryWriter(str(log_dir))


def _wandb(run_dir: Path, init: Mapping[str, Any]) -> Any:
    """A wandb run (`wandb.init(**init)`, files under run_dir), or None with a warning when
    wandb is not installed: it is optional, JSONL is always written."""
    try:
        import wandb
    except ImportError:
        print(
            "patrl: warning: trainer.logger has wandb, but wandb is not installed "
            "(pip install wandb); logging to metrics.jsonl and the other loggers only",
            file=sys.stderr,
            flush=True,
        )
        return None
    return wandb.init(dir=str(run_dir), **init)


def replica_timelines(per_rank: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One timeline per replica the rollout started with, from every rank's engine timeline
    (`{"t", "running", "tp", "switches"}` and, where it speculated, `"verify"`: (start,
    drafted, accepted) per verify step; in rank order), labelled with its ranks and TP sizes.

    The ranks of a TP group run the same steps, so the group's first rank speaks for it; TP
    groups are contiguous ranks, so rank r started in group r // tp, tp its first step's size."""
    out: list[dict[str, Any]] = []
    seen: set[int] = set()
    for rank, mine in enumerate(per_rank):
        if not mine["t"]:
            continue
        tp = mine["tp"][0]
        group = rank // tp
        if group in seen:
            continue
        seen.add(group)
        ranks = f"rank {rank}" if tp == 1 else f"ranks {group * tp}-{group * tp + tp - 1}"
        sizes = [size for i, size in enumerate(mine["tp"]) if i == 0 or mine["tp"][i - 1] != size]
        label = f"replica {group} ({ranks}), tp {'->'.join(map(str, sizes))}"
        keys = [k for k in ("t", "running", "switches", "verify") if k in mine]
        out.append({k: mine[k] for k in keys} | {"label": label})
    return out


def plot_run(
    history: Sequence[Mapping[str, float]],
    lengths: Sequence[int],
    timeline: Sequence[Mapping[str, Any]],
    out_dir: Path,
    max_response_length: int | None = None,
) -> list[Path]:
    """PNG plots in `out_dir`: reward and validation accuracy by step, response lengths (with
    the length cap marked), the generation timeline (one line per replica); a plot without
    data is skipped. `timeline`: one entry per replica, `{"t", "running", "switches", "label"}`
    as `replica_timelines` returns them."""
    figures = [("reward.png", reward_figure(history))]
    if lengths:
        figures.append(("response_lengths.png", lengths_figure(lengths, max_response_length)))
    if timeline:
        figures.append(("generation_timeline.png", timeline_figure(timeline)))
    return [_save(fig, out_dir / name) for name, fig in figures]


def reward_figure(history: Sequence[Mapping[str, float]]) -> Any:
    """Train reward by step, with validation pass@1 dashed beneath it where validated."""
    fig, ax = _figure(7, 4)
    train = [h for h in history if "critic/score/mean" in h]
    val = [h for h in history if "val-core/acc/mean@1" in h]
    # The train line is drawn above the validation one, which often sits on the same values.
    ax.plot(
        [h["step"] for h in train],
        [h["critic/score/mean"] for h in train],
        "o-",
        markersize=3,
        zorder=3,
        label="train reward (mean)",
    )
    if val:
        ax.plot(
            [h["step"] for h in val],
            [h["val-core/acc/mean@1"] for h in val],
            "s--",
            markersize=5,
            alpha=0.8,
            zorder=2,
            label="validation pass@1",
        )
    ax.set_title("reward by step")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    _integer_ticks(ax.xaxis)
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def lengths_figure(lengths: Sequence[int], max_response_length: int | None) -> Any:
    """Histogram of response lengths; the cap (`data.max_response_length`) as a red line, with
    the share of responses that reached it (cut, not finished)."""
    fig, ax = _figure(7, 4)
    ax.hist(lengths, bins=40)
    if max_response_length is not None:
        capped = sum(n >= max_response_length for n in lengths)
        ax.axvline(
            max_response_length,
            color="red",
            linestyle="--",
            label=f"data.max_response_length={max_response_length} "
            f"({capped} reach it, {capped / len(lengths):.1%})",
        )
        ax.legend()
    ax.set_title(f"response lengths, all trained samples ({len(lengths)})")
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("samples")
    _integer_ticks(ax.xaxis)
    return fig


def timeline_figure(timeline: Sequence[Mapping[str, Any]]) -> Any:
    """Running sequences over the last training rollout, one line per replica, TP layout
    switches as red dashed lines (drawn once when replicas share a switch), speculative verify
    steps as dots on their replica's line (its accepted / drafted tokens in the legend)."""
    fig, ax = _figure(9, 4)
    marked: set[tuple[float, str]] = set()
    for i, replica in enumerate(timeline):
        (line,) = ax.plot(
            replica["t"],
            replica["running"],
            drawstyle="steps-post",
            alpha=0.7,
            label=replica.get("label", f"replica {i}"),
        )
        verify = replica.get("verify", [])
        if verify:
            at = dict(zip(replica["t"], replica["running"], strict=True))  # on the line
            drafted = sum(d for _, d, _ in verify)
            accepted = sum(a for _, _, a in verify)
            ax.plot(
                [t for t, _, _ in verify],
                [at.get(t, 0) for t, _, _ in verify],
                ".",
                color=line.get_color(),
                markersize=3,
                label=f"verify steps ({len(verify)}): {accepted}/{drafted} drafted tokens accepted",
            )
        for t, text in replica.get("switches", []):
            if (t, text) in marked:
                continue
            marked.add((t, text))
            ax.axvline(t, color="red", linestyle="--", alpha=0.5)
            ax.text(t, max(replica["running"] or [1]), text, color="red", fontsize=7)
    legend = " (red: TP layout switches)" if marked else ""
    ax.set_title(f"generation timeline, last training rollout{legend}")
    ax.set_xlabel("seconds into the rollout")
    ax.set_ylabel("running sequences")
    _integer_ticks(ax.yaxis)
    ax.legend(fontsize=8)
    return fig


def _figure(width: float, height: float) -> tuple[Any, Any]:
    """A figure and its axes, outside pyplot's global state (nothing to close, any thread)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    return fig, fig.add_subplot()


def _integer_ticks(axis: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
