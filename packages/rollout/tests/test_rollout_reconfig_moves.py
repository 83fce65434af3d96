"""Cut-and-migrate between replicas, and reconfigure's refusals that leave the engine as it was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_rollout_reconfig import _add, _config, _drain, _everyone, _workload

from patrl.rollout.adaptive import cut_and_migrate, reconfigure
from patrl.rollout.adaptive.reconfig import _moving
from patrl.rollout.engine import Engine
from patrl.tpreshard import GroupCache, ParallelLayout
from patrl_testkit.models import save_hf_model, tiny_hf_model
from patrl_testkit.multirank import run_ranks


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(tiny_hf_model("llama"), tmp_path_factory.mktemp("llama_moves"))


def _cut(rank: int, world_size: int, model_dir: str, with_kv: bool) -> dict[str, Any]:
    groups = GroupCache([1], world_size=world_size, rank=rank)
    engine = Engine(_config(model_dir), groups.layout(1), groups)
    reference: dict[str, Any] = {}
    _add(engine)
    _drain(engine, reference)
    live: dict[str, Any] = {}
    _add(engine)
    _drain(engine, live, steps=5)
    ids = [rid for rid, _, _ in _workload(0)]
    moved = cut_and_migrate(engine, ids, src_dp=0, dst_dp=1, with_kv=with_kv)
    left = engine.request_ids()
    _drain(engine, live)
    return {
        "reference": _everyone(reference),
        "live": _everyone(live),
        "moved": moved,
        "left": left,
    }


@pytest.mark.multirank
@pytest.mark.parametrize("with_kv", [True, False])
def test_cut_and_migrate_three_requests_finishes_them_with_the_same_tokens(
    llama_dir: Path, with_kv: bool
) -> None:
    results = run_ranks(_cut, 2, args=(str(llama_dir), with_kv), timeout_s=300)
    ref = results[0]["reference"]
    assert len(ref) == 6
    assert results[0]["live"] == results[1]["live"] == ref
    assert results[0]["left"] == []  # replica A gave all three away
    assert sorted(results[1]["left"]) == sorted(
        [r for r, _, _ in _workload(0)] + [r for r, _, _ in _workload(1)]
    )
    assert (results[0]["moved"] > 0) == with_kv


def _snapshot(engine: Engine) -> tuple[Any, ...]:
    return (
        engine.layout,
        engine.request_ids(),
        [p.data.clone() for p in engine.model.parameters()],
        engine.cache,
    )


def _unchanged(engine: Engine, before: tuple[Any, ...]) -> bool:
    layout, ids, params, cache = before
    return (
        engine.layout is layout
        and engine.request_ids() == ids
        and engine.cache is cache
        and all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), params, strict=True))
    )


def test_bad_reconfigure_targets_fail_clearly_and_change_nothing(llama_dir: Path) -> None:
    groups = GroupCache([1], world_size=1, rank=0)  # a world of one: no process groups
    engine = Engine(_config(str(llama_dir)), groups.layout(1), groups)
    reference: dict[str, Any] = {}
    _add(engine)
    _drain(engine, reference)
    live: dict[str, Any] = {}
    _add(engine)
    _drain(engine, live, steps=4)
    before = _snapshot(engine)
    with pytest.raises(ValueError, match=r"TP size 2 is not a candidate of this GroupCache: \[1\]"):
        reconfigure(engine, 2)
    three = ParallelLayout(tp_size=3, tp_rank=0, tp_group=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tp_size=3 must divide num_attention_heads=4"):
        reconfigure(engine, three)
    _moving.add(engine)  # as if another reconfigure were running
    with pytest.raises(RuntimeError, match="already in progress"):
        reconfigure(engine, groups.layout(1))
    _moving.discard(engine)
    with pytest.raises(ValueError, match="already at tp_size=1"):
        reconfigure(engine, 1)
    assert _unchanged(engine, before)
    _drain(engine, live)
    assert live == reference


def test_a_weight_of_the_wrong_shape_names_both_shapes(llama_dir: Path) -> None:
    engine = Engine(_config(str(llama_dir)))
    with pytest.raises(ValueError, match=r"shape \(64,\).*\(65,\)"):
        engine.load_weights([("model.norm.weight", torch.zeros(65))], version=1)
    assert engine.weight_version == 0


def test_a_split_keeps_samples_of_a_request_together_and_balances_remaining_tokens() -> None:
    # a switch without a plan runs the planner's split, each sample's work its remaining
    # max_tokens (reconfigure's `derive_plan`)
    from patrl.lenpredict import Layout
    from patrl.rollout.adaptive.switch_plan import Row, derive_plan

    def row(rid: str, index: int, left: int) -> tuple[int, Row]:
        return 0, Row(rid, index, 1 + 20 - left, 20 - left, 20, False, 0)

    rows = [row("a", 0, 10), row("b", 0, 4), row("b", 1, 4), row("c", 0, 3), row("d", 0, 3)]
    got = derive_plan(rows, Layout(dp=1, tp=2), Layout(dp=2, tp=1)).replica
    assert got[("b", 0)] == got[("b", 1)]
    load = [0, 0]
    for (rid, _), j in got.items():
        load[j] += {"a": 10, "b": 4, "c": 3, "d": 3}[rid]
    assert sorted(load) == [11, 13]  # a (10) + d (3) vs b (4 + 4) + c (3): the best split
