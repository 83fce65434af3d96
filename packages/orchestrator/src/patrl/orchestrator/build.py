"""Building a job's parts, the same for both schedules: seeds, data, the rollout engine and the
trainer's config."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from patrl.lenpredict import LengthPredictor, Profile, usable_tp_sizes
from patrl.orchestrator.config import JobConfig, resolve_schedule
from patrl.orchestrator.data import PromptDataset, PromptLoader, dataset_for
from patrl.orchestrator.distributed import World
from patrl.orchestrator.latency_profile import (
    cache_root,
    ensure_profile,
    job_grid,
    keep_run_profile,
    spec_query_lens,
)
from patrl.orchestrator.topology import record_topology
from patrl.rollout import AdaptiveTP, EngineConfig, RolloutEngine, make_engine
from patrl.rollout.config import SpeculativeConfig
from patrl.rollout.loader import read_config
from patrl.rollout.model_config import ModelArch
from patrl.tpreshard.groups import GroupCache
from patrl.trainer import CriticConfig, TrainerConfig


@dataclass(slots=True)
class JobData:
    """The tokenizer, the prompt sets and the loader that draws each step's prompts, and the
    job's config with the run's length resolved (`resolve_schedule`) on this train set."""

    config: JobConfig
    tokenizer: Any
    train_set: PromptDataset
    val_set: PromptDataset | None
    loader: PromptLoader


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_data(
    config: JobConfig, model_dir: str, train_files: Any, val_files: Any, announce: bool = False
) -> JobData:
    """The job's prompts, tokenized with the model's tokenizer (no validation set without
    `val_files`); `announce` prints each set's size and what was filtered. The config comes
    back as it is where its run's length is resolved already (preflight read the train set),
    else resolved on the train set loaded here: the one place a job's length is fixed after
    preflight."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    train_set = dataset_for(config, tokenizer, train_files)
    val_set = dataset_for(config, tokenizer, val_files, validation=True) if val_files else None
    if announce:
        for name, ds in (("train", train_set), ("validation", val_set)):
            if ds is not None:
                print(
                    f"{name}: {len(ds)} prompts, {ds.num_filtered_overlong} of {ds.num_rows} "
                    f"filtered as longer than data.max_prompt_length={config.data.max_prompt_length}"
                )
    loader = PromptLoader(
        train_set.items,
        config.data.train_batch_size,
        shuffle=config.data.shuffle,
        seed=config.data.seed,
    )
    if not config.schedule_resolved:
        config = resolve_schedule(config, len(train_set))
    return JobData(config, tokenizer, train_set, val_set, loader)


def trainer_config(config: JobConfig) -> TrainerConfig:
    """The trainer's settings: the `actor.*` keys it knows, and the run's seed; with
    `actor.use_dynamic_bsz` (verl's meaning) micro-batches are cut by tokens alone."""
    fields = TrainerConfig.model_fields
    values = {k: v for k, v in config.actor.model_dump().items() if k in fields}
    values["seed"] = config.trainer.seed
    if config.actor.use_dynamic_bsz:
        values["ppo_micro_batch_size_per_gpu"] = None
    if values.get("loss_scale_factor") is None:  # verl pads responses to this length
        values["loss_scale_factor"] = float(config.data.max_response_length)
    values["lora"] = lora_settings(config)
    return TrainerConfig(**values)


LORA_KEYS = ("lora_rank", "lora_alpha", "target_modules", "exclude_modules", "lora_adapter_path")


def lora_settings(config: JobConfig) -> dict[str, Any]:
    """The trainer's `lora` section from verl's `model.lora_*` keys."""
    return {k: getattr(config.model, k) for k in LORA_KEYS}


def starts_from_adapter(config: JobConfig) -> bool:
    """Whether a fresh run's policy is not what the engine loads from `model.path` (the base
    with zero adapters): LoRA from `model.lora_adapter_path`, which the engine gets by a sync
    before the first rollout."""
    return config.model.lora_rank > 0 and config.model.lora_adapter_path is not None


def engine_lora(config: JobConfig) -> dict[str, Any]:
    """EngineConfig's LoRA fields: adapters on the projections a target list names (their last
    name component); on all of them for 'all-linear' or a regex (an untargeted one's B stays
    zero, so it adds nothing); merged mode from `model.lora.merge`."""
    m = config.model
    if m.lora_rank <= 0:
        return {}
    out: dict[str, Any] = {
        "lora_rank": m.lora_rank,
        "lora_alpha": m.lora_alpha,
        "lora_merged": m.lora.merge,
    }
    if isinstance(m.target_modules, list):
        out["lora_target_modules"] = sorted({t.rsplit(".", 1)[-1] for t in m.target_modules})
    return out


# The critic's build, micro-batching and packing follow the actor's unless `critic.*` says.
_CRITIC_FROM_ACTOR = (
    "use_remove_padding",
    "param_dtype",
    "enable_gradient_checkpointing",
    "attn_implementation",
    "max_nonfinite_steps",
    "logprob_chunk_tokens",
)


def critic_config(config: JobConfig) -> CriticConfig:
    """The critic's trainer settings: `critic.*`, the rest as the actor's, the run's seed."""
    actor, c = config.actor, config.critic
    values = {k: getattr(actor, k) for k in _CRITIC_FROM_ACTOR}
    values.update(
        optim=c.optim,
        grad_clip=c.grad_clip,
        cliprange_value=c.cliprange_value,
        loss_agg_mode=c.loss_agg_mode,
        checkpoint=c.checkpoint,
        ppo_max_token_len_per_gpu=c.ppo_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu,
        # verl: the critic's use_dynamic_bsz follows the actor's
        ppo_micro_batch_size_per_gpu=None
        if actor.use_dynamic_bsz
        else c.ppo_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu,
        seed=config.trainer.seed,
        lora=critic_lora_settings(config),
    )
    return CriticConfig(**values)


def critic_lora_settings(config: JobConfig) -> dict[str, Any]:
    """The critic's `lora` section from verl's `critic.model.lora_*` keys."""
    m = config.critic.model
    return {
        "lora_rank": m.lora_rank,
        "lora_alpha": m.lora_alpha,
        "target_modules": m.target_modules,
    }


# the job's KV budget on CPU when rollout.kv_cache_memory_bytes is None
CPU_KV_CACHE_BYTES = 1 << 29


def kv_cache_bytes(config: JobConfig, world: World) -> int | None:
    """The engine's KV budget: the job's, else on CPU `CPU_KV_CACHE_BYTES`, else None (the
    engine sizes it from rollout.gpu_memory_utilization)."""
    given = config.rollout.kv_cache_memory_bytes
    if given is not None or world.device.type == "cuda":
        return given
    return CPU_KV_CACHE_BYTES


def tp_candidates(
    config: JobConfig, world_size: int, node_size: int, model: str | ModelArch
) -> tuple[int, ...]:
    """The TP sizes adaptive TP may use: `rollout.adaptive_tp.candidates` that divide the world
    and a node (a fold larger than a node would run its per-layer collectives across nodes).
    Left at their default, the candidates the model cannot be split into (its heads, its MLP)
    are dropped too; an explicit choice is kept whole, for preflight to refuse by name."""
    a = config.rollout.adaptive_tp
    usable = usable_tp_sizes(a.candidates, world_size, node_size)
    if "candidates" in a.model_fields_set or len(usable) < 2:
        return usable  # (one size: static TP, whose own check names a size the model refuses)
    spec = model if isinstance(model, ModelArch) else ModelArch.from_hf(read_config(model))
    return tuple(t for t in usable if _splits(spec, t))


def _splits(model: ModelArch, tp: int) -> bool:
    try:
        model.check_tp(tp)
    except ValueError:
        return False
    return True


def engine_config(config: JobConfig, model_dir: str, world: World) -> EngineConfig:
    """The rollout engine of this job; under adaptive TP with its latency profile (measured
    now, every rank taking part, unless cached or given), which also prices speculation
    (`speculation_profile`)."""
    r, d = config.rollout, config.data
    base = EngineConfig(
        model=model_dir,
        dtype=r.dtype,
        device=str(world.device),
        attention_backend=r.attention_backend,
        tp_comm=r.tp_comm,
        block_size=r.block_size,
        num_kv_blocks=r.num_kv_blocks,
        kv_cache_memory_bytes=kv_cache_bytes(config, world),
        gpu_memory_utilization=r.gpu_memory_utilization,
        max_num_seqs=r.max_num_seqs,
        max_num_batched_tokens=r.max_num_batched_tokens,
        max_model_len=d.max_prompt_length + d.max_response_length,
        enable_prefix_caching=r.enable_prefix_caching,
        enforce_eager=r.enforce_eager,
        keep_full_weights=r.adaptive_tp.keep_full_weights,
        speculative=r.speculative.model_dump(),
        **engine_lora(config),
    )
    a = r.adaptive_tp
    candidates = tp_candidates(config, world.size, world.node_size, model_dir)
    if not a.enable or len(candidates) < 2:
        if a.enable and not world.distributed:
            # one process has nothing to fold; its TP-1 profile is for the simulator
            profile = a.profile or job_profile(config, model_dir, base, world, (1,))
            keep_run_profile(profile, config.run_dir, world)
            return with_speculation_profile(config, base, profile)
        if a.enable and world.is_first:
            print(
                f"rollout.adaptive_tp: candidates {list(a.candidates)} leave fewer than two TP sizes "
                f"dividing the world size {world.size} and the {world.node_size} ranks per "
                "node; running static TP"
            )
        return with_speculation_profile(config, base, None)
    profile = a.profile or job_profile(config, model_dir, base, world, candidates)
    keep_run_profile(profile, config.run_dir, world)
    engine = with_speculation_profile(config, base, profile)
    return engine.model_copy(update={"tp_policy": a.policy(candidates, profile)})


def speculation_profile(config: JobConfig, job_profile: str | None) -> str | None:
    """The latency profile that prices the engine's drafts: `rollout.speculative
    .latency_profile` if set, else the job's own (adaptive TP's) `job_profile` when it has
    verify rows, else None (the drafter drafts whenever the batch is small enough)."""
    spec = config.rollout.speculative
    if not spec.enable:
        return None
    if spec.latency_profile is not None:
        return spec.latency_profile
    if job_profile is not None and Profile.load(job_profile).verify:
        return str(job_profile)
    return None


def with_speculation_profile(
    config: JobConfig, engine: EngineConfig, job_profile: str | None
) -> EngineConfig:
    """`engine` with `speculation_profile` as its speculation's latency profile."""
    path = speculation_profile(config, job_profile)
    if path is None:
        return engine
    spec = engine.speculative.model_copy(update={"latency_profile": path})
    return engine.model_copy(update={"speculative": spec})


def job_profile(
    config: JobConfig, model_dir: str, base: EngineConfig, world: World, tp_sizes: tuple[int, ...]
) -> str:
    """The cached profile of this job's shape at `tp_sizes`, measured now if not cached; a
    speculating job's has verify rows too (`spec_query_lens`), measured with the engine's own
    drafter off (the profiler drafts for them itself)."""
    r, d = config.rollout, config.data
    per_replica = -(-d.train_batch_size // world.size) * r.n
    spec = r.speculative
    query_lens = spec_query_lens(spec.num_speculative_tokens) if spec.enable else ()
    grid = job_grid(tp_sizes, per_replica, d.max_prompt_length + d.max_response_length, query_lens)
    plain = base.model_copy(update={"speculative": SpeculativeConfig()})
    return str(ensure_profile(model_dir, plain, world, grid, cache_root()))


def build_engine(
    config: JobConfig,
    model_dir: str,
    world: World,
    lengths: LengthPredictor | None = None,
    span_world: bool = True,
) -> RolloutEngine:
    """This rank's rollout engine. With `span_world` (the sync schedule) its TP groups are cut
    from the whole world, every rank making every group at once; without (an async rollout
    rank) it runs on this rank alone. `lengths` feeds adaptive TP's planner."""
    engine = engine_config(config, model_dir, world)
    adaptive = isinstance(engine.tp_policy, AdaptiveTP)
    tp_sizes = (
        list(engine.tp_policy.candidates)
        if isinstance(engine.tp_policy, AdaptiveTP)
        else [config.rollout.tensor_model_parallel_size]
    )
    groups = (
        GroupCache(tp_sizes, world_size=world.size, rank=world.rank, tp_comm=config.rollout.tp_comm)
        if span_world and world.distributed
        else None
    )
    if groups is not None:
        record_topology(world, groups, config.run_dir)
    return make_engine(
        engine,
        None if adaptive or groups is None else groups.layout(tp_sizes[0]),
        groups,
        lengths=lengths if adaptive else None,
    )
