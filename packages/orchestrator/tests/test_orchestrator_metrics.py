"""MetricsLogger: JSONL rows, resumed history, a summary that compares like with like, the
loggers `trainer.logger` names; the end-of-run plots, read back through matplotlib's objects."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from patrl.orchestrator.config import load_config
from patrl.orchestrator.metrics import (
    MetricsLogger,
    lengths_figure,
    plot_run,
    replica_timelines,
    reward_figure,
    timeline_figure,
)


def test_summary_uses_each_metrics_own_window(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path, ["jsonl"], total_steps=10)
    for step in range(1, 11):
        row = {"critic/score/mean": step / 10}
        if step % 5 == 0:  # validation twice: first vs last must not be the same two values
            row["val-core/acc/mean@1"] = step / 20
        log.log(step, row)
    lines = {line.split()[0]: line.split() for line in log.summary().splitlines()[1:]}
    assert lines["critic/score/mean"][1:4] == ["0.3", "0.8", "+0.5"]
    assert lines["val-core/acc/mean@1"][1:4] == ["0.25", "0.5", "+0.25"]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [float(s) for s in range(1, 11)]


def test_resumed_logger_drops_rows_after_the_checkpoint(tmp_path: Path) -> None:
    first = MetricsLogger(tmp_path, ["jsonl"], total_steps=4)
    for step in range(1, 5):
        first.log(step, {"critic/score/mean": float(step)})
    resumed = MetricsLogger(tmp_path, ["jsonl"], total_steps=4, start_step=2)
    assert [h["step"] for h in resumed.history] == [1.0, 2.0]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_the_console_bar_is_named_after_the_estimator(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, ["console"], total_steps=3, label="gae")
    assert logger._bar is not None and logger._bar.desc.startswith("gae")
    logger.close()


def test_console_alone_still_writes_the_runs_record(tmp_path: Path) -> None:
    """metrics.jsonl is the run's record (resume, summary, plots): no `trainer.logger` value
    turns it off."""
    logger = MetricsLogger(tmp_path, ["console"], total_steps=2)
    logger.log(1, {"critic/score/mean": 0.5})
    logger.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1.0, "critic/score/mean": 0.5}]


def test_missing_tensorboard_warns_once_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    logger = MetricsLogger(tmp_path, ["tensorboard"], total_steps=3)
    for step in (1, 2, 3):
        logger.log(step, {"critic/score/mean": 0.1 * step})
    logger.close()
    err = capsys.readouterr().err
    assert err.count("warning") == 1, err
    assert "pip install 'patrl-orchestrator[tensorboard]'" in err
    assert not (tmp_path / "tensorboard").exists()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_no_tensorboard_no_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    MetricsLogger(tmp_path, ["console", "jsonl"], total_steps=1).close()
    assert "tensorboard" not in capsys.readouterr().err


def test_the_demo_config_asks_for_no_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newcomer's first run (examples/configs/demo.yaml, a fresh install without the
    tensorboard extra) prints no warning."""
    demo = Path(__file__).resolve().parents[3] / "examples" / "configs" / "demo.yaml"
    loggers = load_config(str(demo), []).trainer.logger
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # the extra is missing
    MetricsLogger(tmp_path, loggers, total_steps=1).close()
    assert "warning" not in capsys.readouterr().err


class _Writer:
    """Stands in for torch.utils.tensorboard.SummaryWriter: records what it is given."""

    scalars: ClassVar[list[tuple[str, float, int]]] = []

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir

    def add_scalar(self, key: str, value: float, step: int) -> None:
        self.scalars.append((key, value, step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_tensorboard_gets_the_finite_scalars(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = type(sys)("torch.utils.tensorboard")
    fake.SummaryWriter = _Writer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    monkeypatch.setattr(_Writer, "scalars", [])
    logger = MetricsLogger(tmp_path, ["tensorboard"], total_steps=1)
    logger.log(1, {"critic/score/mean": 0.5, "actor/kl": float("nan")})
    logger.close()
    assert _Writer.scalars == [("critic/score/mean", 0.5, 1)]
    assert capsys.readouterr().err == ""


def _run_data() -> tuple[list[dict[str, float]], list[int], list[dict[str, Any]]]:
    """Three steps validated before and after, five lengths (two at the cap of 16), and two
    replicas' timelines that share one TP switch."""
    history = [{"step": 0.0, "val-core/acc/mean@1": 0.2}]
    history += [{"step": float(s), "critic/score/mean": 0.1 * s} for s in (1, 2, 3)]
    history[-1]["val-core/acc/mean@1"] = 0.3
    switch = [(0.15, "tp1->tp2")]
    timeline = [
        {"t": [0.0, 0.1, 0.2], "running": [8, 4, 1], "switches": switch, "label": "replica 0"},
        {"t": [0.0, 0.1, 0.2], "running": [8, 5, 1], "switches": switch, "label": "replica 1"},
    ]
    return history, [3, 5, 8, 16, 16], timeline


def test_plot_run_writes_the_three_pngs(tmp_path: Path) -> None:
    history, lengths, timeline = _run_data()
    written = plot_run(history, lengths, timeline, tmp_path, max_response_length=16)
    assert [p.name for p in written] == [
        "reward.png",
        "response_lengths.png",
        "generation_timeline.png",
    ]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)
    (tmp_path / "x").mkdir()  # no lengths, no timeline: those plots are skipped
    assert plot_run(history, [], [], tmp_path / "x") == [tmp_path / "x" / "reward.png"]


def test_reward_plot_titles_integer_steps_train_line_on_top() -> None:
    ax = reward_figure(_run_data()[0]).axes[0]
    assert ax.get_title() == "reward by step"
    assert all(float(t).is_integer() for t in ax.get_xticks())
    train, val = ax.get_lines()
    assert train.get_label() == "train reward (mean)" and val.get_label() == "validation pass@1"
    assert list(train.get_xdata()) == [1.0, 2.0, 3.0] and list(val.get_xdata()) == [0.0, 3.0]
    assert train.get_zorder() > val.get_zorder()  # validation shares values, drawn beneath
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "train reward (mean)",
        "validation pass@1",
    ]


def test_lengths_plot_marks_the_cap_and_the_share_that_reached_it() -> None:
    _, lengths, _ = _run_data()
    ax = lengths_figure(lengths, 16).axes[0]
    assert ax.get_title() == "response lengths, all trained samples (5)"
    (cap,) = ax.get_lines()
    assert list(cap.get_xdata()) == [16, 16] and cap.get_color() == "red"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "data.max_response_length=16 (2 reach it, 40.0%)"
    ]
    assert not lengths_figure(lengths, None).axes[0].get_lines()


def test_timeline_plot_has_a_legend_of_replicas_and_one_line_per_switch() -> None:
    ax = timeline_figure(_run_data()[2]).axes[0]
    assert ax.get_title().startswith("generation timeline")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["replica 0", "replica 1"]
    switches = [line for line in ax.get_lines() if line.get_color() == "red"]
    assert len(switches) == 1 and list(switches[0].get_xdata()) == [0.15, 0.15]
    assert all(float(t).is_integer() for t in ax.get_yticks())


def _rank(tp: list[int], running: list[int]) -> dict[str, Any]:
    return {"t": [0.1 * i for i in range(len(tp))], "running": running, "tp": tp, "switches": []}


def test_replica_timelines_one_per_starting_tp_group() -> None:
    # 4 ranks starting at dp4 x tp1; ranks 2-3 fold into tp2 midway. Each keeps its own line,
    # labelled with the TP sizes it went through.
    folded = [
        _rank([1, 1], [4, 3]),
        _rank([1, 1], [4, 2]),
        _rank([1, 2], [4, 3]),
        _rank([1, 2], [4, 3]),
    ]
    assert [r["label"] for r in replica_timelines(folded)] == [
        "replica 0 (rank 0), tp 1",
        "replica 1 (rank 1), tp 1",
        "replica 2 (rank 2), tp 1->2",
        "replica 3 (rank 3), tp 1->2",
    ]
    # 4 ranks that opened at dp2 x tp2: the two groups' first ranks speak for them.
    opened = [_rank([2, 2], [8, 1]), _rank([2, 2], [8, 1]), _rank([2], [8]), _rank([2], [8])]
    replicas = replica_timelines(opened)
    assert [r["label"] for r in replicas] == [
        "replica 0 (ranks 0-1), tp 2",
        "replica 1 (ranks 2-3), tp 2",
    ]
    assert replicas[0]["running"] == [8, 1] and set(replicas[0]) == {
        "t",
        "running",
        "switches",
        "label",
    }
    assert replica_timelines([_rank([], [])]) == []  # no rollout yet: nothing to draw


def test_timeline_plot_marks_verify_steps_with_their_drafted_and_accepted_tokens() -> None:
    """A speculating replica's verify steps (start, drafted, accepted) pass through
    `replica_timelines` and are dots on its line, their totals in the legend; a replica that
    did not speculate has none."""
    spec = _rank([1, 1, 1, 1], [4, 3, 2, 1])
    t = spec["t"]
    spec["verify"] = [(t[2], 3, 2), (t[3], 2, 1)]  # the steps that left 2 and 1 running
    plain = _rank([1, 1], [4, 2])
    replicas = replica_timelines([spec, plain])
    assert replicas[0]["verify"] == spec["verify"] and "verify" not in replicas[1]
    ax = timeline_figure(replicas).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "replica 0 (rank 0), tp 1",
        "verify steps (2): 3/5 drafted tokens accepted",
        "replica 1 (rank 1), tp 1",
    ]
    dots = [line for line in ax.get_lines() if line.get_linestyle() == "None"]
    assert len(dots) == 1
    assert list(dots[0].get_xdata()) == [t[2], t[3]] and list(dots[0].get_ydata()) == [2, 1]
    assert dots[0].get_color() == ax.get_lines()[0].get_color()
