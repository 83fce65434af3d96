"""Speculative rollouts with multi-turn agent loops (issue 46): drafts only decide how many
tokens a step verifies, so greedy trajectories over kept-KV turns are the same tokens with
speculation on and off (logprobs within 1e-5: a verify step scores several query tokens in
one forward, a float32 sum in another order), at TP 1 and at static TP 2, where every rank
proposes the same drafts (the drafter's state is a function of the engine calls, which the
group's first rank broadcasts, tool tokens included).

A conversation is one drafter sample: a kept turn stays in its prompt's group and its
continuation appends the tool's ids to its stream, so siblings draft from each other's later
turns and the finished conversation (model and tool ids, exactly the trained response) is
remembered as the prompt's history.

The model is agent_scripted's tiny Llama that calls the calculator on every turn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from agent_scripted import CALL, hermes_tokenizer, save_scripted_model
from test_orchestrator_agent_loop import tool_loop

from patrl.orchestrator.agent import AgentLoopRunner, CalculatorTool, ToolPool
from patrl.rollout import Engine, EngineConfig, SamplingParams
from patrl_testkit.multirank import run_ranks

TURNS = 3
SIBLINGS = 3
GREEDY = SamplingParams(temperature=0, max_tokens=64)
SPEC = {"enable": True, "max_num_seqs": 0, "num_speculative_tokens": 6}
QUESTION = [{"role": "user", "content": "What is 6*7?"}]
OTHER = [{"role": "user", "content": "Six times seven?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("agent_spec")
    return save_scripted_model(root / "again", hermes_tokenizer(), CALL, call_after_tool=True)


def engine(model: str, speculative: bool, layout: Any = None, **spec: Any) -> Engine:
    config = EngineConfig(
        model=model,
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=1024,
        max_model_len=1024,
        speculative={**SPEC, **spec} if speculative else {"enable": False},
    )
    return Engine(config, layout) if layout is not None else Engine(config)


def rollout(eng: Engine) -> tuple[list[Any], dict[str, Any]]:
    """SIBLINGS samples of QUESTION and one of OTHER, TURNS model turns each, kept KV; the
    outputs, and what the drafter proposed (seq id, draft) in order, its source counts and
    history (None without speculation)."""
    loop = tool_loop(eng, ToolPool([CalculatorTool()]), max_assistant_turns=TURNS)
    runner = AgentLoopRunner(eng, {"tool_agent": loop})
    proposed: list[tuple[int, list[int]]] = []
    drafter = eng.drafter
    if drafter is not None:
        propose = drafter.propose

        def recording_propose(seq_id: int, context: Any, limit: int) -> Any:
            draft = propose(seq_id, context, limit)
            proposed.append((seq_id, list(draft.tokens)))
            return draft

        drafter.propose = recording_propose  # type: ignore[method-assign]
    rows = [{"raw_prompt": QUESTION}] * SIBLINGS + [{"raw_prompt": OTHER}]
    outs = runner.run(rows, GREEDY)
    info: dict[str, Any] = {"proposed": proposed, "kept": eng.kept_request_ids()}
    if drafter is not None:
        info["accepted"] = dict(drafter.counts.accepted)
        info["history"] = {k: v for k, v in drafter.history.items()}
        info["groups"] = drafter.num_groups()
    blocks = eng.cache.blocks
    info["all_free"] = blocks.num_free_blocks == blocks.num_blocks
    return outs, info


def trajectories(outs: list[Any]) -> list[tuple[list[int], list[int], list[int]]]:
    return [(o.prompt_ids, o.response_ids, o.response_mask) for o in outs]


def assert_logprobs_close(got: list[Any], want: list[Any]) -> None:
    for g, w in zip(got, want, strict=True):
        assert len(g.response_logprobs) == len(w.response_logprobs)
        worst = max(
            abs(a - b) for a, b in zip(g.response_logprobs, w.response_logprobs, strict=True)
        )
        assert worst <= 1e-5, worst


def test_greedy_multi_turn_trajectories_are_the_same_with_speculation_on_and_off(
    model: Path,
) -> None:
    plain, _ = rollout(engine(str(model), speculative=False))
    spec, info = rollout(engine(str(model), speculative=True))
    assert all(o.num_turns >= 2 * TURNS - 1 for o in plain)  # model, tool, ..., model
    assert all(0 in o.response_mask for o in plain)  # tool tokens in every trajectory
    assert trajectories(spec) == trajectories(plain)
    assert_logprobs_close(spec, plain)
    # speculation happened, and drafts from the siblings' streams were accepted
    assert sum(info["accepted"].values()) > 0
    assert info["accepted"]["group"] > 0
    # each conversation was one drafter sample: its whole response, model and tool ids, is
    # the prompt's history (keyed by the first turn's prompt ids), and nothing is left over
    by_prompt: dict[tuple[int, ...], list[list[int]]] = {}
    for o in spec:
        by_prompt.setdefault(tuple(o.prompt_ids), []).append(o.response_ids)
    assert {k: sorted(v) for k, v in info["history"].items()} == {
        k: sorted(v) for k, v in by_prompt.items()
    }
    assert info["groups"] == 0 and info["kept"] == [] and info["all_free"]


def test_a_sibling_s_turns_draft_from_the_remembered_conversation(model: Path) -> None:
    """One conversation run, then its sibling, drafting from history alone: every model turn
    of the sibling (three tokens: the prefill's, then one decode step that verifies a draft
    of the call and samples `</tool_call>`) drafts from the first conversation and has the
    draft accepted: one decode step per turn, where decoding alone takes two. A turn after
    a tool opens with " <tool_call>", a bigram
    found only across a tool turn's ids and the next model turn: the remembered conversation
    holds the tool ids."""
    eng = engine(str(model), speculative=True, sources=["history"])
    loop = tool_loop(eng, ToolPool([CalculatorTool()]), max_assistant_turns=TURNS)
    runner = AgentLoopRunner(eng, {"tool_agent": loop})
    (first,) = runner.run([{"raw_prompt": QUESTION}], GREEDY)
    drafter = eng.drafter
    assert drafter is not None
    (key,) = drafter.history
    assert drafter.history[key] == [first.response_ids]
    assert key == tuple(first.prompt_ids)
    before = drafter.counts.stats()
    (second,) = runner.run([{"raw_prompt": QUESTION}], GREEDY)
    after = drafter.counts.stats()
    assert second.response_ids == first.response_ids
    model_tokens = sum(second.response_mask)
    assert model_tokens == 3 * TURNS
    delta = {k: after[k] - before[k] for k in after}
    assert delta["spec_sample_steps"] == TURNS
    assert delta["spec_emitted_tokens"] == 2 * TURNS
    assert delta["spec_accepted_tokens/history"] == TURNS  # each turn's call token


def _tp_rank(rank: int, world_size: int, model: str) -> dict[str, Any]:
    import torch.distributed as dist

    from patrl.tpreshard import ParallelLayout

    group = dist.new_group(list(range(world_size)))
    layout = ParallelLayout(tp_size=world_size, tp_rank=rank, tp_group=group)
    outs, info = rollout(engine(model, speculative=True, layout=layout))
    info["trajectories"] = trajectories(outs)
    info["logprobs"] = [o.response_logprobs for o in outs]
    return info


@pytest.mark.multirank
def test_tp2_ranks_propose_the_same_drafts_and_sample_what_tp1_samples(model: Path) -> None:
    plain, _ = rollout(engine(str(model), speculative=False))
    leader, peer = run_ranks(_tp_rank, world_size=2, args=(str(model),), timeout_s=300)
    assert leader["proposed"] == peer["proposed"]  # the same drafts, step by step
    assert sum(len(d) for _, d in leader["proposed"]) > 0
    assert leader["history"] == peer["history"]
    for rank in (leader, peer):
        assert rank["trajectories"] == trajectories(plain)
        for got, want in zip(rank["logprobs"], plain, strict=True):
            worst = max(abs(a - b) for a, b in zip(got, want.response_logprobs, strict=True))
            assert worst <= 1e-5, worst
        assert rank["kept"] == [] and rank["all_free"] and rank["groups"] == 0
