"""Reward functions, spec resolution, and the manager's containment of misbehaving functions.

The pool tests share one spawned RewardManager (spawning is slow); `chaos_reward` below is
imported by name in its workers and misbehaves on command, chosen by the response's first word.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from patrl.orchestrator.config import ConfigError, load_config
from patrl.orchestrator.rewards import (
    FailureGuard,
    FailureSummary,
    RewardError,
    RewardManager,
    RewardResult,
    RewardsFailed,
    boxed_content,
    format_reward,
    math_verify_reward,
    resolve_reward_fn,
)

CHAOS = "test_orchestrator_rewards:chaos_reward"
TIMEOUT_S = 4.0  # generous: a cold first math-verify call on a busy 2-core box
NOT_CALLABLE = 42


def chaos_reward(response: str, answer: str, **meta: Any) -> Any:
    word = response.split(" ", 1)[0]
    if word == "raise":
        raise RuntimeError("chaos: raised on purpose")
    if word == "hang":
        time.sleep(60)
    if word == "nan":
        return float("nan")
    if word == "string":
        return "not a number"
    if word == "nodict":
        return {"acc": 1.0}
    if word == "exit":
        os._exit(3)
    if word == "dict":
        return {"score": 0.25, "length": len(response), "note": "not numeric"}
    return float(meta.get("bonus", 0.0))


def answer_only_reward(response: str, answer: str, bonus: float = 0.0) -> float:
    """Takes no **meta: it must be passed `bonus` and nothing else."""
    return 1.0 + bonus if response == answer else bonus


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child that is not yet reaped is a zombie: dead for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("The answer is 42", "42"),
        ("Adding them gives 40 + 2 = 42.\nThe answer is 42.", "42"),
        ("So the result is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("The probability is \\boxed{1/2}", "\\frac{1}{2}"),
        ("I get 3/4.", "0.75"),
        ("\\boxed{\\dfrac{3}{4}}", "3/4"),
        ("x = \\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        ("\\boxed{42}", "$42$"),
        ("The answer is -7", "-7"),
    ],
)
def test_math_verify_accepts_equal_answers(response: str, answer: str) -> None:
    assert math_verify_reward(response, answer) == 1.0


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("The answer is 41", "42"),
        ("\\boxed{\\frac{1}{3}}", "0.5"),
        ("I have no idea.", "42"),
        ("", "42"),
        ("The answer is 7", "-7"),
    ],
)
def test_math_verify_rejects_wrong_answers(response: str, answer: str) -> None:
    assert math_verify_reward(response, answer) == 0.0


def test_format_reward() -> None:
    assert format_reward("so \\boxed{12}", "12") == 1.0
    assert format_reward("\\boxed{\\frac{1}{2}} done", "") == 1.0
    assert format_reward("the answer is 12", "12") == 0.0
    assert format_reward("\\boxed{}", "") == 0.0
    assert format_reward("\\boxed{12", "") == 0.0
    assert boxed_content("a \\boxed{1} then \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert boxed_content("\\boxed{1} then \\boxed{2") == "1"


def test_resolve_specs() -> None:
    assert resolve_reward_fn("math_verify") is math_verify_reward
    assert resolve_reward_fn("format") is format_reward
    assert resolve_reward_fn(CHAOS) is chaos_reward
    with pytest.raises(ValueError, match=r"'nope'.*math_verify, format.*module:function"):
        resolve_reward_fn("nope")
    with pytest.raises(ValueError, match=r"'no_such_module_xyz:f'.*cannot import"):
        resolve_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match=r"has no attribute 'missing'"):
        resolve_reward_fn("test_orchestrator_rewards:missing")
    with pytest.raises(ValueError, match=r"NOT_CALLABLE' is a int, not callable"):
        resolve_reward_fn("test_orchestrator_rewards:NOT_CALLABLE")
    with pytest.raises(ValueError, match=r"'nope'"):
        RewardManager([("nope", 1.0)], num_workers=0)
    with pytest.raises(ValueError, match="listed twice"):
        RewardManager([("format", 1.0), ("format", 2.0)], num_workers=0)


@pytest.fixture(scope="module")
def pool() -> Iterator[RewardManager]:
    with RewardManager(
        [("math_verify", 1.0), (CHAOS, 0.5)], num_workers=2, timeout_s=TIMEOUT_S
    ) as manager:
        yield manager


def _check_misbehaviour_contained(manager: RewardManager) -> None:
    responses = [
        "The answer is 42",  # 0: fine: 1.0 + 0.5 * bonus 2
        "raise The answer is 42",  # 1: exception
        "nan \\boxed{42}",  # 2: invalid (NaN)
        "string 42",  # 3: invalid (a str)
        "nodict 42",  # 4: invalid (dict without score)
        "dict The answer is 41",  # 5: fine: 0.0 + 0.5 * 0.25, with a numeric extra
        "\\boxed{7}",  # 6: fine: 1.0 + 0.5 * 0
    ]
    answers = ["42", "42", "42", "42", "42", "42", "7"]
    metas = [{"bonus": 2.0}] + [{}] * 6
    result = manager.score(responses, answers, metas)
    assert result.rewards == [2.0, 0.0, 0.0, 0.0, 0.0, 0.125, 1.0]
    assert result.components["math_verify"] == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    assert result.components[CHAOS] == [2.0, 0.0, 0.0, 0.0, 0.0, 0.25, 0.0]
    assert result.extras[f"{CHAOS}/length"][5] == len(responses[5])
    assert f"{CHAOS}/note" not in result.extras
    assert result.error_counts() == {"exception": 1, "timeout": 0, "invalid": 3, "crash": 0}
    by_sample = {e.sample: e for e in result.errors}
    assert set(by_sample) == {1, 2, 3, 4}
    assert "RuntimeError: chaos: raised on purpose" in by_sample[1].message
    assert "nan" in by_sample[2].message
    assert "str 'not a number'" in by_sample[3].message
    assert "without 'score'" in by_sample[4].message
    assert all(e.function == CHAOS for e in result.errors)
    metrics = result.metrics()
    assert metrics["reward/errors/invalid"] == 3.0
    assert metrics["reward/errors/samples"] == 4.0


def test_pool_contains_raise_nan_and_non_numbers(pool: RewardManager) -> None:
    _check_misbehaviour_contained(pool)


def test_pool_kills_and_replaces_a_hung_worker(pool: RewardManager) -> None:
    pids_before = set(pool.worker_pids())
    started = time.monotonic()
    result = pool.score(
        ["hang The answer is 42", "The answer is 42", "The answer is 5"], ["42", "42", "42"]
    )
    elapsed = time.monotonic() - started
    assert result.error_counts()["timeout"] == 1
    assert result.errors[0].sample == 0 and result.errors[0].kind == "timeout"
    assert result.rewards == [0.0, 1.0, 0.0]
    assert result.workers_restarted == 1
    assert elapsed < 30, "the hung call was not cut at its deadline"
    replaced = pids_before - set(pool.worker_pids())
    assert len(replaced) == 1
    assert not _alive(replaced.pop())
    # still usable, including on the replacement worker
    _check_misbehaviour_contained(pool)


def test_pool_survives_a_worker_that_exits(pool: RewardManager) -> None:
    result = pool.score(["exit now", "\\boxed{3}", "\\boxed{4}"], ["3", "3", "3"])
    assert result.error_counts() == {"exception": 0, "timeout": 0, "invalid": 0, "crash": 1}
    assert "exited with code 3" in result.errors[0].message
    assert result.rewards == [0.0, 1.0, 0.0]
    assert pool.score(["\\boxed{3}"], ["3"]).rewards == [1.0]
    assert pool.totals["errors/crash"] >= 1


def test_pool_passes_only_named_meta_to_strict_functions() -> None:
    spec = "test_orchestrator_rewards:answer_only_reward"
    with RewardManager([(spec, 2.0)], num_workers=1, timeout_s=TIMEOUT_S) as manager:
        result = manager.score(["a", "b"], ["a", "a"], [{"bonus": 0.5, "other": 1}, {"x": 3}])
        assert result.rewards == [3.0, 0.0]
        assert result.errors == []
        pids = manager.worker_pids()
    assert not any(_alive(pid) for pid in pids), "close() left a worker running"
    with pytest.raises(RuntimeError, match="closed"):
        manager.score(["a"], ["a"])


def test_in_process_contains_the_same_misbehaviour_and_refuses_a_timeout() -> None:
    manager = RewardManager([("math_verify", 1.0), (CHAOS, 0.5)], num_workers=0)
    _check_misbehaviour_contained(manager)
    manager.close()
    # In process nothing can stop a call (one that catches BaseException, or blocks in C):
    # a deadline there would be a promise the manager cannot keep.
    with pytest.raises(ValueError, match=r"reward\.timeout_s=4\.0 needs reward worker processes"):
        RewardManager([(CHAOS, 1.0)], num_workers=0, timeout_s=TIMEOUT_S)
    with pytest.raises(ConfigError, match=r"reward\.timeout_s=5\.0 needs reward worker"):
        load_config(None, ["reward.num_workers=0", "reward.timeout_s=5"])
    assert load_config(None, ["reward.num_workers=0"]).reward.timeout_s is None


def _error(sample: int, function: str, kind: str, message: str) -> RewardError:
    return RewardError(sample, function, kind, message)  # type: ignore[arg-type]


def test_failure_guard_stops_after_max_failed_steps_and_names_the_cause() -> None:
    every = RewardResult(rewards=[0.0] * 3, components={})
    every.errors = [
        _error(0, "mod:f", "exception", "ValueError: bad row 0 at /x/f.py:3"),
        _error(1, "mod:f", "exception", "ValueError: bad row 0 at /x/f.py:3"),
        _error(2, "mod:f", "timeout", "took longer than 10.0s"),
        _error(2, "format", "invalid", "returned str 'x', not a number"),
    ]
    some = RewardResult(rewards=[1.0, 0.0], components={}, errors=[every.errors[0]])
    replicas = FailureSummary.total([FailureSummary.of(every), FailureSummary.of(every)])
    assert (replicas.samples, replicas.failed) == (6, 6) and replicas.all_failed
    assert replicas.most_common() == "mod:f: exception: ValueError: bad row 0 (4 of 8 failed calls)"
    guard = FailureGuard(max_failed_steps=2)
    assert guard.observe(1, FailureSummary.of(some)) is None  # one sample scored: it learns
    line = guard.observe(2, replicas)
    assert line is not None and line.startswith("step 2: the reward of every one of 6 samples")
    assert "(1 of reward.max_failed_steps=2)" in line
    assert guard.observe(3, FailureSummary.total([FailureSummary.of(some)])) is None
    guard.observe(4, replicas)
    with pytest.raises(RewardsFailed, match=r"step 5: .*mod:f: exception: ValueError: bad row 0"):
        guard.observe(5, replicas)
    assert not FailureSummary().all_failed  # a step that scored nothing failed nothing


def test_failure_guard_stops_a_run_whose_every_step_failed_at_its_last_step() -> None:
    """A run shorter than reward.max_failed_steps whose every step's rewards all failed ends
    in RewardsFailed at its last step (not exit 0 having learnt nothing); one that scored on
    any step only says so."""
    every = RewardResult(rewards=[0.0], components={})
    every.errors = [_error(0, "mod:f", "exception", "KeyError: 'answer' at /x/f.py:3")]
    some = RewardResult(rewards=[1.0, 0.0], components={}, errors=[every.errors[0]])
    guard = FailureGuard(max_failed_steps=3)
    assert guard.observe(1, FailureSummary.of(every)) is not None
    with pytest.raises(RewardsFailed) as info:
        guard.observe(2, FailureSummary.of(every), last=True)
    message = str(info.value)
    assert message.startswith("step 2: the reward of every one of 1 samples failed"), message
    assert "every step of this run (2;" in message and "reward.max_failed_steps=3" in message
    assert "mod:f: exception: KeyError: 'answer'" in message
    scored_once = FailureGuard(max_failed_steps=3)
    assert scored_once.observe(1, FailureSummary.of(some)) is None
    line = scored_once.observe(2, FailureSummary.of(every), last=True)
    assert line is not None and "(1 of reward.max_failed_steps=3)" in line
    single = FailureGuard(max_failed_steps=3)
    with pytest.raises(RewardsFailed, match=r"every step of this run \(1;"):
        single.observe(5, FailureSummary.of(every), last=True)  # a resumed run's one step


def test_a_reward_worker_whose_training_process_dies_exits_quietly(tmp_path: Path) -> None:
    """SIGKILL of the training process (its rank killed): the worker sees its pipe close and
    exits without a traceback (an EOFError one was noise after the job's one-line stop)."""
    script = tmp_path / "die.py"
    script.write_text(
        "import os, signal\n"
        "from patrl.orchestrator.rewards import RewardManager\n"
        "if __name__ == '__main__':\n"
        "    m = RewardManager([('format', 1.0)], num_workers=1)\n"
        "    m.score(['a'], ['a'])\n"  # the worker is up and has answered
        "    print(m.worker_pids()[0], flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # stderr is shared with the worker: run() returns once the worker has exited too
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == -9, done.stderr
    worker = int(done.stdout.split()[0])
    assert not Path(f"/proc/{worker}").exists() or _is_zombie(worker)
    assert "Traceback" not in done.stderr and "EOFError" not in done.stderr, done.stderr


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_score_rejects_misaligned_inputs(pool: RewardManager) -> None:
    with pytest.raises(ValueError, match="2 responses, 1 answers"):
        pool.score(["a", "b"], ["a"])
    with pytest.raises(ValueError, match=r"metas\[0\] has reserved key\(s\) \['answer'\]"):
        pool.score(["a"], ["a"], [{"answer": "b"}])
    assert pool.score([], []).rewards == []


def test_worker_that_cannot_start_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    # importable here (registered in sys.modules) but not in a freshly spawned worker
    module = types.ModuleType("patrl_reward_only_in_parent")
    module.score = lambda response, answer, **meta: 1.0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    manager = RewardManager([(f"{module.__name__}:score", 1.0)], num_workers=1)
    pids = manager.worker_pids()
    with pytest.raises(RuntimeError, match=r"failed to start.*cannot import"):
        manager.score(["a"], ["a"])
    assert not any(_alive(pid) for pid in pids), "the failed pool was not shut down"
    with pytest.raises(RuntimeError, match="closed"):
        manager.score(["a"], ["a"])


def test_pool_chunks_keep_every_other_call_when_one_misbehaves(pool: RewardManager) -> None:
    # 48 samples x 2 functions: calls go to the workers in chunks, so a crash, a hang and an
    # unpicklable meta land in the middle of one; the rest of that chunk must still be scored.
    responses = [f"\\boxed{{{i}}}" for i in range(48)]
    responses[5], responses[20], responses[33] = "exit now", "hang on", "raise it"
    answers = [str(i) for i in range(48)]
    metas: list[dict[str, Any]] = [{} for _ in range(48)]
    metas[40] = {"bonus": lambda: 1.0}  # cannot be sent to a worker
    result = pool.score(responses, answers, metas)
    assert result.error_counts() == {"exception": 3, "timeout": 1, "invalid": 0, "crash": 1}
    failed = {5, 20, 33, 40}
    assert {e.sample for e in result.errors} == failed
    assert "cannot send to worker" in next(e for e in result.errors if e.sample == 40).message
    assert result.rewards == [0.0 if i in failed else 1.0 for i in range(48)]
