"""The old name of `patrl_testkit.profiles`, kept while tests still import it from here."""

from patrl_testkit.profiles import synthetic_profile

__all__ = ["synthetic_profile"]
