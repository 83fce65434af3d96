"""Worked examples that use patrl but are not part of it (the `patrl-examples` project,
`pip install -e examples` from a checkout). `patrl_examples.demo` is the main job's embedded
task: a tiny Llama with its own tokenizer, its SFT warm start, the addition task and its
preference data. The library finds it through the `patrl.assets` entry point group only."""
