"""A fake monotonic clock for code that takes `clock` and `sleep` callables: tests step time
instead of waiting it out, so no assertion depends on how fast the machine is."""

from __future__ import annotations


class FakeClock:
    """Seconds that move only when told. `clock()` (or `clock.now`) reads the time; `sleep(s)`
    advances it by `s` at once, as a sleeping caller would find on waking; `advance(s)` is the
    same, for a test to step time between calls."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"sleep needs seconds >= 0, got {seconds}")
        self.now += seconds

    advance = sleep
