"""Single-process checkpoints, their contents, and Hugging Face export (live and the CLI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from trainer_testkit import QWEN2_TIED, VOCAB, config, full_weights, make_batch, tiny_llama
from transformers import (
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PreTrainedTokenizerFast,
)

from patrl.trainer import Critic, CriticConfig, Trainer
from patrl.trainer.checkpoint import read_marker
from patrl.trainer.export import HF_DIR
from patrl.trainer.export import main as export_main
from patrl_testkit import filesystems
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


def test_save_contents_names_the_accepted_values() -> None:
    with pytest.raises(ValidationError, match=r"unknown value\(s\) \['weights'\].*'hf_model'"):
        config(checkpoint={"save_contents": ["model", "weights"]})
    with pytest.raises(ValidationError, match="an empty list"):
        config(checkpoint={"save_contents": []})
    assert config().checkpoint.save_contents == ["model", "optimizer", "extra", "hf_model"]
    assert CriticConfig().checkpoint.save_contents == ["model", "optimizer", "extra"]


def test_a_checkpoint_without_optimizer_state_is_not_resumed(tmp_path: Path) -> None:
    trainer = Trainer(config(checkpoint={"save_contents": ["model", "hf_model"]}), tiny_llama())
    trainer.train_step(make_batch(0, [3, 4]))
    path = trainer.save(tmp_path / "ckpt")
    assert read_marker(path)["contents"] == ["model", "hf_model"]
    assert not list(path.glob("trainer_state_rank*.pt"))  # no "extra"
    with pytest.raises(ValueError, match=r"not \['optimizer', 'extra'\]: resuming needs"):
        Trainer(config(), tiny_llama()).load(path)


def _read_dir(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    return {name: t for f in files for name, t in load_file(f).items()}


def test_export_cli_writes_what_the_live_export_writes(tmp_path: Path) -> None:
    """A checkpoint plus the metadata-only HF directory a run writes beside it -> the CLI's
    directory has the live export's tensors, config and tokenizer; sharded too (with an
    index that from_pretrained follows); and from the source directory (--model) alike."""
    src = _model_dir_with_tokenizer(tmp_path / "src")
    trainer = Trainer(config(), str(src))
    trainer.train_step(make_batch(1, [5, 3]))
    checkpoint = trainer.save(tmp_path / "ckpt")
    trainer.export_hf(checkpoint / HF_DIR, weights=False)
    live = trainer.export_hf(tmp_path / "live")
    shards = tmp_path / "sharded"
    assert export_main([str(checkpoint), str(shards), "--max-shard-bytes", "20000"]) == 0
    assert export_main([str(checkpoint), str(tmp_path / "from_src"), "--model", str(src)]) == 0

    want = _read_dir(live)
    assert "lm_head.weight" not in want  # tied: stored once, as in HF's own files
    for out in (shards, tmp_path / "from_src"):
        got = _read_dir(out)
        assert got.keys() == want.keys()
        for name, t in want.items():
            assert torch.equal(got[name], t), name
        assert json.loads((out / "config.json").read_text()) == json.loads(
            (live / "config.json").read_text()
        )
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (out / name).read_bytes() == (live / name).read_bytes(), name
    assert len(list(shards.glob("model-*-of-*.safetensors"))) > 2
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(want)
    loaded = AutoModelForCausalLM.from_pretrained(shards, dtype=torch.float32)
    ids = make_batch(2, [9]).input_ids[0][None]
    # Bit-equal: the weights are bit-equal (above), the same model class and attention
    # implementation run the same input in one process: the same kernels on the same shapes.
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits)


def test_export_cli_errors_name_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert export_main([str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "nothing' is not a complete patrl checkpoint" in err and "global_step_<N>" in err
    # From a config: no source directory and no huggingface/ to read a config from.
    checkpoint = Trainer(config(), tiny_llama()).save(tmp_path / "ckpt")
    assert export_main([str(checkpoint), str(tmp_path / "out")]) == 2
    assert "no model config for checkpoint" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert export_main([str(checkpoint), str(tmp_path / "full")]) == 2
    assert "full' exists and is not an empty directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        export_main([str(checkpoint), str(tmp_path / "out"), "--max-shard-bytes", "0"])
    assert exit_.value.code == 2
    assert "--max-shard-bytes 0: accepted 1 or more" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_critic_exports_a_token_classification_model(tmp_path: Path) -> None:
    src = _model_dir_with_tokenizer(tmp_path / "src")
    critic = Critic(CriticConfig(optim={"lr": 1e-3}), str(src))
    batch = make_batch(3, [4, 6])
    rewards = [torch.ones(m.shape) for m in batch.loss_mask]
    critic.update(batch, rewards, 1.0, 1.0)
    live = critic.export_hf(tmp_path / "live")
    config_json = json.loads((live / "config.json").read_text())
    assert config_json["architectures"] == ["Qwen2ForTokenClassification"]
    loaded = AutoModelForTokenClassification.from_pretrained(live, dtype=torch.float32)
    ids = batch.input_ids[1][None]
    with torch.no_grad():
        want = critic.model(input_ids=ids).logits
        assert float(want.abs().max()) > 0  # the head moved off its zero init
        assert torch.equal(loaded(input_ids=ids).logits, want)  # as above: same weights, kernels
    checkpoint = critic.save(tmp_path / "critic")
    assert export_main([str(checkpoint), str(tmp_path / "cli"), "--model", str(src)]) == 0
    got, expected = _read_dir(tmp_path / "cli"), _read_dir(live)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    assert json.loads((tmp_path / "cli" / "config.json").read_text()) == config_json


def test_export_keeps_the_source_models_dtype(tmp_path: Path) -> None:
    """A bf16 source trains in fp32 master weights and exports bf16 (a drop-in replacement);
    the CLI does the same; --dtype overrides it."""
    src = _model_dir_with_tokenizer(tmp_path / "src")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(src)
    trainer = Trainer(config(), str(src))
    assert trainer.export_dtype == torch.bfloat16
    assert next(trainer.model.parameters()).dtype == torch.float32
    trainer.train_step(make_batch(1, [5, 3]))
    live = _read_dir(trainer.export_hf(tmp_path / "live"))
    master = full_weights(trainer)
    assert live.keys() == master.keys()
    for name, t in master.items():
        assert live[name].dtype == torch.bfloat16 and torch.equal(live[name], t.bfloat16()), name
    assert json.loads((tmp_path / "live" / "config.json").read_text())["dtype"] == "bfloat16"
    checkpoint = trainer.save(tmp_path / "ckpt")
    assert export_main([str(checkpoint), str(tmp_path / "cli")]) == 0  # the recorded source
    assert all(torch.equal(t, live[n]) for n, t in _read_dir(tmp_path / "cli").items())
    assert export_main([str(checkpoint), str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    fp32 = _read_dir(tmp_path / "fp32")
    assert all(torch.equal(fp32[n], t) for n, t in master.items())


def test_export_with_another_models_config_names_the_tensors_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--model naming a smaller model of the same family: its config would describe tensors
    the checkpoint does not hold (fewer layers, another width): refused, naming shapes and
    the left-out tensors, with no OUT or OUT.tmp."""
    src = _model_dir_with_tokenizer(tmp_path / "src")
    checkpoint = Trainer(config(), str(src)).save(tmp_path / "ckpt")
    wide = json.loads((src / "config.json").read_text())
    smaller = save_tiny_model(
        tmp_path / "smaller",
        "qwen2",
        "plain",
        **{
            **QWEN2_TIED,
            "vocab_size": wide["vocab_size"],
            "hidden_size": wide["hidden_size"] // 2,
            "num_hidden_layers": wide["num_hidden_layers"] - 1,
        },
    )
    out = tmp_path / "out"
    capsys.readouterr()  # the setup's progress bars
    assert export_main([str(checkpoint), str(out), "--model", str(smaller)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("patrl: error: ") and len(err.strip().splitlines()) == 1, err
    assert f"holds a different model than the config of --model '{smaller}'" in err
    assert "tensors of another shape, e.g. 'model.embed_tokens.weight' is [" in err
    last = wide["num_hidden_layers"] - 1
    assert f"tensors it has no place for, e.g. ['model.layers.{last}." in err
    assert not out.exists() and not (tmp_path / "out.tmp").exists()
    # The same, but a model with one more layer: the tensors the checkpoint lacks are named.
    deeper = save_tiny_model(
        tmp_path / "deeper",
        "qwen2",
        "plain",
        **{**QWEN2_TIED, "vocab_size": wide["vocab_size"], "num_hidden_layers": last + 2},
    )
    capsys.readouterr()
    assert export_main([str(checkpoint), str(out), "--model", str(deeper)]) == 2
    err = capsys.readouterr().err
    assert f"of its tensors missing, e.g. ['model.layers.{last + 1}." in err
    assert not out.exists() and not (tmp_path / "out.tmp").exists()


def _run_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """(a run checkpoint as the orchestrator lays it out: trainer/ with the manifest of its
    files beside it, its first shard file)."""
    src = _model_dir_with_tokenizer(tmp_path / "src")
    run_checkpoint = tmp_path / "global_step_1"
    Trainer(config(), str(src)).save(run_checkpoint / "trainer")
    files = {
        str(p.relative_to(run_checkpoint)): p.stat().st_size
        for p in sorted(run_checkpoint.rglob("*"))
        if p.is_file()
    }
    (run_checkpoint / "manifest.json").write_text(json.dumps({"files": files}))
    return run_checkpoint, next((run_checkpoint / "trainer").glob("*.distcp"))


def test_export_of_a_damaged_checkpoint_names_the_file_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A shard cut short or removed after the save: its manifest names the file and both
    sizes before anything is read; without a manifest, DCP's failure is one line naming the
    checkpoint. No OUT and no OUT.tmp either way."""
    run_checkpoint, shard = _run_checkpoint(tmp_path)
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-100])
    out = tmp_path / "out"
    capsys.readouterr()
    assert export_main([str(run_checkpoint), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"patrl: error: checkpoint '{run_checkpoint}' is damaged: {shard} is " in err
    assert f"{size - 100} bytes, its manifest says {size}" in err
    assert not out.exists() and not (tmp_path / "out.tmp").exists()
    (run_checkpoint / "manifest.json").unlink()
    shard.write_bytes(shard.read_bytes()[:200])  # into the model's tensors
    assert export_main([str(run_checkpoint), str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"patrl: error: checkpoint '{run_checkpoint}' cannot be read: "), err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not (tmp_path / "out.tmp").exists()
    shard.unlink()
    _, _ = _run_checkpoint(tmp_path / "again")
    again = tmp_path / "again" / "global_step_1"
    gone = next((again / "trainer").glob("*.distcp"))
    gone.unlink()
    assert export_main([str(again), str(out)]) == 2
    assert f"{gone} is missing" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "out.tmp").exists()


def test_export_to_a_directory_that_cannot_be_written_is_refused_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = Trainer(config(), tiny_llama()).save(tmp_path / "ckpt")
    with filesystems.read_only_dir(tmp_path / "ro") as ro:
        capsys.readouterr()
        assert export_main([str(checkpoint), str(ro / "out")]) == 2
        err = capsys.readouterr().err
    assert err.startswith(f"patrl: error: the directory of OUT {ro}: {ro} "), err
    assert "read-only filesystem" in err or "is not writable" in err
