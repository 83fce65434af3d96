"""Single-process checkpoints and Hugging Face export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from trainer_testkit import QWEN2_TIED, VOCAB, config, full_weights, make_batch, tiny_llama
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from patrl.trainer import Trainer
from patrl_testkit.models import save_tiny_model


def _batches() -> list:
    return [make_batch(s, [3 + s, 6, 2 + 2 * s]) for s in range(4)]


def test_resume_at_step_2_equals_uninterrupted_run(tmp_path: Path) -> None:
    cfg = config(optim={"lr": 1e-3, "eps": 1e-6, "lr_warmup_steps": 3}, use_kl_loss=True)
    batches = _batches()
    straight = Trainer(cfg, tiny_llama())
    for b in batches:
        straight.train_step(b)

    first = Trainer(cfg, tiny_llama())
    for b in batches[:2]:
        first.train_step(b)
    first.save(tmp_path / "ckpt")
    torch.manual_seed(1234)  # the checkpoint, not the current RNG, must decide what follows
    resumed = Trainer(cfg, tiny_llama())
    resumed.load(tmp_path / "ckpt")
    assert resumed.step == 2
    lrs = [resumed.train_step(b)["actor/lr"] for b in batches[2:]]
    assert lrs == pytest.approx([1e-3, 1e-3])  # the warmup resumed at step 2, not 0
    a, b = full_weights(straight), full_weights(resumed)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_save_restores_rng_state(tmp_path: Path) -> None:
    trainer = Trainer(config(), tiny_llama())
    torch.manual_seed(7)
    trainer.save(tmp_path / "c")
    expected = torch.rand(3)
    torch.manual_seed(99)
    trainer.load(tmp_path / "c")
    assert torch.equal(torch.rand(3), expected)


def test_incomplete_checkpoint_is_refused(tmp_path: Path) -> None:
    trainer = Trainer(config(), tiny_llama())
    trainer.train_step(make_batch(0, [3, 4]))
    path = trainer.save(tmp_path / "ckpt")
    (path / "COMPLETE").unlink()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        trainer.load(path)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        trainer.load(tmp_path / "never-written")


def test_save_over_an_existing_checkpoint_replaces_it(tmp_path: Path) -> None:
    trainer = Trainer(config(), tiny_llama())
    trainer.save(tmp_path / "ckpt")
    trainer.train_step(make_batch(0, [3, 4]))
    trainer.save(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .tmp / .old left
    fresh = Trainer(config(), tiny_llama())
    fresh.load(tmp_path / "ckpt")
    assert fresh.step == 1


def _model_dir_with_tokenizer(path: Path) -> Path:
    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    return save_tiny_model(path, "qwen2", "plain", tokenizer=fast, **QWEN2_TIED)


def test_export_hf_round_trip_from_directory_with_tokenizer(tmp_path: Path) -> None:
    src = _model_dir_with_tokenizer(tmp_path / "src")
    trainer = Trainer(config(), str(src))
    trainer.train_step(make_batch(1, [5, 3]))
    out = trainer.export_hf(tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = make_batch(2, [9]).input_ids[0][None]
    with torch.no_grad():
        expected = trainer.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert torch.equal(got, expected)
    # The export is not just the source again: training changed the weights.
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        assert not torch.allclose(original(input_ids=ids).logits, got)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert PreTrainedTokenizerFast.from_pretrained(out)("w3 w5")["input_ids"] == [3, 5]


def test_export_hf_from_config_has_no_tokenizer(tmp_path: Path) -> None:
    trainer = Trainer(config(), tiny_llama())
    out = trainer.export_hf(tmp_path / "export", dtype=torch.bfloat16)
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names and "config.json" in names
    assert not any(n.startswith("tokenizer") for n in names)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for name, t in loaded.state_dict().items():
        torch.testing.assert_close(t, full_weights(trainer)[name].to(torch.bfloat16))
