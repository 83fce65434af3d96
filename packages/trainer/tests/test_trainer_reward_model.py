"""Reward models: scoring equals HF's sequence classifier, bad RM directories and preference
rows fail naming the file/key, and the Bradley-Terry trainer learns, shards and round-trips."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.trainer.reward_model import (
    BradleyTerryTrainer,
    RewardModelEncoder,
    RewardModelScorer,
    ShardedRewardModelScorer,
    check_reward_model_dir,
    read_preferences,
    tokenize_pairs,
)
from patrl.trainer.reward_model.__main__ import main as train_main
from patrl_examples.demo.tokenizer import build_tokenizer
from patrl_testkit import filesystems
from patrl_testkit.models import save_tiny_model, save_tiny_reward_model
from patrl_testkit.multirank import run_ranks


def save_tiny_rm(path: Path, num_labels: int = 1) -> Path:
    return save_tiny_reward_model(path, build_tokenizer(), num_labels=num_labels)


def test_scores_equal_hf_sequence_classifier_with_padding(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    path = save_tiny_rm(tmp_path / "rm")
    tok = build_tokenizer()
    texts = ["1+2=?3", "a much longer sequence of text 12345", "x"]
    seqs = [tok(t)["input_ids"] for t in texts]
    scorer = RewardModelScorer(path, micro_batch_size=2)
    got = scorer.score(seqs)
    hf = AutoModelForSequenceClassification.from_pretrained(path).eval()
    batch = tok(texts, padding=True, return_tensors="pt")
    assert batch["attention_mask"].min() == 0  # the reference batch is padded
    with torch.no_grad():
        want = hf(**batch).logits[:, 0]
        alone = torch.cat([hf(input_ids=torch.tensor([s])).logits[:, 0] for s in seqs])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)


def _sharded_scores(rank: int, world_size: int, path: Path, seqs: list[list[int]]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    scorer = ShardedRewardModelScorer(path, mesh, "cpu", micro_batch_size=2)
    weight = scorer.model.get_parameter("score.weight")
    held = weight.to_local().shape[0] if hasattr(weight, "to_local") else -1
    # Every rank passes the same sequences; 5 over 2 ranks: shares of 3 and 2, two forwards
    # each (the second rank's second one a stand-in); then a share of 0 on the second rank.
    return scorer.score(seqs), scorer.score(seqs[:1]), scorer.score([]), held


@pytest.mark.multirank
def test_sharded_scores_equal_the_replicated_scorer(tmp_path: Path) -> None:
    path = save_tiny_rm(tmp_path / "rm")
    tok = build_tokenizer()
    texts = ["1+2=?3", "a much longer sequence of text 12345", "x", "4+4=?8", "99"]
    seqs = [tok(t)["input_ids"] for t in texts]
    want = RewardModelScorer(path, micro_batch_size=2).score(seqs)
    results = run_ranks(_sharded_scores, world_size=2, args=(path, seqs), timeout_s=120)
    for all_five, first, none, held in results:
        torch.testing.assert_close(all_five, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(first, want[:1], atol=1e-5, rtol=0)
        assert none.numel() == 0
        assert held == 0 or held == 1  # the 1-row score head: one rank holds it, not both
    assert sorted(r[3] for r in results) == [0, 1]


def test_encoder_passes_ids_through_for_the_same_tokenizer_and_re_encodes_otherwise(
    tmp_path: Path,
) -> None:
    tok = build_tokenizer()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "1+1=?"}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tok("2", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    same = RewardModelEncoder(tok, build_tokenizer())
    assert same.same and same.encode(prompt_ids, response_ids) == prompt_ids + response_ids
    other = build_tokenizer()
    other.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    enc = RewardModelEncoder(tok, other)
    assert not enc.same
    got = enc.encode(prompt_ids, response_ids, [{"role": "user", "content": "1+1=?"}])
    assert other.decode(got) == "[user]1+1=?[assistant]2"
    plain = build_tokenizer()
    plain.chat_template = None
    got = RewardModelEncoder(tok, plain).encode(prompt_ids, response_ids)
    assert plain.decode(got, skip_special_tokens=True) == "1+1=?\n2"


def test_bad_reward_model_directories_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        check_reward_model_dir(tmp_path / "nothing")
    lm = save_tiny_model(tmp_path / "lm", "llama", "plain", tokenizer=build_tokenizer())
    with pytest.raises(
        ValueError, match=r"config\.json lists architectures \['LlamaForCausalLM'\]"
    ):
        check_reward_model_dir(lm)
    two = save_tiny_rm(tmp_path / "two", num_labels=2)
    with pytest.raises(ValueError, match="num_labels=2"):
        check_reward_model_dir(two)
    bare = save_tiny_rm(tmp_path / "bare")
    for f in bare.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()
    with pytest.raises(
        ValueError, match=r"reward_model\.model\.path=.*bare.*no usable tokenizer"
    ) as info:
        check_reward_model_dir(bare)
    # patrl's own reason, not transformers' hint to install a converter it does not need
    assert "holds no tokenizer files" in str(info.value)
    assert "sentencepiece" not in str(info.value)


def test_preference_rows_missing_a_key_name_file_row_and_key(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"})
        + "\n"
        + json.dumps({"prompt": "p", "chosen": "a"})
        + "\n"
    )
    with pytest.raises(ValueError, match=r"p\.jsonl' row 1: no rejected key 'rejected'"):
        read_preferences(f)
    f.write_text(json.dumps({"prompt": "p", "rejected": "b"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0: no chosen key 'chosen'"):
        read_preferences(f)
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["p"], "good": ["a"], "rejected": ["b"]})
    pq.write_table(table, tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"p\.parquet' row 0: no chosen key 'chosen'"):
        read_preferences(tmp_path / "p.parquet")
    # The CLI reads and checks every row before it builds a model or writes anything.
    out = tmp_path / "out"
    lm = save_tiny_model(tmp_path / "lm", "llama", "plain", tokenizer=build_tokenizer())
    args = ["--model", str(lm), "--train-files", str(f)]
    with pytest.raises(ValueError, match=r"p\.jsonl' row 0: no chosen key 'chosen'"):
        train_main([*args, "--output", str(out)])
    assert not out.exists()


def write_pairs(path: Path, n: int, seed: int) -> Path:
    """Separable pairs: the chosen response ends in '!', the rejected one in '?'."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            body = "".join(rng.choice("0123456789 +=") for _ in range(rng.randint(1, 6)))
            row = {"prompt": f"{a}+{b}=?", "chosen": body + "!", "rejected": body + "?"}
            f.write(json.dumps(row) + "\n")
    return path


@pytest.mark.e2e
def test_bradley_terry_learns_separable_pairs_and_round_trips_through_hf(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    lm = save_tiny_model(tmp_path / "lm", "llama", "plain", tokenizer=build_tokenizer())
    train = write_pairs(tmp_path / "train.jsonl", 64, seed=0)
    val = write_pairs(tmp_path / "val.jsonl", 32, seed=1)
    out = tmp_path / "rm"
    args = ["--model", str(lm), "--train-files", str(train), "--val-files", str(val)]
    args += ["--output", str(out), "--epochs", "3", "--batch-size", "8", "--lr", "3e-3"]
    held_out = train_main(args)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [x["train/loss"] for x in lines if "train/loss" in x]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4
    assert held_out["accuracy"] >= 0.8
    assert [x["val/accuracy"] for x in lines if "val/accuracy" in x][-1] == held_out["accuracy"]
    check_reward_model_dir(out)
    hf = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tok = build_tokenizer()
    pairs = tokenize_pairs(read_preferences(val), tok, 64)
    with torch.no_grad():
        margins = [
            hf(input_ids=torch.tensor([c])).logits[0, 0]
            - hf(input_ids=torch.tensor([r])).logits[0, 0]
            for c, r in pairs
        ]
    assert sum(float(m > 0) for m in margins) / len(margins) == pytest.approx(held_out["accuracy"])


def _pairs() -> list[tuple[list[int], list[int]]]:
    rng = random.Random(0)
    return [
        (
            [rng.randrange(10, 100) for _ in range(rng.randint(2, 7))],
            [rng.randrange(10, 100) for _ in range(3)],
        )
        for _ in range(4)
    ]


def _bt_step(rank: int, world_size: int, lm: str) -> dict[str, torch.Tensor]:
    mesh = None
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,))
    trainer = BradleyTerryTrainer(lm, mesh=mesh, lr=1e-2, seed=3)
    trainer.train_step(_pairs())
    return {n: t.clone() for b in trainer_weights(trainer) for n, t in b}


def trainer_weights(trainer: BradleyTerryTrainer) -> Any:
    from patrl.trainer.weights import iter_full_weights

    return iter_full_weights(trainer.model, 1 << 24)


def test_bradley_terry_two_ranks_equal_one_process(tmp_path: Path) -> None:
    lm = str(save_tiny_model(tmp_path / "lm", "llama", "plain", tokenizer=build_tokenizer()))
    one = _bt_step(0, 1, lm)
    two = run_ranks(_bt_step, world_size=2, args=(lm,), timeout_s=240)
    assert one.keys() == two[0].keys()
    moved = max(float((one[k] - _bt_step_init(lm)[k]).abs().max()) for k in one)
    assert moved > 0
    # Adam's first step moves every weight by about lr (1e-2): 1e-5 is far below one step.
    for k in one:
        torch.testing.assert_close(two[0][k], one[k], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(two[1][k], one[k], atol=1e-5, rtol=1e-5)


def _bt_step_init(lm: str) -> dict[str, torch.Tensor]:
    trainer = BradleyTerryTrainer(lm, seed=3)
    return {n: t.clone() for b in trainer_weights(trainer) for n, t in b}


@pytest.mark.gpu
def test_scorer_and_bradley_terry_on_cuda(tmp_path: Path) -> None:
    """fp32 on CUDA scores as HF on the host (TF32 off); bf16 stays close; a BT step on CUDA
    lowers the loss of its own batch."""
    from transformers import AutoModelForSequenceClassification

    path = save_tiny_rm(tmp_path / "rm")
    tok = build_tokenizer()
    seqs = [tok(t)["input_ids"] for t in ["1+2=?3", "a longer sequence 12345", "x"]]
    hf = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        want = torch.cat([hf(input_ids=torch.tensor([s])).logits[:, 0] for s in seqs])
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        fp32 = RewardModelScorer(path, "cuda", torch.float32, micro_batch_size=2).score(seqs)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.testing.assert_close(fp32, want, atol=1e-4, rtol=0)
    bf16 = RewardModelScorer(path, "cuda", torch.bfloat16, micro_batch_size=3).score(seqs)
    torch.testing.assert_close(bf16, want, atol=5e-2, rtol=5e-2)
    lm = save_tiny_model(tmp_path / "lm", "llama", "plain", tokenizer=tok)
    trainer = BradleyTerryTrainer(lm, device="cuda", lr=1e-3)
    pairs = _pairs()
    first = trainer.train_step(pairs)["loss"]
    for _ in range(5):
        last = trainer.train_step(pairs)["loss"]
    assert last < first


def test_a_run_that_would_take_no_step_is_refused_naming_the_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """4 pairs (1 held out) and the default 8 a step: no step would run and the random head
    would be saved as if trained; --batch-size 1 on 2 ranks: no pair for either rank. Both
    refused before a model is built or anything written, naming pairs, batch size and ranks."""
    from patrl.trainer.reward_model.__main__ import cli, step_batch

    lm = save_tiny_model(tmp_path / "lm", "llama", "plain", tokenizer=build_tokenizer())
    pairs = write_pairs(tmp_path / "four.jsonl", 4, seed=0)
    out = tmp_path / "out"
    args = ["--model", str(lm), "--train-files", str(pairs), "--output", str(out)]
    with pytest.raises(ValueError) as info:
        train_main(args)
    assert str(info.value) == (
        "3 training pairs (after holding out 1 for validation) and --batch-size 8 make no "
        "training step (a step takes 8 pairs), so the model would be saved untrained; lower "
        "--batch-size to at most 3, or give more pairs"
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    capsys.readouterr()  # the setup's progress bars
    assert cli([*args, "--batch-size", "1"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "patrl: error: --batch-size 1 on 2 ranks gives each rank no pair per step (the batch "
        "is split evenly over the ranks); use --batch-size 2 or a multiple of it\n"
    )
    assert not out.exists()
    assert step_batch(8, 5, 2) == 4  # rounded down to what two ranks split evenly
    with pytest.raises(ValueError, match=r"^3 training pairs and --batch-size 5 on 2 ranks"):
        step_batch(3, 5, 2)
    with pytest.raises(ValueError, match="--batch-size 0: pairs per step, accepted 1 or more"):
        step_batch(3, 0, 1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--val-fraction", "1.5"], "--val-fraction 1.5: the share of the pairs held out"),
        (["--lr", "nan"], "--lr nan: accepted a finite number above 0"),
        (["--epochs", "0"], "--epochs 0: accepted 1 or more"),
        (["--max-length", "0"], "--max-length 0: accepted 1 or more tokens"),
        (["--output", "{file}"], "exists and is not a directory"),
    ],
)
def test_flags_that_cannot_train_a_model_are_refused_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    """Each refused in one line before any file is read or a model built (the model and
    pairs named here do not exist: a later failure would name them instead)."""
    from patrl.trainer.reward_model.__main__ import cli

    (tmp_path / "file").write_text("")
    flags = [f.format(file=tmp_path / "file") for f in flags]
    args = ["--model", str(tmp_path / "no_model"), "--train-files", str(tmp_path / "none")]
    assert cli([*args, "--output", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("patrl: error: ") and message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_an_output_that_cannot_be_written_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from patrl.trainer.reward_model.__main__ import cli

    args = ["--model", str(tmp_path / "no_model"), "--train-files", str(tmp_path / "none")]
    with filesystems.read_only_dir(tmp_path / "ro") as ro:
        assert cli([*args, "--output", str(ro / "rm")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"patrl: error: --output {ro / 'rm'}: {ro} "), err
