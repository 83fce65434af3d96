"""rollout.speculative.*: read into the job config, bad values named with what is accepted."""

from __future__ import annotations

import pytest

from patrl.orchestrator.config import ConfigError, load_config
from patrl.rollout.config import EngineConfig


def test_speculative_keys_reach_the_engine_config() -> None:
    config = load_config(
        None,
        [
            "rollout.speculative.enable=true",
            "rollout.speculative.num_speculative_tokens=6",
            "rollout.speculative.sources=[history,group]",
        ],
    )
    spec = config.rollout.speculative
    assert (spec.enable, spec.num_speculative_tokens, spec.sources) == (
        True,
        6,
        ["history", "group"],
    )
    assert not load_config(None, []).rollout.speculative.enable  # off by default
    engine = EngineConfig(model="unused", speculative=spec.model_dump())
    assert engine.speculative.sources == ("history", "group")
    assert engine.speculative.num_speculative_tokens == 6


@pytest.mark.parametrize(
    ("override", "named"),
    [
        (
            "rollout.speculative.sources=[group,draft_model]",
            r"(?s)rollout\.speculative\.sources.*'prompt'",
        ),
        (
            "rollout.speculative.num_speculative_tokens=0",
            r"rollout\.speculative\.num_speculative_tokens",
        ),
        ("rollout.speculative.enabled=true", r"rollout\.speculative\.enabled"),
        ("rollout.speculative.max_num_seqs=-1", r"rollout\.speculative\.max_num_seqs"),
    ],
)
def test_a_bad_speculative_value_is_a_config_error_naming_it(override: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_config(None, [override])
