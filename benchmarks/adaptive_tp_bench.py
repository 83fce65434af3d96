"""Adaptive TP against the best static layout on 2 gloo ranks: the entry point of the
`adaptive_tp` package beside this file (`nox -s bench` runs `*_bench.py` scripts).

    python benchmarks/adaptive_tp_bench.py [--quick] [--shapes ...] [--repeats N]
    python benchmarks/adaptive_tp_bench.py --report benchmarks/results/adaptive_tp_bench.json

What it runs: `adaptive_tp/__init__.py`; what it measured: `benchmarks/README.md`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adaptive_tp.cli import main  # a sibling package, not installed

if __name__ == "__main__":
    main()
