"""An engine under torchrun with no process group made: it joins the world from torchrun's
environment and builds its own groups, and generates what one process generates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_engine_job import GREEDY, prompts

from patrl.rollout import Engine, EngineConfig, StaticTP
from patrl_testkit.models import save_hf_model, tiny_hf_model
from patrl_testkit.processes import kill_tree
from patrl_testkit.profiles import synthetic_profile

JOB = Path(__file__).with_name("torchrun_engine_job.py")
TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(tiny_hf_model("llama"), tmp_path_factory.mktemp("llama"))


def run_torchrun(args: list[str], log: Path) -> None:
    """The job on 2 ranks of one torchrun agent; fails the test with its output if it fails
    or outlives TIMEOUT_S (then it and its workers are killed)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(JOB), *args,
    ]  # fmt: skip
    tests = str(Path(__file__).parent)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
    }
    with log.open("w") as out:
        job = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        code = job.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_tree(job.pid)
        job.wait()
        pytest.fail(f"torchrun hung past {TIMEOUT_S:.0f}s:\n{log.read_text()[-5000:]}")
    if code != 0:
        pytest.fail(f"torchrun failed with exit code {code}:\n{log.read_text()[-5000:]}")


@pytest.mark.e2e
@pytest.mark.multirank
@pytest.mark.slow
def test_static_tp2_and_adaptive_engines_join_torchrun_by_themselves(
    llama_dir: Path, tmp_path: Path
) -> None:
    profile = tmp_path / "profile.json"
    synthetic_profile(str(llama_dir), tp2_speedup=20.0).save(str(profile))
    run_torchrun([str(llama_dir), str(profile), str(tmp_path)], tmp_path / "torchrun.log")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    one = Engine(EngineConfig(model=str(llama_dir), block_size=4, num_kv_blocks=64))
    expected = [o.outputs[0].token_ids for o in one.generate(prompts(), GREEDY)]
    for rank, got in enumerate(ranks):
        assert got["backend"] == "gloo"
        assert (got["tp_size"], got["tp_rank"]) == (2, rank)
        assert got["kv_blocks"] == 8 * 16  # the CPU default, sized at tp 2: 8 x 64 tokens
        assert got["static"] == expected
        assert got["adaptive_world"] == 2
        assert got["adaptive"] == expected[rank::2]


def test_static_tp2_without_a_launcher_says_how_to_launch(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    config = EngineConfig(model=str(llama_dir), tp_policy=StaticTP(tp=2))
    with pytest.raises(ValueError, match=r"StaticTP\(tp=2\) needs several ranks.*torchrun"):
        Engine(config)
