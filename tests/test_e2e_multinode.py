"""Two "nodes" on this host: two torchrun agents (`--nnodes 2`, c10d rendezvous, 2 ranks each)
run 2 GRPO steps of the real job.

Adaptive TP is offered folds of 1, 2 and 4 under a profile on which every larger fold pays. A
fold of 4 would put a TP group across both nodes, so it must not be offered: the run folds to
2, inside each node, with shared-memory TP collectives, and the world (two nodes) gets none. A
node is a torchrun agent, not a host: these two share one, and must still behave as two
machines would. A failing or hanging agent ends the test in bounded time with both outputs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from patrl_testkit.jobs import addition_job, tiny_job_overrides
from patrl_testkit.multirank import free_port
from patrl_testkit.processes import descendants
from patrl_testkit.profiles import synthetic_profile

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

NODES, PER_NODE = 2, 2
JOB_TIMEOUT_S = 150.0  # a hang must fail the test, not the CI job


def job_overrides(assets: Path, out: Path, profile: Path) -> list[str]:
    return tiny_job_overrides(
        assets,
        out,
        **{
            "rollout.adaptive_tp.enable": "true",
            "rollout.adaptive_tp.candidates": "[1,2,4]",
            "rollout.adaptive_tp.profile": profile,
            "reward.functions": '[{name: "patrl_testkit.jobs:digit_reward"}]',
            "trainer.total_training_steps": 2,
            "trainer.save_freq": 0,
        },
    )


def start_agent(overrides: list[str], endpoint: str, rdzv_id: str, log: Path) -> subprocess.Popen:
    """One node: a torchrun agent in its own session (so it and its workers die together)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(NODES),
        "--nproc_per_node",
        str(PER_NODE),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "-m",
        "patrl.orchestrator",
        *overrides,
    ]
    tests = str(Path(__file__).parent)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
    }
    with log.open("w") as out:
        return subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def run_nodes(overrides: list[str], logs: list[Path]) -> list[int]:
    """Every agent's exit code. An agent that fails or outlives JOB_TIMEOUT_S takes the
    others down with it and fails the test with every agent's output."""
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv_id = f"patrl-test-{uuid.uuid4().hex[:8]}"
    agents = [start_agent(overrides, endpoint, rdzv_id, log) for log in logs]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    problem = None
    try:
        while problem is None:
            codes = [a.poll() for a in agents]
            if all(c == 0 for c in codes):
                return [0] * len(agents)
            if any(c not in (None, 0) for c in codes):
                problem = f"an agent failed: exit codes {codes}"
            elif time.monotonic() > deadline:
                problem = f"the job hung: still running after {JOB_TIMEOUT_S:.0f}s"
            else:
                time.sleep(0.2)
    finally:
        stop(agents)
    outputs = "\n".join(
        f"--- node agent {i}:\n{log.read_text()[-5000:]}" for i, log in enumerate(logs)
    )
    pytest.fail(f"{problem}\n{outputs}")


def stop(agents: list[subprocess.Popen]) -> None:
    """End every agent still running and its workers (which torchrun starts in sessions of
    their own): SIGTERM, on which torchrun stops its workers, then SIGKILL to whatever of them
    is left after a grace period."""
    running = [a for a in agents if a.poll() is None]
    workers = [w for a in running for w in descendants(a.pid)]
    for agent in running:
        agent.send_signal(signal.SIGTERM)
    grace = time.monotonic() + 10.0
    while any(a.poll() is None for a in running) and time.monotonic() < grace:
        time.sleep(0.1)
    for pid in [a.pid for a in running if a.poll() is None] + workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for agent in agents:
        agent.wait()


@pytest.mark.e2e
def test_two_nodes_keep_every_tp_group_inside_a_node(tmp_path: Path) -> None:
    assets = addition_job(tmp_path / "assets")
    profile = tmp_path / "profile.json"
    synthetic_profile(str(assets / "model"), tp2_speedup=20.0, tp_sizes=(1, 2, 4)).save(profile)
    logs = [tmp_path / f"node{i}.log" for i in range(NODES)]
    run_nodes(job_overrides(assets, tmp_path, profile), logs)
    run_dir = tmp_path  # trainer.default_local_dir

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert max(r["rollout/tp_max"] for r in steps) == 2  # folded, and never across nodes

    topology = json.loads((run_dir / "topology.json").read_text())
    assert topology["world_size"] == NODES * PER_NODE
    assert topology["node_sizes"] == [PER_NODE] * NODES
    assert topology["tp_sizes"] == [1, 2]  # the fold of 4 would span both nodes: not offered
    ranks = topology["ranks"]
    assert [r["rank"] for r in ranks] == list(range(NODES * PER_NODE))
    assert len({r["host"] for r in ranks}) == 1  # one host, yet two nodes
    node = {r["rank"]: r["node"] for r in ranks}  # each rank's own GROUP_RANK
    assert sorted(node.values()) == [n for n in range(NODES) for _ in range(PER_NODE)]
    for r in ranks:
        for size, tp in r["tp"].items():
            assert r["rank"] in tp["group"] and len(tp["group"]) == int(size)
            assert {node[m] for m in tp["group"]} == {node[r["rank"]]}, (size, tp)
        assert r["tp"]["2"]["comm"] == "shm"  # gloo ranks of one node: shared memory
    assert topology["world_comm"] == "process_group"  # the world spans nodes: no shm
    assert "topology: 2 node(s)" in logs[0].read_text() + logs[1].read_text()
