"""Logit parity with transformers for every family, at TP 1, 2 and 4; config and loader errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from rollout_testkit import hf_reference, max_diff_prefill_and_decode, tp_parity_body, workload
from transformers import GPT2Config, MistralConfig

from patrl.rollout.loader import (
    checkpoint_files,
    load_model,
    load_weights,
    read_eos_token_ids,
    read_tokenizer,
    weight_keys,
)
from patrl.rollout.model_config import ModelArch
from patrl.rollout.models import build_model
from patrl_testkit.models import FAMILIES, save_hf_model, tiny_config, tiny_hf_model
from patrl_testkit.multirank import run_ranks

TOL = 1e-4


def _case(family: str, tmp: Path, **save_kwargs: object) -> tuple[Path, list, list, list]:
    hf = tiny_hf_model(family)
    prompts, conts = workload(hf.config.vocab_size)
    path = save_hf_model(hf, tmp / family, **save_kwargs)
    return path, prompts, conts, hf_reference(hf, prompts, conts)


@pytest.mark.parametrize("cache", ["dense", "paged", "kvstore"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_at_tp1(family: str, cache: str, tmp_path: Path) -> None:
    path, prompts, conts, refs = _case(family, tmp_path)
    model = load_model(path, attention="sdpa", dtype=torch.float32)
    assert max_diff_prefill_and_decode(model, refs, prompts, conts, cache) <= TOL


@pytest.mark.multirank
def test_logits_match_transformers_at_tp2(tmp_path: Path) -> None:
    cases = []
    for family in FAMILIES:
        path, prompts, conts, refs = _case(family, tmp_path)
        cases += [(path, prompts, conts, refs, "dense"), (path, prompts, conts, refs, "paged")]
    per_rank = run_ranks(tp_parity_body, world_size=2, args=(cases,), timeout_s=240)
    assert len(per_rank) == 2 and all(len(d) == len(cases) for d in per_rank)
    assert max(max(d) for d in per_rank) <= TOL, per_rank


@pytest.mark.multirank
def test_llama_at_tp4_replicates_kv_heads_and_pads_vocab(tmp_path: Path) -> None:
    # 2 kv heads over 4 ranks (replicated), vocab 250 = 4 x 63 - 2 (padded last block).
    path, prompts, conts, refs = _case("llama", tmp_path)
    per_rank = run_ranks(
        tp_parity_body, world_size=4, args=([(path, prompts, conts, refs, "paged")],), timeout_s=300
    )
    assert max(d[0] for d in per_rank) <= TOL, per_rank


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_stay_close_to_transformers_bf16(family: str) -> None:
    hf = tiny_hf_model(family).to(torch.bfloat16)
    model = build_model(hf.config, attention="sdpa", dtype=torch.bfloat16)
    load_weights(model, hf.state_dict().items())
    assert model.lm_head.weight.dtype == torch.bfloat16
    prompts, conts = workload(hf.config.vocab_size)
    refs = hf_reference(hf, prompts, conts)
    diff = max_diff_prefill_and_decode(model, refs, prompts, conts, "paged")
    # Same math in bf16, not the same kernels: allow 4 bf16 ulps (8-bit significand) of the
    # largest logit. Measured: about one ulp for every family.
    scale = max(r.abs().max().item() for r in refs)
    ulp = 2.0 ** (math.floor(math.log2(scale)) - 7)
    assert diff <= 4 * ulp, (diff, ulp)


def test_sharded_checkpoint_with_index_loads(tmp_path: Path) -> None:
    path, prompts, conts, refs = _case("qwen3", tmp_path, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(checkpoint_files(path)) > 1
    model = load_model(path, attention="sdpa")
    assert max_diff_prefill_and_decode(model, refs, prompts, conts, "dense") <= TOL


def test_tied_embeddings_share_one_tensor(tmp_path: Path) -> None:
    path, *_ = _case("qwen2", tmp_path)
    model = load_model(path, attention="sdpa")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in weight_keys(model)


def test_cpu_matmul_weights_are_input_major_and_equal_the_checkpoint(tmp_path: Path) -> None:
    """Linear and (untied) head weights are transposed views of contiguous [in, out] storage
    on CPU (faster small-batch matmuls); the embedding table stays row-major for lookups.
    Values are the checkpoint's, whatever the storage order (the parity tests check logits)."""
    hf = tiny_hf_model("llama")
    path = save_hf_model(hf, tmp_path / "llama")
    model = load_model(path, attention="sdpa", dtype=torch.float32)
    params = dict(model.named_parameters())
    matmul = [n for n in params if n.endswith("proj.weight") or n == "lm_head.weight"]
    assert len(matmul) == 4 * hf.config.num_hidden_layers + 1
    for name in matmul:
        p = params[name]
        assert not p.is_contiguous() and p.t().is_contiguous(), name
    assert params["model.embed_tokens.weight"].is_contiguous()
    ref = hf.state_dict()
    assert torch.equal(params["lm_head.weight"], ref["lm_head.weight"])
    assert torch.equal(
        params["model.layers.0.mlp.down_proj.weight"], ref["model.layers.0.mlp.down_proj.weight"]
    )


def test_unknown_checkpoint_name_is_an_error() -> None:
    hf = tiny_hf_model("llama")
    model = build_model(hf.config, attention="sdpa")
    with pytest.raises(KeyError, match=r"'model.layers.0.mlp.experts.weight' matches no parameter"):
        load_weights(model, [("model.layers.0.mlp.experts.weight", torch.zeros(1))])


def test_a_missing_weight_is_an_error(tmp_path: Path) -> None:
    path, *_ = _case("llama", tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 weights.*layers.1.self_attn.qkv_proj.weight:k"):
        load_model(path, attention="sdpa")


def test_loading_streams_full_tensors_in_any_order() -> None:
    hf = tiny_hf_model("qwen3")
    model = build_model(hf.config, attention="sdpa")
    items = list(hf.state_dict().items())[::-1]
    assert load_weights(model, iter(items)) == weight_keys(model)


def test_eos_ids_come_from_generation_config(tmp_path: Path) -> None:
    path, *_ = _case("llama", tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    assert read_eos_token_ids(path) == [3, 7]


def test_tokenizer_is_read_from_the_directory(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(tmp_path)
    loaded = read_tokenizer(tmp_path)
    assert loaded.encode("hello world") == [2, 3]
    assert loaded.eos_token_id == 1


def test_unsupported_model_type_lists_the_supported_ones() -> None:
    with pytest.raises(
        ValueError,
        match=r"model_type 'gpt2' is not supported; supported: \['llama', 'qwen2', 'qwen3'\]",
    ):
        ModelArch.from_hf(GPT2Config())
    with pytest.raises(ValueError, match=r"model_type 'mistral' is not supported"):
        build_model(MistralConfig(), attention="sdpa")


@pytest.mark.parametrize(
    ("family", "overrides", "message"),
    [
        ("llama", {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported; only 'silu'"),
        ("llama", {"mlp_bias": True}, r"mlp_bias=True is not supported"),
        (
            "llama",
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            r"rope_type 'dynamic' is not supported; supported: \['default', 'linear', 'llama3', 'yarn'\]",
        ),
        (
            "qwen3",
            {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
            r"layer_types \['full_attention', 'sliding_attention'\] are not supported",
        ),
    ],
)
def test_configs_that_would_compute_wrong_math_are_rejected(
    family: str, overrides: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ModelArch.from_hf(tiny_config(family, **overrides))


def test_tp_that_cannot_split_the_model_is_rejected() -> None:
    config = ModelArch.from_hf(tiny_config("llama", num_key_value_heads=4))
    with pytest.raises(ValueError, match=r"tp_size=3 must divide num_attention_heads=4"):
        config.check_tp(3)
    three_kv = ModelArch.from_hf(
        tiny_config("llama", num_attention_heads=12, num_key_value_heads=3, hidden_size=96)
    )
    with pytest.raises(ValueError, match=r"tp_size=4 and num_key_value_heads=3: one must divide"):
        three_kv.check_tp(4)


def test_a_dropped_model_frees_its_weights_at_once() -> None:
    # Each parameter's weight_loader is bound to a weak proxy of its module: a bound method
    # made module -> parameter -> loader -> module a cycle, so a model the engine dropped (it
    # rebuilds one at every weight sync after an adaptive rollout) kept its memory until the
    # cyclic collector ran, which it is held off from here.
    import gc
    import weakref

    hf = tiny_hf_model("llama")
    model = build_model(hf.config, attention="sdpa")
    load_weights(model, hf.state_dict().items())
    weights = [weakref.ref(p) for p in model.parameters()]
    gc.disable()
    try:
        del model
        assert all(w() is None for w in weights)
    finally:
        gc.enable()
    # the loaders still load while their module lives
    again = build_model(hf.config, attention="sdpa")
    assert load_weights(again, hf.state_dict().items()) == weight_keys(again)
