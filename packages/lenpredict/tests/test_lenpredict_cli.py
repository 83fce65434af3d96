import json

import pytest
from lenpredict_testkit import tp_speeds_up

from patrl.lenpredict import (
    LengthRecord,
    LongTailSpec,
    group_by_rollout,
    group_by_step,
    long_tail_trace,
    write_lengths,
)
from patrl.lenpredict.simulate import PolicySpec, main
from patrl_testkit.profiles import profile_from


def test_cli_prints_the_comparison_table(tmp_path, capsys):
    profile, lengths, out = tmp_path / "p.json", tmp_path / "l.jsonl", tmp_path / "rows.json"
    profile_from(tp_speeds_up).save(profile)
    write_lengths(lengths, long_tail_trace(LongTailSpec(median=50, max_length=400), 8, 4, steps=2))
    argv = ["--profile", str(profile), "--lengths", str(lengths), "--json", str(out)]
    assert main([*argv, "--policy", "static:2", "--policy", "adaptive"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("SIMULATED") and "64 samples in 2 rollout(s)" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["static:2", "adaptive"]
    assert rows[0]["vs_best_static"] == 0.0 and rows[1]["total_s"] < rows[0]["total_s"]
    assert main([*argv, "--lengths-known", "predicted"]) == 0  # every static TP + adaptive
    assert len(json.loads(out.read_text())["rows"]) == 5
    assert main([*argv, "--lengths-known", "predicted", "--finish-time", "independent"]) == 0


def test_cli_rejects_unknown_policies():
    with pytest.raises(ValueError, match="unknown policy 'dynamic'"):
        PolicySpec.parse("dynamic")
    assert PolicySpec.parse("static:4").tp == 4


def test_help_describes_the_input_formats(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for field in ("prompt_id", "response_tokens", "finish_reason", "round", "FILE:LINE"):
        assert field in text
    assert "patrl.rollout.profile" in text and "profile.json" in text


def test_bad_input_names_the_file_and_line(tmp_path):
    profile, lengths = tmp_path / "p.json", tmp_path / "l.jsonl"
    profile_from(tp_speeds_up).save(profile)
    good = LengthRecord(prompt_id="a", sample=0, prompt_tokens=10, response_tokens=5)
    lengths.write_text(good.model_dump_json() + "\n\n" + '{"prompt_id": "a", "sample": 1}\n')
    with pytest.raises(SystemExit, match=r"l\.jsonl:3: not a length record"):
        main(["--profile", str(profile), "--lengths", str(lengths)])
    clash = good.model_copy(update={"sample": 1, "prompt_tokens": 11})
    lengths.write_text(good.model_dump_json() + "\n" + clash.model_dump_json() + "\n")
    with pytest.raises(SystemExit, match=r"l\.jsonl:2: .*prompt_tokens=11, but 10 at line 1"):
        main(["--profile", str(profile), "--lengths", str(lengths)])
    lengths.write_text(good.model_dump_json() + "\n" + good.model_dump_json() + "\n")
    with pytest.raises(SystemExit, match=r"l\.jsonl:2: sample 0 .* also at line 1"):
        main(["--profile", str(profile), "--lengths", str(lengths)])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"--profile .*bad\.json: not a latency profile"):
        main(["--profile", str(tmp_path / "bad.json"), "--lengths", str(lengths)])
    with pytest.raises(SystemExit, match=r"--lengths .*missing\.jsonl"):
        main(["--profile", str(profile), "--lengths", str(tmp_path / "missing.jsonl")])
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit) as exit_:
            main(["--profile", str(profile), "--lengths", str(lengths), "--max-rollouts", bad])
        assert exit_.value.code == 2  # argparse's usage error, naming --max-rollouts
    binary = tmp_path / "lengths.bin"
    binary.write_bytes(b"\x00\xa9\xff" * 10)
    with pytest.raises(SystemExit, match=r"--lengths .*lengths\.bin: not a text file \(byte 1"):
        main(["--profile", str(profile), "--lengths", str(binary)])
    with pytest.raises(SystemExit, match=r"--profile .*lengths\.bin: not a text file"):
        main(["--profile", str(binary), "--lengths", str(lengths)])


def test_lengths_beyond_the_profile_are_warned_about(tmp_path, capsys):
    profile, lengths = tmp_path / "p.json", tmp_path / "l.jsonl"
    profile_from(tp_speeds_up, tp_sizes=(1, 2)).save(profile)  # contexts up to 8192 a sequence
    records = [
        LengthRecord(prompt_id="a", sample=i, prompt_tokens=100, response_tokens=n)
        for i, n in enumerate((50, 9000))
    ]
    write_lengths(lengths, records)
    assert main(["--profile", str(profile), "--lengths", str(lengths)]) == 0
    err = capsys.readouterr().err
    assert "1 of 2 samples" in err and "9100 tokens" in err and "8192" in err


def test_cost_sweep_prints_time_gpu_hours_and_the_sweet_spot(tmp_path, capsys):
    profile, lengths, out = tmp_path / "p.json", tmp_path / "l.jsonl", tmp_path / "sweep.json"
    profile_from(tp_speeds_up, tp_sizes=(1, 2)).save(profile)
    write_lengths(lengths, long_tail_trace(LongTailSpec(median=50, max_length=400), 8, 4, steps=2))
    argv = ["--profile", str(profile), "--lengths", str(lengths), "--json", str(out)]
    assert (
        main([*argv, "--sweep-gpus", "1,2,4", "--price-per-gpu-hour", "3", "--idle-gpus", "4"]) == 0
    )
    printed = capsys.readouterr().out
    assert (
        printed.startswith("SIMULATED cost sweep") and "sweet spot, adaptive TP allowed" in printed
    )
    sweep = json.loads(out.read_text())
    rows = sweep["rows"]
    assert {(r["gpus"], r["policy"]) for r in rows} == {
        (1, "static:1"), (2, "static:1"), (2, "static:2"), (2, "adaptive"),
        (4, "static:1"), (4, "static:2"), (4, "adaptive"),
    }  # fmt: skip
    for r in rows:
        assert r["gpu_hours"] == pytest.approx(r["gpus"] * r["time_s"] / 3600)
        assert r["cost_with_idle"] == pytest.approx(3 * (r["gpus"] + 4) * r["time_s"] / 3600)
    assert sweep["sweet_spot"]["cost_with_idle"] == min(r["cost_with_idle"] for r in rows)
    statics = [r for r in rows if r["policy"].startswith("static")]
    assert sweep["sweet_spot_static"]["cost_with_idle"] == min(r["cost_with_idle"] for r in statics)
    # more GPUs finish sooner, but cost more GPU-hours for the same work (idle tails)
    one = {r["gpus"]: r for r in rows if r["policy"] == "static:1"}
    assert one[4]["time_s"] < one[1]["time_s"] and one[4]["gpu_hours"] > one[1]["gpu_hours"]


def test_a_tp1_profile_sweeps_replica_counts(tmp_path, capsys):
    """A 1-process run's profile holds TP 1 only: the sweep compares replica counts."""
    profile, lengths = tmp_path / "p.json", tmp_path / "l.jsonl"
    profile_from(tp_speeds_up, tp_sizes=(1,), num_devices=1).save(profile)
    write_lengths(lengths, long_tail_trace(LongTailSpec(median=50, max_length=400), 8, 4))
    assert (
        main(["--profile", str(profile), "--lengths", str(lengths), "--sweep-gpus", "1,2,8"]) == 0
    )
    printed = capsys.readouterr().out
    assert "adaptive" not in printed.split("sweet spot")[0]
    assert printed.count("static:1") >= 3


def test_rounds_of_a_step_are_rollouts_of_their_own(tmp_path, capsys):
    """DAPO's dynamic sampling generates several rounds a step: each is simulated alone."""
    profile, lengths = tmp_path / "p.json", tmp_path / "l.jsonl"
    profile_from(tp_speeds_up, tp_sizes=(1, 2)).save(profile)
    records = [
        LengthRecord(step=3, round=r, prompt_id=p, sample=i, prompt_tokens=20, response_tokens=n)
        for r, p in ((0, "a"), (1, "b"))
        for i, n in enumerate((30, 60))
    ]
    write_lengths(lengths, records)
    assert main(["--profile", str(profile), "--lengths", str(lengths)]) == 0
    assert "4 samples in 2 rollout(s)" in capsys.readouterr().out
    assert list(group_by_rollout(records)) == [(3, 0), (3, 1)]
    with pytest.raises(ValueError, match="several generation rounds"):
        group_by_step(records)
