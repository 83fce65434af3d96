"""A multi-turn turn moved between engines mid-generation (a fold's or cut-and-migrate's
export and import) keeps what makes it a turn: its `keep` flag (it is kept with its KV when
it completes, for the next turn's `continue_request`) and its prompt key."""

from __future__ import annotations

from pathlib import Path

import pytest

from patrl.rollout import Engine, EngineConfig, SamplingParams
from patrl_testkit.models import save_hf_model, tiny_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(tiny_hf_model("llama"), tmp_path_factory.mktemp("llama_turns"))


def engine_of(model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=64))


def finish(engine: Engine) -> list[int]:
    """Step until idle; the token ids of the one request that finished."""
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    (out,) = outs
    return list(out.outputs[0].token_ids)


@pytest.mark.parametrize("with_kv", [True, False])
def test_a_moved_turn_is_kept_where_it_completes_and_continues_there(
    llama_dir: Path, with_kv: bool
) -> None:
    prompt, appended = [5, 6, 7, 8, 9], [11, 12, 13]
    # the twin: the turn and its continuation on one engine
    twin = engine_of(llama_dir)
    twin.add_request(prompt, GREEDY, request_id="t0", prompt_key="p", keep=True)
    first = finish(twin)
    twin.continue_request("t0", appended, GREEDY, "t1")
    second = finish(twin)

    src, dst = engine_of(llama_dir), engine_of(llama_dir)
    src.add_request(prompt, GREEDY, request_id="t0", prompt_key="p", keep=True)
    for _ in range(3):  # the prefill and two decode steps, then the move
        assert src.step() == []
    (state,) = src.export_requests(["t0"], with_kv=with_kv)
    assert state.keep and state.prompt_key == "p"
    dst.import_requests([state])
    assert finish(dst) == first
    assert dst.kept_request_ids() == ["t0"] and src.kept_request_ids() == []
    dst.continue_request("t0", appended, GREEDY, "t1")
    assert finish(dst) == second
    assert dst.kept_request_ids() == []
