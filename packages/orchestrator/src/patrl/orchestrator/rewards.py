"""Reward functions and the manager that runs them without letting one take the run down.

A reward function is `fn(response: str, answer: str, **meta) -> float | dict` (a dict holds the
score under "score", other numeric entries are extras); without `**kwargs` it gets only the meta
keys it names. A function with verl's parameters (`solution_str`, `ground_truth`: verl's
`compute_score(data_source, solution_str, ground_truth, extra_info)`) is called as verl calls
it, by keyword. A spec is a built-in name (`math_verify`, `format`), `module:function`, or
`path/to/file.py:function` (verl's custom_reward_function).

`RewardManager` runs the calls in spawned worker processes, each call with its own deadline. A
call that raises, times out, returns a non-finite value or kills its worker scores 0.0 for its
sample only (a `RewardError` of that kind) and a dead worker is replaced. `num_workers=0` runs
in process, with no timeout (nothing can stop a call that catches BaseException or blocks in C
code). `FailureGuard` stops a run whose every reward call keeps failing. See docs/rewards.md.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import multiprocessing as mp
import numbers
import signal
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from functools import lru_cache
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from math_verify import parse, verify

from patrl.orchestrator.errors import IN_PROCESS_TIMEOUT, JobError

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Any]
ErrorKind = Literal["exception", "timeout", "invalid", "crash"]
ERROR_KINDS: tuple[ErrorKind, ...] = ("exception", "timeout", "invalid", "crash")


def math_verify_reward(response: str, answer: str, **meta: Any) -> float:
    """1.0 when the response's final answer equals the gold answer, else 0.0 (math-verify:
    \\boxed{}, "the answer is ...", fractions, LaTeX and plain numbers; numeric and symbolic
    equality). The gold may be bare ("42", "\\frac{1}{2}") or LaTeX in $...$."""
    # math-verify's own timeouts use SIGALRM, which fails off the main thread; a worker's
    # deadline covers slow parses instead (so math-verify's "timeout is disabled" warning is
    # noise for us).
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    gold = _parse_gold(answer)
    if not gold:
        return 0.0
    prediction = parse(response, parsing_timeout=None)
    return 1.0 if verify(list(gold), prediction, timeout_seconds=None) else 0.0


@lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple[Any, ...]:
    # The n samples of a prompt share its gold answer: parsing it is half the cost of a call.
    return tuple(parse(answer, parsing_timeout=None) or parse(f"${answer}$", parsing_timeout=None))


def format_reward(response: str, answer: str, **meta: Any) -> float:
    """1.0 when the response puts a non-empty final answer in \\boxed{...}, else 0.0."""
    return 1.0 if boxed_content(response) else 0.0


def boxed_content(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), or None if there is none."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 1, start + len("\\boxed{")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip() or None
        start = text.rfind("\\boxed{", 0, start)
    return None


BUILTIN_REWARDS: dict[str, RewardFn] = {"math_verify": math_verify_reward, "format": format_reward}


def resolve_reward_fn(spec: str) -> RewardFn:
    """A built-in name, `module:function` or `file.py:function` -> the callable."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"reward function {spec!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) "
            "nor of the form 'module:function' or 'path/to/file.py:function'"
        )
    try:
        module = (
            _import_file(module_name)
            if module_name.endswith(".py")
            else importlib.import_module(module_name)
        )
    except Exception as e:
        raise ValueError(f"reward function {spec!r}: cannot import {module_name!r}: {e!r}") from e
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"reward function {spec!r}: {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is a {type(fn).__name__}, not callable")
    return fn


def _import_file(path: str) -> Any:
    """The module of a Python file (verl's custom_reward_function.path), executed once per
    process under a name of its own."""
    import importlib.util
    import os
    import sys

    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise FileNotFoundError(f"no such file: {full}")
    name = f"patrl_reward_file_{abs(hash(full)):x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


# verl's compute_score parameters: a function naming these is called as verl calls it
_VERL_PARAMS = {"solution_str", "ground_truth"}


@dataclass(frozen=True, slots=True)
class RewardError:
    """One failed call: which sample, which function, what kind of failure, and why."""

    sample: int
    function: str
    kind: ErrorKind
    message: str


@dataclass(slots=True)
class RewardResult:
    """A scored batch. `rewards[i]` is sample i's weighted total (0.0 if any of its calls
    failed); `components[name][i]` is function `name`'s score (0.0 where it failed);
    `extras["name/key"][i]` holds numeric dict entries (NaN where absent)."""

    rewards: list[float]
    components: dict[str, list[float]]
    extras: dict[str, list[float]] = field(default_factory=dict)
    errors: list[RewardError] = field(default_factory=list)
    workers_restarted: int = 0
    seconds: float = 0.0
    model_seconds: float = 0.0

    def error_counts(self) -> dict[ErrorKind, int]:
        counts = Counter(e.kind for e in self.errors)
        return {kind: counts[kind] for kind in ERROR_KINDS}

    def metrics(self) -> dict[str, float]:
        """Counters and means for the step's metrics line."""
        out: dict[str, float] = {
            f"reward/errors/{k}": float(n) for k, n in self.error_counts().items()
        }
        out["reward/errors/samples"] = float(len({e.sample for e in self.errors}))
        out["reward/workers_restarted"] = float(self.workers_restarted)
        for name, values in self.components.items():
            out[f"reward/{name}/mean"] = sum(values) / len(values) if values else 0.0
        out["timing_s/reward"] = self.seconds
        scores = self.components.get(MODEL_COMPONENT)
        if scores:
            out["reward_model/score/mean"] = sum(scores) / len(scores)
            out["reward_model/score/max"] = max(scores)
            out["reward_model/score/min"] = min(scores)
            out["timing_s/reward_model"] = self.model_seconds
        return out


MODEL_COMPONENT = "reward_model"


def add_model_scores(
    result: RewardResult, scores: Sequence[float], weight: float, seconds: float = 0.0
) -> None:
    """Add a reward model's `scores` x `weight` to `result`'s rewards (a sample whose rule
    call failed keeps 0.0), as component "reward_model", with its metrics and time."""
    if len(scores) != len(result.rewards):
        raise ValueError(f"{len(scores)} reward-model scores for {len(result.rewards)} samples")
    failed = {e.sample for e in result.errors}
    for s, score in enumerate(scores):
        if s not in failed:
            result.rewards[s] += weight * float(score)
    result.components[MODEL_COMPONENT] = [float(x) for x in scores]
    result.model_seconds = seconds


OVERLONG_COMPONENT = "overlong_reward"


@dataclass(frozen=True, slots=True)
class OverlongBuffer:
    """DAPO's overlong shaping (verl's DAPORewardManager): a response of L tokens gets
    min(-(L - (max_len - buffer)) / buffer x penalty_factor, 0) added to its reward."""

    buffer: int
    penalty_factor: float
    max_len: int
    log: bool = False

    def penalty(self, length: int) -> float:
        exceed = length - (self.max_len - self.buffer)
        return min(-exceed / self.buffer * self.penalty_factor, 0.0)


def add_overlong_penalty(
    result: RewardResult, lengths: Sequence[int], overlong: OverlongBuffer
) -> list[float]:
    """Add each sample's overlong penalty to `result`'s rewards (a sample whose call failed
    keeps 0.0) and return the penalties; with `overlong.log` they are a component
    ("overlong_reward": reward/overlong_reward/mean) and their share below 0 an extra
    ("overlong": reward/overlong/mean), verl's reward_extra_info keys."""
    if len(lengths) != len(result.rewards):
        raise ValueError(f"{len(lengths)} lengths for {len(result.rewards)} samples")
    failed = {e.sample for e in result.errors}
    penalties = [0.0 if s in failed else overlong.penalty(n) for s, n in enumerate(lengths)]
    for s, p in enumerate(penalties):
        result.rewards[s] += p
    if overlong.log:
        result.components[OVERLONG_COMPONENT] = penalties
        result.components["overlong"] = [float(p < 0) for p in penalties]
    return penalties


@dataclass(frozen=True, slots=True)
class _Outcome:
    kind: Literal["ok", "exception", "invalid"]
    score: float = 0.0
    extras: Mapping[str, float] = field(default_factory=dict)
    message: str = ""


class _Callable:
    """A resolved spec, called with only the meta keys it accepts (verl's keywords for a
    function with verl's parameters)."""

    def __init__(self, spec: str) -> None:
        self.fn = resolve_reward_fn(spec)
        params = inspect.signature(self.fn).parameters.values()
        self.takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        self.names = {p.name for p in params}
        self.verl = self.names >= _VERL_PARAMS

    def __call__(self, response: str, answer: str, meta: Mapping[str, Any]) -> _Outcome:
        try:
            if self.verl:
                value = self.fn(**_verl_kwargs_of(self, response, answer, meta))
            else:
                kwargs = (
                    meta if self.takes_all else {k: v for k, v in meta.items() if k in self.names}
                )
                value = self.fn(response, answer, **kwargs)
        except Exception as e:
            return _Outcome("exception", message=_describe(e))
        return _validate(value)


def _verl_kwargs_of(
    fn: _Callable, response: str, answer: str, meta: Mapping[str, Any]
) -> dict[str, Any]:
    """verl's keyword call: data_source, solution_str, ground_truth, extra_info (the row's
    columns of those names), each that the function takes."""
    kwargs = {
        "data_source": meta.get("data_source"),
        "solution_str": response,
        "ground_truth": answer,
        "extra_info": meta.get("extra_info"),
    }
    return {k: v for k, v in kwargs.items() if fn.takes_all or k in fn.names}


def _validate(value: Any) -> _Outcome:
    extras: dict[str, float] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            return _Outcome(
                "invalid", message=f"returned a dict without 'score': keys {list(value)}"
            )
        extras = {
            str(k): float(v)
            for k, v in value.items()
            if k != "score" and isinstance(v, numbers.Real) and math.isfinite(float(v))
        }
        value = value["score"]
    if not isinstance(value, numbers.Real):
        return _Outcome(
            "invalid", message=f"returned {type(value).__name__} {value!r:.80}, not a number"
        )
    if not math.isfinite(float(value)):
        return _Outcome("invalid", message=f"returned {float(value)}, not a finite number")
    return _Outcome("ok", float(value), extras)


def _describe(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}: {e}{where}"


def _worker_main(conn: Connection, specs: list[str]) -> None:
    """A reward process: resolve the specs, say ready, then answer calls until told to stop."""
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fns = [_Callable(spec) for spec in specs]
    except BaseException as e:
        conn.send(("boot_error", _describe(e)))
        return
    conn.send(("ready", None))
    try:
        while (chunk := conn.recv()) is not None:
            for fn_index, response, answer, meta in chunk:
                out = fns[fn_index](response, answer, meta)
                conn.send(("done", (out.kind, out.score, dict(out.extras), out.message)))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the training process is gone (its rank was stopped or killed): so is its work


@dataclass(slots=True)
class _Worker:
    process: Any  # multiprocessing.context.SpawnProcess
    conn: Connection
    started: float
    ready: bool = False
    # (sample, function index) of the calls handed over and not answered yet, in the order
    # the worker runs them; the deadline is the first one's.
    tasks: deque[tuple[int, int]] = field(default_factory=deque)
    deadline: float = math.inf


# Calls per message to a worker, at most.
_MAX_CHUNK = 16
DEFAULT_TIMEOUT_S = 10.0


class RewardManager:
    """Scores batches with weighted reward functions, containing their failures (docs/rewards.md).
    Use as a context manager, or call `close()`."""

    def __init__(
        self,
        specs: Sequence[tuple[str, float]],
        *,
        num_workers: int = 2,
        timeout_s: float | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        """`timeout_s`: each call's deadline in a worker (None: DEFAULT_TIMEOUT_S). In process
        (`num_workers=0`) a call cannot be stopped, so a timeout there is refused."""
        if not specs:
            raise ValueError("RewardManager needs at least one (spec, weight) pair")
        names = [spec for spec, _ in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"reward functions listed twice: {names}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 (0 = in process), got {num_workers}")
        if num_workers == 0 and timeout_s is not None:
            raise ValueError(IN_PROCESS_TIMEOUT.format(timeout=timeout_s))
        timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.names = names
        self.weights = [float(w) for _, w in specs]
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        # Resolved here too, so that a bad spec fails at construction with its own message.
        self.fns = [_Callable(spec) for spec in names]
        self.totals: Counter[str] = Counter()
        self._restarts = 0
        self._ctx = mp.get_context("spawn")
        self._workers = [self._start_worker() for _ in range(num_workers)]
        self._closed = False
        self._chunk_limit = _MAX_CHUNK

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def score(
        self,
        responses: Sequence[str],
        answers: Sequence[str],
        metas: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardResult:
        """Score sample i = (responses[i], answers[i], metas[i]) with every function."""
        if self._closed:
            raise RuntimeError("RewardManager is closed")
        metas = metas if metas is not None else [{}] * len(responses)
        if not len(responses) == len(answers) == len(metas):
            raise ValueError(
                f"{len(responses)} responses, {len(answers)} answers, {len(metas)} metas: "
                "need one of each per sample"
            )
        for i, meta in enumerate(metas):
            clash = {"response", "answer"} & set(meta)
            if clash:
                raise ValueError(f"metas[{i}] has reserved key(s) {sorted(clash)}")
        started = time.perf_counter()
        self._restarts = 0
        outcomes: dict[tuple[int, int], _Outcome | RewardError] = {}
        tasks = [(s, f) for s in range(len(responses)) for f in range(len(self.fns))]
        samples = (responses, answers, metas)
        if self._workers:
            try:
                self._run_in_pool(tasks, samples, outcomes)
            except BaseException:
                # A pool that failed to start, or a Ctrl-C, leaves calls in flight: stop the
                # workers now instead of leaving a half-used pool behind.
                self.close()
                raise
        else:
            self._run_in_process(tasks, samples, outcomes)
        result = self._assemble(len(responses), outcomes)
        result.workers_restarted = self._restarts
        result.seconds = time.perf_counter() - started
        self._record(result)
        return result

    def close(self) -> None:
        """Stop every worker (politely, then by force); idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for w in self._workers:
            with suppress(OSError):  # already dead: killed below either way
                w.conn.send(None)
        for w in self._workers:
            w.process.join(timeout=2.0)
            self._kill(w)
        self._workers = []

    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    # -- in process ---------------------------------------------------------------------------

    def _run_in_process(
        self,
        tasks: list[tuple[int, int]],
        samples: tuple[Sequence[str], Sequence[str], Sequence[Mapping[str, Any]]],
        outcomes: dict[tuple[int, int], _Outcome | RewardError],
    ) -> None:
        responses, answers, metas = samples
        for s, f in tasks:
            outcomes[s, f] = self.fns[f](responses[s], answers[s], metas[s])

    # -- process pool -------------------------------------------------------------------------

    def _run_in_pool(
        self,
        tasks: list[tuple[int, int]],
        samples: tuple[Sequence[str], Sequence[str], Sequence[Mapping[str, Any]]],
        outcomes: dict[tuple[int, int], _Outcome | RewardError],
    ) -> None:
        pending = deque(tasks)
        self._chunk_limit = _MAX_CHUNK
        while pending or any(w.tasks for w in self._workers):
            for w in self._workers:
                if w.ready and not w.tasks and pending:
                    self._dispatch(w, pending, samples, outcomes)
            self._wait_and_collect(pending, outcomes)
            self._enforce_deadlines(pending, outcomes)

    def _dispatch(
        self,
        w: _Worker,
        pending: deque[tuple[int, int]],
        samples: tuple[Sequence[str], Sequence[str], Sequence[Mapping[str, Any]]],
        outcomes: dict[tuple[int, int], _Outcome | RewardError],
    ) -> None:
        # Chunks amortise a message round trip over several cheap calls; a few chunks per
        # worker keep the workers evenly busy to the end.
        size = min(self._chunk_limit, max(1, len(pending) // (4 * len(self._workers))))
        chunk = [pending.popleft() for _ in range(min(size, len(pending)))]
        responses, answers, metas = samples
        message = [(f, responses[s], answers[s], dict(metas[s])) for s, f in chunk]
        try:
            w.conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            # The worker died while idle: not these samples' fault, so they go back in line.
            pending.extendleft(reversed(chunk))
            self._replace(w)
            return
        except Exception as e:  # a meta could not be pickled (nothing was sent)
            if len(chunk) > 1:  # find which: from now on one call per message
                self._chunk_limit = 1
                pending.extendleft(reversed(chunk))
                return
            s, f = chunk[0]
            outcomes[s, f] = self._error(
                s, f, "exception", f"cannot send to worker: {_describe(e)}"
            )
            return
        w.tasks.extend(chunk)
        w.deadline = time.monotonic() + self.timeout_s

    def _wait_and_collect(
        self,
        pending: deque[tuple[int, int]],
        outcomes: dict[tuple[int, int], _Outcome | RewardError],
    ) -> None:
        now = time.monotonic()
        busy = [w for w in self._workers if w.tasks]
        booting = [w for w in self._workers if not w.ready]
        deadlines = [w.deadline for w in busy] + [w.started + self.start_timeout_s for w in booting]
        timeout = max(0.0, min(deadlines, default=now) - now)
        by_conn = {id(w.conn): w for w in busy + booting}
        for conn in wait([w.conn for w in busy + booting], timeout=timeout):
            w = by_conn[id(conn)]
            try:
                tag, payload = w.conn.recv()
            except (EOFError, OSError):
                self._on_crash(w, pending, outcomes)
                continue
            if tag == "ready":
                w.ready = True
            elif tag == "boot_error":
                raise RuntimeError(f"reward worker failed to start: {payload}")
            elif w.tasks:
                outcomes[w.tasks.popleft()] = _Outcome(*payload)
                # The worker starts its next call as it sends this answer.
                w.deadline = time.monotonic() + self.timeout_s if w.tasks else math.inf

    def _enforce_deadlines(
        self,
        pending: deque[tuple[int, int]],
        outcomes: dict[tuple[int, int], _Outcome | RewardError],
    ) -> None:
        now = time.monotonic()
        for w in self._workers:
            if w.tasks and now >= w.deadline:
                s, f = w.tasks.popleft()
                outcomes[s, f] = self._error(s, f, "timeout", f"took longer than {self.timeout_s}s")
                pending.extendleft(reversed(w.tasks))  # the rest of its chunk never ran
                self._replace(w)
            elif not w.ready and now >= w.started + self.start_timeout_s:
                raise RuntimeError(
                    f"reward worker pid {w.process.pid} did not start within "
                    f"{self.start_timeout_s}s (start_timeout_s)"
                )

    def _on_crash(
        self,
        w: _Worker,
        pending: deque[tuple[int, int]],
        outcomes: dict[tuple[int, int], _Outcome | RewardError],
    ) -> None:
        w.process.join(timeout=1.0)
        code = w.process.exitcode
        if not w.tasks and not w.ready:
            raise RuntimeError(
                f"reward worker pid {w.process.pid} exited with {code} while starting (its error "
                "is on stderr; under spawn, a script that makes a RewardManager needs the "
                "`if __name__ == '__main__':` guard)"
            )
        if w.tasks:  # the call it was running killed it; the rest of its chunk never ran
            s, f = w.tasks.popleft()
            outcomes[s, f] = self._error(s, f, "crash", f"worker process exited with code {code}")
            pending.extendleft(reversed(w.tasks))
        self._replace(w)

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_worker_main, args=(child, self.names), daemon=True, name="patrl-reward"
        )
        process.start()
        child.close()
        return _Worker(process, parent, time.monotonic())

    def _replace(self, w: _Worker) -> None:
        self._kill(w)
        fresh = self._start_worker()
        w.process, w.conn, w.started = fresh.process, fresh.conn, fresh.started
        w.ready, w.tasks, w.deadline = False, deque(), math.inf
        self._restarts += 1

    @staticmethod
    def _kill(w: _Worker) -> None:
        if w.process.is_alive():
            w.process.kill()
        w.process.join(timeout=5.0)
        w.conn.close()

    # -- results ------------------------------------------------------------------------------

    def _error(self, sample: int, fn_index: int, kind: ErrorKind, message: str) -> RewardError:
        return RewardError(sample, self.names[fn_index], kind, message)

    def _assemble(
        self, num_samples: int, outcomes: dict[tuple[int, int], _Outcome | RewardError]
    ) -> RewardResult:
        result = RewardResult(rewards=[0.0] * num_samples, components={})
        failed: set[int] = set()
        for f, name in enumerate(self.names):
            scores = []
            for s in range(num_samples):
                out = outcomes[s, f]
                if isinstance(out, _Outcome) and out.kind != "ok":
                    out = self._error(s, f, out.kind, out.message)
                if isinstance(out, RewardError):
                    result.errors.append(out)
                    failed.add(s)
                    scores.append(0.0)
                    continue
                scores.append(out.score)
                for key, value in out.extras.items():
                    column = result.extras.setdefault(f"{name}/{key}", [math.nan] * num_samples)
                    column[s] = value
            result.components[name] = scores
        for s in range(num_samples):
            if s not in failed:
                result.rewards[s] = sum(
                    w * result.components[n][s]
                    for n, w in zip(self.names, self.weights, strict=True)
                )
        return result

    def _record(self, result: RewardResult) -> None:
        self.totals["samples"] += len(result.rewards)
        self.totals["workers_restarted"] += result.workers_restarted
        for kind, n in result.error_counts().items():
            self.totals[f"errors/{kind}"] += n
        for kind in ERROR_KINDS:
            first = next((e for e in result.errors if e.kind == kind), None)
            if first is not None:
                logger.warning(
                    "reward %s: %d call(s) this batch; first: sample %d, %s: %s",
                    kind,
                    result.error_counts()[kind],
                    first.sample,
                    first.function,
                    first.message,
                )


@dataclass(slots=True)
class FailureSummary:
    """How many samples a scoring saw and how many of them had a failed call, with the
    failures counted by (function, cause): what a step's reward calls did, in a form that
    adds up across replicas and rounds."""

    samples: int = 0
    failed: int = 0
    causes: Counter[tuple[str, str]] = field(default_factory=Counter)

    @classmethod
    def of(cls, result: RewardResult) -> FailureSummary:
        causes = Counter((e.function, _cause(e)) for e in result.errors)
        return cls(len(result.rewards), len({e.sample for e in result.errors}), causes)

    @classmethod
    def total(cls, parts: Iterable[FailureSummary]) -> FailureSummary:
        out = cls()
        for part in parts:
            out.samples += part.samples
            out.failed += part.failed
            out.causes.update(part.causes)
        return out

    @property
    def all_failed(self) -> bool:
        return self.samples > 0 and self.failed == self.samples

    def most_common(self) -> str:
        """'function: cause (n of m calls)' of the most frequent failure."""
        (function, cause), n = self.causes.most_common(1)[0]
        return f"{function}: {cause} ({n} of {sum(self.causes.values())} failed calls)"


def _cause(error: RewardError) -> str:
    """An error's kind and message without where it was raised (which differs per call)."""
    message = error.message.split(" at ", 1)[0] if error.kind == "exception" else error.message
    return f"{error.kind}: {message[:200]}"


class RewardsFailed(JobError):
    """Every reward call failed for `max_failed_steps` steps in a row, or on every step of a
    run shorter than that: the run cannot learn."""


class FailureGuard:
    """Stops a run whose rewards all failed for `max_failed_steps` consecutive steps, or on
    every step of a run that ends sooner: every sample scores 0, so the run would exit 0
    having learnt nothing. `observe` returns an error line for a step whose every sample's
    reward failed, and raises `RewardsFailed` on the last such step allowed, or on the run's
    last step when every step it took failed so."""

    def __init__(self, max_failed_steps: int) -> None:
        if max_failed_steps < 1:
            raise ValueError(f"max_failed_steps must be >= 1, got {max_failed_steps}")
        self.max_failed_steps = max_failed_steps
        self.streak = 0
        self.steps = 0  # steps observed by this process (a resumed run counts from its resume)

    def observe(self, step: int, summary: FailureSummary, last: bool = False) -> str | None:
        """`last`: `step` is the run's last (trainer.total_training_steps)."""
        self.steps += 1
        if not summary.all_failed:
            self.streak = 0
            return None
        self.streak += 1
        line = (
            f"step {step}: the reward of every one of {summary.samples} samples failed; most "
            f"common: {summary.most_common()}"
        )
        fix = (
            "Fix the reward function (run it on a sample by hand), or raise reward.timeout_s "
            "if its calls time out"
        )
        if self.streak >= self.max_failed_steps:
            raise RewardsFailed(
                f"{line}. That is {self.streak} steps in a row (reward.max_failed_steps="
                f"{self.max_failed_steps}): every reward is 0, so the run cannot learn. {fix}"
            )
        if last and self.streak == self.steps:
            raise RewardsFailed(
                f"{line}. That is every step of this run ({self.steps}; it ends here, at "
                "trainer.total_training_steps, before reward.max_failed_steps="
                f"{self.max_failed_steps} is reached): every reward was 0, so it learnt "
                f"nothing. {fix}"
            )
        return f"{line} ({self.streak} of reward.max_failed_steps={self.max_failed_steps})"
