import json

import pytest
from lenpredict_testkit import tp_speeds_up

from patrl.lenpredict import LongTailSpec, long_tail_trace, write_lengths
from patrl.lenpredict.simulate import PolicySpec, main
from patrl_testkit.profiles import profile_from


def test_cli_prints_the_comparison_table(tmp_path, capsys):
    profile, lengths, out = tmp_path / "p.json", tmp_path / "l.jsonl", tmp_path / "rows.json"
    profile_from(tp_speeds_up).save(profile)
    write_lengths(lengths, long_tail_trace(LongTailSpec(median=50, max_length=400), 8, 4, steps=2))
    argv = ["--profile", str(profile), "--lengths", str(lengths), "--json", str(out)]
    assert main([*argv, "--policy", "static:2", "--policy", "adaptive"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("SIMULATED") and "64 samples in 2 step(s)" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["static:2", "adaptive"]
    assert rows[0]["vs_best_static"] == 0.0 and rows[1]["total_s"] < rows[0]["total_s"]
    assert main([*argv, "--lengths-known", "predicted"]) == 0  # every static TP + adaptive
    assert len(json.loads(out.read_text())["rows"]) == 5


def test_cli_rejects_unknown_policies():
    with pytest.raises(ValueError, match="unknown policy 'dynamic'"):
        PolicySpec.parse("dynamic")
    assert PolicySpec.parse("static:4").tp == 4
