"""KV reuse between turns (issue 46): the engine keeps each conversation's KV between its turns
(`Engine.continue_request`), so each continuation prefills exactly the appended tool tokens and
the previous turn's last sampled token (its KV is computed when it is fed back, never at
sampling), at every block size; the trajectories equal a slow twin that re-prefills the whole
conversation every turn on an engine without prefix caching, tokens exactly; every block is
free again after a run. The runner's `keep_kv=False` path (each turn a new request, over
prefix caching) is pinned too: exact with one-token blocks only.

The model is agent_scripted's tiny Llama that calls the calculator on every turn, so a sample
has as many continuations as `max_assistant_turns` allows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from agent_scripted import CALL, hermes_tokenizer, save_scripted_model
from test_orchestrator_agent_loop import GREEDY, QUESTIONS, Recorder, samples, tool_loop

from patrl.orchestrator.agent import AgentLoopRunner, CalculatorTool, ToolOutcome, ToolPool
from patrl.rollout import Engine, EngineConfig, SamplingParams

TURNS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kv_reuse")
    return save_scripted_model(root / "again", hermes_tokenizer(), CALL, call_after_tool=True)


def engine(model: Path, block_size: int, prefix_caching: bool = True) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            device="cpu",
            block_size=block_size,
            num_kv_blocks=4096 // block_size,
            max_model_len=1024,
            enable_prefix_caching=prefix_caching,
        )
    )


def reprefilling_twin(model: Path, question: str) -> tuple[list[int], list[int], list[float]]:
    """The conversation as one growing list of ids, each turn submitted whole to an engine
    without prefix caching (so every turn prefills all of it), one call-free `generate` per
    turn; the tool turns are the ids the loop's template rendering gives for the calculator's
    answer "42" (the re-rendered chat would differ: the template opens a turn after a tool
    answer with a space it does not keep in the history). (every id, mask, logprobs)."""
    eng = engine(model, 4, prefix_caching=False)
    loop = tool_loop(eng)
    ids = loop.prompt_ids([{"role": "user", "content": question}])
    n = len(ids)
    mask: list[int] = []
    logprobs: list[float] = []
    params = SamplingParams(temperature=0, max_tokens=64, stop=["</tool_call>"])
    for turn in range(TURNS):
        before = eng.counters.prefill_tokens
        out = eng.generate([ids], params)[0].outputs[0]
        assert eng.counters.prefill_tokens - before == len(ids)  # the whole conversation
        ids = ids + out.token_ids
        mask += [1] * len(out.token_ids)
        logprobs += out.logprobs
        if turn == TURNS - 1:
            break
        tool = loop.tool_turn_ids([ToolOutcome("42")], ended_with_eos=False)
        ids += tool
        mask += [0] * len(tool)
        logprobs += [0.0] * len(tool)
    assert len(ids) == n + len(mask)
    return ids, mask, logprobs


def continuations(
    model: Path, block_size: int, keep_kv: bool = True, prefix_caching: bool = True
) -> tuple[list[tuple[int, int]], list[int]]:
    """One sample of TURNS model turns, run alone (so the engine's prefill counter is its
    own): per model turn (submitted tokens, prefilled tokens), and per tool turn its length.
    The engine is left with every block free."""
    eng = engine(model, block_size, prefix_caching)
    loop = tool_loop(eng, ToolPool([CalculatorTool()]), max_assistant_turns=TURNS)
    runner = AgentLoopRunner(eng, {"tool_agent": loop}, keep_kv=keep_kv)
    rec = Recorder(runner, loop)
    (out,) = runner.run(samples(1), GREEDY)
    assert [k for k, _, _ in rec.turns] == ["model", "tool"] * (TURNS - 1) + ["model"]
    assert out.metrics["tool_calls"] == TURNS - 1
    appended = [len(ids) for kind, ids, _ in rec.turns if kind == "tool"]
    assert_all_free(eng)
    return rec.prefill, appended


def assert_all_free(eng: Engine) -> None:
    """Nothing kept, no block referenced, the bookkeeping consistent."""
    blocks = eng.cache.blocks
    blocks.check_integrity()
    assert eng.kept_request_ids() == []
    assert blocks.num_free_blocks == blocks.num_blocks
    assert all(blocks.ref_count(b) == 0 for b in range(blocks.num_blocks))


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_each_continuation_prefills_exactly_the_appended_tokens(
    model: Path, block_size: int, prefix_caching: bool
) -> None:
    """The kept KV: turn t+1 prefills the tool turn's ids and turn t's last sampled token,
    nothing of the rest, at any block size, with or without the prefix cache."""
    prefill, appended = continuations(model, block_size, prefix_caching=prefix_caching)
    (first_len, first_prefill), *rest = prefill
    assert first_prefill == first_len  # a cold cache
    assert len(rest) == len(appended) == TURNS - 1
    for (submitted, prefilled), tool_tokens in zip(rest, appended, strict=True):
        assert prefilled == tool_tokens + 1, (submitted, prefilled, tool_tokens)
        assert submitted > 3 * prefilled  # the conversation is not prefilled again


@pytest.mark.parametrize("block", [1, 4])
def test_without_kept_kv_a_continuation_prefills_less_than_one_block_more(
    model: Path, block: int
) -> None:
    """keep_kv=False: each turn is a new request, and the prefix cache keeps full blocks
    only: the tokens of the last, partly filled block of computed KV are prefilled again,
    fewer than block_size of them (none with one-token blocks)."""
    prefill, appended = continuations(model, block, keep_kv=False)
    for (_, prefilled), tool_tokens in zip(prefill[1:], appended, strict=True):
        assert tool_tokens + 1 <= prefilled < tool_tokens + 1 + block
        if block == 1:
            assert prefilled == tool_tokens + 1


@pytest.mark.parametrize(("block_size", "keep_kv"), [(1, True), (4, True), (16, True), (4, False)])
def test_greedy_trajectories_over_many_turns_equal_the_reprefilling_twin(
    model: Path, block_size: int, keep_kv: bool
) -> None:
    """Several samples at once (their turns and tool waits interleave); afterwards every
    block is free."""
    eng = engine(model, block_size)
    loop = tool_loop(eng, ToolPool([CalculatorTool()]), max_assistant_turns=TURNS)
    outs = AgentLoopRunner(eng, {"tool_agent": loop}, keep_kv=keep_kv).run(samples(), GREEDY)
    assert_all_free(eng)
    for question, out in zip(QUESTIONS, outs, strict=True):
        ids, mask, logprobs = reprefilling_twin(model, question)
        assert out.prompt_ids + out.response_ids == ids  # tokens exactly
        assert out.response_mask == mask
        assert sum(mask) == 3 * TURNS  # <tool_call>, the call, </tool_call> each turn
        # kept or prefix-cached KV vs full prefills sum in other orders: float32 rounding
        assert out.response_logprobs == pytest.approx(logprobs, abs=1e-5)
