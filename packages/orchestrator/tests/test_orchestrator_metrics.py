"""MetricsLogger: JSONL rows, resumed history, and a summary that compares like with like."""

from __future__ import annotations

import json
from pathlib import Path

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
