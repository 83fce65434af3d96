"""The latency profile: what the engine's profiler measured (or a roofline model computed).

JSON on disk. A profile belongs to one model architecture, one dtype and one machine; a
`LatencyModel` is fitted from it, and an engine refuses a profile of another model or dtype
(`Profile.check_matches`) because its step times would be wrong by a factor, silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from patrl.lenpredict.layout import usable_tp_sizes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
Dtype = Literal["float32", "bfloat16", "float16"]
CollectiveOp = Literal["all_reduce", "all_gather", "broadcast", "send"]


class ProfileMismatchError(ValueError):
    """A profile measured for another model or dtype than the engine's."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelInfo(_Strict):
    """The architecture facts that decide costs. `name` is informational only: a fine-tuned
    checkpoint of the same architecture has the same step times."""

    name: str
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    num_params: int = Field(gt=0)

    def weight_bytes(self, dtype: str) -> int:
        return self.num_params * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V of every layer for one token, all KV heads."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def kv_heads_per_rank(self, tp: int) -> float:
        """KV heads are split across TP ranks, and replicated once TP exceeds their number."""
        return max(1.0, self.num_kv_heads / tp)


class HardwareInfo(_Strict):
    name: str
    device: str
    num_devices: int = Field(gt=0)
    memory_bytes_per_device: int = Field(gt=0)
    interconnect: str


class DecodeRow(_Strict):
    """One decode step of `batch` sequences holding `context_tokens` tokens in total, the
    longest of them `max_context` (None: all hold the same, context_tokens / batch). A padded
    attention backend pays for batch · max_context, so skewed rows are what let the latency
    model tell a padded backend from a ragged one."""

    tp: int = Field(gt=0)
    batch: int = Field(gt=0)
    context_tokens: int = Field(ge=0)
    seconds: float = Field(gt=0)
    max_context: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _max_context_possible(self) -> DecodeRow:
        m = self.max_context
        if m is not None and not (m <= self.context_tokens <= m * self.batch):
            raise ValueError(
                f"max_context={m} impossible for {self.batch} sequences of "
                f"{self.context_tokens} tokens in total: it needs "
                f"context_tokens / batch <= max_context <= context_tokens"
            )
        return self

    @property
    def padded_tokens(self) -> float:
        """batch · max_context: what a backend that pads to the longest sequence reads."""
        return self.context_tokens if self.max_context is None else self.batch * self.max_context


class PrefillRow(_Strict):
    """One prefill step of `num_seqs` sequences of `tokens` tokens each. Rows of several
    sequences are what price the work a prefill does per sequence rather than per token: the
    LM head on its last position and the sampler's draw, dear on a large vocabulary."""

    tp: int = Field(gt=0)
    tokens: int = Field(gt=0)
    seconds: float = Field(gt=0)
    num_seqs: int = Field(default=1, gt=0)


class VerifyRow(_Strict):
    """One speculative verify step: `batch` sequences each carrying `query_len` query tokens
    (its last sampled token and query_len - 1 drafted ones) over `context_tokens` of context
    in all. Against the decode rows of the same batch and context, these price the extra
    query tokens a step verifies."""

    tp: int = Field(gt=0)
    batch: int = Field(gt=0)
    query_len: int = Field(gt=1)
    context_tokens: int = Field(ge=0)
    seconds: float = Field(gt=0)


class CollectiveRow(_Strict):
    """One collective in a group of `group_size` ranks. `nbytes` is the size of the result each
    rank holds (the reduced tensor, the gathered tensor, the broadcast or sent tensor)."""

    op: CollectiveOp
    nbytes: int = Field(gt=0)
    group_size: int = Field(gt=1)
    seconds: float = Field(gt=0)


class SwitchRow(_Strict):
    """One measured reconfiguration from `src_tp` to `dst_tp`. With no sequence in flight
    (`num_seqs` 0) it is the fixed price of a switch (weights re-cut or gathered, KV cache
    re-made, groups looked up); rows with `num_seqs` sequences in flight across the world,
    holding `context_tokens` tokens of KV in all, price what each moved sequence adds beyond
    its KV bytes (its state exchanged, its KV copied in and out of the caches)."""

    src_tp: int = Field(gt=0)
    dst_tp: int = Field(gt=0)
    seconds: float = Field(gt=0)
    num_seqs: int = Field(default=0, ge=0)
    context_tokens: int = Field(default=0, ge=0)


class Profile(_Strict):
    schema_version: Literal[1] = 1
    source: Literal["measured", "roofline"]
    hardware: HardwareInfo
    model: ModelInfo
    dtype: Dtype
    decode: list[DecodeRow] = Field(min_length=1)
    prefill: list[PrefillRow] = Field(min_length=1)
    collectives: list[CollectiveRow] = Field(default_factory=list)
    switches: list[SwitchRow] = Field(default_factory=list)
    verify: list[VerifyRow] = Field(default_factory=list)
    notes: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _tp_fits_hardware(self) -> Profile:
        n = self.hardware.num_devices
        switch_tps = {r.src_tp for r in self.switches} | {r.dst_tp for r in self.switches}
        tps = {r.tp for r in self.decode} | {r.tp for r in self.prefill} | switch_tps
        bad = sorted(tps - set(usable_tp_sizes(tps, n)))
        if bad:
            raise ValueError(f"rows with tp={bad[0]}: it does not divide num_devices={n}")
        return self

    @property
    def tp_sizes(self) -> list[int]:
        return sorted({row.tp for row in self.decode})

    def check_matches(self, model: ModelInfo, dtype: str) -> None:
        """Raise `ProfileMismatchError` naming the first field that differs from the engine's."""
        if dtype != self.dtype:
            raise ProfileMismatchError(
                f"profile dtype={self.dtype!r} but the engine runs dtype={dtype!r}; "
                "re-run the profiler with the engine's dtype"
            )
        for field in ModelInfo.model_fields:
            if field == "name":
                continue
            ours, theirs = getattr(self.model, field), getattr(model, field)
            if ours != theirs:
                raise ProfileMismatchError(
                    f"profile model.{field}={ours} but the engine's model has {field}={theirs} "
                    f"(profile of {self.model.name!r}, engine model {model.name!r}); "
                    "re-run the profiler for this model"
                )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.model_validate_json(Path(path).read_text())
