"""Live reconfiguration: a run that changes (dp, tp) mid-generation gives the tokens of a run
that never did; migrated KV equals a fresh prefill's; re-cut weights equal a fresh load's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from patrl.rollout.adaptive import WayBack, reconfigure
from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.loader import iter_checkpoint
from patrl.rollout.sampler import SamplingParams
from patrl.rollout.transfer import state_of
from patrl.tpreshard import GroupCache, has_full
from patrl.tpreshard import reshard as reshard_module
from patrl_testkit.models import save_hf_model, tiny_hf_model
from patrl_testkit.multirank import run_ranks

pytestmark = pytest.mark.multirank

GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(tiny_hf_model("llama"), tmp_path_factory.mktemp("llama_reconfig"))


def _config(model_dir: str) -> EngineConfig:
    return EngineConfig(model=model_dir, block_size=4, num_kv_blocks=96, max_model_len=96)


def _workload(dp_rank: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Per replica: two greedy requests and one sampled request of two samples."""
    g = torch.Generator().manual_seed(100 + dp_rank)
    out = []
    for i, (n, params) in enumerate(((5, GREEDY), (11, SAMPLED), (8, GREEDY))):
        out.append((f"d{dp_rank}-{i}", torch.randint(0, 250, (n,), generator=g).tolist(), params))
    return out


def _add(engine: Engine) -> None:
    for rid, prompt, params in _workload(engine.layout.dp_rank):
        engine.add_request(prompt, params, request_id=rid)


def _drain(engine: Engine, done: dict[str, Any], steps: int | None = None) -> None:
    n = 0
    while engine.has_unfinished() and (steps is None or n < steps):
        for out in engine.step():
            done[out.request_id] = [c.token_ids for c in out.outputs]
        n += 1


def _everyone(done: dict[str, Any]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, done)
    return {k: v for p in parts for k, v in p.items()}


def _fresh_prefill_diff(engine: Engine, model_dir: str) -> tuple[float, bool]:
    """Max |KV diff| of the engine's running samples vs a fresh engine's prefill of the same
    tokens at the same layout, and whether the engine's weights equal that fresh load's."""
    fresh = Engine(_config(model_dir), engine.layout)
    same_weights = all(
        torch.equal(a, b)
        for a, b in zip(engine.model.parameters(), fresh.model.parameters(), strict=True)
    )
    running = list(engine.scheduler.running)
    fresh.import_requests([state_of(s, None) for s in running])
    while fresh.scheduler.waiting:  # prefill every imported sample (siblings a step later,
        fresh.step()  # sharing their prompt's cached blocks)
    worst = 0.0
    by_key = {(s.request_id, s.sample_index): s for s in fresh.scheduler.running}
    for seq in running:
        mine = engine.cache.export(seq.seq_id)
        twin = fresh.cache.export(by_key[(seq.request_id, seq.sample_index)].seq_id)
        n = mine.num_computed
        assert n > 0 and twin.head_start == mine.head_start
        worst = max(worst, (mine.k - twin.k[:, :n]).abs().max().item())
        worst = max(worst, (mine.v - twin.v[:, :n]).abs().max().item())
    return worst, same_weights


def _sync_probe(engine: Engine, model_dir: str) -> bool:
    """After a weight sync at the engine's current layout, are its tokens on a probe batch
    those of an engine freshly loaded at that layout and synced the same way, and its
    logprobs within 1e-5 of them? Not bit-equal: a fold may leave a weight a strided view
    of its storage, which a CPU GEMM may reduce in another order than a contiguous copy."""
    sync = [(name, t * 0.5) for name, t in iter_checkpoint(model_dir)]
    fresh = Engine(_config(model_dir), engine.layout)
    engine.load_weights(sync, version=2)
    fresh.load_weights(sync, version=2)
    probe = [[5, 6, 7, 8], [9, 10]]
    a, b = engine.generate(probe, GREEDY), fresh.generate(probe, GREEDY)
    got, want = [c for o in a for c in o.outputs], [c for o in b for c in o.outputs]
    return [c.token_ids for c in got] == [c.token_ids for c in want] and all(
        x.logprobs == pytest.approx(y.logprobs, rel=1e-5, abs=1e-5)
        for x, y in zip(got, want, strict=True)
    )


def _sharded_storages(engine: Engine) -> dict[str, int]:
    return {
        n: p.untyped_storage().data_ptr()
        for n, p in engine.model.named_parameters()
        if getattr(p, "shard_spec", None) is not None and p.shard_spec.dim is not None
    }


def _kept_storages(engine: Engine) -> dict[str, int]:
    """The storage of the full tensor a fold kept beside each sharded weight."""
    return {
        n: getattr(p, reshard_module._FULL).untyped_storage().data_ptr()
        for n, p in engine.model.named_parameters()
        if getattr(p, "shard_spec", None) is not None and p.shard_spec.dim is not None
    }


def _live(
    rank: int,
    world_size: int,
    model_dir: str,
    path: list[int],
    policy: str,
    at_step: int,
    sync_check: bool = False,
    keep_full: bool = True,
) -> dict[str, Any]:
    groups = GroupCache(path, world_size=world_size, rank=rank)
    created = groups.num_created
    new_group = dist.new_group

    def no_new_groups(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a process group was created after start-up")

    config = _config(model_dir).model_copy(update={"keep_full_weights": keep_full})
    engine = Engine(config, groups.layout(path[0]), groups)
    dist.new_group = no_new_groups  # type: ignore[assignment]
    try:
        reference: dict[str, Any] = {}
        _add(engine)
        _drain(engine, reference)
        live: dict[str, Any] = {}
        _add(engine)
        checks = []
        reports = []
        kept = []  # per move from tp 1: every sharded weight's full tensor kept where it was
        for tp in path[1:]:
            _drain(engine, live, steps=at_step)
            storages = _sharded_storages(engine)
            from_tp1 = engine.layout.tp_size == 1
            reports.append(reconfigure(engine, tp, policy))
            if from_tp1 and keep_full:
                kept.append(_kept_storages(engine) == storages)
            elif from_tp1:  # cut inside each weight's own storage, nothing kept beside it
                kept.append(_sharded_storages(engine) == storages and not has_full(engine.model))
            assert engine.layout.tp_size == tp
            if policy == "migrate" and engine.scheduler.running:
                checks.append(_fresh_prefill_diff(engine, model_dir))
        _drain(engine, live)
        synced = _sync_probe(engine, model_dir) if sync_check else None
        unfolded = None
        if sync_check and path[0] == 1:
            # the sync wrote into the shards: the full weights a fold kept are stale, so the
            # way back gathers the synced ones instead of taking those
            reconfigure(engine, 1)
            fresh = Engine(_config(model_dir), engine.layout)
            fresh.load_weights([(n, t * 0.5) for n, t in iter_checkpoint(model_dir)], version=2)
            unfolded = all(
                torch.equal(a, b)
                for a, b in zip(engine.model.parameters(), fresh.model.parameters(), strict=True)
            )
    finally:
        dist.new_group = new_group  # type: ignore[assignment]
    assert groups.num_created == created
    return {
        "reference": _everyone(reference),
        "live": _everyone(live),
        "checks": checks,
        "synced": synced,
        "unfolded": unfolded,
        "kept": kept,
        "migrated": [r.num_migrated for r in reports],
        "recomputed": [r.tokens_recomputed for r in reports],
    }


def _assert_same_tokens(results: list[dict[str, Any]]) -> None:
    ref = results[0]["reference"]
    assert ref
    for r in results:
        assert r["reference"] == ref
        assert r["live"] == ref


def test_merge_dp2_tp1_to_tp2_with_migrate(llama_dir: Path) -> None:
    results = run_ranks(_live, 2, args=(str(llama_dir), [1, 2], "migrate", 4, True), timeout_s=300)
    _assert_same_tokens(results)
    assert all(r["synced"] is True and r["unfolded"] is True for r in results)
    assert len(results[0]["reference"]) == 6  # 3 requests on each of the 2 replicas
    for r in results:
        assert r["kept"] == [True]  # the fold kept every full weight, for a free way back
        assert r["migrated"][0] > 0
        for diff, same_weights in r["checks"]:
            assert diff <= 1e-5
            assert same_weights


def test_merge_without_keeping_the_full_weights_cuts_them_in_place(llama_dir: Path) -> None:
    # EngineConfig.keep_full_weights=False: less memory while folded; the same tokens, and the
    # sync and the way back still right (by a gather)
    args = (str(llama_dir), [1, 2], "migrate", 4, True, False)
    results = run_ranks(_live, 2, args=args, timeout_s=300)
    _assert_same_tokens(results)
    for r in results:
        assert r["kept"] == [True] and r["synced"] is True and r["unfolded"] is True


def test_merge_dp2_tp1_to_tp2_with_recompute(llama_dir: Path) -> None:
    results = run_ranks(_live, 2, args=(str(llama_dir), [1, 2], "recompute", 4), timeout_s=300)
    _assert_same_tokens(results)
    assert all(r["migrated"] == [0] and r["recomputed"][0] > 0 for r in results)


def test_split_dp1_tp2_to_dp2_tp1_with_migrate(llama_dir: Path) -> None:
    results = run_ranks(_live, 2, args=(str(llama_dir), [2, 1], "migrate", 4, True), timeout_s=300)
    _assert_same_tokens(results)
    for r in results:
        assert r["synced"] is True
        assert r["checks"], "no sample was running at the reconfiguration"
        for diff, same_weights in r["checks"]:
            assert diff <= 1e-5
            assert same_weights


def test_dp4_tp1_to_dp2_tp2_to_dp1_tp4_with_migrate(llama_dir: Path) -> None:
    # At tp 4 the model's 2 KV heads are replicated: each head goes to two ranks.
    results = run_ranks(_live, 4, args=(str(llama_dir), [1, 2, 4], "migrate", 3), timeout_s=500)
    _assert_same_tokens(results)
    assert len(results[0]["reference"]) == 12
    for r in results:
        assert r["kept"] == [True]
        assert len(r["checks"]) == 2
        for diff, same_weights in r["checks"]:
            assert diff <= 1e-5
            assert same_weights


def _bad_sync_after_fold(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    groups = GroupCache([1, 2], world_size=world_size, rank=rank)
    engine = Engine(_config(model_dir), groups.layout(1), groups)
    reconfigure(engine, 2)  # a fold: the full weights are kept
    way_back = WayBack(engine)
    way_back.later(groups.layout(1))  # as after an adaptive rollout
    try:
        way_back.load_weights([("model.norm.weight", torch.zeros(65))], version=1)
        message = ""
    except ValueError as e:
        message = str(e)
    probe = [[5, 6, 7, 8], [9, 10]]
    got = engine.generate(probe, GREEDY)
    want = Engine(_config(model_dir)).generate(probe, GREEDY)
    dist.barrier()
    return {
        "message": message,
        "tp": engine.layout.tp_size,
        "version": engine.weight_version,
        "same": [c.token_ids for o in got for c in o.outputs]
        == [c.token_ids for o in want for c in o.outputs],
    }


def test_a_bad_weight_sync_after_a_fold_leaves_a_working_engine_at_tp1(llama_dir: Path) -> None:
    # The sync pays the return from the kept full weights first, then loads: a tensor that
    # does not fit raises, naming both shapes, and the engine is whole at tp 1, unchanged.
    for r in run_ranks(_bad_sync_after_fold, 2, args=(str(llama_dir),), timeout_s=300):
        assert "(64,)" in r["message"] and "(65,)" in r["message"]
        assert r["tp"] == 1 and r["version"] == 0 and r["same"]


def _shared_prompt_fold(
    rank: int, world_size: int, model_dir: str, prefix_caching: bool
) -> dict[str, Any]:
    """Each replica: 4 samples of one 24-token prompt, folded into TP=2 after 3 steps."""
    groups = GroupCache([1, 2], world_size=world_size, rank=rank)
    config = _config(model_dir).model_copy(update={"enable_prefix_caching": prefix_caching})
    engine = Engine(config, groups.layout(1), groups)
    g = torch.Generator().manual_seed(300 + rank)
    prompt = torch.randint(0, 250, (24,), generator=g).tolist()
    params = SamplingParams(temperature=1.0, seed=7 + rank, n=4, max_tokens=12, ignore_eos=True)
    reference: dict[str, Any] = {}
    engine.add_request(prompt, params, request_id=f"p{rank}")
    _drain(engine, reference)
    live: dict[str, Any] = {}
    engine.add_request(prompt, params, request_id=f"p{rank}")
    _drain(engine, live, steps=3)
    report = reconfigure(engine, 2, "migrate")
    running = len(engine.scheduler.running)  # imported with their KV, none left to recompute
    _drain(engine, live)
    sent: list[int] = [0] * world_size
    dist.all_gather_object(sent, report.kv_bytes_sent)
    return {
        "reference": _everyone(reference),
        "live": _everyone(live),
        "sent": sum(sent),
        "full": sum(c.migrate_bytes for c in report.costs),  # every sample's whole KV
        "migrated": report.num_migrated,
        "running": running,
    }


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_samples_of_one_prompt_send_its_kv_once(llama_dir: Path, prefix_caching: bool) -> None:
    """Of a prompt's 4 samples crossing ranks, the first sends its whole KV and the others
    only what follows the prompt's 24 tokens (6 full blocks), which the receiver's prefix
    cache holds by the time it imports them; without a prefix cache all of it is sent. The
    tokens are those of the uninterrupted run either way."""
    results = run_ranks(
        _shared_prompt_fold, 2, args=(str(llama_dir), prefix_caching), timeout_s=300
    )
    _assert_same_tokens(results)
    r = results[0]
    assert r["migrated"] == 8 and r["full"] > 0
    assert all(x["running"] == 8 for x in results)
    if prefix_caching:
        # per crossing: one sample's 26 tokens, three samples' 2 tokens each
        assert r["sent"] == r["full"] * (26 + 3 * 2) // (4 * 26)
    else:
        assert r["sent"] == r["full"]
