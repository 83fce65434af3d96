"""rollout.attention_backend and rollout.block_size: checked as a pair when both are named,
passed through to the engine, where an unset block size becomes the backend's."""

from __future__ import annotations

import pytest
import torch

from patrl.orchestrator.build import engine_config
from patrl.orchestrator.config import ConfigError, load_config
from patrl.orchestrator.distributed import World

CPU = World(0, 1, 0, torch.device("cpu"))
# One process with adaptive TP measures a TP-1 profile of the model for the simulator; these
# tests name no real model and look at the engine's attention settings only.
STATIC = "rollout.adaptive_tp.enable=false"


def test_an_unset_block_size_is_the_backends() -> None:
    config = load_config(None, [STATIC])
    assert config.rollout.block_size is None and config.rollout.attention_backend == "auto"
    engine = engine_config(config, "model", CPU)
    assert (engine.attention_backend, engine.block_size) == ("sdpa", 16)
    named = engine_config(
        load_config(None, [STATIC, "rollout.attention_backend=flash"]), "model", CPU
    )
    assert (named.attention_backend, named.block_size) == ("flash", 256)


def test_an_explicit_block_size_passes_through() -> None:
    engine = engine_config(load_config(None, [STATIC, "rollout.block_size=8"]), "model", CPU)
    assert engine.block_size == 8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.attention_backend=flash", "rollout.block_size=16"],
            r"attention_backend='flash' cannot use block_size=16: it takes a positive multiple "
            r"of 256",
        ),
        (["rollout.attention_backend=xformers"], r"unknown attention backend 'xformers'"),
    ],
)
def test_a_bad_pair_fails_at_load_naming_both(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
