"""A fake monotonic clock for code that takes `clock` and `sleep` callables: tests step time
instead of waiting it out, so no assertion depends on how fast the machine is."""

from __future__ import annotations


class FakeClock:
    """Seconds that move only when told. `clock()` reads the time (and then moves it on by
    `tick`: for a caller that spins on the clock without sleeping); `sleep(s)` advances it by
    `s` at once, as a sleeping caller would find on waking; `advance(s)` is the same, for a
    test to step time between calls."""

    def __init__(self, start: float = 1000.0, tick: float = 0.0) -> None:
        if tick < 0:
            raise ValueError(f"tick needs seconds >= 0, got {tick}")
        self.now = start
        self.tick = tick

    def __call__(self) -> float:
        now = self.now
        self.now += self.tick
        return now

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"sleep needs seconds >= 0, got {seconds}")
        self.now += seconds

    advance = sleep
