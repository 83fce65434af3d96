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
    """Writes one JSON line per step (always), TensorBoard scalars and wandb rows (when
    installed and asked)."""

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
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional: JSONL is always written
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


def plot_run(
    history: Sequence[Mapping[str, float]],
    lengths: Sequence[int],
    timeline: Sequence[Mapping[str, Any]],
    out_dir: Path,
) -> list[Path]:
    """PNG plots: reward and validation accuracy by step, response lengths, generation timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    train = [h for h in history if "critic/score/mean" in h]
    val = [h for h in history if "val-core/acc/mean@1" in h]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [h["step"] for h in train],
        [h["critic/score/mean"] for h in train],
        label="train reward (mean)",
    )
    if val:
        ax.plot(
            [h["step"] for h in val],
            [h["val-core/acc/mean@1"] for h in val],
            "o-",
            label="validation pass@1",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.legend()
    ax.grid(alpha=0.3)
    written.append(_save(fig, out_dir / "reward.png"))

    if lengths:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.hist(lengths, bins=40)
        ax.set_xlabel("response length (tokens)")
        ax.set_ylabel("samples")
        ax.set_title("response lengths, all steps")
        written.append(_save(fig, out_dir / "response_lengths.png"))

    if timeline:
        fig, ax = plt.subplots(figsize=(9, 4))
        for event in timeline:
            ax.plot(event["t"], event["running"], drawstyle="steps-post", alpha=0.6)
            for t, label in event.get("switches", []):
                ax.axvline(t, color="red", linestyle="--", alpha=0.5)
                ax.text(t, max(event["running"] or [1]), label, color="red", fontsize=7)
        ax.set_xlabel("seconds into the rollout")
        ax.set_ylabel("running sequences (per replica)")
        ax.set_title("generation timeline (last step); red: TP layout switches")
        written.append(_save(fig, out_dir / "generation_timeline.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
