"""What an engine records as it runs: a timeline of its steps and running counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step, for the generation timeline."""

    t: float  # seconds since the timeline started
    duration_s: float
    running: int  # samples running after the step
    num_tokens: int  # tokens run through the model
    is_prefill: bool
    tp_size: int


@dataclass(slots=True)
class EngineCounters:
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
