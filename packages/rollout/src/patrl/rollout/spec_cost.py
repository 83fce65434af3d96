"""Whether a speculative step pays, priced by a latency profile (`rollout.speculative`'s
`latency_profile`): the drafter's `step_cost` from the profile's decode fit and its verify rows
(patrl.lenpredict `LatencyModel.verify_time`). At small batch a step reads every weight once
whatever its rows, so a few more query tokens cost little and drafts pay; at large batch the
step is compute-bound, each query token costs about as much as a sequence, and the expected
accepted tokens never cover their price, so speculation stays off by itself.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import ValidationError

from patrl.lenpredict import LatencyModel, Profile, ProfileMismatchError
from patrl.rollout.config import SpeculativeConfig
from patrl.rollout.drafter import Drafter, StepCost, new_drafter
from patrl.rollout.model_config import ModelArch

# ModelInfo's field -> ModelArch's: the architecture facts a step's price depends on
_SHAPE = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_attention_heads": "num_heads",
    "num_kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
}


def profile_step_cost(latency: LatencyModel, tp: int) -> StepCost:
    """The drafter's `step_cost` at TP size `tp`: `latency.verify_time`, evaluated in plain
    Python from the fit's coefficients (a scheduler calls it twice a decode step, where
    numpy's per-call overhead would show; tests hold it to `verify_time`)."""
    fixed, per_seq, per_token, per_padded, knees, changes = latency.step_coefficients(tp)
    bends = list(zip(knees, changes, strict=True))
    verify = latency.verify_s.get(tp)

    def step(num_seqs: float, context_tokens: float) -> float:
        t = fixed + per_seq * num_seqs + (per_token + per_padded) * context_tokens
        return t + sum(change * max(0.0, num_seqs - knee) for knee, change in bends)

    def cost(num_seqs: int, num_tokens: int, context_tokens: int) -> float:
        if num_tokens == num_seqs:
            return step(num_seqs, context_tokens)
        if verify is None:
            return step(num_tokens, context_tokens)
        return step(num_seqs, context_tokens) + verify[0] + verify[1] * (num_tokens - num_seqs)

    return cost


def load_latency(path: str | Path, model: ModelArch, dtype: torch.dtype) -> LatencyModel:
    """The latency model of the profile at `path`, checked against the engine's model shape
    and dtype (a profile of another model would price every step wrongly, silently)."""
    try:
        profile = Profile.load(path)
    except (OSError, ValidationError, ValueError) as e:
        raise ValueError(
            f"speculative.latency_profile={str(path)!r} is not a readable latency profile "
            f"(python -m patrl.rollout.profile writes one): {e}"
        ) from e
    ours = str(dtype).removeprefix("torch.")
    if profile.dtype != ours:
        raise ProfileMismatchError(
            f"speculative.latency_profile={str(path)!r} was measured in dtype "
            f"{profile.dtype!r} but the engine runs {ours!r}"
        )
    for info_field, config_field in _SHAPE.items():
        theirs, mine = getattr(profile.model, info_field), getattr(model, config_field)
        if theirs != mine:
            raise ProfileMismatchError(
                f"speculative.latency_profile={str(path)!r} is a profile of a model with "
                f"{info_field}={theirs}, the engine's has {mine}: profile this model"
            )
    return LatencyModel.fit(profile)


def drafter_for(
    config: SpeculativeConfig, model: torch.nn.Module, tp: int, model_config: ModelArch
) -> Drafter | None:
    """The engine's drafter (None: speculation off), its steps priced by
    `config.latency_profile` at TP size `tp` when one is given."""
    if not config.enable:
        return None
    cost = None
    if config.latency_profile is not None:
        dtype = next(model.parameters()).dtype
        cost = profile_step_cost(load_latency(config.latency_profile, model_config, dtype), tp)
    return new_drafter(config, cost)
