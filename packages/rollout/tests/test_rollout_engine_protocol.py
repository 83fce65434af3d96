"""`RolloutEngine`: both kinds of engine are one, and `AdaptiveEngine` carries nothing of
`Engine`'s beyond it (the step-level API is reached through its `engine`)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from patrl.rollout import (
    AdaptiveEngine,
    AdaptiveTP,
    Engine,
    EngineConfig,
    RolloutEngine,
    SamplingParams,
    make_engine,
)
from patrl_testkit.models import save_hf_model, tiny_hf_model

# AdaptiveEngine's own calls, beyond the protocol: chat (its generate's), the way back, and
# switch (a verdict carried out; SteppedRollout's multi-turn driver calls it between steps)
OWN = {"chat", "return_later", "settle_layout", "switch"}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(tiny_hf_model("llama"), tmp_path_factory.mktemp("llama_protocol"))


def _members(cls: type) -> set[str]:
    return {n for n, _ in inspect.getmembers(cls) if not n.startswith("_")}


def _static(static: Engine, adaptive: AdaptiveEngine) -> list[RolloutEngine]:
    """mypy's check: both classes satisfy the protocol structurally."""
    return [static, adaptive]


def test_both_engines_are_rollout_engines(llama_dir: Path) -> None:
    config = EngineConfig(model=str(llama_dir), block_size=4, num_kv_blocks=64, max_model_len=64)
    static = make_engine(config)
    # one process: an adaptive engine with nothing to adapt (no controller), still the wrapper
    policy = AdaptiveTP(candidates=(1, 2), profile=None)
    adaptive = make_engine(config.model_copy(update={"tp_policy": policy}))
    assert isinstance(static, Engine) and isinstance(adaptive, AdaptiveEngine)
    for engine in _static(static, adaptive):
        assert isinstance(engine, RolloutEngine)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # the protocol's calls run alike on both (tp=1, one process: the same tokens)
    want = [o.outputs[0].token_ids for o in static.generate([[3, 1, 4]], params)]
    got = [o.outputs[0].token_ids for o in adaptive.generate([[3, 1, 4]], params)]
    assert got == want
    assert adaptive.layout.tp_size == static.layout.tp_size == 1
    assert adaptive.drafter is None and static.drafter is None
    assert adaptive.stats()["weight_version"] == 0
    # the wrapped engine is public: the step-level API lives there
    assert isinstance(adaptive.engine, Engine)
    assert adaptive.engine.request_ids() == []


def test_adaptive_engine_has_no_pass_throughs() -> None:
    protocol = _members(RolloutEngine)
    assert protocol == {
        "drafter",
        "generate",
        "generate_partial",
        "layout",
        "load_weights",
        "sleep",
        "stats",
        "wake_up",
    }
    assert _members(AdaptiveEngine) == protocol | OWN
