"""Every tensor collective of the multi-rank flows would be accepted by NCCL: run under
`check_collective_devices` (patrl.tpreshard.device_check), where a collective given a tensor the
code put on the host on purpose raises. Flows: a TP 2 engine generating (agreement check, seed
broadcast), a live reconfigure 1 -> 2 -> 1 with a weight sync (folds, the way back), the
profiler's collective timings, and a 2-rank FSDP trainer step."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from patrl.rollout.adaptive import reconfigure
from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.loader import iter_checkpoint
from patrl.rollout.profile import COLLECTIVE_OPS, measure_collective
from patrl.rollout.sampler import SamplingParams
from patrl.tpreshard import GroupCache, ParallelLayout
from patrl.tpreshard.device_check import (
    CollectiveDeviceError,
    check_collective_devices,
    check_tensors,
    is_host_tensor,
)
from patrl_testkit.models import save_hf_model, tiny_config, tiny_hf_model
from patrl_testkit.multirank import run_ranks

pytestmark = pytest.mark.multirank

SAMPLED = SamplingParams(temperature=1.0, n=2, max_tokens=6, ignore_eos=True)  # no seed


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_model(tiny_hf_model("llama"), tmp_path_factory.mktemp("llama_devices"))


def _config(model_dir: str) -> EngineConfig:
    return EngineConfig(model=model_dir, block_size=4, num_kv_blocks=96, max_model_len=96)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in (5, 11, 8)]


def test_the_mode_tells_host_tensors_from_device_tensors() -> None:
    device = torch.device("cpu")  # the compute device of a CPU run
    with check_collective_devices():
        weights = torch.ones(3, device=device)
        on_device = weights * 2
        assert not is_host_tensor(on_device)
        assert not is_host_tensor(torch.zeros(2, device=device).double())
        for host in (on_device.cpu(), torch.zeros(3), torch.tensor([1]), on_device.to("cpu")):
            assert is_host_tensor(host)
            assert is_host_tensor(host.clone() + 1)  # computed from host tensors only
            with pytest.raises(CollectiveDeviceError):
                check_tensors("test", host)
        assert not is_host_tensor(torch.zeros(3).to(device))
        check_tensors("test", on_device)
    check_tensors("test", torch.zeros(1))  # off outside the mode


def _engine_tp2(rank: int, world_size: int, model_dir: str, comm: str) -> list[Any]:
    with check_collective_devices():
        if comm == "shm":
            layout = GroupCache([2], world_size=world_size, rank=rank).layout(2)
        else:
            group = dist.new_group(list(range(world_size)))
            layout = ParallelLayout(tp_size=2, tp_rank=rank, tp_group=group)
        engine = Engine(_config(model_dir), layout)
        seeded = dataclasses.replace(SAMPLED, seed=3)
        out = engine.generate(_prompts(), seeded)  # the ranks' agreement checked each step
        out += engine.generate(_prompts(), SAMPLED)  # and the seeds drawn by rank 0
        return [[c.token_ids for c in o.outputs] for o in out]


@pytest.mark.parametrize("comm", ["process_group", "shm"])
def test_tp2_engine_generates_with_device_tensors(llama_dir: Path, comm: str) -> None:
    per_rank = run_ranks(_engine_tp2, 2, args=(str(llama_dir), comm), timeout_s=240)
    assert per_rank[0] == per_rank[1]


def _reconfigure(rank: int, world_size: int, model_dir: str) -> list[Any]:
    with check_collective_devices():
        groups = GroupCache([1, 2], world_size=world_size, rank=rank, tp_comm="process_group")
        engine = Engine(_config(model_dir), groups.layout(1), groups)
        for i, prompt in enumerate(_prompts()):
            engine.add_request(prompt, SAMPLED, request_id=f"r{rank}-{i}")
        done: dict[str, Any] = {}
        for _ in range(3):
            done.update({out.request_id: out for out in engine.step()})
        reconfigure(engine, 2, "migrate")  # a fold: KV moves, weights re-cut
        engine.load_weights(list(iter_checkpoint(model_dir)), version=2)  # weight sync at TP 2
        reconfigure(engine, 1)  # the way back: `_all_kept` over the TP group
        reconfigure(engine, 2, "recompute")
        for _ in range(2):  # decode at TP 2: the ranks' agreement check
            done.update({out.request_id: out for out in engine.step()})
        reconfigure(engine, 1)
        while engine.has_unfinished():
            done.update({out.request_id: out for out in engine.step()})
        return sorted(done)  # the requests this rank's replica finished


def test_live_reconfigure_and_weight_sync_use_device_tensors(llama_dir: Path) -> None:
    per_rank = run_ranks(_reconfigure, 2, args=(str(llama_dir),), timeout_s=300)
    assert sorted(per_rank[0] + per_rank[1]) == [f"r{r}-{i}" for r in range(2) for i in range(3)]


def _profile_collectives(rank: int, world_size: int) -> list[int]:
    with check_collective_devices():
        group = dist.new_group(list(range(world_size)))
        layout = ParallelLayout(tp_size=2, tp_rank=rank, tp_group=group)
        device = torch.device("cpu")
        return [measure_collective(op, 256, layout, 2, device=device)[1] for op in COLLECTIVE_OPS]


def test_profiled_collectives_use_device_tensors() -> None:
    per_rank = run_ranks(_profile_collectives, 2, timeout_s=120)
    assert per_rank[0] == per_rank[1]


def _trainer_step(rank: int, world_size: int) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh

    from patrl.trainer import PolicyBatch, Trainer, TrainerConfig

    with check_collective_devices():
        config = TrainerConfig.model_validate({"optim": {"lr": 1e-3}, "use_kl_loss": True})
        model = tiny_config("llama", "plain", vocab_size=128, tie_word_embeddings=False)
        trainer = Trainer(config, model, mesh=init_device_mesh("cpu", (world_size,)))
        g = torch.Generator().manual_seed(0)
        lengths = [3, 7, 2, 5]
        batch = PolicyBatch.from_responses(
            [torch.randint(0, 128, (4,), generator=g).tolist() for _ in lengths],
            [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths],
            [1.0, -1.0, 0.5, -0.5],
        )
        return trainer.train_step(batch)


def test_trainer_step_reduces_device_tensors() -> None:
    per_rank = run_ranks(_trainer_step, 2, timeout_s=240)
    # Bit-equal: the metric is all-reduced, and every rank receives the same reduced bits.
    assert per_rank[0]["actor/pg_loss"] == per_rank[1]["actor/pg_loss"]


def _sum_a_tensor_made_on(rank: int, world_size: int, device: torch.device | None) -> float:
    t = torch.ones(1) if device is None else torch.ones(1, device=device)
    dist.all_reduce(t)
    return float(t[0])


@pytest.mark.multirank
def test_run_ranks_checks_collective_devices_when_the_environment_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PATRL_CHECK_COLLECTIVE_DEVICES=1 runs any multi-rank test under the check: a tensor made
    without a device fails its collective, one made on the compute device passes."""
    from patrl_testkit.multirank import CHECK_DEVICES_ENV, RankFailed

    assert run_ranks(_sum_a_tensor_made_on, world_size=2, args=(None,)) == [2.0, 2.0]
    monkeypatch.setenv(CHECK_DEVICES_ENV, "1")
    on_device = (torch.device("cpu"),)
    assert run_ranks(_sum_a_tensor_made_on, world_size=2, args=on_device) == [2.0, 2.0]
    with pytest.raises(RankFailed, match="given a host tensor"):
        run_ranks(_sum_a_tensor_made_on, world_size=2, args=(None,))
