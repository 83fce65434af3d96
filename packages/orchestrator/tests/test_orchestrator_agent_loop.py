"""The agent loop on patrl's engine: tokens in, tokens out (the trajectory is the sampled ids
plus the appended ids, the mask 1 exactly on sampled ones); greedy trajectories equal a slow
twin that re-renders and re-prefills the whole conversation each turn with prefix caching
off; a continuation prefills only what the prefix cache lacks; tool faults give verl's error
observation and the sample goes on; one sample's slow tool does not stall the others."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_scripted import (
    ANSWER,
    CALL,
    MALFORMED,
    UNKNOWN,
    GatedTool,
    HangingTool,
    hermes_tokenizer,
    save_scripted_model,
    tool_config,
)

from patrl.orchestrator.agent import (
    AgentLoopOutput,
    AgentLoopRunner,
    CalculatorTool,
    TokenOutput,
    ToolAgentLoop,
    ToolPool,
    extract_tool_calls,
    load_tools,
)
from patrl.rollout import Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=64)
QUESTIONS = ["What is 6*7?", "Six times seven?", "Compute 6*7 please."]
BLOCK = 4


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return hermes_tokenizer()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("agent_models")
    return {
        "call": save_scripted_model(root / "call", tokenizer, CALL),
        "malformed": save_scripted_model(root / "malformed", tokenizer, MALFORMED),
        "unknown": save_scripted_model(root / "unknown", tokenizer, UNKNOWN),
    }


def engine(model: Path, prefix_caching: bool = True) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            device="cpu",
            block_size=BLOCK,
            num_kv_blocks=512,
            max_model_len=1024,
            enable_prefix_caching=prefix_caching,
        )
    )


def tool_loop(eng: Engine, pool: ToolPool | None = None, **keys: Any) -> ToolAgentLoop:
    keys.setdefault("response_length", 400)
    return ToolAgentLoop(
        eng.tokenizer, pool or ToolPool([CalculatorTool()]), sorted(eng.eos_token_ids), **keys
    )


def samples(n: int = len(QUESTIONS)) -> list[dict[str, Any]]:
    return [{"raw_prompt": [{"role": "user", "content": q}]} for q in QUESTIONS[:n]]


class Recorder:
    """Records, per request prefix, each model turn and each appended tool turn, and the
    engine's prefill tokens of each model turn (exact for one sample at a time)."""

    def __init__(self, runner: AgentLoopRunner, loop: ToolAgentLoop) -> None:
        self.turns: list[tuple[str, list[int], list[float]]] = []
        self.prefill: list[tuple[int, int]] = []  # (submitted tokens, prefilled tokens)
        server, generate, tool_turn_ids = runner.server, runner.server.generate, loop.tool_turn_ids

        async def recording_generate(request_id: str, **kw: Any) -> TokenOutput:
            before = server.engine.counters.prefill_tokens
            out = await generate(request_id, **kw)
            self.prefill.append(
                (len(kw["prompt_ids"]), server.engine.counters.prefill_tokens - before)
            )
            self.turns.append(("model", out.token_ids, out.log_probs))
            return out

        def recording_tool_turn_ids(outcomes: Any, ended_with_eos: bool) -> list[int]:
            ids = tool_turn_ids(outcomes, ended_with_eos)
            self.turns.append(("tool", ids, [0.0] * len(ids)))
            return ids

        server.generate = recording_generate  # type: ignore[method-assign]
        loop.tool_turn_ids = recording_tool_turn_ids  # type: ignore[method-assign]


def run_one(model: Path, pool: ToolPool, **keys: Any) -> tuple[AgentLoopOutput, Recorder, Any]:
    eng = engine(model)
    loop = tool_loop(eng, pool, **keys)
    runner = AgentLoopRunner(eng, {"tool_agent": loop})
    rec = Recorder(runner, loop)
    (out,) = runner.run(samples(1), GREEDY)
    return out, rec, eng.tokenizer


def check_tito(out: AgentLoopOutput, rec: Recorder) -> None:
    """The response is the recorded turns, concatenated position by position; the mask is 1
    exactly on model turns; logprobs are the engine's there and 0.0 on tool turns."""
    ids = [t for _, turn, _ in rec.turns for t in turn]
    mask = [int(kind == "model") for kind, turn, _ in rec.turns for _ in turn]
    logprobs = [lp for _, _, lps in rec.turns for lp in lps]
    assert out.response_ids == ids
    assert out.response_mask == mask
    assert out.response_logprobs == logprobs
    assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs)


def test_a_tool_turn_is_appended_as_tokens_and_the_model_goes_on(
    models: dict[str, Path], tokenizer: Any
) -> None:
    out, rec, tok = run_one(models["call"], ToolPool([CalculatorTool()]))
    check_tito(out, rec)
    kinds = [k for k, _, _ in rec.turns]
    assert kinds == ["model", "tool", "model"]
    call_turn, tool_turn, answer_turn = (t for _, t, _ in rec.turns)
    assert tok.decode(call_turn, skip_special_tokens=False) == f"<tool_call>{CALL}</tool_call>"
    assert tok.decode(tool_turn, skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n "
    )
    assert tok.decode(answer_turn, skip_special_tokens=False) == f"{ANSWER}<|im_end|>"
    assert out.num_turns == 4  # verl's count: prompt + 2 assistant turns + 1 tool turn
    assert out.metrics == {
        "tool_calls": 1,
        "tool_errors": 0,
        "tool_truncated": 0,
        "tool_exceptions": 0,
        "tool_timeouts": 0,
    }
    # the trajectory is the chat template's rendering of the conversation up to the last
    # turn's opening, then the last turn's sampled tokens
    messages = [
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": f"<tool_call>{CALL}</tool_call>"},
        {"role": "tool", "content": "42"},
    ]
    tools = [CalculatorTool().tool_schema.model_dump(exclude_unset=True, exclude_none=True)]
    rendered = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    expected = tok.encode(rendered, add_special_tokens=False) + answer_turn
    assert out.prompt_ids + out.response_ids == expected


def slow_twin(
    model: Path, question: str, max_turns: int
) -> tuple[list[int], list[int], list[float]]:
    """The same conversation kept as messages, each turn re-rendered by the chat template and
    prefilled from scratch on an engine without prefix caching: (every id, the mask and the
    logprobs over the response)."""
    eng = engine(model, prefix_caching=False)
    tok = eng.tokenizer
    tools = [CalculatorTool().tool_schema.model_dump(exclude_unset=True, exclude_none=True)]
    messages: list[dict[str, str]] = [{"role": "user", "content": question}]
    spans: list[tuple[int, list[float]]] = []  # (start, logprobs) of each model turn
    for turn in range(max_turns):
        text = tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        ids = tok.encode(text, add_special_tokens=False)
        if turn == 0:
            prompt_len = len(ids)
        params = SamplingParams(temperature=0, max_tokens=64, stop=["</tool_call>"])
        out = eng.generate([ids], params)[0].outputs[0]
        spans.append((len(ids), out.logprobs))
        reply = tok.decode(out.token_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        if not extract_tool_calls(reply)[1]:
            break
        messages.append({"role": "tool", "content": "42"})  # the calculator's answer to 6*7
    final = ids + out.token_ids
    mask, logprobs = [0] * len(final), [0.0] * len(final)
    for start, lps in spans:
        mask[start : start + len(lps)] = [1] * len(lps)
        logprobs[start : start + len(lps)] = lps
    return final, mask[prompt_len:], logprobs[prompt_len:]


@pytest.mark.parametrize("max_turns", [1, 2, 3])
def test_greedy_trajectories_equal_a_twin_that_reprefills_every_turn(
    models: dict[str, Path], max_turns: int
) -> None:
    eng = engine(models["call"])
    runner = AgentLoopRunner(eng, {"tool_agent": tool_loop(eng, max_assistant_turns=max_turns)})
    outs = runner.run(samples(), GREEDY)
    for question, out in zip(QUESTIONS, outs, strict=True):
        ids, mask, logprobs = slow_twin(models["call"], question, max_turns)
        assert out.prompt_ids + out.response_ids == ids  # tokens exactly
        assert out.response_mask == mask
        # prefix-cached vs full prefills sum in other orders: float32 rounding only
        assert out.response_logprobs == pytest.approx(logprobs, abs=1e-5)
        assert sum(mask) == (3 if max_turns == 1 else 5)  # the call (3), then answer + EOS


@pytest.mark.parametrize("keep_kv", [True, False])
def test_a_continuation_prefills_only_what_the_engine_lacks(
    models: dict[str, Path], keep_kv: bool
) -> None:
    """Turn 1 computed KV for its prompt and all but its last sampled token. Kept (the
    default), that KV is extended: turn 2 prefills exactly the rest. Without it, the prefix
    cache finds its full blocks again and the rest of the conversation is prefilled."""
    eng = engine(models["call"])
    loop = tool_loop(eng, ToolPool([CalculatorTool()]))
    runner = AgentLoopRunner(eng, {"tool_agent": loop}, keep_kv=keep_kv)
    rec = Recorder(runner, loop)
    runner.run(samples(1), GREEDY)
    (first_len, first_prefill), (second_len, second_prefill) = rec.prefill
    assert first_prefill == first_len  # a cold cache
    call_turn = rec.turns[0][1]
    computed = first_len + len(call_turn) - 1
    if keep_kv:
        assert second_prefill == second_len - computed
    else:
        assert second_prefill == second_len - (computed // BLOCK) * BLOCK
        assert second_prefill < BLOCK + second_len - computed
    print(f"turn 2: {second_len} tokens submitted, {second_prefill} prefilled")


def observation(tok: Any, rec: Recorder) -> str:
    """The text of the (one) tool turn: between <tool_response>\\n and \\n</tool_response>."""
    (tool_turn,) = [t for kind, t, _ in rec.turns if kind == "tool"]
    text = tok.decode(tool_turn, skip_special_tokens=False)
    return str(text.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0])


@pytest.fixture
def released_hang() -> Iterator[None]:
    HangingTool.gate.clear()
    yield
    HangingTool.gate.set()  # let the abandoned thread end


@pytest.mark.parametrize(
    ("model", "tool", "expected", "kind"),
    [
        ("malformed", None, "Error when executing tool: the tool call is not valid JSON", None),
        ("unknown", None, "Error when executing tool: unknown tool 'search'", None),
        (
            "call",
            "RaisingTool",
            "Error when executing tool: the calculator is broken",
            "exceptions",
        ),
        (
            "call",
            "HangingTool",
            "Error when executing tool: calculator timed out after 0.5s",
            "timeouts",
        ),
    ],
)
def test_a_faulty_call_gets_verls_error_observation_and_the_sample_goes_on(
    models: dict[str, Path],
    tmp_path: Path,
    released_hang: None,
    model: str,
    tool: str | None,
    expected: str,
    kind: str | None,
) -> None:
    tools = (
        load_tools(tool_config(tmp_path / "tools.yaml", f"agent_scripted.{tool}"))
        if tool
        else [CalculatorTool()]
    )
    out, rec, tok = run_one(models[model], ToolPool(tools, timeout_s=0.5))
    check_tito(out, rec)
    assert observation(tok, rec).startswith(expected)
    assert [k for k, _, _ in rec.turns] == ["model", "tool", "model"]  # it went on
    assert tok.decode(rec.turns[-1][1], skip_special_tokens=False) == f"{ANSWER}<|im_end|>"
    assert out.metrics["tool_errors"] == 1
    # the tool's own failures are counted apart (the tool guard's); the model's are not
    assert out.metrics["tool_exceptions"] == (kind == "exceptions")
    assert out.metrics["tool_timeouts"] == (kind == "timeouts")


@pytest.mark.parametrize(
    ("side", "expected"),
    [
        ("left", "01234567890123456789...(truncated)"),
        ("right", "(truncated)...01234567890123456789"),
        ("middle", "0123456789...(truncated)...0123456789"),
    ],
)
def test_a_huge_answer_is_truncated_as_verl_does(
    models: dict[str, Path], tmp_path: Path, side: Any, expected: str
) -> None:
    tools = load_tools(tool_config(tmp_path / "tools.yaml", "agent_scripted.HugeTool"))
    pool = ToolPool(tools, max_response_length=20, truncate_side=side)
    out, rec, tok = run_one(models["call"], pool)
    check_tito(out, rec)
    assert observation(tok, rec) == expected
    assert out.metrics == {
        "tool_calls": 1,
        "tool_errors": 0,
        "tool_truncated": 1,
        "tool_exceptions": 0,
        "tool_timeouts": 0,
    }


def test_a_slow_tool_does_not_stall_the_other_samples(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """The first call blocks until every other sample has finished (their decoding, their
    tools and their last turns ran meanwhile); a loop that waited on it would never get
    there, and the blocked call would answer "stalled"."""
    GatedTool.gate.clear()
    GatedTool.calls = 0
    tools = load_tools(tool_config(tmp_path / "tools.yaml", "agent_scripted.GatedTool"))
    eng = engine(models["call"])
    runner = AgentLoopRunner(eng, {"tool_agent": tool_loop(eng, ToolPool(tools))})
    order: list[int] = []
    n = len(QUESTIONS)

    def on_finish(i: int, out: AgentLoopOutput) -> None:
        order.append(i)
        if len(order) == n - 1:
            GatedTool.gate.set()

    try:
        outs = runner.run(samples(), GREEDY, on_finish=on_finish)
    finally:
        GatedTool.gate.set()
    assert len(order) == n and GatedTool.calls == n
    tok = eng.tokenizer
    texts = [tok.decode(o.response_ids, skip_special_tokens=False) for o in outs]
    assert all("stalled" not in t and "\n42\n" in t for t in texts)
    blocked = order[-1]  # the sample whose call waited finished last, and correctly
    assert texts[blocked].endswith(f"{ANSWER}<|im_end|>")
    assert outs[blocked].response_ids == outs[order[0]].response_ids


def test_a_turn_without_calls_ends_the_sample(tmp_path: Path, tokenizer: Any) -> None:
    model = save_scripted_model(tmp_path / "answer", tokenizer, call=None)
    eng = engine(model)
    (out,) = AgentLoopRunner(eng, {"tool_agent": tool_loop(eng)}).run(samples(1), GREEDY)
    assert tokenizer.decode(out.response_ids, skip_special_tokens=False) == f"{ANSWER}<|im_end|>"
    assert out.response_mask == [1, 1] and out.num_turns == 2


def test_turn_limits_and_the_response_budget_end_a_sample(models: dict[str, Path]) -> None:
    out, rec, _ = run_one(models["call"], ToolPool([CalculatorTool()]), max_user_turns=1)
    assert [k for k, _, _ in rec.turns] == ["model", "tool", "model"]  # ended by EOS anyway
    out, rec, _ = run_one(models["call"], ToolPool([CalculatorTool()]), max_assistant_turns=1)
    assert [k for k, _, _ in rec.turns] == ["model"] and sum(out.response_mask) == 3
    # the tool turn is rendered, but does not fit in 20 ids after the call's 3: verl's rule,
    # a trajectory never ends on a tool turn
    out, rec, _ = run_one(models["call"], ToolPool([CalculatorTool()]), response_length=20)
    assert len(rec.turns[1][1]) > 17
    assert out.response_ids == rec.turns[0][1] and out.response_mask == [1, 1, 1]


def test_an_unknown_agent_name_is_refused_before_anything_runs(models: dict[str, Path]) -> None:
    eng = engine(models["call"])
    runner = AgentLoopRunner(eng, {"tool_agent": tool_loop(eng)})
    with pytest.raises(ValueError, match="agent_name='react' is not one of"):
        runner.run(
            [{"raw_prompt": [{"role": "user", "content": "x"}], "agent_name": "react"}], GREEDY
        )
    assert not eng.has_unfinished()


def test_verls_way_ends_the_turn_at_eos_and_the_eos_is_not_appended_again(
    tmp_path: Path, tokenizer: Any
) -> None:
    model = save_scripted_model(tmp_path / "eos", tokenizer, eos_after_call=True)
    out, rec, tok = run_one(model, ToolPool([CalculatorTool()]), stop_at_tool_call=False)
    check_tito(out, rec)
    call_turn, tool_turn, _ = (t for _, t, _ in rec.turns)
    assert (
        tok.decode(call_turn, skip_special_tokens=False)
        == f"<tool_call>{CALL}</tool_call><|im_end|>"
    )
    assert tok.decode(tool_turn, skip_special_tokens=False).startswith("\n<|im_start|>user\n")


class Failing(ToolAgentLoop):
    """Raises after its first model turn, for sample 0 only."""

    async def run(self, sampling_params: SamplingParams, **kwargs: Any) -> AgentLoopOutput:
        if kwargs["sample_index"] == 0:
            await self.server_manager.generate(
                "failing",
                prompt_ids=self.prompt_ids(kwargs["raw_prompt"]),
                sampling_params=sampling_params,
            )
            raise RuntimeError("this loop is broken")
        return await super().run(sampling_params, **kwargs)


def test_a_loop_that_raises_stops_the_run_and_leaves_the_engine_idle(
    models: dict[str, Path],
) -> None:
    eng = engine(models["call"])
    loop = Failing(
        eng.tokenizer, ToolPool([CalculatorTool()]), sorted(eng.eos_token_ids), response_length=400
    )
    with pytest.raises(RuntimeError, match="this loop is broken"):
        AgentLoopRunner(eng, {"tool_agent": loop}).run(samples(), GREEDY)
    assert not eng.has_unfinished()
    (out,) = AgentLoopRunner(eng, {"tool_agent": tool_loop(eng)}).run(samples(1), GREEDY)
    assert sum(out.response_mask) == 5  # the engine serves the next run


def test_a_runner_and_its_pool_serve_run_after_run(models: dict[str, Path]) -> None:
    """Each run has its own event loop; the pool's worker bound (1 here, 3 samples calling
    at once) follows it."""
    eng = engine(models["call"])
    runner = AgentLoopRunner(
        eng, {"tool_agent": tool_loop(eng, ToolPool([CalculatorTool()], max_workers=1))}
    )
    first = runner.run(samples(), GREEDY)
    second = runner.run(samples(), GREEDY)
    assert [o.response_ids for o in first] == [o.response_ids for o in second]
    assert all(sum(o.response_mask) == 5 for o in second)


def test_a_tool_turn_that_would_not_fit_max_model_len_ends_the_sample(
    models: dict[str, Path],
) -> None:
    eng = engine(models["call"])
    loop = tool_loop(eng)
    prompt = len(loop.prompt_ids(samples(1)[0]["raw_prompt"]))
    small = Engine(eng.config.model_copy(update={"max_model_len": prompt + 10}))
    (out,) = AgentLoopRunner(small, {"tool_agent": tool_loop(small)}).run(samples(1), GREEDY)
    assert out.response_mask == [1, 1, 1]  # the call; its answer did not fit
