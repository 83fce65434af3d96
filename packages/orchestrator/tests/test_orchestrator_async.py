"""Asynchronous GRPO (async_loop.py): parity with the synchronous loop at max_staleness=0, the
staleness bound over a whole run, the control plane's failure reports, the weight store."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from patrl.lenpredict import read_lengths
from patrl.orchestrator import run_checkpoint
from patrl.orchestrator.async_loop import AsyncGRPO
from patrl.orchestrator.async_rl.tickets import token_versions
from patrl.orchestrator.async_rl.trainer_worker import TrainerWorker
from patrl.orchestrator.config import load_config
from patrl.orchestrator.control import ControlPlane, PeerFailed
from patrl.orchestrator.distributed import World
from patrl.orchestrator.length_log import LENGTH_LOG
from patrl.orchestrator.sync_loop import SyncGRPO
from patrl.orchestrator.weight_store import WeightStore
from patrl_testkit.clock import FakeClock
from patrl_testkit.jobs import learning_job_extras, tiny_job_overrides
from patrl_testkit.multirank import run_ranks


def job_config(assets: Path, run_dir: Path, **extra: Any) -> Any:
    own = {"trainer.total_training_steps": 3, "trainer.save_freq": 0}
    extras = {**learning_job_extras(assets), **own, **extra}
    return load_config(None, tiny_job_overrides(assets, run_dir, **extras))


def _async_run(
    rank: int, world_size: int, assets: Path, run_dir: Path, extra: dict[str, Any]
) -> dict[str, Any]:
    world = World(rank, world_size, rank, torch.device("cpu"))
    config = job_config(assets, run_dir, **{"trainer.mode": "async", **extra})
    files = (config.data.train_files, config.data.val_files)
    loop = AsyncGRPO(config, world, str(assets / "model"), *files, peer_timeout_s=120)
    result = loop.run()
    if not isinstance(loop.role, TrainerWorker):
        return {"role": "rollout"}
    return {
        "role": "trainer",
        "history": result.history,
        "trained": loop.role.trained_versions,
        "weight_versions": loop.role.job.weights.versions(),
        "weights": {
            n: t.numpy().copy() for b in loop.role.trainer.iter_full_weights(1 << 20) for n, t in b
        },
    }


SAMPLE_KEYS = (
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "critic/advantages/max",
    "critic/advantages/min",
    "response_length/mean",
    "response_length/max",
    "response_length/min",
    "prompt_length/mean",
)
ACTOR_KEYS = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl")


CRITIC_KEYS = (
    "critic/vf_loss",
    "critic/vf_explained_var",
    "critic/values/mean",
    "critic/returns/mean",
    "critic/grad_norm",
)
GAE = {"algorithm.adv_estimator": "gae", "algorithm.lam": 0.95, "critic.optim.lr": 3e-3}


@pytest.mark.e2e
@pytest.mark.multirank
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_staleness_zero_reproduces_the_sync_loop(
    assets: Path, tmp_path: Path, estimator: str
) -> None:
    """1 rollout + 1 trainer rank at max_staleness=0 against the sync loop on one rank, same
    seeds; under grpo the async run stops after step 1 and resumes from its checkpoint for
    step 2 (the trainer republishes its weights, the rollout restores the loader position);
    under gae (the critic on the trainer rank) it runs both steps at once.

    Samples, rewards and advantages must be equal: the same prompts are sampled with the same
    seeds from the same weights. Actor metrics differ only by decoupled PPO's behaviour weight
    exp(proximal - behaviour), which is 1 up to the engine/trainer logprob mismatch (~1e-6 in
    fp32 on CPU), hence rtol 1e-4. The critic trains on-policy for itself in both schedules,
    so its metrics match as closely."""
    algo: dict[str, Any] = GAE if estimator == "gae" else {}
    extra: dict[str, Any] = {
        "async_rl.max_staleness": 0,
        "async_rl.rollout_ranks": 1,
        "trainer.test_freq": 1,
        "trainer.val_before_train": "true",
        **algo,
    }
    # RunLoop checkpoints the critic alike in both schedules; the sync resume test covers it.
    for steps in (1, 2) if estimator == "grpo" else (2,):
        extra["trainer.total_training_steps"] = steps
        results = run_ranks(
            _async_run, world_size=2, args=(assets, tmp_path / "async", extra), timeout_s=300
        )
    assert [r["role"] for r in results] == ["rollout", "trainer"]
    async_steps = [h for h in results[1]["history"] if "critic/score/mean" in h]

    extra = {
        "trainer.total_training_steps": 2,
        "trainer.test_freq": 1,
        "trainer.val_before_train": "true",
        **algo,
    }
    config = job_config(assets, tmp_path / "sync", **extra)
    world = World(0, 1, 0, torch.device("cpu"))
    files = (config.data.train_files, config.data.val_files)
    sync_history = SyncGRPO(config, world, str(assets / "model"), *files).run().history
    sync_steps = [h for h in sync_history if "critic/score/mean" in h]

    # Validation: rank 0 validated versions 0, 1, 2 like the sync loop before and after steps.
    def validation(history: list[dict[str, float]]) -> list[tuple[float, float]]:
        return [
            (h["step"], h["val-core/acc/mean@1"]) for h in history if "val-core/acc/mean@1" in h
        ]

    assert validation(results[1]["history"]) == validation(sync_history)
    assert [step for step, _ in validation(sync_history)] == [0.0, 1.0, 2.0]

    assert len(async_steps) == len(sync_steps) == 2
    for a, s in zip(async_steps, sync_steps, strict=True):
        for key in SAMPLE_KEYS:
            assert a[key] == pytest.approx(s[key], rel=1e-6, abs=1e-9), key
        for key in ACTOR_KEYS + (CRITIC_KEYS if estimator == "gae" else ()):
            assert a[key] == pytest.approx(s[key], rel=1e-4, abs=1e-6), key
        assert a["async/staleness_max"] == 0.0
        assert a["async/staleness_count/0"] == 16.0
        assert a["actor/behav_capped_frac"] == 0.0
        assert a["actor/behav_imp_weight"] == pytest.approx(1.0, abs=1e-4)
        assert a["time/wait_for_batch"] >= 0.0 and a["time/wait_for_weights"] >= 0.0
    # The advantages were not all zero: the comparison above covered real updates.
    assert any(s["critic/advantages/max"] > 0 for s in sync_steps)
    # The async schedule's checkpoints hold the policy as a Hugging Face directory too.
    hf = run_checkpoint.hf_dir(run_checkpoint.step_dir(tmp_path / "async", 2))
    exported = load_file(hf / "model.safetensors")
    assert (hf / "config.json").is_file() and (hf / "tokenizer.json").is_file()
    assert exported.keys() == results[1]["weights"].keys()
    for name, t in results[1]["weights"].items():
        assert torch.equal(exported[name], torch.from_numpy(t)), name


@pytest.mark.e2e
@pytest.mark.multirank
def test_staleness_two_is_never_exceeded(assets: Path, tmp_path: Path) -> None:
    """2 rollout + 1 trainer rank at max_staleness=2: every trained sample's oldest token is at
    most 2 versions behind the weights it trains, asserted from the recorded token versions;
    each step trains its own tickets; and the rollout did run ahead (some staleness > 0).
    verl's dumps: the trainer writes each step's trained responses, rollout rank 0 each
    validation's."""
    extra = {
        "async_rl.max_staleness": 2,
        "async_rl.rollout_ranks": 2,
        "trainer.test_freq": 2,
        "trainer.val_before_train": "true",
        "trainer.rollout_data_dir": str(tmp_path / "rollouts"),
        "trainer.validation_data_dir": str(tmp_path / "validations"),
    }
    steps = 3
    extra["trainer.total_training_steps"] = steps
    results = run_ranks(_async_run, world_size=3, args=(assets, tmp_path, extra), timeout_s=300)
    trainer = results[2]
    history = [h for h in trainer["history"] if "critic/score/mean" in h]
    validated = [h["step"] for h in trainer["history"] if "val-core/acc/mean@1" in h]
    # before training, after step 2 and after the last step (verl's rule), by rollout rank 0
    assert validated == [0.0, 2.0, 3.0]
    assert [h["step"] for h in history] == [1.0, 2.0, 3.0]
    trained = trainer["trained"]
    assert len(trained) == steps * 4 * 4  # steps x prompts x samples
    for step, ticket, oldest, newest in trained:
        weights = step - 1  # the version the step's update starts from
        assert (step - 1) * 4 <= ticket < step * 4
        assert 0 <= weights - oldest <= 2, (step, ticket, oldest)
        assert oldest <= newest <= weights
    assert max(step - 1 - oldest for step, _, oldest, _ in trained) >= 1
    for h in history:
        assert h["async/staleness_max"] <= 2
        assert sum(h[f"async/staleness_count/{s}"] for s in range(3)) == 16
    # The newest version stays on disk (older ones go once no rollout rank holds them): the
    # last step's, published for its validation.
    assert trainer["weight_versions"][-1] == steps
    # The trainer logs each step's trained samples for the simulator.
    records = read_lengths(job_config(assets, tmp_path).run_dir / LENGTH_LOG)
    assert [sum(r.step == s for r in records) for s in range(1, steps + 1)] == [16] * steps
    dumped = {int(p.stem): p for p in (tmp_path / "rollouts").glob("*.jsonl")}
    assert sorted(dumped) == [1, 2, 3]
    for step, path in dumped.items():
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        assert len(rows) == 16 and {r["step"] for r in rows} == {step}
        mean = sum(r["score"] for r in rows) / len(rows)
        (logged,) = [h for h in history if h["step"] == step]
        assert mean == pytest.approx(logged["critic/score/mean"])  # the responses it trained
    val_rows = {int(p.stem): p for p in (tmp_path / "validations").glob("*.jsonl")}
    assert sorted(val_rows) == [0, 2, 3]
    for version, path in val_rows.items():
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        (logged,) = [
            h for h in trainer["history"] if h["step"] == version and "val-core/acc/mean@1" in h
        ]
        mean = sum(r["score"] for r in rows) / len(rows)
        assert mean == pytest.approx(logged["val-core/acc/mean@1"])


def _stalled_peer(rank: int, world_size: int) -> str:
    """Rank 0 never beats (stalled, or its host is gone); rank 1 waits on it through the
    job's own store, as the trainer waits for samples. Rank 0 stays (holding the store) until
    rank 1 has its verdict, however slowly either started."""
    control = ControlPlane.of_default_group(rank, timeout_s=1.5)
    if rank == 0:
        # A blocking store wait, not `wait_until` (which beats); its deadline is a safety net.
        control.store.wait([control.prefix + "verdict"], timedelta(seconds=150))
        return ""
    with pytest.raises(PeerFailed) as err:
        control.wait_until(lambda: control.has(["sample/0"]), "the samples of step 1", [0])
    control.put("verdict", "1")
    return str(err.value)


@pytest.mark.multirank
def test_a_stalled_peer_is_named_not_waited_for() -> None:
    results = run_ranks(_stalled_peer, world_size=2, timeout_s=180)
    assert results[1] == "rank 1: ranks [0] sent no heartbeat for 2 s (dead or stalled)"


# ------------------------------------------------------------------ single-process parts


def test_token_versions_follow_the_switch_points() -> None:
    assert token_versions([(0, 3)], 4) == [3, 3, 3, 3]
    # Loaded v4 after 2 tokens and v5 after 3; a switch before the first token wins.
    assert token_versions([(0, 3), (2, 4), (3, 5)], 5) == [3, 3, 4, 5, 5]
    assert token_versions([(0, 3), (0, 4)], 2) == [4, 4]
    assert token_versions([(0, 1)], 0) == []


def test_control_plane_reports_failures_and_stale_peers() -> None:
    store, clock = dist.HashStore(), FakeClock()
    # Times that floats hold exactly: the boundary below is exactly timeout_s.
    a, b = (ControlPlane(store, r, timeout_s=0.25, clock=clock, sleep=clock.sleep) for r in (0, 1))
    a.beat()
    b.check_alive([0])  # first sight: the clock starts
    clock.advance(0.25)
    b.check_alive([0])  # silent for exactly timeout_s: not yet stale
    clock.advance(0.125)
    with pytest.raises(PeerFailed, match=r"ranks \[0\] sent no heartbeat"):
        b.check_alive([0])
    a.beat()  # rate-limited: 0.375 s since the last beat, too soon for another
    with pytest.raises(PeerFailed, match=r"ranks \[0\] sent no heartbeat"):
        b.check_alive([0])
    a.beat(now=True)
    b.check_alive([0])  # moved: alive again
    with pytest.raises(PeerFailed, match="while waiting for nothing"):
        a.finish()
        b.wait_until(lambda: False, "nothing", [])
    c = ControlPlane(dist.HashStore(), 2, timeout_s=5, clock=clock, sleep=clock.sleep)
    assert not c.done()
    c.fail("boom")
    c.fail("a consequence")  # the first failure is the one reported
    with pytest.raises(PeerFailed, match="rank 2: boom"):
        c.done()
    assert c.wait_until(lambda: True, "x", []) == 0.0
    d = ControlPlane(dist.HashStore(), 3, timeout_s=5, clock=clock, sleep=clock.sleep)
    polls = iter([False, False, True])
    assert d.wait_until(lambda: next(polls), "x", [], poll_s=0.5) == 1.0  # two polls slept


def test_a_wait_fails_once_its_peer_is_silent_for_timeout_s() -> None:
    """A wait polls on the plane's clock: it fails on the poll that finds the peer silent for
    more than timeout_s, having slept that long, and not before."""
    store, clock = dist.HashStore(), FakeClock()
    peer, waiter = (ControlPlane(store, r, 1.0, clock=clock, sleep=clock.sleep) for r in (0, 1))
    peer.beat()
    start = clock()
    with pytest.raises(PeerFailed, match=r"ranks \[0\] sent no heartbeat"):
        waiter.wait_until(lambda: False, "samples", [0], poll_s=0.25)
    assert clock() - start == 1.25  # the first poll past the deadline


def test_waiting_on_peers_that_beat_but_never_work_fails() -> None:
    """Alive is not enough: if no peer works while one waits, the wait fails by name."""
    store, clock = dist.HashStore(), FakeClock()
    waiter, *peers = (
        ControlPlane(store, r, timeout_s=0.2, clock=clock, sleep=clock.sleep) for r in (0, 1, 2)
    )
    waiter.check_progress([1, 2], "step 3")  # first sight
    clock.advance(0.3)
    peers[1].progress()  # one of them works: fine
    waiter.check_progress([1, 2], "step 3")
    clock.advance(0.3)
    with pytest.raises(PeerFailed, match=r"ranks \[1, 2\] are alive but did no work .* step 3"):
        waiter.check_progress([1, 2], "step 3")


def test_weight_store_round_trip_and_pruning(tmp_path: Path) -> None:
    store = WeightStore(tmp_path)
    w = {"a": torch.randn(3, 4), "b": torch.arange(5.0), "c": torch.randn(2).t()}
    for version in (1, 2, 3):
        store.publish(version, [[("a", w["a"] * version), ("b", w["b"])], [("c", w["c"])]])
    assert store.versions() == [1, 2, 3]
    got = dict(store.load(2))
    assert set(got) == {"a", "b", "c"}
    torch.testing.assert_close(got["a"], w["a"] * 2)
    torch.testing.assert_close(got["c"], w["c"])
    (tmp_path / "v4.tmp").mkdir()  # an unfinished write is no version
    store.prune(3)
    assert store.versions() == [3]
    with pytest.raises(FileNotFoundError, match="weights version 7"):
        list(store.load(7))


def test_unsupported_async_options_fail_by_name(assets: Path, tmp_path: Path) -> None:
    world = World(0, 2, 0, torch.device("cpu"))
    cases = [
        ({"async_rl.rollout_ranks": 2}, "async_rl.rollout_ranks=2 leaves no trainer rank"),
        ({"rollout.over_sample_rate": 0.5}, "rollout.over_sample_rate=0"),
        ({"algorithm.filter_groups.enable": "true"}, "filter_groups"),
        ({"algorithm.adv_estimator": "remax"}, "adv_estimator=remax: its greedy baseline"),
        (
            {
                "reward_model.enable": "true",
                "reward_model.model.path": "/no/rm",
                "reward_model.strategy": "fsdp",
            },
            "reward_model.strategy=fsdp: a sharded",
        ),
    ]
    for extra, message in cases:
        config = job_config(assets, tmp_path, **{"trainer.mode": "async", **extra})
        with pytest.raises(ValueError, match=message):
            AsyncGRPO(config, world, str(assets / "model"), config.data.train_files, None)
