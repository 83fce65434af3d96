"""What an engine records as it runs: a timeline of its steps and running counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step, for the generation timeline. A speculative verify step drafted
    `drafted` tokens (its sequences' drafts together) and accepted `accepted` of them, as the
    drafter counts them for `rollout/spec_acceptance`; 0 and 0 in any other step."""

    t: float  # seconds since the timeline started
    duration_s: float
    running: int  # samples running after the step
    num_tokens: int  # tokens run through the model
    is_prefill: bool
    tp_size: int
    drafted: int = 0
    accepted: int = 0


@dataclass(slots=True)
class EngineCounters:
    """Running totals over an engine's life: steps, tokens, and seconds spent in `step`."""

    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0  # tokens run through the model in prefill steps
    decode_tokens: int = 0
    generated_tokens: int = 0
    busy_s: float = 0.0

    def count_step(self, is_prefill: bool, num_tokens: int) -> None:
        """Count one model step of `num_tokens` tokens."""
        self.steps += 1
        if is_prefill:
            self.prefill_steps += 1
            self.prefill_tokens += num_tokens
        else:
            self.decode_steps += 1
            self.decode_tokens += num_tokens

    @property
    def tokens_per_s(self) -> float:
        """Tokens sampled per second of `step` time."""
        return self.generated_tokens / self.busy_s if self.busy_s else 0.0

    def stats(self) -> dict[str, float]:
        """The totals `Engine.stats` reports."""
        return {
            "steps": self.steps,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "generated_tokens": self.generated_tokens,
            "tokens_per_s": self.tokens_per_s,
        }
