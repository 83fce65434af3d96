"""`python -m adaptive_tp` from `benchmarks/`: the same as `benchmarks/adaptive_tp_bench.py`."""

from .cli import main

main()
