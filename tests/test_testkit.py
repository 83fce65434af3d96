"""The shared test kit's own contracts: each family's "full" tiny model carries the feature it
is there to exercise, overrides win, and importing the kit loads no modelling code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from patrl.rollout.model_config import ModelArch
from patrl_testkit.models import FAMILIES, save_tiny_model, tiny_config, tiny_hf_model
from patrl_testkit.processes import descendants, kill_tree


def test_full_flavour_turns_on_each_family_feature() -> None:
    llama, qwen2, qwen3 = (tiny_config(f) for f in FAMILIES)
    assert llama.rope_scaling["rope_type"] == "llama3"
    assert llama.num_key_value_heads < llama.num_attention_heads
    assert qwen2.tie_word_embeddings and not llama.tie_word_embeddings
    assert qwen3.head_dim != qwen3.hidden_size // qwen3.num_attention_heads
    names = {f: {n for n, _ in tiny_hf_model(f).named_parameters()} for f in FAMILIES}
    assert "model.layers.0.self_attn.q_proj.bias" in names["qwen2"]
    assert "model.layers.0.self_attn.q_norm.weight" in names["qwen3"]
    assert "model.layers.0.self_attn.o_proj.bias" in names["qwen3"]
    for family in FAMILIES:
        ModelArch.from_hf(tiny_config(family))  # the engine accepts every one


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_flavour_keeps_hf_init_and_overrides_win(family: str) -> None:
    model = tiny_hf_model(family, flavour="plain", vocab_size=96, num_hidden_layers=1)
    assert model.config.vocab_size == 96 and model.config.num_hidden_layers == 1
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)
    full = tiny_hf_model(family)
    assert not all(
        torch.equal(p, torch.ones_like(p)) for n, p in full.named_parameters() if "norm" in n
    )
    same_seed = tiny_hf_model(family, flavour="plain", vocab_size=96, num_hidden_layers=1)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), same_seed.parameters(), strict=True)
    )


def test_saved_model_takes_its_vocab_from_the_tokenizer(tmp_path: Path) -> None:
    from patrl_examples.demo.tokenizer import build_tokenizer

    tok = build_tokenizer()
    path = save_tiny_model(tmp_path / "m", "qwen3", "plain", tokenizer=tok)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in path.iterdir()
    }
    assert json.loads((path / "config.json").read_text())["vocab_size"] == len(tok)


def test_importing_the_kit_loads_no_modelling_code() -> None:
    """Spawned ranks import the kit; transformers' modelling code costs them seconds."""
    code = (
        "import sys\n"
        "import patrl_testkit.jobs, patrl_testkit.models, patrl_testkit.multirank\n"
        "import patrl_testkit.profiles\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    kit = str(Path(__file__).resolve().parent)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([kit, os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_kill_tree_reaches_a_child_in_a_session_of_its_own(tmp_path: Path) -> None:
    """As torchrun's workers: the child escapes its parent's process group."""
    pid_file = tmp_path / "child.pid"
    child = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "start_new_session=True); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    assert grandchild in descendants(parent.pid)
    kill_tree(parent.pid)
    assert parent.wait(timeout=10) != 0
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not yet reaped by init, counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
