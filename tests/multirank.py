"""The old name of `patrl_testkit.multirank`, kept while tests still import it from here."""

from patrl_testkit.multirank import RankFailed, free_port, run_ranks

__all__ = ["RankFailed", "free_port", "run_ranks"]
