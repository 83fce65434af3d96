"""The engine's LoRA path against the merged-weights model (its slow twin) at TP 1 and 2, its
merged mode, and greedy tokens against transformers + PEFT on the same adapter."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rollout_testkit import Driver, hf_reference, max_diff_prefill_and_decode, workload
from safetensors.torch import load_file

from patrl.rollout import Engine, EngineConfig
from patrl.rollout.adaptive import WayBack, reconfigure
from patrl.rollout.layers.lora import (
    LORA_TARGETS,
    merge_lora,
    saved_base_weights,
    unmerge_lora,
)
from patrl.rollout.loader import load_model, load_weights
from patrl.rollout.sampler import SamplingParams
from patrl.tpreshard import GroupCache, ParallelLayout
from patrl_testkit.models import save_hf_model, tiny_hf_model
from patrl_testkit.multirank import run_ranks

peft = pytest.importorskip("peft", reason="peft is a test dependency (noxfile TEST_DEPS)")

RANK, ALPHA = 4, 8.0
LORA = (RANK, ALPHA, LORA_TARGETS)
EXACT = 1e-5  # fp32: the adapter path and the merged weights are the same sums, reordered
HF_TOL = 1e-4  # against transformers' kernels (test_rollout_models' tolerance)


def _peft(family: str, root: Path) -> dict[str, Any]:
    """Base, PEFT adapter (random A and B, so every projection changes) and the merged model,
    each saved; the adapter's tensors under PEFT's names."""
    base = save_hf_model(tiny_hf_model(family), root / "base")
    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0)
    model = peft.get_peft_model(tiny_hf_model(family), cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(tuple(p.shape), generator=g) * 0.05)
    model.save_pretrained(root / "adapter")
    adapter = load_file(str(root / "adapter" / "adapter_model.safetensors"))
    prompts, conts = workload(model.config.vocab_size)
    refs = hf_reference(model, prompts, conts)
    half = copy.deepcopy(model)  # the same adapter with B halved: a second sync's values
    with torch.no_grad():
        for name, p in half.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    merged_half = save_hf_model(half.merge_and_unload(), root / "merged_half")
    merged = save_hf_model(model.merge_and_unload(), root / "merged")
    return {
        "base": base,
        "adapter": adapter,
        "adapter_dir": root / "adapter",
        "merged": merged,
        "adapter_half": {n: t * 0.5 if "lora_B" in n else t for n, t in adapter.items()},
        "merged_half": merged_half,
        "prompts": prompts,
        "conts": conts,
        "refs": refs,
    }


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _peft(request.param, tmp_path_factory.mktemp(f"lora_{request.param}"))


@torch.no_grad()
def _logits(model: Any, prompts: list[list[int]], conts: list[list[int]]) -> list[torch.Tensor]:
    """Every position's logits, each sequence prefilled whole."""
    seqs = [p + c for p, c in zip(prompts, conts, strict=True)]
    return Driver(model, len(seqs), "dense").step(seqs)


def _compare(c: dict[str, Any], layout: ParallelLayout | None) -> dict[str, float]:
    """Worst logit differences: adapter path vs merged-weights model, merged mode vs the same,
    adapter path vs transformers + PEFT; and whether unmerge restored every weight exactly."""
    p, q = c["prompts"], c["conts"]
    twin = load_model(c["merged"], layout, attention="sdpa", dtype=torch.float32)
    refs = _logits(twin, p, q)
    model = load_model(c["base"], layout, attention="sdpa", dtype=torch.float32, lora=LORA)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    load_weights(model, c["adapter"].items())
    out = {
        "lora": max_diff_prefill_and_decode(model, refs, p, q, "paged"),
        "hf": max_diff_prefill_and_decode(model, c["refs"], p, q, "paged"),
    }
    adapters = {n: t.clone() for n, t in model.state_dict().items() if "lora_" in n}
    merge_lora(model)
    out["merged"] = max_diff_prefill_and_decode(model, refs, p, q, "paged")
    unmerge_lora(model)
    out["unmerge_exact"] = float(
        all(
            torch.equal(t, adapters[n] if "lora_" in n else before[n])
            for n, t in model.state_dict().items()
        )
    )
    return out


def test_lora_forward_equals_merged_weights_at_tp1(case: dict[str, Any]) -> None:
    got = _compare(case, None)
    assert got["lora"] <= EXACT and got["merged"] <= EXACT, got
    assert got["hf"] <= HF_TOL, got
    assert got["unmerge_exact"] == 1.0


def _tp_body(rank: int, world_size: int, c: dict[str, Any]) -> dict[str, float]:
    group = dist.new_group(list(range(world_size)))
    return _compare(c, ParallelLayout(tp_size=world_size, tp_rank=rank, tp_group=group))


@pytest.mark.multirank
def test_lora_forward_equals_merged_weights_at_tp2(case: dict[str, Any]) -> None:
    for got in run_ranks(_tp_body, 2, args=(case,), timeout_s=240):
        assert got["lora"] <= EXACT and got["merged"] <= EXACT, got
        assert got["hf"] <= HF_TOL, got
        assert got["unmerge_exact"] == 1.0


def test_an_adapter_load_in_merged_mode_unmerges_first(case: dict[str, Any]) -> None:
    """Loading adapters into a merged model (twice, different values) gives the weights a
    fresh merge of the last adapter gives: no update is folded in twice."""
    fresh = load_model(case["base"], dtype=torch.float32, lora=LORA)
    load_weights(fresh, case["adapter"].items())
    merge_lora(fresh)
    model = load_model(case["base"], dtype=torch.float32, lora=LORA, lora_merged=True)
    halved = {n: t * 0.5 for n, t in case["adapter"].items()}
    load_weights(model, halved.items())
    load_weights(model, case["adapter"].items())
    want = fresh.state_dict()
    for n, t in model.state_dict().items():
        assert torch.equal(t, want[n]), n


def test_adapters_need_lora_on_the_engine(case: dict[str, Any]) -> None:
    model = load_model(case["base"], dtype=torch.float32)
    with pytest.raises(KeyError, match="lora_rank > 0"):
        load_weights(model, case["adapter"].items())
    with pytest.raises(ValueError, match=r"accepted:.*q_proj"):
        load_model(case["base"], dtype=torch.float32, lora=(2, 4.0, ("lm_head",)))


def test_merged_mode_sleeps_its_saved_base_weights_too(case: dict[str, Any]) -> None:
    """sleep(2) moves the base weights merged mode keeps (for the unmerge) to the host with
    the others; after wake_up the engine's tokens and its exact unmerge are unchanged."""
    config = EngineConfig(
        model=str(case["base"]),
        block_size=4,
        num_kv_blocks=64,
        max_model_len=64,
        lora_rank=RANK,
        lora_alpha=ALPHA,
        lora_merged=True,
    )
    engine = Engine(config)
    engine.load_weights(case["adapter"].items(), version=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in engine.generate(case["prompts"], params)]
    saved = saved_base_weights(engine.model)
    assert saved and all(t.untyped_storage().nbytes() > 0 for t in saved)
    engine.sleep(level=2)
    assert all(t.untyped_storage().nbytes() == 0 for t in saved)
    engine.wake_up()
    after = [o.outputs[0].token_ids for o in engine.generate(case["prompts"], params)]
    assert after == before
    unmerge_lora(engine.model)
    fresh = load_model(case["base"], dtype=torch.float32, lora=LORA)
    want = {n: t for n, t in fresh.state_dict().items() if "lora_" not in n}
    for n, t in engine.model.state_dict().items():
        if n in want:
            assert torch.equal(t, want[n]), n


@pytest.mark.parametrize("merged", [False, True])
def test_greedy_tokens_equal_transformers_with_peft(case: dict[str, Any], merged: bool) -> None:
    from transformers import AutoModelForCausalLM

    engine = Engine(
        EngineConfig(
            model=str(case["base"]),
            block_size=4,
            num_kv_blocks=128,
            max_model_len=128,
            lora_rank=RANK,
            lora_alpha=ALPHA,
            lora_merged=merged,
        )
    )
    engine.load_weights(case["adapter"].items(), version=1)
    prompts = case["prompts"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = engine.generate(prompts, params)
    base = AutoModelForCausalLM.from_pretrained(case["base"], dtype=torch.float32)
    ref_model = peft.PeftModel.from_pretrained(base, case["adapter_dir"]).eval()
    for prompt, result in zip(prompts, out, strict=True):
        ids = torch.tensor([prompt])
        ref = ref_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
        )
        assert result.outputs[0].token_ids == ref[0, len(prompt) :].tolist()


def test_merged_mode_is_refused_with_adaptive_tp(case: dict[str, Any]) -> None:
    from patrl.rollout import AdaptiveTP

    with pytest.raises(ValueError, match="lora_merged=True runs at static TP only"):
        EngineConfig(
            model=str(case["base"]), lora_rank=RANK, lora_merged=True, tp_policy=AdaptiveTP()
        )
    # Without kept full weights the way back waits for the next rollout (a gather), as the
    # adapter-only sync cannot rebuild the base: allowed (test_..._across_live_reconfigures).
    EngineConfig(
        model=str(case["base"]), lora_rank=RANK, keep_full_weights=False, tp_policy=AdaptiveTP()
    )


@pytest.fixture(scope="module")
def llama_case(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _peft("llama", tmp_path_factory.mktemp("lora_reconfig"))


def _generate_across(engine: Engine, tp: int | None) -> dict[str, list[list[int]]]:
    """Each replica's three requests, moved to TP `tp` (None: not moved) after 3 steps, run to
    the end; every replica's tokens by request id."""
    dp_rank = engine.layout.dp_rank
    g = torch.Generator().manual_seed(50 + dp_rank)
    for i, n in enumerate((5, 11, 8)):
        prompt = torch.randint(0, 250, (n,), generator=g).tolist()
        params = SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=12, ignore_eos=True)
        engine.add_request(prompt, params, request_id=f"r{dp_rank}-{i}")
    done: dict[str, list[list[int]]] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == 3 and tp is not None:
            reconfigure(engine, tp, "migrate")
        for out in engine.step():
            done[out.request_id] = [s.token_ids for s in out.outputs]
        steps += 1
    parts: list[dict[str, list[list[int]]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, done)
    return {k: v for part in parts for k, v in part.items()}


def _reconfig_body(rank: int, world_size: int, c: dict[str, Any]) -> list[dict[str, Any]]:
    """From each opening TP (1, then 2): adapters loaded, a live move to the other TP
    mid-generation, an adapter sync there, the move back; then an adaptive rollout's way back
    paid by an adapter-only sync. Each stage's worst logit difference against the merged-weights
    model (PEFT's merge) of the adapter loaded last, at the engine's layout of the moment."""
    groups = GroupCache([1, 2], world_size=world_size, rank=rank)
    p, q = c["prompts"], c["conts"]
    refs = _logits(load_model(c["merged"], dtype=torch.float32), p, q)
    half = _logits(load_model(c["merged_half"], dtype=torch.float32), p, q)
    results = []
    for opening, other in ((1, 2), (2, 1)):
        config = EngineConfig(
            model=str(c["base"]),
            block_size=4,
            num_kv_blocks=128,
            max_model_len=128,
            lora_rank=RANK,
            lora_alpha=ALPHA,
        )
        engine = Engine(config, groups.layout(opening), groups)
        engine.load_weights(c["adapter"].items(), version=1)
        out: dict[str, Any] = {
            "opening": max_diff_prefill_and_decode(engine.model, refs, p, q, "paged")
        }
        out["same_tokens"] = _generate_across(engine, None) == _generate_across(engine, other)
        assert engine.layout.tp_size == other
        out["moved"] = max_diff_prefill_and_decode(engine.model, refs, p, q, "paged")
        engine.load_weights(c["adapter_half"].items(), version=2)
        out["synced"] = max_diff_prefill_and_decode(engine.model, half, p, q, "paged")
        reconfigure(engine, opening)
        out["back"] = max_diff_prefill_and_decode(engine.model, half, p, q, "paged")
        # As after an adaptive rollout: moved away, the return owed, the next sync adapters only.
        reconfigure(engine, other)
        way_back = WayBack(engine)
        way_back.later(groups.layout(opening))
        way_back.load_weights(c["adapter"].items(), version=3)
        way_back.settle()
        out["tp_after_way_back"] = engine.layout.tp_size
        out["way_back"] = max_diff_prefill_and_decode(engine.model, refs, p, q, "paged")
        results.append(out)
    return results


@pytest.mark.multirank
def test_lora_forward_equals_merged_weights_across_live_reconfigures(
    llama_case: dict[str, Any],
) -> None:
    """Adapters are resharded with the base: after every move (fold and split, mid-generation)
    and every adapter sync at the new layout, the LoRA forward is the merged-weights forward;
    the sampled tokens are those of a run that never moved."""
    for per_opening in run_ranks(_reconfig_body, 2, args=(llama_case,), timeout_s=400):
        for (opening, _), got in zip(((1, 2), (2, 1)), per_opening, strict=True):
            assert got["same_tokens"], (opening, got)
            assert got["tp_after_way_back"] == opening, got
            for stage in ("opening", "moved", "synced", "back", "way_back"):
                assert got[stage] <= EXACT, (opening, stage, got)


@pytest.mark.parametrize("merged", [False, True])
def test_adapter_loads_keep_the_decode_graphs(case: dict[str, Any], merged: bool) -> None:
    """An adapter sync writes into the tensors captured graphs read (the adapters, and in
    merged mode the weights, in place): the graphs stay (none is dropped or captured anew) and
    their path (the CPU twin of the capture's static buffers) gives an eager engine's tokens and
    logprobs of the new adapters."""
    from patrl.rollout.cuda_graphs import DecodeGraphs

    def engine() -> Engine:
        config = EngineConfig(
            model=str(case["base"]), block_size=4, num_kv_blocks=128, max_model_len=64,
            max_num_seqs=8, lora_rank=RANK, lora_alpha=ALPHA, lora_merged=merged,
        )  # fmt: skip
        return Engine(config)

    def run(eng: Engine) -> tuple[list[list[int]], list[float]]:
        params = SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=10, ignore_eos=True)
        outs = [c for o in eng.generate(case["prompts"], params) for c in o.outputs]
        return [c.token_ids for c in outs], [lp for c in outs for lp in c.logprobs]

    graphed = engine()
    runner = graphed.runner
    graphs = runner.graphs = DecodeGraphs(
        runner.model, runner.cache, 8, runner.max_model_len, capture=False
    )
    for step, adapter in enumerate((case["adapter"], case["adapter_half"])):
        eager = engine()
        eager.load_weights(adapter.items(), version=step + 1)
        graphed.load_weights(adapter.items(), version=step + 1)
        before = dict(graphs.graphs)
        got, want = run(graphed), run(eager)
        assert got[0] == want[0]
        assert got[1] == pytest.approx(want[1], abs=1e-5)
        assert graphs.graphs and all(graphs.graphs[b] is g for b, g in before.items())
