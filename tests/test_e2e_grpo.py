"""The real GRPO loop end to end on a tiny random model: 2 ranks, resume, config errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.orchestrator import run_checkpoint
from patrl.orchestrator.config import ConfigError, load_config
from patrl.orchestrator.distributed import World
from patrl.orchestrator.main import main
from patrl.orchestrator.run import completed
from patrl.orchestrator.sync_loop import SyncGRPO
from patrl.rollout import SamplingParams
from patrl_testkit.jobs import learning_job_extras, tiny_job_overrides
from patrl_testkit.multirank import run_ranks
from patrl_testkit.profiles import synthetic_profile


def overrides(assets: Path, run_dir: Path, **extra: Any) -> list[str]:
    own = {
        "rollout.adaptive_tp.enable": "true",
        "trainer.total_training_steps": 2,
        "trainer.test_freq": 2,
        "trainer.save_freq": 0,
        "trainer.val_before_train": "true",
    }
    return tiny_job_overrides(assets, run_dir, **{**learning_job_extras(assets), **own, **extra})


def make_loop(assets: Path, run_dir: Path, world: World, **extra: Any) -> SyncGRPO:
    config = load_config(None, overrides(assets, run_dir, **extra))
    return SyncGRPO(
        config, world, str(assets / "model"), config.data.train_files, config.data.val_files
    )


def _two_rank_run(rank: int, world_size: int, assets: Path, run_dir: Path) -> dict[str, Any]:
    world = World(rank, world_size, rank, torch.device("cpu"))
    # Adaptive TP (the default) on a profile under which tp=2 always pays: the first rollout
    # (validation, before step 1) starts at dp2 x tp1 and switches to tp2 at its first check;
    # the weight syncs then load the weights at tp2 and the training rollouts open there, the
    # two ranks' shares of the batch merged, and never switch. Length-aware assignment: both ranks must derive the same split from their
    # predictors.
    profile = run_dir / "profile.json"
    if rank == 0:
        synthetic_profile(str(assets / "model"), tp2_speedup=20.0).save(profile)
    torch.distributed.barrier()
    extra = {
        "rollout.prompt_assignment": "length_aware",
        "rollout.adaptive_tp.profile": profile,
        "trainer.plots": "true",
    }
    loop = make_loop(assets, run_dir, world, **extra)
    before = {k: v.clone() for bucket in loop.trainer.iter_full_weights(1 << 20) for k, v in bucket}
    result = loop.run()
    after = {k: v.clone() for bucket in loop.trainer.iter_full_weights(1 << 20) for k, v in bucket}
    changed = max(float((after[k] - before[k]).abs().max()) for k in before)
    # The engine holds exactly the trainer's new weights: its logprobs are the trainer's.
    out = loop.engine.generate(
        [[1, 70, 71]], SamplingParams(seed=5, max_tokens=8, ignore_eos=True)
    )[0].outputs[0]
    from patrl.trainer import PolicyBatch

    batch = PolicyBatch.from_responses([[1, 70, 71]], [out.token_ids], [0.0])
    trainer_lp = loop.trainer.compute_logprobs(batch)[0][-len(out.token_ids) :]
    gap = float((trainer_lp - torch.tensor(out.logprobs)).abs().max())
    labels = [t["label"] for t in loop.timelines()]
    return {"history": result.history, "changed": changed, "gap": gap, "timelines": labels}


@pytest.mark.e2e
@pytest.mark.multirank
def test_two_ranks_two_steps_through_the_real_loop(assets: Path, tmp_path: Path) -> None:
    results = run_ranks(_two_rank_run, world_size=2, args=(assets, tmp_path), timeout_s=300)
    first = results[0]
    steps = [h for h in first["history"] if "critic/score/mean" in h]
    assert [h["step"] for h in steps] == [1.0, 2.0]
    assert any("val-core/acc/mean@1" in h for h in first["history"])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(first["history"])
    for key in (
        "timing_s/gen",
        "timing_s/update_actor",
        "timing_s/update_weights",
        "actor/pg_loss",
        "actor/grad_norm",
    ):
        assert key in steps[0]
    assert all(r["changed"] > 0 for r in results)  # the optimizer moved the weights
    assert all(r["gap"] < 1e-4 for r in results)  # and the engine got them
    assert steps[1]["training/rollout_probs_diff_max"] < 1e-4
    assert "timing_s/old_log_prob" in steps[0]  # two mini-batches: a scoring pass first
    assert run_checkpoint.latest_checkpoint(tmp_path) is not None
    assert "lenpredict/prompt_mean_abs_error" in steps[1]
    assert [h["rollout/tp_switches"] for h in steps] == [0, 0]
    assert all(h["rollout/tp_max"] == 2 for h in steps)
    # The timeline plot gathers every replica's rollout: one TP-2 replica of both ranks.
    assert [r["timelines"] for r in results] == [["replica 0 (ranks 0-1), tp 2"]] * 2
    for png in ("reward.png", "response_lengths.png", "generation_timeline.png"):
        assert (tmp_path / png).is_file()


def _four_ranks_opening_at_tp2(
    rank: int, world_size: int, assets: Path, run_dir: Path, partial: bool
) -> dict[str, Any]:
    world = World(rank, world_size, rank, torch.device("cpu"))
    profile = run_dir / "profile.json"
    if rank == 0:
        synthetic_profile(str(assets / "model"), tp2_speedup=20.0, tp_sizes=(1, 2, 4)).save(profile)
    torch.distributed.barrier()
    extra = {
        "rollout.adaptive_tp.candidates": "[2,4]",
        "rollout.adaptive_tp.profile": profile,
        "trainer.total_training_steps": 1,
        "trainer.val_before_train": "false",
        "trainer.test_freq": 0,
        "data.train_batch_size": 8,
        "actor.ppo_mini_batch_size": 8,
        "rollout.over_sample_rate": 0.5 if partial else 0.0,
    }
    loop = make_loop(assets, run_dir, world, **extra)
    handed: list[list[str]] = []  # the training requests this rank handed to the engine
    generate, generate_partial = loop.engine.generate, loop.engine.generate_partial

    def recording(prompts: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        handed.append(sorted(kwargs["prompt_keys"]))
        return generate(prompts, params, *args, **kwargs)

    def recording_partial(prompts: Any, params: Any, quota: int, **kwargs: Any) -> Any:
        handed.append(sorted(kwargs["request_ids"]))
        return generate_partial(prompts, params, quota, **kwargs)

    loop.engine.generate = recording  # type: ignore[method-assign]
    loop.engine.generate_partial = recording_partial  # type: ignore[method-assign]
    history = loop.run().history
    return {"handed": handed, "history": history, "opened_tp": loop.layout.tp_size}


@pytest.mark.e2e
@pytest.mark.multirank
@pytest.mark.parametrize("partial", [False, True], ids=["generate", "partial"])
def test_adaptive_tp_opening_at_tp2_runs_each_prompt_once(
    assets: Path, tmp_path: Path, partial: bool
) -> None:
    """Candidates [2, 4] on 4 ranks: the engine opens at TP 2 (two replicas of two ranks).
    `generate` gathers every rank's requests into the replica that runs them, so each rank
    hands in a share of its own: the batch's 8 prompts go once over the world, not once per
    TP rank. A partial rollout (`generate_partial`) queues what each rank hands in on its
    own replica, so a replica's two ranks hand in the same requests (one share a replica)
    and its first rank scores them. Either way the step trains 8 groups of n samples."""
    results = run_ranks(
        _four_ranks_opening_at_tp2,
        world_size=4,
        args=(assets, tmp_path, partial),
        timeout_s=300,
    )
    assert [r["opened_tp"] for r in results] == [2] * 4
    handed = [r["handed"] for r in results]
    assert all(len(h) == 1 for h in handed)  # one training rollout
    shares = [h[0] for h in handed]
    if partial:
        assert shares[0] == shares[1] and shares[2] == shares[3]  # a replica's ranks
        every = shares[0] + shares[2]
        assert len(every) == len(set(every)) == 12  # 8 x (1 + 0.5) groups, once each
    else:
        every = [key for share in shares for key in share]
        assert len(every) == len(set(every)) == 8  # disjoint, and the whole batch
    (step,) = [h for h in results[0]["history"] if "critic/score/mean" in h]
    assert step["response_length/mean"] > 0 and step["actor/pg_loss"] == step["actor/pg_loss"]
    if partial:
        assert step["partial/finished_groups"] >= 8


KEYS = (
    "critic/score/mean",
    "response_length/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
)


@pytest.mark.e2e
def test_resume_reproduces_the_uninterrupted_run(
    assets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run of 2 steps, extended to 4 by raising total_training_steps, equals a straight run
    of 4; re-running it unchanged in between says it is complete and does nothing."""
    world = World(0, 1, 0, torch.device("cpu"))
    straight = make_loop(assets, tmp_path / "a", world, **{"trainer.total_training_steps": 4}).run()
    make_loop(assets, tmp_path / "b", world, **{"trainer.save_freq": 2}).run()
    run_dir = tmp_path / "b"
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(overrides(assets, tmp_path / "b", **{"trainer.save_freq": 2})) == 0
    out = capsys.readouterr().out
    assert out.startswith("patrl: nothing to do:") and out.count("\n") == 1, out
    assert f"{run_checkpoint.step_dir(run_dir, 2)} is at step 2" in out
    assert "trainer.total_training_steps=2" in out and f"in {run_dir}/" in out
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before
    assert run_checkpoint.latest_checkpoint(run_dir) == run_checkpoint.step_dir(run_dir, 2)
    # A crash while writing step 3's checkpoint left debris that must be ignored.
    debris = run_checkpoint.staging_dir(tmp_path / "b", 3)
    debris.mkdir()
    (debris / "half").write_text("x")
    resumed = make_loop(assets, tmp_path / "b", world, **{"trainer.total_training_steps": 4}).run()
    assert resumed.steps == 4

    def tail(history: list[dict[str, float]]) -> list[list[float]]:
        return [[h[k] for k in KEYS] for h in history if h["step"] > 2 and "critic/score/mean" in h]

    assert len(tail(straight.history)) == 2
    torch.testing.assert_close(
        torch.tensor(tail(resumed.history)),
        torch.tensor(tail(straight.history)),
        rtol=1e-5,
        atol=1e-6,
    )


def test_latest_checkpoint_ignores_incomplete_ones(tmp_path: Path) -> None:
    for step, complete in ((2, True), (3, False), (4, False)):
        d = run_checkpoint.step_dir(tmp_path, step)
        d.mkdir(parents=True)
        if complete:
            (d / run_checkpoint.STATE_FILE).write_text("{}")
    run_checkpoint.staging_dir(tmp_path, 5).mkdir()
    assert run_checkpoint.latest_checkpoint(tmp_path) == run_checkpoint.step_dir(tmp_path, 2)


@pytest.mark.parametrize(
    ("mode", "saved_step", "total", "complete"),
    [
        ("auto", 2, 2, True),
        ("auto", 3, 2, True),  # total lowered below the checkpoint
        ("auto", 2, 3, False),
        ("disable", 2, 2, False),
        ("resume_path", 2, 2, True),
    ],
)
def test_completed_only_when_the_resumed_checkpoint_has_no_step_left(
    tmp_path: Path, mode: str, saved_step: int, total: int, complete: bool
) -> None:
    assert completed(load_config(None, [f"trainer.default_local_dir={tmp_path}"])) is None
    checkpoint = run_checkpoint.step_dir(tmp_path, saved_step)
    checkpoint.mkdir(parents=True)
    (checkpoint / run_checkpoint.STATE_FILE).write_text(f'{{"step": {saved_step}}}')
    keys = [
        f"trainer.default_local_dir={tmp_path}",
        f"trainer.total_training_steps={total}",
        f"trainer.resume_mode={mode}",
    ]
    if mode == "resume_path":
        keys.append(f"trainer.resume_from_path={checkpoint}")
    notice = completed(load_config(None, keys))
    assert (notice is not None) == complete
    if notice is not None:
        assert f"{checkpoint} is at step {saved_step}" in notice
        assert f"trainer.total_training_steps={total}" in notice


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.nn=4", "unknown key 'rollout.nn'.*did you mean n"),
        (
            "data.train_batch_size=many",
            "data.train_batch_size: Input should be a valid integer.*'many'",
        ),
        ("rollout.top_p=1.5", "rollout.top_p: Input should be less than or equal to 1"),
        (
            "algorithm.adv_estimator=ppo",
            "algorithm.adv_estimator: Input should be 'grpo', 'dr_grpo', 'rloo', .*"
            "'reinforce_plus_plus'",
        ),
        ("colour=red", "unknown key 'colour'"),
        (
            "actor.ppo_mini_batch_size=3",
            "actor.ppo_mini_batch_size=3 must divide data.train_batch_size=8",
        ),
    ],
)
def test_config_errors_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_cli_reports_config_errors_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rollout.n=0"]) == 2
    assert "rollout.n: Input should be greater than 0" in capsys.readouterr().err
    assert main(["--dry-run", "rollout.n=3"]) == 0
    assert "n: 3" in capsys.readouterr().out


@pytest.mark.e2e
def test_grpo_raises_a_dense_reward(assets: Path, tmp_path: Path) -> None:
    """Does it train? On a reward a random model can climb (share of digits in the response),
    15 GRPO steps must raise the mean reward clearly: a sign or scaling bug anywhere in
    rewards -> advantages -> loss -> weight sync -> sampling would show as no gain."""
    world = World(0, 1, 0, torch.device("cpu"))
    extra = {
        "data.train_batch_size": 8,
        "actor.ppo_mini_batch_size": 8,
        "rollout.n": 8,
        "trainer.total_training_steps": 15,
        "trainer.test_freq": 0,
        "trainer.val_before_train": "false",
    }
    history = make_loop(assets, tmp_path, world, **extra).run().history
    steps = [h for h in history if "critic/score/mean" in h]
    # One optimizer step per batch: the old logprobs come from the update's forward, and they
    # are still the engine's (the diff would show a wrong or stale scoring).
    assert not any("timing_s/old_log_prob" in h for h in steps)
    assert max(h["training/rollout_probs_diff_max"] for h in steps) < 1e-4
    rewards = [h["critic/score/mean"] for h in steps]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= first + 0.05, f"reward went {first:.3f} -> {last:.3f}: {rewards}"
