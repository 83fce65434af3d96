"""verl's key paths, read as patrl's: the one table of what a verl command line means here.

A verl key reaches patrl's config in two moves. Its section is renamed (`SECTIONS`:
`actor_rollout_ref.actor.*` -> `actor.*`, `actor_rollout_ref.rollout.*` -> `rollout.*`,
`actor_rollout_ref.model.*` -> `model.*`, `actor_rollout_ref.ref.*` -> `ref.*`); then a
path that is not one of patrl's own keys is looked up in `RULES`:

- `Alias`: the same setting under patrl's name (`actor.optim.warmup_style` is
  `actor.optim.lr_scheduler_type`);
- `Fixed`: patrl always behaves as verl does at the listed values; those are accepted silently,
  any other value is refused, saying why and what to use instead;
- `Noted`: accepted with no effect here, with a one-line notice of why.

Paths that are patrl's own keys after the section rename (`actor.optim.lr`, `rollout.n`, ...)
need no rule: same name, same meaning. `custom_reward_function.{path,name}` become a
`reward.functions` entry (`finish`). The table is listed in docs/verl.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SECTIONS = {
    "actor_rollout_ref.actor": "actor",
    "actor_rollout_ref.rollout": "rollout",
    "actor_rollout_ref.model": "model",
    "actor_rollout_ref.ref": "ref",
}


class UnsupportedKey(ValueError):
    """A verl key (or value) patrl knows and does not support; the message says why."""


@dataclass(frozen=True, slots=True)
class Alias:
    """verl's key is patrl's `target` (dotted)."""

    target: str


@dataclass(frozen=True, slots=True)
class Fixed:
    """patrl behaves as verl does with the key at one of `values`: those pass silently, any
    other value is refused with `why` and `use`."""

    values: tuple[Any, ...]
    why: str
    use: str


@dataclass(frozen=True, slots=True)
class Noted:
    """Accepted without effect; a notice says `why`, except for the `quiet` values (those that
    ask for what patrl does anyway)."""

    why: str
    quiet: tuple[Any, ...] = ()


Rule = Alias | Fixed | Noted

_NO_OFFLOAD = (
    "patrl's FSDP2 trainer keeps parameters and optimizer state on the device",
    "more ranks (FSDP2 shards the model over all of them), "
    "actor.enable_gradient_checkpointing=true, and rollout.free_cache_engine / "
    "rollout.offload_weights (the engine's memory is freed during the update)",
)
_STRATEGY = Fixed(
    ("fsdp", "fsdp2"),
    "patrl trains with FSDP2 (both fsdp and fsdp2 mean that here)",
    "strategy=fsdp2, or leave it unset",
)
_LOGPROB_BATCHES = Noted(
    "patrl computes old and reference logprobs with the actor's micro-batches "
    "(actor.ppo_max_token_len_per_gpu tokens, at most actor.ppo_micro_batch_size_per_gpu samples)"
)
_OWN_ENGINE = "patrl generates with its own engine (patrl.rollout), in the training processes"
_NO_RAY = Noted("patrl runs under torchrun without Ray")
_PERF_KNOB = Noted("a kernel/compile option of verl's workers; patrl's trainer has its own")


def _optim_rules(section: str) -> dict[str, Rule]:
    trainer = section.removesuffix(".optim")
    return {
        f"{section}.warmup_style": Alias(f"{section}.lr_scheduler_type"),
        f"{section}.clip_grad": Alias(f"{trainer}.grad_clip"),
        f"{section}.optimizer": Fixed(("AdamW",), "patrl's optimizer is AdamW", "AdamW"),
        f"{section}.optimizer_impl": Fixed(
            ("torch.optim",), "patrl's optimizer is torch.optim.AdamW", "torch.optim"
        ),
        f"{section}.num_cycles": Fixed(
            (0.5,), "patrl's cosine decays over half a cycle (verl's default)", "0.5"
        ),
        f"{section}.override_optimizer_config": Fixed(
            (None, {}), "patrl builds AdamW from the optim keys only", "the optim.* keys"
        ),
    }


def _fsdp_rules(section: str) -> dict[str, Rule]:
    return {
        f"{section}.fsdp_config.param_offload": Fixed((False,), *_NO_OFFLOAD),
        f"{section}.fsdp_config.optimizer_offload": Fixed((False,), *_NO_OFFLOAD),
        f"{section}.fsdp_config.offload_policy": Fixed((False,), *_NO_OFFLOAD),
        f"{section}.fsdp_config.*": Noted(
            "patrl shards every decoder layer, then the root, with FSDP2 (no wrap policy, "
            "no per-key FSDP settings)"
        ),
        f"{section}.strategy": _STRATEGY,
        f"{section}.ulysses_sequence_parallel_size": Fixed(
            (1,),
            "patrl has no sequence parallelism",
            "actor.ppo_max_token_len_per_gpu and gradient checkpointing for long sequences",
        ),
    }


RULES: dict[str, Rule] = {
    # ---- model (actor_rollout_ref.model.*)
    "model.use_remove_padding": Alias("actor.use_remove_padding"),
    "model.enable_gradient_checkpointing": Alias("actor.enable_gradient_checkpointing"),
    "model.external_lib": Fixed(
        (None,),
        "patrl loads Llama, Qwen2 and Qwen3 checkpoints itself",
        "a model of a supported family",
    ),
    "model.trust_remote_code": Noted(
        "patrl's engine and trainer build supported architectures without remote code",
        quiet=(False,),
    ),
    "model.use_shm": Noted("patrl reads the model directory directly", quiet=(False,)),
    "model.use_fused_kernels": _PERF_KNOB,
    "model.use_liger": _PERF_KNOB,
    "model.enable_activation_offload": Fixed((False,), *_NO_OFFLOAD),
    # verl's GSM8K interaction example adds this key with `+` (its Hydra accepts it; nothing
    # reads it: verl's own key is enable_activation_offload)
    "model.enable_activation_offloading": Noted(
        "verl reads no such key (its own is model.enable_activation_offload)"
    ),
    # ---- actor (actor_rollout_ref.actor.*)
    **_fsdp_rules("actor"),
    **_optim_rules("actor.optim"),
    "actor.ppo_micro_batch_size": Fixed(
        (None,),
        "it is verl's deprecated global micro-batch size",
        "actor.ppo_micro_batch_size_per_gpu",
    ),
    "actor.use_torch_compile": _PERF_KNOB,
    "actor.entropy_from_logits_with_chunking": _PERF_KNOB,
    "actor.entropy_checkpointing": _PERF_KNOB,
    # ---- rollout correction (algorithm.rollout_correction.* are patrl's own keys)
    "actor.tis_imp_ratio_cap": Fixed(
        (-1, None),
        "verl replaced it by algorithm.rollout_correction (the same token-level truncated IS, "
        "its weights taken against the rescored old logprobs)",
        "algorithm.rollout_correction.rollout_is=token "
        "algorithm.rollout_correction.rollout_is_threshold=<the cap>",
    ),
    "actor.shuffle": Noted("patrl takes each step's mini-batches in sample order", quiet=(False,)),
    "actor.data_loader_seed": Noted("patrl's mini-batches are not shuffled"),
    # ---- reference policy (actor_rollout_ref.ref.*)
    "ref.log_prob_micro_batch_size_per_gpu": _LOGPROB_BATCHES,
    "ref.log_prob_micro_batch_size": _LOGPROB_BATCHES,
    "ref.log_prob_use_dynamic_bsz": _LOGPROB_BATCHES,
    "ref.log_prob_max_token_len_per_gpu": _LOGPROB_BATCHES,
    "ref.fsdp_config.param_offload": Noted(
        "patrl keeps the frozen reference FSDP2-sharded on the device (1/world of the "
        "weights per rank, no gradients or optimizer state)",
        quiet=(False,),
    ),
    "ref.*": Noted("patrl builds the reference policy as it builds the actor (actor.*)"),
    # ---- rollout (actor_rollout_ref.rollout.*)
    "rollout.name": Noted(_OWN_ENGINE + "; rollout.name is not read"),
    "rollout.mode": Noted(_OWN_ENGINE + " (the RL schedule is trainer.mode)"),
    "rollout.load_format": Noted(
        "patrl's engine loads the checkpoint's safetensors, then receives the trainer's weights"
    ),
    "rollout.layered_summon": Noted("patrl streams weights to the engine bucket by bucket"),
    "rollout.multi_stage_wake_up": Noted(
        "patrl's engine sleeps and wakes in one step (rollout.free_cache_engine)", quiet=(False,)
    ),
    "rollout.log_prob_micro_batch_size_per_gpu": _LOGPROB_BATCHES,
    "rollout.log_prob_micro_batch_size": _LOGPROB_BATCHES,
    "rollout.log_prob_use_dynamic_bsz": _LOGPROB_BATCHES,
    "rollout.log_prob_max_token_len_per_gpu": _LOGPROB_BATCHES,
    "rollout.calculate_log_probs": Noted(
        "patrl's engine always returns the sampled tokens' logprobs", quiet=(False, True)
    ),
    "rollout.enable_chunked_prefill": Noted(
        "patrl's scheduler splits prefills to rollout.max_num_batched_tokens", quiet=(True,)
    ),
    "rollout.disable_log_stats": Noted("patrl's engine logs no stats", quiet=(True,)),
    "rollout.do_sample": Fixed(
        (True,),
        "GRPO/PPO rollouts are sampled",
        "rollout.temperature (> 0); greedy decoding is for validation: rollout.val_kwargs",
    ),
    "rollout.val_kwargs.do_sample": Noted(
        "patrl validates at rollout.val_kwargs.temperature (0 = greedy), as verl's agent-loop "
        "rollout does; do_sample is not read"
    ),
    # rollout.multi_turn.* are patrl's own keys (config.MultiTurnConfig); these are verl's rest
    "rollout.multi_turn.tokenization_sanity_check_mode": Noted(
        "patrl's agent loop never re-tokenizes model text (tokens in, tokens out)",
        quiet=("strict", "disable"),
    ),
    "rollout.multi_turn.use_inference_chat_template": Noted(
        "patrl renders tool turns with the tokenizer's chat template", quiet=(False,)
    ),
    # rollout.agent.agent_loop_config_path is patrl's own key (config.AgentConfig)
    "rollout.agent.num_workers": Noted(
        "a rank runs its agent loops on one event loop beside its engine (no worker actors)"
    ),
    "rollout.ignore_eos": Fixed((False,), "patrl's rollouts stop at EOS", "ignore_eos=false"),
    "rollout.val_temperature": Alias("rollout.val_kwargs.temperature"),  # patrl's earlier name
    # ---- data
    "data.tokenizer": Fixed((None,), "the tokenizer is the model's (model.path)", "null"),
    "data.custom_cls.path": Fixed(
        (None,), "patrl reads jsonl/parquet rows itself", "a jsonl or parquet file"
    ),
    "data.return_raw_chat": Noted("patrl keeps each prompt's messages", quiet=(True,)),
    "data.return_raw_input_ids": Noted("patrl tokenizes prompts once", quiet=(False,)),
    "data.return_full_prompt": Noted("patrl keeps each rendered prompt", quiet=(False,)),
    "data.reward_fn_key": Noted(
        "patrl passes every row's data_source to verl-style reward functions",
        quiet=("data_source",),
    ),
    "data.dataloader_num_workers": Noted("patrl reads all rows up front"),
    "data.filter_overlong_prompts_workers": Noted("patrl filters in one process"),
    "data.use_shm": Noted("patrl reads data files directly", quiet=(False,)),
    "data.trust_remote_code": Noted("patrl reads local files or a hub id", quiet=(False,)),
    # ---- trainer
    "trainer.max_actor_ckpt_to_keep": Alias("trainer.max_checkpoints_to_keep"),
    "trainer.device": Noted("patrl uses CUDA where present, else the CPU", quiet=("cuda",)),
    "trainer.balance_batch": Noted(
        "patrl balances rollout work over replicas by predicted length "
        "(rollout.prompt_assignment) and micro-batches by tokens",
        quiet=(True,),
    ),
    "trainer.default_hdfs_dir": Fixed(
        (None,), "patrl writes checkpoints to local paths only", "trainer.default_local_dir"
    ),
    "trainer.del_local_ckpt_after_load": Fixed(
        (False,), "patrl keeps checkpoints (trainer.max_checkpoints_to_keep)", "false"
    ),
    "trainer.log_val_generations": Fixed(
        (0,), "patrl does not log generations", "0 (metrics.jsonl has val-core/*)"
    ),
    "trainer.esi_redundant_time": Noted("patrl has no ESI expiry saves", quiet=(0,)),
    "trainer.ray_wait_register_center_timeout": _NO_RAY,
    "trainer.use_legacy_worker_impl": Noted("patrl has one worker implementation"),
    "trainer.max_critic_ckpt_to_keep": Noted(
        "the critic is saved in each run checkpoint (trainer.max_checkpoints_to_keep)"
    ),
    # ---- algorithm, critic, rewards
    "algorithm.use_pf_ppo": Fixed(
        (False,), "patrl has no preference-feedback PPO reweighting", "false"
    ),
    **_fsdp_rules("critic.model"),
    **_optim_rules("critic.optim"),
    "critic.strategy": _STRATEGY,
    "critic.enable": Noted(
        "patrl trains a critic exactly when algorithm.adv_estimator=gae", quiet=(None,)
    ),
    "critic.model.enable_gradient_checkpointing": Noted(
        "the critic follows actor.enable_gradient_checkpointing"
    ),
    "critic.model.use_remove_padding": Noted("the critic follows actor.use_remove_padding"),
    "critic.ppo_micro_batch_size": Fixed(
        (None,),
        "it is verl's deprecated global micro-batch size",
        "critic.ppo_micro_batch_size_per_gpu",
    ),
    "reward_model.reward_manager": Fixed(
        ("naive", "dapo"),
        "patrl scores each sample with reward.functions, as verl's naive manager does; dapo's "
        "overlong shaping is reward_model.overlong_buffer.*",
        "reward.functions (and custom_reward_function.path)",
    ),
    "reward_model.micro_batch_size_per_gpu": Alias("reward_model.micro_batch_size"),
    # verl's main_ppo passes the DAPO manager's overlong settings as reward_kwargs
    **{
        f"reward_model.reward_kwargs.overlong_buffer_cfg.{key}": Alias(
            f"reward_model.overlong_buffer.{key}"
        )
        for key in ("enable", "len", "penalty_factor", "log")
    },
    "reward_model.launch_reward_fn_async": Noted(
        "patrl's reward functions run in their own worker processes (reward.num_workers)"
    ),
    "reward_model.use_reward_loop": Noted("patrl scores in its reward worker processes"),
    "actor_rollout_ref.hybrid_engine": Fixed(
        (True,),
        "patrl's sync schedule colocates rollout and training on every rank",
        "trainer.mode=async to split ranks into rollout and trainer ranks",
    ),
    "actor_rollout_ref.nccl_timeout": Noted("patrl's collectives use torch.distributed's timeout"),
    "ray_kwargs.*": _NO_RAY,
    "global_profiler.*": Noted("patrl has no global profiler (benchmarks/ measure steps)"),
    "transfer_queue.enable": Fixed((False,), "patrl has no transfer queue", "false"),
}

# verl's custom reward function: a Python file and the function in it (verl's default name).
CUSTOM_REWARD = "custom_reward_function"
CUSTOM_REWARD_NAME = "compute_score"


def patrl_parts(parts: list[str]) -> list[str]:
    """`parts` with verl's section renamed to patrl's (`SECTIONS`); others unchanged."""
    for depth in (2, 1):
        head = ".".join(parts[:depth])
        if head in SECTIONS:
            return SECTIONS[head].split(".") + parts[depth:]
    return parts


def rule_for(parts: list[str]) -> Rule | None:
    """The rule for a (section-renamed) key: its own, else the nearest `prefix.*` one."""
    key = ".".join(parts)
    if key in RULES:
        return RULES[key]
    for depth in range(len(parts) - 1, 0, -1):
        wildcard = ".".join(parts[:depth]) + ".*"
        if wildcard in RULES:
            return RULES[wildcard]
    return None


def is_section(parts: list[str]) -> bool:
    """Whether `parts` (section-renamed) leads to verl keys: a prefix of a rule, a renamed
    section, or the custom reward function."""
    if parts[0] == CUSTOM_REWARD:
        return True
    if rule_for(parts) is not None:
        return True
    key = ".".join(parts) + "."
    return any(k.startswith(key) for k in RULES) or any(
        s.startswith(key) or s == key[:-1] for s in SECTIONS
    )


def translate(
    written: str,
    parts: list[str],
    value: Any,
    is_own_key: Callable[[list[str]], bool],
    notices: list[str],
) -> tuple[list[str], Any] | None:
    """Where the key `written` (split and section-renamed: `parts`) goes in patrl's config:
    (patrl path, value), or None when it is accepted without effect (a notice, unless quiet,
    is added to `notices`). Raises UnsupportedKey for a refused key or value. A path that is
    one of patrl's own keys, or no verl key at all, goes through unchanged (unknown keys are
    the caller's to report)."""
    if is_own_key(parts) or parts[0] == CUSTOM_REWARD:
        return parts, value
    rule = rule_for(parts)
    shown = f"{written}={value!r}" if not isinstance(value, dict) else written
    if isinstance(rule, Alias):
        return rule.target.split("."), value
    if isinstance(rule, Fixed):
        if any(_same(value, ok) for ok in rule.values):
            return None
        accepted = " or ".join(repr(v) for v in rule.values)
        raise UnsupportedKey(
            f"verl's {shown} is not supported by patrl: {rule.why} (accepted: {accepted}); "
            f"use {rule.use}"
        )
    if isinstance(rule, Noted):
        if not any(_same(value, q) for q in rule.quiet):
            notices.append(f"verl's {shown} has no effect in patrl: {rule.why}")
        return None
    return parts, value


def _same(value: Any, accepted: Any) -> bool:
    # True == 1 in Python: a boolean key's value must be a boolean to count as accepted.
    if isinstance(accepted, bool) or isinstance(value, bool):
        return value is accepted
    return bool(value == accepted)


def finish(raw: dict[str, Any]) -> None:
    """Turn verl's `custom_reward_function: {path, name}` in `raw` (the merged, translated
    config) into patrl's `reward.functions` entry `<path>:<name>`, in place."""
    custom = raw.pop(CUSTOM_REWARD, None)
    if custom is None:
        return
    if not isinstance(custom, dict) or set(custom) - {"path", "name"}:
        raise UnsupportedKey(f"{CUSTOM_REWARD} takes path and name (verl's keys), got {custom!r}")
    path = custom.get("path")
    if path is None:
        return  # verl: no custom function, the built-in scorer
    name = custom.get("name") or CUSTOM_REWARD_NAME
    reward = raw.setdefault("reward", {})
    if not isinstance(reward, dict):
        return  # pydantic names the wrong type
    if "functions" in reward:
        raise UnsupportedKey(
            f"{CUSTOM_REWARD}.path={path} and reward.functions are both set: they name the "
            "same thing (the reward); keep one"
        )
    reward["functions"] = [{"name": f"{path}:{name}"}]


def rules_table() -> str:
    """The rule table as Markdown (docs/verl.md embeds it)."""
    rows = ["| verl key (after the section rename) | in patrl |", "|---|---|"]
    for key, rule in RULES.items():
        if isinstance(rule, Alias):
            what = f"= `{rule.target}`"
        elif isinstance(rule, Fixed):
            accepted = ", ".join(f"`{v!r}`" for v in rule.values)
            what = f"only {accepted}: {rule.why}; else use {rule.use}"
        else:
            quiet = (
                f" (silent at {', '.join(f'`{v!r}`' for v in rule.quiet)})" if rule.quiet else ""
            )
            what = f"no effect{quiet}: {rule.why}"
        rows.append(f"| `{key}` | {what} |")
    return "\n".join(rows)
