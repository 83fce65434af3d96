"""MetricsLogger: JSONL rows, resumed history, and a summary that compares like with like."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from patrl.orchestrator.metrics import MetricsLogger


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
