"""How the engine chooses its tensor-parallel layout: fixed, or re-planned while it generates."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StaticTP(BaseModel):
    """One layout for the whole rollout: the layout the engine is given, or, with `tp` set
    and no layout given, this rank's TP group of `tp` ranks (under torchrun the engine joins
    the world and makes its groups itself; see patrl.rollout.torchrun). A layout of another
    TP size than `tp` is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["static"] = "static"
    tp: int | None = Field(None, gt=0, description="TP size; None = the layout the engine gets")


class AdaptiveTP(BaseModel):
    """Let the planner fold data-parallel replicas into larger TP groups as the batch drains
    (PAT). Rollouts open at the layout the last rollout's first check priced fastest for a full
    batch (at first the smallest candidate); every `check_every` decode steps the planner may
    fold; after a rollout the engine returns to the opening layout. See docs/adaptive_tp.md.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["adaptive"] = "adaptive"
    candidates: tuple[int, ...] = Field((1, 2), description="TP sizes the rollout may use")
    check_every: int = Field(
        64, gt=0, description="decode steps between planner checks (each is a world sync point)"
    )
    check_budget: float = Field(
        0.005,
        ge=0,
        lt=1,
        description="space checks further than check_every where one would cost more than "
        "this fraction of the decode time between two (0: exactly check_every)",
    )
    margin: float = Field(0.2, ge=0, description="switch when gain > overhead x (1 + margin)")
    kv_policy: Literal["auto", "migrate", "recompute"] = Field(
        "auto", description="auto: the planner's cheaper choice per sequence"
    )
    profile: str | None = Field(
        None,
        description="latency profile JSON (python -m patrl.rollout.profile); "
        "required unless a planner object is given to the Engine",
    )

    @model_validator(mode="after")
    def _candidates_ok(self) -> AdaptiveTP:
        if not self.candidates or any(tp < 1 for tp in self.candidates):
            raise ValueError(f"candidates must be positive TP sizes, got {self.candidates}")
        if len(set(self.candidates)) < 2:
            raise ValueError(
                f"adaptive TP needs at least two candidate TP sizes, got {self.candidates}; "
                "use static for one"
            )
        return self

    @property
    def start_tp(self) -> int:
        """The smallest candidate: where the first rollout opens."""
        return min(self.candidates)


TPPolicy = Annotated[StaticTP | AdaptiveTP, Field(discriminator="kind")]
