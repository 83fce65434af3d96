"""The embedded demo: task, tokenizer, model directory, cached atomic build."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest
import torch
from math_verify import parse, verify
from transformers import AutoModelForCausalLM, AutoTokenizer

from patrl.orchestrator.demo import (
    DemoRecipe,
    TaskConfig,
    boxed_answer,
    build_tokenizer,
    ensure_demo_assets,
    ensure_demo_at,
    generate_problems,
)
from patrl.orchestrator.demo.assets import MANIFEST
from patrl.orchestrator.demo.task import Problem, read_jsonl
from patrl.orchestrator.demo.tokenizer import CHARACTERS, VOCAB_SIZE, prompt_text
from patrl.rollout import Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory: pytest.TempPathFactory):
    return ensure_demo_assets(tmp_path_factory.mktemp("cache"), quick=True, progress=False)


# ------------------------------------------------------------------- task


def test_problems_are_reproducible_from_the_seed() -> None:
    assert generate_problems(200, seed=7) == generate_problems(200, seed=7)
    assert generate_problems(200, seed=7) != generate_problems(200, seed=8)


def test_solution_writes_every_running_sum() -> None:
    problem = Problem((7, 1, 5))
    assert problem.prompt == "Add: a7 b1 c5"
    assert problem.solution() == "a7: 7\nb1: 7+1=8\nc5: 8+5=13\n\\boxed{13}"
    assert problem.answer == 13


def test_solution_lengths_have_a_long_tail() -> None:
    tokenizer = build_tokenizer()
    problems = generate_problems(4000, seed=0)
    lengths = sorted(
        len(tokenizer.encode(p.solution(), add_special_tokens=False)) for p in problems
    )
    median = statistics.median(lengths)
    p99 = lengths[int(0.99 * len(lengths))]
    assert p99 / median >= 4, (median, p99)
    assert lengths[-1] / median >= 6, (median, lengths[-1])
    # Most responses are short: the tail is a tail, not the bulk.
    assert sum(n <= 2 * median for n in lengths) / len(lengths) >= 0.7


def test_every_step_count_up_to_the_cap_occurs() -> None:
    config = TaskConfig()
    steps = {p.num_steps for p in generate_problems(20000, seed=0, config=config)}
    assert min(steps) == 1 and max(steps) == config.max_steps
    longest = max(generate_problems(20000, seed=0, config=config), key=lambda p: p.num_steps)
    labels = [line[0] for line in longest.solution().splitlines()[:-1]]
    assert len(set(labels)) == len(labels) == config.max_steps + 1  # every label is unique


def test_running_sums_are_correct() -> None:
    for problem in generate_problems(300, seed=5):
        total = problem.addends[0]
        lines = problem.solution().splitlines()[1:]
        for line, x in zip(lines, problem.addends[1:], strict=False):
            total += x
            assert line.endswith(f"+{x}={total}"), (problem, line)
        assert total == problem.answer


def test_gold_solutions_verify_with_math_verify() -> None:
    for problem in generate_problems(100, seed=3):
        gold = parse(str(problem.answer))
        assert verify(gold, parse(problem.solution())), problem
        assert boxed_answer(problem.solution()) == str(problem.answer)
        wrong = problem.solution().replace(f"{{{problem.answer}}}", f"{{{problem.answer + 1}}}")
        assert not verify(gold, parse(wrong)), problem


# -------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_every_character_one_token_each() -> None:
    tokenizer = build_tokenizer()
    assert len(tokenizer) == VOCAB_SIZE
    for char in CHARACTERS:
        ids = tokenizer.encode(char, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] != tokenizer.unk_token_id, repr(char)
        assert tokenizer.decode(ids) == char
    text = "".join(p.prompt + "\n" + p.solution() for p in generate_problems(50, seed=1))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_chat_template_and_special_tokens_survive_save_and_load(tmp_path: Path) -> None:
    build_tokenizer().save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    ids = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert None not in ids and len(ids) == 3
    chat = [
        {"role": "user", "content": "Add: 1+2"},
        {"role": "assistant", "content": "1+2=3\n\\boxed{3}"},
    ]
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    assert text == "<s><|user|>Add: 1+2\n<|assistant|>1+2=3\n\\boxed{3}</s>"
    prompt = prompt_text(tokenizer, "Add: 1+2")
    assert text.startswith(prompt) and prompt.endswith("<|assistant|>")
    # Markers are single tokens, so the prompt/answer boundary is a token boundary.
    assert len(tokenizer.encode("<|assistant|>", add_special_tokens=False)) == 1


# ----------------------------------------------------------- built assets


def test_quick_build_writes_data_and_manifest(quick_demo) -> None:
    rows = read_jsonl(quick_demo.train_file)
    assert len(rows) == DemoRecipe.default(quick=True).num_train
    assert {"prompt", "answer"} <= set(rows[0])
    val = read_jsonl(quick_demo.val_file)
    assert {r["prompt"] for r in val}.isdisjoint({r["prompt"] for r in rows}) or len(val) < 5
    for row in rows:  # gold answers are plain numbers
        assert str(row["answer"]).isdigit()
    manifest = json.loads((quick_demo.root / MANIFEST).read_text())
    assert manifest["key"] == DemoRecipe.default(quick=True).key()
    assert (quick_demo.model_dir / "model.safetensors").is_file()
    generation = json.loads((quick_demo.model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == build_tokenizer().eos_token_id


def test_model_directory_loads_in_transformers_and_generates(quick_demo) -> None:
    tokenizer = AutoTokenizer.from_pretrained(quick_demo.model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(quick_demo.model_dir, local_files_only=True)
    assert model.config.model_type == "llama"
    assert model.config.vocab_size == len(tokenizer)
    ids = tokenizer.encode(prompt_text(tokenizer, "Add: 1+2"), add_special_tokens=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)
    assert out.shape[1] > len(ids)


def test_model_directory_runs_in_the_rollout_engine_like_transformers(quick_demo) -> None:
    tokenizer = AutoTokenizer.from_pretrained(quick_demo.model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(quick_demo.model_dir, local_files_only=True)
    engine = Engine(EngineConfig(model=str(quick_demo.model_dir), device="cpu", num_kv_blocks=64))
    ids = tokenizer.encode(prompt_text(tokenizer, "Add: 4+5+6"), add_special_tokens=False)
    [out] = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    got = out.outputs[0].token_ids
    assert len(got) == 8
    want = model.generate(
        torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, min_new_tokens=8
    )[0, len(ids) :].tolist()
    assert got == want


def test_second_call_reuses_the_build(quick_demo) -> None:
    before = (quick_demo.root / MANIFEST).stat().st_mtime_ns
    again = ensure_demo_assets(quick_demo.root.parent, quick=True, progress=False)
    assert again.root == quick_demo.root
    assert (again.root / MANIFEST).stat().st_mtime_ns == before


def test_an_interrupted_build_is_ignored_and_rebuilt(tmp_path: Path) -> None:
    recipe = DemoRecipe.default(seed=1, quick=True)
    target = tmp_path / "demo"
    (target / "model").mkdir(parents=True)  # a partial build: files but no manifest
    (target / "model" / "config.json").write_text("{}")
    stale = tmp_path / ".demo.tmp-999-deadbeef"  # a killed builder's temporary
    stale.mkdir()
    assets = ensure_demo_at(target, recipe, progress=False)
    assert (target / MANIFEST).is_file()
    assert json.loads((target / "model" / "config.json").read_text())["model_type"] == "llama"
    assert not stale.exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    assert assets.manifest["key"] == recipe.key()


def test_a_manifest_of_another_recipe_is_rebuilt(tmp_path: Path) -> None:
    target = tmp_path / "demo"
    ensure_demo_at(target, DemoRecipe.default(seed=1, quick=True), progress=False)
    other = DemoRecipe.default(seed=2, quick=True)
    assets = ensure_demo_at(target, other, progress=False)
    assert assets.manifest["key"] == other.key()


def test_cache_root_comes_from_the_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATRL_CACHE_DIR", str(tmp_path))
    assets = ensure_demo_assets(seed=3, quick=True, progress=False)
    assert assets.root.parent == tmp_path
    assert assets.root.name == f"demo-{DemoRecipe.default(seed=3, quick=True).key()}"
    assert os.path.isdir(assets.model_dir)
