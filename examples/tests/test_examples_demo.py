"""The embedded demo: task, tokenizer, model directory, cached atomic build."""

from __future__ import annotations

import json
import os
import random
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from math_verify import parse, verify
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from patrl.rollout import Engine, EngineConfig, SamplingParams
from patrl_examples.demo import (
    DemoRecipe,
    TaskConfig,
    boxed_answer,
    build_tokenizer,
    ensure_demo_assets,
    ensure_demo_at,
    generate_problems,
    provider,
)
from patrl_examples.demo.__main__ import main
from patrl_examples.demo.assets import MANIFEST
from patrl_examples.demo.reward import shows_work
from patrl_examples.demo.sft import IGNORE, SFTConfig, iter_batches
from patrl_examples.demo.task import Problem, read_jsonl
from patrl_examples.demo.tokenizer import CHARACTERS, VOCAB_SIZE, prompt_text


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
    assert problem.direct_solution() == "\\boxed{13}"
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
    assert min(steps) == config.min_steps and max(steps) == config.max_steps
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


def test_concurrent_callers_build_once(tmp_path: Path) -> None:
    # flock excludes separate open()s even within one process, so threads stand in for ranks.
    recipe = DemoRecipe.default(seed=4, quick=True)
    with ThreadPoolExecutor(2) as pool:
        results = list(
            pool.map(lambda _: ensure_demo_at(tmp_path / "demo", recipe, progress=False), range(2))
        )
    assert results[0].manifest["build_id"] == results[1].manifest["build_id"]


@pytest.mark.e2e
def test_cli_builds_and_describes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path / "demo"), "--quick", "--seed", "5"]) == 0
    printed = capsys.readouterr().out
    assert str(tmp_path / "demo") in printed and "parameters" in printed
    assert (tmp_path / "demo" / MANIFEST).is_file()


# ---------------------------------------------------------------- the SFT


def test_sft_batches_cover_each_example_once_within_the_budget() -> None:
    tokenizer = build_tokenizer()
    config = SFTConfig(tokens_per_batch=256, pool_size=40, direct_fraction=0.5)
    problems = generate_problems(40, seed=9)
    batches = iter_batches(iter(problems), tokenizer, config, random.Random(0))
    seen = []
    for _ in range(40):
        input_ids, labels = next(batches)
        assert input_ids.numel() <= config.tokens_per_batch or input_ids.shape[0] == 1
        for row_ids, row_labels in zip(input_ids.tolist(), labels.tolist(), strict=True):
            seen.append(_slow_decode_example(tokenizer, row_ids, row_labels))
        if len(seen) == len(problems):
            break
    # Each problem once, worked or bare as the batcher's rng draws it (once per problem, in
    # stream order, before it shuffles the batches).
    rng = random.Random(0)
    want = sorted(
        (
            prompt_text(tokenizer, p.prompt),
            (p.direct_solution() if rng.random() < 0.5 else p.solution()) + tokenizer.eos_token,
        )
        for p in problems
    )
    assert sorted(seen) == want
    num_direct = sum(not response.startswith("a") for _, response in seen)
    assert 10 <= num_direct <= 30, num_direct


def test_sft_without_direct_fraction_shows_all_work() -> None:
    tokenizer = build_tokenizer()
    config = SFTConfig(tokens_per_batch=256, pool_size=20, direct_fraction=0.0)
    batches = iter_batches(iter(generate_problems(20, seed=4)), tokenizer, config, random.Random(0))
    input_ids, labels = next(batches)
    for row_ids, row_labels in zip(input_ids.tolist(), labels.tolist(), strict=True):
        _, response = _slow_decode_example(tokenizer, row_ids, row_labels)
        assert shows_work(response, "") == 1.0, response


def _slow_decode_example(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], labels: list[int]
) -> tuple[str, str]:
    """(prompt, trained-on response) of one padded row, decoded token by token."""
    prompt, response = [], []
    for token, label in zip(ids, labels, strict=True):
        if label == IGNORE:
            if token != tokenizer.pad_token_id:
                assert not response, "a prompt token after the response"
                prompt.append(tokenizer.convert_ids_to_tokens(token))
        else:
            assert label == token
            response.append(tokenizer.convert_ids_to_tokens(token))
    return "".join(prompt), "".join(response)


def test_a_directory_the_demo_did_not_write_is_never_deleted(tmp_path: Path) -> None:
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"notes\.txt"):
        ensure_demo_at(target, DemoRecipe.default(seed=1, quick=True), progress=False)
    assert (target / "notes.txt").read_text() == "keep me"


def test_boxed_exact_match_is_never_looser_than_math_verify() -> None:
    # The build's pass@1 uses the exact boxed integer; a pass there must be a math-verify pass.
    problem = Problem((4, 9, 8))
    gold = str(problem.answer)
    responses = [
        problem.solution(),
        problem.solution().replace("\\boxed{21}", "\\boxed{12}"),
        problem.solution().replace("\\boxed{21}", "21"),
        "a4: 4\nb9: 4+9=13\n\\boxed{13}\n\\boxed{21}",
        problem.direct_solution(),
        "\\boxed{",
        "",
    ]
    verdicts = [(boxed_answer(r) == gold, verify(parse(gold), parse(r))) for r in responses]
    assert verdicts[0] == (True, True) and verdicts[1] == (False, False)
    for exact, lenient in verdicts:
        assert lenient or not exact


def test_builds_are_reproducible_from_the_seed(tmp_path: Path) -> None:
    recipe = DemoRecipe.default(seed=6, quick=True)
    first = ensure_demo_at(tmp_path / "one", recipe, progress=False)
    second = ensure_demo_at(tmp_path / "two", recipe, progress=False)
    for relative in ("model/model.safetensors", "data/train.jsonl", "data/val.jsonl"):
        assert (first.root / relative).read_bytes() == (second.root / relative).read_bytes()
    other = ensure_demo_at(
        tmp_path / "three", DemoRecipe.default(seed=7, quick=True), progress=False
    )
    assert (other.model_dir / "model.safetensors").read_bytes() != (
        first.model_dir / "model.safetensors"
    ).read_bytes()


# ---------------------------------------------------------------- reward


def test_shows_work_tells_worked_from_bare_answers() -> None:
    problem = Problem((7, 1, 5))
    assert shows_work(problem.solution(), str(problem.answer)) == 1.0
    assert shows_work(problem.direct_solution(), str(problem.answer)) == 0.0
    # A wrong worked solution still shows its work; the reward, not this, judges it.
    assert shows_work("a7: 8\nb1: 8+1=9\n\\boxed{9}", "13") == 1.0
    for other in ("", "\\boxed{", "b1: 7+1=8", "a7:", "The answer is 13"):
        assert shows_work(other, "13") == 0.0, other


def _build_on(rank: int, world_size: int, root: str) -> list[str]:
    if rank != 1:
        return []
    # transformers 5's save_pretrained writes nothing on a torch.distributed rank other than
    # 0, and any rank may win the build lock: the demo must still come out whole
    assets = ensure_demo_assets(Path(root), seed=6, quick=True, progress=False)
    engine = Engine(EngineConfig(model=str(assets.model_dir), device="cpu", num_kv_blocks=64))
    assert engine.model is not None
    return sorted(p.name for p in assets.model_dir.iterdir())


@pytest.mark.multirank
def test_a_rank_other_than_zero_builds_a_whole_demo(tmp_path: Path) -> None:
    from patrl_testkit.multirank import run_ranks

    files = run_ranks(_build_on, 2, args=(str(tmp_path),), timeout_s=300)[1]
    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(files)
    assert "tokenizer.json" in files


# ------------------------------------------------------------------- the orchestrator's hook


def test_the_project_registers_the_demo_where_the_orchestrator_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The installed examples project is the `demo` of the `patrl.assets` entry points: the
    orchestrator's lookup finds this module; with an empty cache it has nothing built and
    writes nothing; its tokenizer is the demo's."""
    from patrl.orchestrator.demo_provider import load_demo_provider

    monkeypatch.setenv("PATRL_CACHE_DIR", str(tmp_path))
    found = load_demo_provider("model.path is unset")
    assert found is provider
    assert found.built_assets() is None and list(tmp_path.iterdir()) == []
    assert found.build_tokenizer().get_vocab() == build_tokenizer().get_vocab()


def test_built_assets_finds_exactly_a_complete_build_of_the_recipe(quick_demo) -> None:
    quick = DemoRecipe.default(quick=True)
    found = provider.built_assets(quick_demo.root.parent, quick)
    assert found is not None and found.root == quick_demo.root
    assert (found.model_dir, found.train_file, found.val_file) == (
        quick_demo.model_dir,
        quick_demo.train_file,
        quick_demo.val_file,
    )
    # another recipe's (the default, here never built) is not there
    assert provider.built_assets(quick_demo.root.parent) is None
