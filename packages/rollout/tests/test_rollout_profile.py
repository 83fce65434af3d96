"""The engine profiler: its quick grid at TP=1 in process and at TP 1+2 on two gloo ranks
writes a lenpredict Profile that validates, fits, and is refused for another model or dtype."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from patrl.lenpredict import LatencyModel, Profile, ProfileMismatchError
from patrl.rollout import Engine, EngineConfig
from patrl.rollout.profile import (
    COLLECTIVE_OPS,
    ProfileGrid,
    decode_context_tokens,
    engine_dtype,
    main,
    measure_decode,
    measure_verify,
    model_info,
    profile_distributed,
    profile_single,
    quick_grid,
)
from patrl_testkit.models import save_hf_model, tiny_hf_model
from patrl_testkit.multirank import run_ranks


def _save_llama(path: Path, layers: int) -> int:
    """A tiny random Llama at `path`; returns its parameter count as HF counts it."""
    model = tiny_hf_model("llama", 0, "plain", num_hidden_layers=layers, vocab_size=256)
    save_hf_model(model, path)
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("profile")
    return {
        "tiny": root / "tiny",
        "tiny_params": _save_llama(root / "tiny", layers=2),
        "other": root / "other",
        "other_params": _save_llama(root / "other", layers=3),
    }


@pytest.fixture(scope="module")
def tp1_profile_path(models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "sub" / "profile.json"
    main(["--model", str(models["tiny"]), "--out", str(out), "--quick", "--dtype", "float32"])
    return out


def _expected_decode_cells(grid: ProfileGrid, tp: int) -> set[tuple[int, int, int]]:
    return {(tp, b, decode_context_tokens(b, c, grid.decode_steps)) for b, c in grid.decode_cells()}


def _check_fits(profile: Profile) -> LatencyModel:
    latency = LatencyModel.fit(profile)
    for tp in profile.tp_sizes:
        assert float(latency.step_time(tp, 4, 200)) > 0
        assert latency.prefill_time(tp, [64]) > 0
    return latency


@pytest.mark.e2e
def test_quick_profile_tp1_cli_writes_a_profile_that_fits(
    models: dict[str, Any], tp1_profile_path: Path
) -> None:
    out = tp1_profile_path
    assert [p.name for p in out.parent.iterdir()] == ["profile.json"]  # no temporary left
    profile = Profile.model_validate_json(out.read_text())  # the schema, strictly

    grid = quick_grid()
    assert profile.source == "measured" and profile.dtype == "float32"
    assert profile.hardware.num_devices == 1
    cells = {(r.tp, r.batch, r.context_tokens) for r in profile.decode}
    assert cells == _expected_decode_cells(grid, 1)
    assert len(profile.decode) == len(cells)
    assert sorted((r.num_seqs, r.tokens) for r in profile.prefill) == sorted(grid.prefill_cells())
    assert {r.num_seqs for r in profile.prefill} == {1, 4}  # several price each sequence
    assert profile.collectives == []  # one process: no group to time
    assert all(r.seconds > 0 for r in [*profile.decode, *profile.prefill])
    # the identity comes from the checkpoint; the parameter count is HF's own count
    assert profile.model.num_layers == 2 and profile.model.num_kv_heads == 2
    assert profile.model.head_dim == 16 and profile.model.vocab_size == 256
    assert profile.model.num_params == models["tiny_params"]
    _check_fits(profile)


@pytest.mark.e2e
def test_profile_of_another_model_or_dtype_is_refused(
    models: dict[str, Any], tp1_profile_path: Path
) -> None:
    profile = Profile.load(tp1_profile_path)

    same = Engine(EngineConfig(model=str(models["tiny"]), dtype="float32", device="cpu"))
    profile.check_matches(model_info(models["tiny"], same), engine_dtype(same))

    other = Engine(EngineConfig(model=str(models["other"]), dtype="float32", device="cpu"))
    other_info = model_info(models["other"], other)
    assert other_info.num_params == models["other_params"]
    with pytest.raises(ProfileMismatchError, match=r"num_layers=2 but .* num_layers=3"):
        profile.check_matches(other_info, engine_dtype(other))

    bf16 = Engine(EngineConfig(model=str(models["tiny"]), dtype="bfloat16", device="cpu"))
    with pytest.raises(ProfileMismatchError, match=r"dtype='float32' but .* dtype='bfloat16'"):
        profile.check_matches(model_info(models["tiny"], bf16), engine_dtype(bf16))


def test_grid_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"batch_sizes .* got \(0, 2\)"):
        ProfileGrid(batch_sizes=(0, 2))
    with pytest.raises(ValueError, match=r"clock must be one of .* got 'gpu'"):
        ProfileGrid(clock="gpu")
    grid = ProfileGrid(contexts=(16, 100, 120), prefill_tokens=(64, 128), decode_steps=8)
    fitted = grid.fit_to(128)  # a context needs room for its decode steps
    assert fitted.contexts == (16, 100) and fitted.prefill_tokens == (64,)
    assert max(fitted.contexts) + fitted.decode_steps + 1 <= 128 and fitted.max_model_len <= 128
    with pytest.raises(ValueError, match="no grid cell fits max_position_embeddings=16"):
        grid.fit_to(16)


@pytest.mark.parametrize("n, prefilled", [(1, 7 * 20), (3, 3 * 20)])
def test_decode_cells_of_shared_prompts_prefill_each_prompt_once(
    models: dict[str, Any], n: int, prefilled: int
) -> None:
    """7 sequences at 3 samples a prompt: 3 prompts (3, 3, 1) prefilled, 7 decoded a step."""
    engine = Engine(EngineConfig(model=str(models["tiny"]), dtype="float32", device="cpu"))
    assert measure_decode(engine, 7, 20, 3, seed=0, samples_per_prompt=n) > 0
    prefills = [r for r in engine.timeline if r.is_prefill]
    assert sum(r.num_tokens for r in prefills) == prefilled
    assert [r.num_tokens for r in engine.timeline if not r.is_prefill] == [7, 7, 7]
    with pytest.raises(ValueError, match="samples_per_prompt must be >= 1, got 0"):
        ProfileGrid(samples_per_prompt=0)


def test_verify_cells_carry_their_query_length_and_price_the_extra_tokens(
    models: dict[str, Any],
) -> None:
    """A verify cell's timed steps carry batch x q query tokens (FixedDrafts), the engine's own
    drafter (none) comes back after, and a grid with query_lens writes verify rows that fit
    into non-negative prices of verifying and of each extra token (the clock is this thread's CPU time)."""
    engine = Engine(EngineConfig(model=str(models["tiny"]), dtype="float32", device="cpu"))
    assert measure_verify(engine, 3, 20, 4, 3, seed=0) > 0
    decodes = [r.num_tokens for r in engine.timeline if not r.is_prefill]
    assert decodes[:3] == [12, 12, 12] and engine.drafter is None
    assert engine.scheduler.drafter is None and engine.stats().get("spec_drafted_tokens") is None
    grid = ProfileGrid(
        batch_sizes=(1, 4),
        contexts=(16,),
        prefill_tokens=(8,),
        prefill_seqs=(1,),
        decode_steps=3,
        passes=1,
        warmup_steps=2,
        query_lens=(3,),
        clock="cpu",
    )
    profile = profile_single(EngineConfig(model=str(models["tiny"]), dtype="float32"), grid)
    assert {(r.batch, r.query_len) for r in profile.verify} == {(1, 3), (4, 3)}
    assert min(LatencyModel.fit(profile).verify_s[1]) >= 0.0
    assert grid.max_model_len == 16 + 3 * 3 + 1
    with pytest.raises(ValueError, match=r"query_lens must be integers > 1, got \(1,\)"):
        ProfileGrid(query_lens=(1,))


def _profile_body(rank: int, world_size: int, model: str) -> str | None:
    base = EngineConfig(model=model, dtype="float32", device="cpu")
    grid = quick_grid((1, world_size))
    profile = profile_distributed(base, grid, dist.group.WORLD, wait_timeout_s=120)
    return None if profile is None else profile.model_dump_json()


@pytest.mark.multirank
def test_quick_profile_tp1_and_tp2_on_two_ranks(models: dict[str, Any]) -> None:
    results = run_ranks(_profile_body, world_size=2, args=(str(models["tiny"]),), timeout_s=240)
    assert results[1] is None  # rank 0 speaks for the job
    profile = Profile.model_validate_json(results[0])

    grid = quick_grid((1, 2))
    assert profile.hardware.num_devices == 2 and profile.hardware.interconnect == "gloo"
    assert profile.tp_sizes == [1, 2]
    cells = {(r.tp, r.batch, r.context_tokens) for r in profile.decode}
    assert cells == _expected_decode_cells(grid, 1) | _expected_decode_cells(grid, 2)
    assert sorted((r.tp, r.num_seqs, r.tokens) for r in profile.prefill) == sorted(
        (tp, *cell) for tp in (1, 2) for cell in grid.prefill_cells()
    )
    ops = {(r.op, r.group_size) for r in profile.collectives}
    assert ops == {(op, 2) for op in COLLECTIVE_OPS}
    gathered = sorted(r.nbytes for r in profile.collectives if r.op == "all_gather")
    assert gathered == sorted(max(8, n) for n in grid.collective_bytes)  # 2 ranks x >= 1 float
    latency = _check_fits(profile)
    for op in COLLECTIVE_OPS:
        assert latency.collective_time(op, 1 << 16, 2) > 0
    # the fixed price of a switch, both ways, measured on an engine with nothing in flight,
    # then with the grid's largest batch in flight across the world (prompt + 1 token of KV)
    assert sorted({(r.src_tp, r.dst_tp) for r in profile.switches}) == [(1, 2), (2, 1)]
    empty = [r for r in profile.switches if r.num_seqs == 0]
    assert latency.switch_time(1, 2, 2) >= 0 and latency.switch_per_seq_time(1, 2) >= 0
    loaded = [r for r in profile.switches if r.num_seqs]
    assert len(empty) == 4 and len(loaded) == 12
    largest, short, long = max(grid.batch_sizes), min(grid.contexts), max(grid.contexts)
    loads = {(r.num_seqs, r.context_tokens) for r in loaded}
    assert loads == {
        (largest // 4, largest // 4 * (short + 1)),
        (largest, largest * (short + 1)),
        (largest // 4, largest // 4 * (long + 1)),
    }
    assert set(latency.switch_per_seq_s) == set(latency.switch_per_token_s) == {(1, 2), (2, 1)}
    assert profile.model.num_params == models["tiny_params"]
