"""The job's configuration: pydantic models, a YAML file, and dotted command-line overrides.

Key names follow verl where the concept exists (`data.train_batch_size`, `rollout.n`,
`actor.ppo_mini_batch_size`, `trainer.save_freq`, ...), with verl's meanings, and verl's own key
paths (`actor_rollout_ref.actor.optim.lr`, ...) are read as patrl's (verl_keys.py), so a verl
command line carries over. Every problem is reported before any rank starts work, naming the
dotted key, the bad value and what is accepted:

    cfg = load_config("examples/configs/demo.yaml", ["rollout.n=8", "data.train_batch_size=16"])
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from patrl.orchestrator import verl_keys
from patrl.orchestrator.advantages import GROUP_ESTIMATORS, AdvEstimator
from patrl.orchestrator.errors import IN_PROCESS_TIMEOUT
from patrl.rollout.tp_policy import AdaptiveTP
from patrl.trainer import OptimConfig, TrainerConfig
from patrl.trainer.config import AggMode, CriticCheckpointConfig, KLType, RolloutCorrectionConfig
from patrl.trainer.lora import LoraConfig

LoggerName = Literal["console", "jsonl", "tensorboard", "wandb"]
_DEFAULT_LOGGERS: tuple[LoggerName, ...] = ("console", "jsonl", "tensorboard")
# trainer.total_training_steps when neither it nor trainer.total_epochs is set
DEFAULT_TOTAL_STEPS = 20
# data.train_files / data.val_files naming the embedded demo task's files
DEMO_FILES = "demo"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class DataConfig(_Section):
    train_files: list[str] | str | None = Field(
        None,
        description="jsonl/parquet files; 'demo' = the demo task's; None = the demo task's "
        "when model.path is unset too",
    )
    val_files: list[str] | str | None = Field(
        None,
        description="validation files; 'demo' = the demo task's; None = none (the demo "
        "task's when training on it)",
    )
    prompt_key: str = "prompt"
    answer_key: str | None = Field(
        None,
        description="column of the gold answer, dotted into structs; None = 'answer', else "
        "verl's 'reward_model.ground_truth'",
    )
    train_batch_size: int = Field(
        8, gt=0, description="prompts per step (each sampled rollout.n times)"
    )
    gen_batch_size: int | None = Field(
        None,
        gt=0,
        description="DAPO (algorithm.filter_groups): prompts drawn per generation round, and "
        "per epoch step; None = train_batch_size",
    )
    val_batch_size: int | None = Field(
        None,
        gt=0,
        description="validation prompts generated at once; every prompt is validated; "
        "None = all at once",
    )
    max_prompt_length: int = Field(256, gt=0)
    max_response_length: int = Field(256, gt=0)
    filter_overlong_prompts: bool = Field(
        True, description="drop (and count) longer prompts; false = data.truncation says"
    )
    truncation: Literal["error", "left", "right", "middle"] = Field(
        "error",
        description="an overlong prompt kept (filter_overlong_prompts=false): error, or cut "
        "to max_prompt_length keeping its end (left), start (right) or both ends (middle)",
    )
    apply_chat_template: bool = True
    system_prompt: str | None = None
    shuffle: bool = True
    seed: int = 0
    train_max_samples: int = Field(
        -1,
        ge=-1,
        description="keep this many rows of data.train_files (drawn with data.seed when "
        "data.shuffle, else the first); -1 = all",
    )
    val_max_samples: int = Field(-1, ge=-1, description="the same for data.val_files")

    @field_validator("train_max_samples", "val_max_samples", mode="before")
    @classmethod
    def _none_is_all(cls, value: Any) -> Any:
        return -1 if value is None else value  # verl's configs write null for "all rows"


class ModelConfig(_Section):
    path: str | None = Field(
        None, description="Hugging Face model directory; None = the demo model"
    )


class LoraServingConfig(_Section):
    """verl's `actor_rollout_ref.model.lora` section, of which patrl reads `merge` (the rank,
    alpha and targets are the flat `model.lora_*` keys, verl's FSDP ones)."""

    merge: bool = Field(
        False,
        description="serve the rollout with the adapters folded into the engine's base weights "
        "(verl's lora.merge: no LoRA cost per generated token; each sync still sends adapters "
        "only and the engine unmerges exactly, loads, merges again); static TP only",
    )


class PolicyModelConfig(ModelConfig):
    """verl's `actor_rollout_ref.model`: the policy's model, and LoRA on it."""

    # ---- LoRA (verl's actor_rollout_ref.model.lora_*; patrl.trainer.lora, rollout layers)
    lora_rank: int = Field(0, description="LoRA rank; 0 = off (full fine-tuning)")
    lora_alpha: float = Field(16.0, gt=0, description="LoRA scale = lora_alpha / lora_rank")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="LoRA targets: 'all-linear', a list of module names / suffixes (q_proj), "
        "or a regex a module's full name matches (PEFT's rule)",
    )
    exclude_modules: str | list[str] | None = Field(
        None, description="modules LoRA leaves out: names / suffixes, or a regex"
    )
    lora_adapter_path: str | None = Field(
        None, description="a PEFT adapter directory to start from; None = fresh adapters"
    )
    lora: LoraServingConfig = Field(default_factory=lambda: LoraServingConfig())


class CriticModelConfig(ModelConfig):
    """verl's `critic.model`: the value model, and LoRA on it (verl's critic.model.lora_*)."""

    lora_rank: int = Field(
        0, ge=0, description="critic LoRA rank; 0 = off (the critic trains every weight)"
    )
    lora_alpha: float = Field(16.0, gt=0, description="critic LoRA scale = lora_alpha / lora_rank")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="critic LoRA targets, as model.target_modules (the value head is never "
        "adapted: it trains whole beside the adapters)",
    )


class AdaptiveTPConfig(AdaptiveTP):
    """Adaptive TP (PAT): start with the most data-parallel replicas, fold them into larger TP
    groups when the planner predicts the long tail finishes sooner that way. The engine's own
    policy (patrl.rollout.AdaptiveTP: its fields are these keys) plus the job's: whether to use
    it, and the fold's weights; `policy` hands the engine its part."""

    model_config = ConfigDict(
        extra="forbid", frozen=False, validate_assignment=True, allow_inf_nan=False
    )

    kind: Literal["adaptive"] = Field("adaptive", exclude=True)  # the engine's tag, not a key
    enable: bool = Field(True, description="off: static TP of rollout.tensor_model_parallel_size")
    candidates: tuple[int, ...] = Field(
        (1, 2),
        description="TP sizes to choose from; those that divide the world size and a node are used",
    )
    profile: str | None = Field(
        None, description="latency profile JSON; None = measure this machine once, cached"
    )
    keep_full_weights: bool = Field(
        True,
        description="a fold keeps each rank's full weights, so the weight sync after it is "
        "free (off: less memory while folded, and the sync rebuilds the model)",
    )

    @field_validator("kind", mode="before")
    @classmethod
    def _no_kind(cls, value: Any) -> Any:
        raise ValueError(
            "is the engine's policy tag, not a key of the job; rollout.adaptive_tp.enable turns "
            "adaptive TP on or off"
        )

    @model_validator(mode="after")
    def _candidates_ok(self) -> AdaptiveTPConfig:
        """Replaces AdaptiveTP's check: the job's candidates are judged against the world and
        the model (build.tp_candidates, preflight); fewer than two usable ones run static TP."""
        return self

    def policy(self, candidates: tuple[int, ...], profile: str) -> AdaptiveTP:
        """The engine's policy: these settings on the `candidates` this job can use and the
        latency `profile` given or measured."""
        mine = {name: getattr(self, name) for name in AdaptiveTP.model_fields}
        return AdaptiveTP(**{**mine, "candidates": candidates, "profile": profile})


class ValKwargsConfig(_Section):
    """verl's `rollout.val_kwargs`: how validation samples (`n` responses per prompt; verl's
    per-source mean@n, best@k and worst@k metrics over them)."""

    temperature: float = Field(0.0, ge=0, description="0 = greedy (pass@1)")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1 or 0 = off")
    n: int = Field(
        1, ge=1, description="responses per prompt (> 1 needs temperature > 0: mean@n, best@k)"
    )

    @model_validator(mode="after")
    def _sampled_when_several(self) -> ValKwargsConfig:
        if self.n > 1 and self.temperature == 0:
            raise ValueError(
                f"rollout.val_kwargs.n={self.n} with rollout.val_kwargs.temperature=0: greedy "
                "responses to one prompt are all the same; set rollout.val_kwargs.temperature "
                "> 0 (verl: val_kwargs.do_sample=true with a temperature), or n=1"
            )
        return self


class SpeculativeConfig(_Section):
    """Speculative rollouts: decode steps verify drafts from the prompt's other samples, its
    earlier responses and the prompt (patrl.rollout.SpeculativeConfig has the details); the
    sampled tokens are distributed as without it. Whether a step drafts is priced by
    `latency_profile`, else by the job's adaptive-TP profile (measured with verify rows when
    speculation is on), else by the batch size alone."""

    enable: bool = False
    sources: list[Literal["group", "history", "prompt"]] = Field(
        ["group", "history", "prompt"], min_length=1, description="draft sources, preferred first"
    )
    num_speculative_tokens: int = Field(4, gt=0, le=64, description="most draft tokens a step")
    max_num_seqs: int = Field(
        16, ge=0, description="speculate in decode steps of at most this many samples; 0 = always"
    )
    history_size: int = Field(8, ge=0, description="earlier responses kept per prompt")
    latency_profile: str | None = Field(
        None,
        description="latency profile (python -m patrl.rollout.profile) pricing each step's "
        "drafts; None = the job's own adaptive-TP profile, else drafts whenever the batch allows",
    )


class MultiTurnConfig(_Section):
    """verl's `rollout.multi_turn`: multi-turn rollouts with tools (patrl.orchestrator.agent,
    docs/agent_loop.md). Turn limits of None mean no limit. Wired into the sync schedule on a
    static TP layout or adaptive TP (preflight refuses the rest)."""

    enable: bool = Field(
        False, description="multi-turn tool rollouts (sync schedule, static or adaptive TP)"
    )
    max_assistant_turns: int | None = Field(None, gt=0, description="model turns at most")
    max_user_turns: int | None = Field(
        None, gt=0, description="tool and interaction (user) turns at most"
    )
    tool_config_path: str | None = Field(
        None, description="YAML of tools: [{class_name, config, tool_schema}] (verl's)"
    )
    max_parallel_calls: int = Field(1, gt=0, description="tool calls run per model turn at most")
    max_tool_response_length: int = Field(
        256, gt=0, description="characters of a tool answer kept; longer ones are truncated"
    )
    tool_response_truncate_side: Literal["left", "middle", "right"] = Field(
        "middle", description="what a truncation keeps: the start, both ends, or the end"
    )
    format: Literal["hermes"] = Field(
        "hermes", description="tool call syntax: <tool_call>{json}</tool_call>"
    )
    tool_timeout_s: float = Field(
        30.0, gt=0, description="deadline of one tool call (and of one interaction call)"
    )
    interaction_config_path: str | None = Field(
        None,
        description="YAML of interactions: {interaction: [{name, class_name, config}]} (verl's); "
        "a row's extra_info.interaction_kwargs.name picks the one answering its final turns",
    )


class AgentConfig(_Section):
    """verl's `rollout.agent`: the agent loops a multi-turn job's data rows pick by their
    `agent_name` (docs/agent_loop.md)."""

    agent_loop_config_path: str | None = Field(
        None,
        description="YAML list of {name, _target_: module.AgentLoopClass} (verl's), added to "
        "the built-in tool_agent and single_turn_agent",
    )


class RolloutConfig(_Section):
    n: int = Field(8, gt=0, description="samples per prompt (the GRPO group)")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1 or 0 = off")
    tensor_model_parallel_size: int = Field(
        1, gt=0, description="rollout TP size when adaptive_tp is off"
    )
    adaptive_tp: AdaptiveTPConfig = Field(default_factory=lambda: AdaptiveTPConfig())
    prompt_assignment: Literal["round_robin", "length_aware"] = Field(
        "length_aware",
        description="prompts to replicas: longest predicted work first onto the least loaded",
    )
    block_size: int | None = Field(
        None,
        gt=0,
        description="tokens per KV block; null = the attention backend's (flash 256, else 16)",
    )
    num_kv_blocks: int | None = Field(None, gt=0)
    kv_cache_memory_bytes: int | None = Field(
        None, gt=0, description="KV budget; None = 512 MiB on CPU, gpu_memory_utilization on CUDA"
    )
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0,
        le=1,
        description="fraction of the GPU's memory the engine may use (weights, activations, KV); "
        "the rest is the colocated trainer's",
    )
    free_cache_engine: bool | None = Field(
        None,
        description="sync schedule: free the engine's KV cache during the policy update, "
        "restored before the weight sync; None = on CUDA only",
    )
    offload_weights: bool = Field(
        False,
        description="with free_cache_engine: also move the engine's weights to host memory "
        "during the update",
    )
    max_num_seqs: int = Field(256, gt=0)
    max_num_batched_tokens: int = Field(2048, gt=0)
    enable_prefix_caching: bool = True
    attention_backend: str = Field(
        "auto",
        description="sdpa, triton (CUDA), flash (CUDA + flash-attn); auto = the first of "
        "flash, triton, sdpa that this machine runs",
    )
    tp_comm: Literal["auto", "shm", "process_group"] = Field(
        "auto",
        description="TP collectives: shm (shared memory, one host, gloo) or the process group; "
        "auto = shm where it can",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="engine dtype; auto = the checkpoint's, float32 -> bfloat16 on CUDA"
    )
    enforce_eager: bool = Field(
        False, description="CUDA: decode eagerly instead of through captured CUDA graphs"
    )
    val_kwargs: ValKwargsConfig = Field(default_factory=lambda: ValKwargsConfig())
    update_weights_bucket_megabytes: int = Field(256, gt=0)
    over_sample_rate: float = Field(
        0.0,
        ge=0,
        description="partial rollouts (APRIL): start this fraction more prompts, stop when the "
        "batch is full, resume the unfinished ones first next step; 0 = off",
    )

    speculative: SpeculativeConfig = Field(default_factory=lambda: SpeculativeConfig())
    multi_turn: MultiTurnConfig = Field(default_factory=lambda: MultiTurnConfig())
    agent: AgentConfig = Field(default_factory=lambda: AgentConfig())

    @model_validator(mode="after")
    def _block_size_fits_backend(self) -> RolloutConfig:
        """A named backend and an explicit block size it cannot use fail here, before any
        rank starts ("auto" is resolved on each rank, where the machine is known)."""
        from patrl.rollout.layers.attention import registry  # the rules live with the backends

        if self.attention_backend != "auto":
            registry.resolve_attention_backend(self.attention_backend)  # names unknown ones
            registry.resolve_block_size(self.attention_backend, self.block_size)
        return self


class ActorConfig(TrainerConfig):
    """The policy trainer (patrl.trainer.TrainerConfig) plus the PPO loop's sizes. LoRA is
    set by verl's `model.lora_*` keys (build.trainer_config), not here."""

    lora: LoraConfig = Field(default_factory=lambda: LoraConfig(), exclude=True)

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_is_the_models(cls, value: Any) -> Any:
        raise ValueError(
            "LoRA is set by model.lora_rank, model.lora_alpha, "
            "model.target_modules, model.exclude_modules, model.lora_adapter_path"
        )

    ppo_mini_batch_size: int = Field(
        8, gt=0, description="prompts per optimizer step (times rollout.n samples)"
    )
    ppo_epochs: int = Field(1, gt=0)
    use_dynamic_bsz: bool = Field(
        False,
        description="micro-batches by ppo_max_token_len_per_gpu alone (ppo_micro_batch_size_"
        "per_gpu unused)",
    )


class FilterGroupsConfig(_Section):
    enable: bool = False
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] | None = Field(
        None,
        description="what must vary within a group: acc/score = the reward functions' score "
        "before the overlong penalty; seq_reward/seq_final_reward (and None) = the reward "
        "trained on",
    )
    max_num_gen_batches: int = Field(4, gt=0, description="generation rounds per step at most")


class KLControlConfig(_Section):
    """verl's `algorithm.kl_ctrl`: the coefficient of the KL penalty in the reward."""

    type: Literal["fixed", "adaptive"] = Field(
        "fixed", description="adaptive: steer the coefficient toward target_kl (Ziegler et al.)"
    )
    kl_coef: float = Field(0.001, ge=0, description="the (initial) coefficient")
    target_kl: float = Field(0.1, gt=0, description="adaptive: the KL per token to hold")
    horizon: int = Field(
        10000, gt=0, description="adaptive: samples over which the coefficient adapts"
    )


class AlgorithmConfig(_Section):
    adv_estimator: Literal[AdvEstimator, "gae"] = Field(
        "grpo",
        description="grpo, dr_grpo, rloo (group baselines: need rollout.n > 1), "
        "reinforce_plus_plus, reinforce_plus_plus_baseline (batch-whitened), "
        "remax (baseline: the reward of the prompt's greedy response, generated each step), "
        "grpo_passk, opo, gpg (verl's; group baselines), grpo_vectorized / rloo_vectorized "
        "(= grpo / rloo), gae (PPO with a critic: the `critic` section)",
    )
    gamma: float = Field(
        1.0, ge=0, le=1, description="gae, reinforce_plus_plus: discount per token"
    )
    lam: float = Field(1.0, ge=0, le=1, description="gae: lambda of the advantage estimate")
    use_kl_in_reward: bool = Field(
        False, description="subtract kl_ctrl's coefficient x the KL to the reference per token"
    )
    kl_penalty: KLType = Field(
        "kl", description="KL estimator in the reward: kl/k1, mse/k2, low_var_kl/k3, abs"
    )
    kl_ctrl: KLControlConfig = Field(default_factory=lambda: KLControlConfig())
    norm_adv_by_std_in_grpo: bool = True
    filter_groups: FilterGroupsConfig = Field(default_factory=lambda: FilterGroupsConfig())
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=lambda: RolloutCorrectionConfig()
    )


class CriticConfig(_Section):
    """verl's `critic.*`: the value model of `algorithm.adv_estimator=gae`, FSDP2-sharded on
    the actor's ranks, with its own optimizer and schedule. Unset sizes follow the actor's."""

    model: CriticModelConfig = Field(default_factory=lambda: CriticModelConfig())
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int | None = Field(
        None, gt=0, description="prompts per critic step; None = actor.ppo_mini_batch_size"
    )
    ppo_epochs: int | None = Field(None, gt=0, description="None = actor.ppo_epochs")
    ppo_micro_batch_size_per_gpu: int | None = Field(None, ge=1)
    ppo_max_token_len_per_gpu: int | None = Field(
        None, ge=2, description="None = actor.ppo_max_token_len_per_gpu"
    )
    cliprange_value: float = Field(0.5, gt=0, description="values move at most this per update")
    loss_agg_mode: AggMode | None = Field(
        None, description="None = actor.loss_agg_mode (verl's oc.select)"
    )
    grad_clip: float = Field(1.0, gt=0)
    checkpoint: CriticCheckpointConfig = Field(default_factory=lambda: CriticCheckpointConfig())


class RewardFunctionConfig(_Section):
    name: str = Field(description="'math_verify', 'format', or 'module:function'")
    weight: float = 1.0


class RewardConfig(_Section):
    functions: list[RewardFunctionConfig] = Field(
        default_factory=lambda: [RewardFunctionConfig(name="math_verify")]
    )
    num_workers: int = Field(
        2, ge=0, description="reward processes; 0 = in process (no timeout: nothing stops a call)"
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="each reward call's deadline in a worker (None: 10 s); refused with "
        "num_workers=0",
    )
    max_failed_steps: int = Field(
        3,
        ge=1,
        description="stop the run when every sample's reward failed this many steps in a row",
    )

    @model_validator(mode="after")
    def _timeout_needs_workers(self) -> RewardConfig:
        if self.num_workers == 0 and self.timeout_s is not None:
            raise ValueError(IN_PROCESS_TIMEOUT.format(timeout=self.timeout_s))
        return self


class RewardModelPathConfig(_Section):
    path: str | None = Field(
        None, description="HF AutoModelForSequenceClassification directory with num_labels=1"
    )


class OverlongBufferConfig(_Section):
    """DAPO's overlong reward shaping (verl's `reward_model.overlong_buffer`): a response
    longer than max_response_length - len tokens loses penalty_factor x (its excess / len),
    added to its score before the advantages."""

    enable: bool = Field(False, description="penalise responses that run into the buffer")
    len: int = Field(0, ge=0, description="the buffer: the last this many tokens of the budget")
    penalty_factor: float = Field(0.0, ge=0, description="the penalty at the full budget")
    log: bool = Field(
        False, description="log reward/overlong_reward/mean and reward/overlong/mean (share)"
    )


class RewardModelConfig(_Section):
    """A learned reward model: its score on a response's last token, times `weight`, is added
    to the rule rewards (docs/reward_models.md). Replicated on each scoring rank, or
    FSDP2-sharded over the world (`strategy`)."""

    enable: bool = Field(
        False, description="add a learned RM's score to the rewards of training samples"
    )
    model: RewardModelPathConfig = Field(default_factory=lambda: RewardModelPathConfig())
    weight: float = Field(1.0, description="the RM score's weight in the reward")
    micro_batch_size: int = Field(8, gt=0, description="sequences per RM forward")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="RM dtype; auto = bfloat16 on CUDA, float32 on CPU"
    )
    overlong_buffer: OverlongBufferConfig = Field(default_factory=lambda: OverlongBufferConfig())
    strategy: Literal["auto", "replicated", "fsdp", "fsdp2"] = Field(
        "auto",
        description="replicated: each scoring rank holds the whole RM; fsdp (= fsdp2): sharded "
        "over every rank, each scoring an equal share of the batch; auto = fsdp on CUDA when "
        "the RM's weights exceed 10% of a GPU's memory, else replicated",
    )

    @model_validator(mode="after")
    def _has_path(self) -> RewardModelConfig:
        if self.enable and not self.model.path:
            raise ValueError(
                "reward_model.enable=true needs reward_model.model.path (an HF "
                "sequence-classification directory; train one with "
                "`python -m patrl.trainer.reward_model`)"
            )
        return self


class RunConfig(_Section):
    """verl's `trainer.*`: the run's length, logging and checkpoints. The key is verl's, the
    class is named for what it holds: the policy trainer's own settings are `actor`
    (`ActorConfig`, turned into `patrl.trainer.TrainerConfig` by `build.trainer_config`)."""

    total_training_steps: int | None = Field(
        None,
        gt=0,
        description="steps to run; None = total_epochs x batches per epoch, or "
        f"{DEFAULT_TOTAL_STEPS} without total_epochs",
    )
    total_epochs: int | None = Field(
        None,
        gt=0,
        description="passes over data.train_files (floor(prompts / train_batch_size) steps "
        "each) when total_training_steps is None",
    )
    mode: Literal["sync", "async"] = Field(
        "sync", description="async: rollout ranks never stop; see async_rl"
    )
    save_freq: int = Field(
        0,
        ge=-1,
        description="steps between checkpoints, and the last step; 0 = the last step only; "
        "-1 = none",
    )
    test_freq: int = Field(
        5,
        ge=-1,
        description="steps between validations, and after the last step; 0 or -1 = none "
        "after steps",
    )
    val_before_train: bool = Field(
        True, description="validate before the first step (whatever test_freq says)"
    )
    logger: list[LoggerName] = Field(
        default_factory=lambda: list(_DEFAULT_LOGGERS),
        description="console: progress bar; tensorboard: scalars (needs the [tensorboard] "
        "extra); wandb: needs `pip install wandb`. metrics.jsonl is always written: resume, "
        "summary and plots read it",
    )
    project_name: str = "patrl"
    experiment_name: str = "grpo"
    default_local_dir: str | None = Field(
        None,
        description="the run's folder: checkpoints (global_step_<N>/), metrics, plots; "
        "None = runs/<project_name>/<experiment_name>",
    )
    rollout_data_dir: str | None = Field(
        None,
        description="write each step's responses to <dir>/<step>.jsonl (verl's columns: input, "
        "output, gts, score, step, reward extras); None = none",
    )
    validation_data_dir: str | None = Field(
        None, description="the same for each validation's responses; None = none"
    )
    val_only: bool = Field(
        False, description="validate the starting weights (val_before_train) and stop"
    )
    n_gpus_per_node: int | None = Field(
        None, gt=0, description="ranks per node the job expects (torchrun's); None = any"
    )
    nnodes: int | None = Field(
        None, gt=0, description="nodes the job expects (torchrun's); None = any"
    )
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: str | None = None
    max_checkpoints_to_keep: int = Field(2, gt=0)
    seed: int = 0
    plots: bool = True
    critic_warmup: int = Field(
        0, ge=0, description="gae: steps that update only the critic before the actor starts"
    )
    heartbeat_timeout_s: float = Field(
        120.0,
        gt=0,
        description="a rank whose heartbeat (a thread's, so a busy rank still beats) stops this "
        "long is named and the job stops",
    )

    @field_validator("logger", mode="before")
    @classmethod
    def _one_logger(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # verl accepts a single name


class AsyncConfig(_Section):
    """Asynchronous RL (AReaL): the first `rollout_ranks` ranks generate, the others train."""

    rollout_ranks: int = Field(1, gt=0, description="ranks that only generate")
    max_staleness: int = Field(
        1, ge=0, description="a trained sample is at most this many policy versions old"
    )
    behaviour_weight_cap: float | None = Field(
        5.0, gt=1, description="decoupled PPO: drop tokens whose behaviour weight exceeds it"
    )
    peer_timeout_s: float = Field(
        600.0,
        gt=0,
        description="a rollout rank silent (no heartbeat) this long is declared gone and its "
        "requests migrate to the others; a silent trainer rank, or all rollout ranks, fail the "
        "job, named",
    )
    report_every: int = Field(
        8,
        gt=0,
        description="engine steps between a rollout rank's reports of its requests in flight "
        "(tokens, logprobs, sampler states): what a peer continues if the rank is lost",
    )


class JobConfig(_Section):
    data: DataConfig = Field(default_factory=lambda: DataConfig())
    model: PolicyModelConfig = Field(default_factory=lambda: PolicyModelConfig())
    rollout: RolloutConfig = Field(default_factory=lambda: RolloutConfig())
    actor: ActorConfig = Field(default_factory=lambda: ActorConfig())
    algorithm: AlgorithmConfig = Field(default_factory=lambda: AlgorithmConfig())
    critic: CriticConfig = Field(default_factory=lambda: CriticConfig())
    reward: RewardConfig = Field(default_factory=lambda: RewardConfig())
    reward_model: RewardModelConfig = Field(default_factory=lambda: RewardModelConfig())
    trainer: RunConfig = Field(default_factory=lambda: RunConfig())  # the run, not the trainer
    async_rl: AsyncConfig = Field(default_factory=lambda: AsyncConfig())

    @model_validator(mode="after")
    def _consistent(self) -> JobConfig:
        if self.data.train_batch_size % self.actor.ppo_mini_batch_size:
            raise ValueError(
                f"actor.ppo_mini_batch_size={self.actor.ppo_mini_batch_size} must divide "
                f"data.train_batch_size={self.data.train_batch_size}"
            )
        mini = self.critic.ppo_mini_batch_size
        if mini is not None and self.data.train_batch_size % mini:
            raise ValueError(
                f"critic.ppo_mini_batch_size={mini} must divide "
                f"data.train_batch_size={self.data.train_batch_size}"
            )
        if self.rollout.over_sample_rate > 0 and self.algorithm.filter_groups.enable:
            raise ValueError(
                "rollout.over_sample_rate > 0 (partial rollouts) cannot be combined with "
                "algorithm.filter_groups.enable=true (DAPO refills): choose one"
            )
        _check_group_size(self)
        _resolve_verl_semantics(self)
        if self.model.path is not None and self.data.train_files is None:
            raise ValueError(
                f"model.path={self.model.path} is set but data.train_files is not: patrl would "
                "train your model on the embedded demo task (single-digit sums, written for the "
                "demo's tokenizer); set data.train_files to your data, or "
                f"data.train_files={DEMO_FILES} to train on the demo task"
            )
        if self.trainer.val_only and not self.trainer.val_before_train:
            raise ValueError(
                "trainer.val_only=true with trainer.val_before_train=false: a validation-only "
                "run validates before training and stops; set trainer.val_before_train=true "
                "(verl's val_only acts only with it)"
            )
        if self.trainer.resume_mode == "resume_path" and not self.trainer.resume_from_path:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        # The trainer's logprobs must use the temperature the rollout sampled with.
        if (
            "temperature" in self.actor.model_fields_set
            and self.actor.temperature != self.rollout.temperature
        ):
            raise ValueError(
                f"actor.temperature={self.actor.temperature} differs from rollout.temperature="
                f"{self.rollout.temperature}: logprobs must use the sampling temperature "
                "(leave actor.temperature unset)"
            )
        self.actor.temperature = self.rollout.temperature
        return self

    @property
    def use_critic(self) -> bool:
        """Whether the job trains a critic (verl: exactly when the estimator is gae)."""
        return self.algorithm.adv_estimator == "gae"

    @property
    def run_dir(self) -> Path:
        """The run's folder (`trainer.default_local_dir`): checkpoints, metrics, plots."""
        t = self.trainer
        if t.default_local_dir is not None:
            return Path(t.default_local_dir)
        return Path("runs") / t.project_name / t.experiment_name

    @property
    def schedule_resolved(self) -> bool:
        """Whether `resolve_schedule` has fixed the run's length (and each optimizer's horizon):
        resolving again would change nothing."""
        return None not in (
            self.trainer.total_training_steps,
            self.actor.optim.total_training_steps,
            self.critic.optim.total_training_steps,
        )

    @property
    def total_steps(self) -> int:
        """The run's length in steps, once `resolve_schedule` has fixed it."""
        steps = self.trainer.total_training_steps
        if steps is None:
            raise RuntimeError(
                "trainer.total_training_steps is not resolved yet (trainer.total_epochs needs "
                "the train set's size): call resolve_schedule first"
            )
        return steps


def resolve_schedule(config: JobConfig, num_train_prompts: int | None) -> JobConfig:
    """`config` with the run's length fixed: trainer.total_training_steps (verl's rule: as
    given, else total_epochs x floor(num_train_prompts / train_batch_size), the batches an epoch
    draws) and each optimizer's unset total_training_steps (the cosine's horizon, the base of
    lr_warmup_steps_ratio). `num_train_prompts` None (not known yet) leaves an epoch count
    unresolved."""
    t = config.trainer
    steps = t.total_training_steps
    if steps is None and t.total_epochs is None:
        steps = DEFAULT_TOTAL_STEPS
    if steps is None and num_train_prompts is not None:
        # verl's DAPO loader draws gen_batch_size prompts per batch
        drawn = config.data.gen_batch_size or config.data.train_batch_size
        per_epoch = num_train_prompts // drawn
        if per_epoch == 0:
            raise ConfigError(
                f"trainer.total_epochs={t.total_epochs}: data.train_files leaves "
                f"{num_train_prompts} prompts, fewer than the {drawn} a batch draws "
                f"(data.train_batch_size={config.data.train_batch_size}, "
                f"data.gen_batch_size={config.data.gen_batch_size}), so an epoch has no batch"
            )
        assert t.total_epochs is not None
        steps = t.total_epochs * per_epoch
    if steps is None:
        return config
    out = config.model_copy(deep=True)
    out.trainer.total_training_steps = steps
    for optim in (out.actor.optim, out.critic.optim):
        if optim.total_training_steps is None:
            optim.total_training_steps = steps
    return out


def _resolve_verl_semantics(config: JobConfig) -> None:
    """verl's couplings between sections: the critic's loss_agg_mode is the actor's unless
    set; rollout correction's bypass mode hands its settings to the actor's loss (verl's
    apply_bypass_mode). Rollout correction with the async schedule is refused: its decoupled
    PPO already weights every token by pi_proximal / pi_behaviour."""
    if config.critic.loss_agg_mode is None:
        config.critic.loss_agg_mode = config.actor.loss_agg_mode
    rc = config.algorithm.rollout_correction
    wanted = rc.model_copy() if rc.bypass_mode else None
    given = config.actor.policy_loss.rollout_correction
    if given is not None and given != wanted:
        raise ValueError(
            "actor.policy_loss.rollout_correction is set from algorithm.rollout_correction "
            "(bypass_mode); set algorithm.rollout_correction.* instead"
        )
    config.actor.policy_loss.rollout_correction = wanted
    if rc.active and config.trainer.mode == "async":
        raise ValueError(
            "algorithm.rollout_correction with trainer.mode=async: the async schedule's "
            "decoupled PPO already weights each token by pi_proximal / pi_behaviour (the "
            "rollout's logprobs), capped by async_rl.behaviour_weight_cap; use that, or "
            "trainer.mode=sync for verl's rollout correction"
        )
    gen = config.data.gen_batch_size
    if (
        gen is not None
        and gen != config.data.train_batch_size
        and not (config.algorithm.filter_groups.enable)
    ):
        raise ValueError(
            f"data.gen_batch_size={gen} differs from data.train_batch_size="
            f"{config.data.train_batch_size} without algorithm.filter_groups.enable=true: "
            "patrl draws gen_batch_size prompts per round only for DAPO's dynamic sampling; "
            "leave it unset"
        )
    ob = config.reward_model.overlong_buffer
    if ob.enable and not 0 < ob.len <= config.data.max_response_length:
        raise ValueError(
            f"reward_model.overlong_buffer.len={ob.len} with enable=true: it must be > 0 and "
            f"<= data.max_response_length={config.data.max_response_length} (verl's bound)"
        )
    if config.actor.policy_loss.loss_mode == "geo_mean" and config.trainer.mode == "async":
        raise ValueError(
            "actor.policy_loss.loss_mode=geo_mean with trainer.mode=async: GMPO's sequence "
            "ratio has no decoupled-PPO (behaviour-weighted) form; use trainer.mode=sync"
        )
    if rc.bypass_mode and config.actor.policy_loss.loss_mode != "vanilla":
        raise ValueError(
            f"algorithm.rollout_correction.bypass_mode=true with actor.policy_loss.loss_mode="
            f"{config.actor.policy_loss.loss_mode}: bypass mode replaces the policy loss by "
            "PPO's clip to the rollout (loss_type=ppo_clip) or REINFORCE (loss_type=reinforce), "
            "as verl's apply_bypass_mode does; leave loss_mode=vanilla"
        )
    if rc.loss_type == "reinforce" and not rc.bypass_mode:
        raise ValueError(
            "algorithm.rollout_correction.loss_type=reinforce applies in bypass mode only (as "
            "in verl); set bypass_mode=true, or leave loss_type=ppo_clip"
        )


def _check_group_size(config: JobConfig) -> None:
    """A group baseline over one sample is the sample itself: every advantage would be 0."""
    estimator = config.algorithm.adv_estimator
    if config.rollout.n == 1 and estimator in GROUP_ESTIMATORS:
        raise ValueError(
            f"algorithm.adv_estimator={estimator} with rollout.n=1: a group of one sample is "
            "its own baseline, so every advantage is 0 and nothing is learned; set rollout.n "
            "> 1, or use adv_estimator=reinforce_plus_plus, remax (a greedy baseline) or gae "
            "(a critic)"
        )


class ConfigError(ValueError):
    """A configuration problem, already phrased for the user."""


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    notices: list[str] | None = None,
) -> JobConfig:
    """Read a YAML file (optional), apply `key.sub=value` overrides, validate. verl's key paths
    are read as patrl's (verl_keys.py); keys accepted without effect, a wandb logger that is not
    installed and a TP size that adaptive TP overrides add a line each to `notices`."""
    settings = yaml_settings(Path(path).read_text(), str(path)) if path is not None else []
    return config_from_settings(settings, overrides, notices)


def config_from_settings(
    settings: list[Setting],
    overrides: list[str] | None = None,
    notices: list[str] | None = None,
) -> JobConfig:
    """`load_config` on a YAML file's `yaml_settings` (so a caller that judged them, with their
    lines, does not read the file twice)."""
    notes: list[str] = [] if notices is None else notices
    raw = _translate_tree(settings, notes)
    for item in overrides or []:
        _apply_override(raw, item, notes)
    try:
        verl_keys.finish(raw)
        config = JobConfig.model_validate(raw)
    except verl_keys.UnsupportedKey as err:
        raise ConfigError(str(err)) from None
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None
    if "wandb" in config.trainer.logger and importlib.util.find_spec("wandb") is None:
        notes.append(
            "trainer.logger has wandb, but wandb is not installed (pip install wandb): "
            "metrics go to metrics.jsonl and the other loggers only"
        )
    notes += verl_differences(config)
    r = config.rollout
    if "tensor_model_parallel_size" in r.model_fields_set and r.adaptive_tp.enable:
        notes.append(
            f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size} is the static "
            "layout; with rollout.adaptive_tp.enable=true (the default) the engine chooses "
            f"among rollout.adaptive_tp.candidates {list(r.adaptive_tp.candidates)} as it generates "
            "(rollout.adaptive_tp.enable=false pins it)"
        )
    return config


def verl_differences(config: JobConfig) -> list[str]:
    """One start-up line for each setting of `config` that patrl reads differently from verl
    on purpose (docs/verl.md, "Where patrl differs from verl on purpose")."""
    out = []
    a, c = config.actor, config.critic
    if "seq-mean-token-sum-norm" in (a.loss_agg_mode, c.loss_agg_mode):
        out.append(
            "loss_agg_mode=seq-mean-token-sum-norm: patrl divides the summed sequence losses by "
            "the scale factor and the number of sequences (Dr.GRPO's 1/G); verl's agg_loss "
            "leaves out 1/G, so verl's loss and gradient (before grad_clip) are G times patrl's"
            + (
                "; the critic's scale factor is each micro-batch's padded width"
                if c.loss_agg_mode == "seq-mean-token-sum-norm"
                else ""
            )
        )
    mode = a.policy_loss.loss_mode
    if mode in ("gspo", "sapo") and a.loss_agg_mode != "seq-mean-token-mean":
        out.append(
            f"actor.policy_loss.loss_mode={mode} aggregates the policy loss seq-mean-token-mean, "
            f"as verl does, whatever actor.loss_agg_mode says ({a.loss_agg_mode}: used for the "
            "entropy and KL terms only)"
        )
    rc = config.algorithm.rollout_correction
    if rc.bypass_mode and config.algorithm.use_kl_in_reward:
        out.append(
            "algorithm.rollout_correction.bypass_mode=true with algorithm.use_kl_in_reward=true: "
            "the reward's KL penalty takes the trainer's logprobs of the batch (a rescoring pass "
            "runs for it); verl's takes the rollout's"
        )
    whitened = config.algorithm.adv_estimator in (
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "gae",
    )
    if rc.rollout_rs is not None and not rc.bypass_mode and whitened:
        out.append(
            f"algorithm.rollout_correction.rollout_rs with adv_estimator="
            f"{config.algorithm.adv_estimator}: rejected tokens leave the loss after the "
            "advantages are whitened, so they count in the whitening statistics; verl rejects "
            "them before"
        )
    if rc.rollout_is_batch_normalize and rc.bypass_mode:
        out.append(
            "algorithm.rollout_correction.rollout_is_batch_normalize=true in bypass mode: the "
            "weights' mean is taken per micro-batch on each rank; verl's over the mini-batch "
            "across ranks"
        )
    return out


def dump_config(config: JobConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def _apply_override(raw: dict[str, Any], item: str, notices: list[str]) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    # Hydra's `+key` / `++key` (add / force-add a key verl's schema lacks) name the same key
    key = key.strip().lstrip("+")
    moved = _translate(key, yaml.safe_load(text) if text.strip() else None, notices)
    if moved is None:
        return
    parts, value = moved
    if parts[0] != verl_keys.CUSTOM_REWARD:
        _check_path(parts, key)
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    node[parts[-1]] = value


def _translate(written: str, value: Any, notices: list[str]) -> tuple[list[str], Any] | None:
    """The patrl path and value of the key `written` (a verl path or patrl's own), or None
    for a verl key accepted without effect."""
    parts = verl_keys.patrl_parts(written.split("."))
    try:
        return verl_keys.translate(written, parts, value, _is_own_key, notices)
    except verl_keys.UnsupportedKey as err:
        raise ConfigError(str(err)) from None


def _translate_tree(settings: list[Setting], notices: list[str]) -> dict[str, Any]:
    """A YAML file's settings (`yaml_settings`) as sections with verl's keys moved to patrl's
    paths (nested verl sections, `actor_rollout_ref: {actor: {...}}`, included). A key reached
    twice under two names (patrl's and verl's for one setting) is an error naming both; a key
    written twice keeps its last value, as YAML's own reading does."""
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}  # patrl key -> the key as written
    for setting in settings:
        if setting.kind != "value":
            continue
        written = setting.key
        moved = _translate(written, setting.value, notices)
        if moved is None:
            continue
        parts, value = moved
        if parts[0] != verl_keys.CUSTOM_REWARD:
            _check_path(parts, written)
        dotted = ".".join(parts)
        if origin.get(dotted, written) != written:
            raise ConfigError(
                f"{origin[dotted]} and {written} both set {dotted}: they are one setting "
                "(verl's name and patrl's); keep one"
            )
        origin[dotted] = written
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{written}: {part!r} is not a section")
        node[parts[-1]] = value
    return out


SettingKind = Literal["section", "value", "entry"]


@dataclass(frozen=True, slots=True)
class Setting:
    """One key of a YAML file: `key` dotted as written (verl's spelling stays verl's), `line`
    (1-based) where it is written, and `kind`: a "section" (a mapping the walk descends into:
    its keys follow, `value` is None), a "value" (what the key sets), or an "entry" (a key
    inside a list of sections, `reward.functions.0.name`: the list's own "value" setting holds
    it; it is listed for its line and to be checked as a key)."""

    key: str
    value: Any
    line: int
    kind: SettingKind


def yaml_settings(text: str, path: str) -> list[Setting]:
    """Every key a YAML file sets, in the file's order: the one walk over a config file
    (load_config builds the config from it, preflight names lines from it). A mapping is
    descended into where it is one of patrl's sections or leads to verl keys; anything else is
    a value. Raises ConfigError for malformed YAML (its line and column) or a top level that
    is not a mapping."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        at = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        context = f" ({err.context})" if err.context else ""
        raise ConfigError(f"{path}{at}: malformed YAML: {err.problem}{context}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: malformed YAML: {err}") from None
    if root is None:
        return []
    if not isinstance(root, yaml.MappingNode):
        top = _construct(root)
        if not top:  # `false`, `0`, `""`: no settings, as an empty file
            return []
        raise ConfigError(
            f"{path}: the top level must be a mapping of sections, got {type(top).__name__}"
        )
    return list(_walk_yaml(root, [], entry=False))


def _walk_yaml(node: yaml.MappingNode, prefix: list[str], entry: bool) -> Iterator[Setting]:
    for key_node, value_node in node.value:
        written = [*prefix, str(key_node.value)]
        key, line = ".".join(written), key_node.start_mark.line + 1
        parts = verl_keys.patrl_parts(written)
        if isinstance(value_node, yaml.MappingNode) and (
            _is_section(parts) or verl_keys.is_section(parts)
        ):
            yield Setting(key, None, line, "section")
            yield from _walk_yaml(value_node, written, entry)
            continue
        yield Setting(key, _construct(value_node), line, "entry" if entry else "value")
        if isinstance(value_node, yaml.SequenceNode) and _is_section_list(parts):
            for i, item in enumerate(value_node.value):
                if isinstance(item, yaml.MappingNode):
                    yield from _walk_yaml(item, [*written, str(i)], entry=True)


def _construct(node: yaml.Node) -> Any:
    """The Python value of a composed YAML node, as yaml.safe_load reads it."""
    return yaml.SafeLoader("").construct_document(node)


def _field_model(parts: list[str]) -> tuple[bool, type[BaseModel] | None]:
    """Whether `parts` is one of JobConfig's keys, and the section model it names (None for a
    value)."""
    model: type[BaseModel] | None = JobConfig
    for part in parts:
        if model is None:
            return True, None  # inside a value (a list of reward functions, ...)
        if part not in model.model_fields:
            return False, None
        model = _section_model(model.model_fields[part].annotation)
    return True, model


def _section_model(annotation: Any) -> type[BaseModel] | None:
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


def _list_item_model(annotation: Any) -> type[BaseModel] | None:
    """The section model of a list of sections' entries (`reward.functions`), else None."""
    if typing.get_origin(annotation) is not list:
        return None
    (item,) = typing.get_args(annotation)
    return _section_model(item)


def _is_own_key(parts: list[str]) -> bool:
    return _field_model(parts)[0]


def _is_section(parts: list[str]) -> bool:
    return _field_model(parts)[1] is not None


def _is_section_list(parts: list[str]) -> bool:
    """Whether `parts` is a patrl key holding a list of sections (`reward.functions`)."""
    parent = _field_model(parts[:-1])[1]
    field = parent.model_fields.get(parts[-1]) if parent is not None else None
    return field is not None and _list_item_model(field.annotation) is not None


def unknown_part(parts: list[str]) -> int | None:
    """The index of the first of `parts` that is none of JobConfig's keys; None where all are
    (or lead into a value). A list of sections' entries are keyed by index
    (`reward.functions.1.name`)."""
    found = _first_unknown(parts)
    return None if found is None else found[0]


def _first_unknown(parts: list[str]) -> tuple[int, type[BaseModel]] | None:
    """(index of the first part that is no key, the section that lacks it), or None."""
    model: type[BaseModel] | None = JobConfig
    depth = 0
    while depth < len(parts) and model is not None:
        fields = model.model_fields
        if parts[depth] not in fields:
            return depth, model
        annotation = fields[parts[depth]].annotation
        model = _section_model(annotation)
        item = _list_item_model(annotation)
        if item is not None and depth + 1 < len(parts) and parts[depth + 1].isdigit():
            model, depth = item, depth + 1  # an entry of a list of sections
        depth += 1
    return None


def unknown_key(parts: list[str], written: str | None = None) -> str | None:
    """Why `parts` is not one of JobConfig's keys, with the close matches ("did you mean"): the
    one wording of an unknown key. None where it is one. `written`: the key as the user wrote
    it, when that was a verl path."""
    found = _first_unknown(parts)
    if found is None:
        return None
    depth, model = found
    fields = list(model.model_fields)
    where = ".".join(parts[:depth]) or "the top level"
    close = difflib.get_close_matches(parts[depth], fields, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    key = ".".join(parts[: depth + 1])
    named = repr(key)
    if written not in (None, ".".join(parts)):
        named = f"{written!r} (patrl's {key!r})"
    return f"unknown key {named}: {where} accepts {sorted(fields)}{hint}"


def _check_path(parts: list[str], written: str | None = None) -> None:
    """Unknown keys fail here with suggestions, before pydantic's generic message."""
    problem = unknown_key(parts, written)
    if problem is not None:
        raise ConfigError(problem)


def _describe(err: ValidationError) -> str:
    """One line per error: the key, what is wrong and the value given. A check of several
    keys together (a validator's ValueError) says its own words, which name the keys."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key {key!r}")
            continue
        value = e.get("input")
        if e["type"] == "value_error":  # pydantic's "Value error, " prefix says nothing
            message = str(e.get("ctx", {}).get("error", e["msg"]))
            lines.append(f"{key}: {message}" if key else message)
            continue
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        lines.append(f"{key}: {e['msg']}{shown}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def config_reference() -> str:
    """The config reference as a Markdown table per section (the README embeds this)."""
    out = []
    for section, field in JobConfig.model_fields.items():
        model = field.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        out.append(f"**`{section}`**\n\n| key | default | meaning |\n|---|---|---|")
        out += _reference_rows(section, model)
        out.append("")
    return "\n".join(out)


def _reference_rows(prefix: str, model: type[BaseModel]) -> list[str]:
    rows = []
    defaults = model().model_dump(mode="json")
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if field.exclude:  # set elsewhere (actor.lora: model.lora_*)
            continue
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += _reference_rows(f"{prefix}.{name}", annotation)
            continue
        default = json.dumps(defaults.get(name))
        rows.append(f"| `{prefix}.{name}` | `{default}` | {field.description or ''} |")
    return rows
