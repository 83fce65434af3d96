"""Adaptive TP against the best static layout on 2 gloo ranks.

Modules: `config` (settings passed to every run), `shapes` (model shapes, run sizes, the model
and engine config), `workloads` (imposed response lengths), `profiles` (the latency profile),
`run` (engines and timed rollouts), `simulation` (the simulator on the measured lengths),
`report` (targets and tables), `cli` (arguments, torchrun). Run it through
`benchmarks/adaptive_tp_bench.py`; what it measured is in `benchmarks/README.md`.
"""
