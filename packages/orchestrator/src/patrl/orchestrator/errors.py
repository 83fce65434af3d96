"""Errors already phrased for the user: the job prints their message as one line, without a
traceback (a traceback from every rank would bury it); and messages shared by the config
checks and the classes that check the same thing."""

from __future__ import annotations


class JobError(RuntimeError):
    """A run that stopped for a reason the user can act on; the message says what and what
    next. `collective`: every rank raises it alike (the first rank prints it); otherwise it is
    this rank's own (each rank that raises it prints it, naming itself)."""

    def __init__(self, message: str, collective: bool = True) -> None:
        super().__init__(message)
        self.collective = collective


IN_PROCESS_TIMEOUT = (
    "reward.timeout_s={timeout} needs reward worker processes: reward.num_workers=0 runs the "
    "calls in the training process, where a call that catches BaseException or blocks in C "
    "code cannot be stopped; set reward.num_workers >= 1 (a call that overruns its deadline is "
    "scored 0 and its worker killed), or leave reward.timeout_s unset"
)
