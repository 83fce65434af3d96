"""The shared test kit: tiny HF models (`models`), gloo multi-rank runs (`multirank`) and
synthetic latency profiles (`profiles`), for every package's tests and the benchmarks.

Import the submodule you need (`from patrl_testkit.models import tiny_hf_model`): this package
imports none of them, so a spawned rank pays only for what its test module uses.
"""
