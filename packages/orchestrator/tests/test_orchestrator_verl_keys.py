"""verl's key paths and meanings: each alias lands on patrl's key, each accepted-without-effect
key says why, each unsupported one is refused saying why and what to use; verl's -1 values,
epochs, schedule horizons, validation and save cadence, the world shape and the loggers mean
what they mean in verl."""

from __future__ import annotations

import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from patrl.orchestrator import verl_keys
from patrl.orchestrator.build import critic_config, trainer_config
from patrl.orchestrator.config import (
    DEFAULT_TOTAL_STEPS,
    ConfigError,
    JobConfig,
    load_config,
    resolve_schedule,
)
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.metrics import MetricsLogger
from patrl.orchestrator.preflight import choose_assets, world_problems
from patrl.orchestrator.rewards import RewardManager
from patrl.orchestrator.run import saves, validates
from patrl.orchestrator.sampling import sampling_params

# ------------------------------------------------------------------------------ key paths


def test_verl_paths_resolve_to_the_same_config_as_patrls_keys() -> None:
    verl = [
        "actor_rollout_ref.model.path=/m",
        "actor_rollout_ref.actor.optim.lr=3e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
        "actor_rollout_ref.rollout.val_kwargs.top_p=0.95",
        "data.train_files=/d.parquet",
    ]
    patrl = [
        "model.path=/m",
        "actor.optim.lr=3e-6",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=2",
        "actor.use_kl_loss=True",
        "actor.kl_loss_coef=0.01",
        "actor.use_dynamic_bsz=True",
        "actor.optim.lr_warmup_steps_ratio=0.1",
        "actor.enable_gradient_checkpointing=True",
        "actor.use_remove_padding=False",
        "rollout.n=4",
        "rollout.temperature=0.7",
        "rollout.gpu_memory_utilization=0.6",
        "rollout.val_kwargs.temperature=0.6",
        "rollout.val_kwargs.top_p=0.95",
        "data.train_files=/d.parquet",
    ]
    notices: list[str] = []
    config = load_config(None, verl, notices)
    assert config == load_config(None, patrl)
    assert notices == []
    assert config.actor.optim.lr == 3e-6 and config.rollout.val_kwargs.top_p == 0.95
    assert config.actor.enable_gradient_checkpointing is True


def test_nested_verl_sections_in_yaml_read_as_the_dotted_keys(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            actor_rollout_ref:
              model:
                path: /m
                enable_gradient_checkpointing: true
              actor:
                optim: {lr: 2.0e-6, warmup_style: cosine}
                fsdp_config: {param_offload: false, optimizer_offload: false}
              rollout:
                name: vllm
                n: 4
                top_k: -1
            data:
              train_files: /d.jsonl
              truncation: error
            trainer:
              total_epochs: 2
              logger: [console, jsonl]
            """
        )
    )
    notices: list[str] = []
    config = load_config(path, ["actor_rollout_ref.rollout.n=6"], notices)
    expected = load_config(
        None,
        [
            "model.path=/m",
            "actor.enable_gradient_checkpointing=true",
            "actor.optim.lr=2e-6",
            "actor.optim.lr_scheduler_type=cosine",
            "rollout.n=6",  # the override wins over the file
            "rollout.top_k=-1",
            "data.train_files=/d.jsonl",
            "trainer.total_epochs=2",
            "trainer.logger=[console,jsonl]",
        ],
    )
    assert config == expected
    assert notices == [
        "verl's actor_rollout_ref.rollout.name='vllm' has no effect in patrl: patrl generates "
        "with its own engine (patrl.rollout), in the training processes; rollout.name is not read"
    ]


def test_one_setting_named_twice_in_a_file_is_an_error_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        "actor:\n  optim: {lr: 1.0e-6}\nactor_rollout_ref:\n  actor: {optim: {lr: 2.0e-6}}\n"
    )
    with pytest.raises(ConfigError, match=r"actor.optim.lr and actor_rollout_ref.actor.optim.lr"):
        load_config(path)


@pytest.mark.parametrize(
    ("verl", "key", "value"),
    [
        (
            "actor_rollout_ref.actor.optim.warmup_style=cosine",
            "actor.optim.lr_scheduler_type",
            "cosine",
        ),
        ("actor_rollout_ref.actor.optim.clip_grad=0.5", "actor.grad_clip", 0.5),
        ("critic.optim.warmup_style=cosine", "critic.optim.lr_scheduler_type", "cosine"),
        ("critic.optim.clip_grad=0.3", "critic.grad_clip", 0.3),
        ("rollout.val_temperature=0.5", "rollout.val_kwargs.temperature", 0.5),
        ("trainer.max_actor_ckpt_to_keep=5", "trainer.max_checkpoints_to_keep", 5),
        ("reward_model.micro_batch_size_per_gpu=3", "reward_model.micro_batch_size", 3),
        ("actor_rollout_ref.model.use_remove_padding=false", "actor.use_remove_padding", False),
    ],
)
def test_an_alias_sets_patrls_key(verl: str, key: str, value: Any) -> None:
    config = load_config(None, ["data.train_files=/d.jsonl", verl])
    node: Any = config
    for part in key.split("."):
        node = getattr(node, part)
    assert node == value


@pytest.mark.parametrize(
    ("override", "why", "use"),
    [
        (
            "actor_rollout_ref.actor.fsdp_config.param_offload=True",
            "keeps parameters and optimizer state on the device",
            "rollout.free_cache_engine",
        ),
        (
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
            "keeps parameters and optimizer state on the device",
            "more ranks",
        ),
        ("critic.model.fsdp_config.param_offload=True", "on the device", "more ranks"),
        ("actor_rollout_ref.actor.strategy=megatron", "FSDP2", "strategy=fsdp2"),
        (
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "no sequence parallelism",
            "ppo_max_token_len_per_gpu",
        ),
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size=64",
            "deprecated global micro-batch size",
            "actor.ppo_micro_batch_size_per_gpu",
        ),
        ("actor_rollout_ref.rollout.ignore_eos=True", "stop at EOS", "ignore_eos=false"),
        ("trainer.default_hdfs_dir=hdfs://x", "local paths only", "trainer.default_local_dir"),
        ("reward_model.reward_manager=prime", "naive manager", "reward.functions"),
        ("actor_rollout_ref.hybrid_engine=False", "colocates", "trainer.mode=async"),
    ],
)
def test_an_unsupported_verl_value_is_refused_saying_why(override: str, why: str, use: str) -> None:
    key = override.partition("=")[0]
    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.train_files=/d.jsonl", override])
    message = str(info.value)
    assert message.startswith(f"verl's {key}=") and "is not supported by patrl: " in message
    assert why in message.split("; use ", 1)[0] and use in message.split("; use ", 1)[1]
    assert "unknown key" not in message


@pytest.mark.parametrize(
    "override",
    [
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.actor.strategy=fsdp",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.model.lora_rank=0",
        "actor_rollout_ref.hybrid_engine=True",
        "actor_rollout_ref.ref.fsdp_config.param_offload=False",
        "data.truncation=error",
        "trainer.val_before_train=True",
    ],
)
def test_a_verl_value_that_asks_for_what_patrl_does_passes_quietly(override: str) -> None:
    notices: list[str] = []
    config = load_config(None, ["data.train_files=/d.jsonl", override], notices)
    assert notices == []
    assert config == load_config(None, ["data.train_files=/d.jsonl", *_own(override)])


def _own(override: str) -> list[str]:
    """The override itself where it names a patrl key, else nothing (it has no effect)."""
    key = override.partition("=")[0]
    return [override] if key.startswith(("data.", "trainer.")) else []


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("actor_rollout_ref.rollout.name=vllm", "its own engine"),
        ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40", "actor's micro-batches"),
        ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40", "actor's micro-batches"),
        ("actor_rollout_ref.ref.fsdp_config.param_offload=True", "frozen reference FSDP2-sharded"),
        ("actor_rollout_ref.ref.some_new_key=1", "builds the reference policy as it builds"),
        ("actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=0", "no wrap policy"),
        ("actor_rollout_ref.rollout.val_kwargs.do_sample=True", "do_sample is not read"),
        ("ray_kwargs.ray_init.num_cpus=8", "without Ray"),
        ("trainer.balance_batch=False", "predicted length"),
    ],
)
def test_a_verl_key_without_effect_is_accepted_with_a_note(override: str, why: str) -> None:
    notices: list[str] = []
    config = load_config(None, ["data.train_files=/d.jsonl", override], notices)
    assert config == load_config(None, ["data.train_files=/d.jsonl"])
    (note,) = notices
    assert note.startswith(f"verl's {override.partition('=')[0]}=") and "has no effect" in note
    assert why in note


def test_an_unknown_verl_key_is_an_unknown_key_naming_both_paths() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["actor_rollout_ref.rollout.tempreature=0.5"])
    message = str(info.value)
    assert "unknown key 'actor_rollout_ref.rollout.tempreature' (patrl's " in message
    assert "did you mean temperature" in message


def test_the_rule_table_never_shadows_patrls_keys_and_aliases_land_on_them() -> None:
    """A rule for one of patrl's own keys would never be read (patrl's key wins); an alias to a
    key patrl does not have would fail at load."""
    from patrl.orchestrator.config import _is_own_key

    for key, rule in verl_keys.RULES.items():
        assert not _is_own_key(key.removesuffix(".*").split(".")), key
        if isinstance(rule, verl_keys.Alias):
            assert _is_own_key(rule.target.split(".")), (key, rule.target)


# ------------------------------------------------------------------------ reward function


def test_custom_reward_function_is_a_reward_function_called_as_verl_calls_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "my_reward.py"
    path.write_text(
        textwrap.dedent(
            """\
            def compute_score(data_source, solution_str, ground_truth, extra_info=None):
                assert data_source == "openai/gsm8k" and extra_info["split"] == "train"
                return {"score": float(solution_str.endswith(ground_truth)), "hit": 1.0}

            def strict(data_source, solution_str, ground_truth, extra_info=None):
                return 1.0 if solution_str == f"#### {ground_truth}" else -1.0
            """
        )
    )
    config = load_config(None, ["data.train_files=/d.jsonl", f"custom_reward_function.path={path}"])
    assert [f.name for f in config.reward.functions] == [f"{path}:compute_score"]
    named = load_config(
        None,
        [
            "data.train_files=/d.jsonl",
            f"custom_reward_function.path={path}",
            "custom_reward_function.name=strict",
        ],
    )
    assert [f.name for f in named.reward.functions] == [f"{path}:strict"]
    meta = {"data_source": "openai/gsm8k", "extra_info": {"split": "train", "index": 3}}
    with RewardManager(
        [(f"{path}:compute_score", 1.0), (f"{path}:strict", 1.0)], num_workers=0
    ) as rm:
        result = rm.score(["so #### 72", "#### 5"], ["72", "5"], [meta, meta])
    assert not result.errors
    assert result.components[f"{path}:compute_score"] == [1.0, 1.0]
    assert result.components[f"{path}:strict"] == [-1.0, 1.0]
    assert result.extras[f"{path}:compute_score/hit"] == [1.0, 1.0]


def test_custom_reward_function_and_reward_functions_are_one_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"custom_reward_function.path=.* and reward.functions"):
        load_config(
            None,
            [
                "data.train_files=/d.jsonl",
                f"custom_reward_function.path={tmp_path / 'r.py'}",
                "reward.functions=[{name: format}]",
            ],
        )
    # verl's default: no path, the built-in scorer
    config = load_config(None, ["data.train_files=/d.jsonl", "custom_reward_function.path=null"])
    assert [f.name for f in config.reward.functions] == ["math_verify"]


# ---------------------------------------------------------------------------- run length


def _job(*overrides: str) -> JobConfig:
    return load_config(None, ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", *overrides])


def test_total_epochs_is_epochs_times_the_batches_an_epoch_draws() -> None:
    config = _job("trainer.total_epochs=3")
    assert config.trainer.total_training_steps is None
    with pytest.raises(RuntimeError, match="not resolved yet"):
        _ = config.total_steps
    resolved = resolve_schedule(config, 10)  # 10 prompts, batches of 4: 2 per epoch (drop_last)
    assert resolved.total_steps == 6
    assert resolved.actor.optim.total_training_steps == 6
    assert resolved.critic.optim.total_training_steps == 6
    assert resolve_schedule(config, None) is config  # the size is not known yet
    with pytest.raises(ConfigError, match="an epoch has no batch"):
        resolve_schedule(config, 3)


def test_total_training_steps_overrides_epochs_and_the_default_is_kept() -> None:
    both = resolve_schedule(_job("trainer.total_epochs=3", "trainer.total_training_steps=5"), 10)
    assert both.total_steps == 5
    assert resolve_schedule(_job(), 10).total_steps == DEFAULT_TOTAL_STEPS
    own = resolve_schedule(
        _job("trainer.total_training_steps=5", "actor.optim.total_training_steps=9"), 10
    )
    assert own.actor.optim.total_training_steps == 9  # an optimizer's own horizon is kept


def test_cosine_and_a_warmup_ratio_take_the_runs_length() -> None:
    config = resolve_schedule(
        _job(
            "trainer.total_epochs=2",
            "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.25",
        ),
        16,
    )
    optim = trainer_config(config).optim
    assert optim.total_training_steps == 8 and optim.num_warmup_steps == 2
    optim.check_horizon()  # the trainer builds its schedule from this


# ------------------------------------------------------------------------- -1 and cadence


def test_top_k_minus_one_is_off_for_training_and_validation() -> None:
    item = PromptItem(0, [1, 2], "p", "a")
    config = _job("rollout.top_k=-1", "rollout.val_kwargs.top_k=-1", "rollout.val_kwargs.top_p=0.9")
    assert sampling_params(config, item, 4, 1.0, (0,)).top_k == 0
    val = sampling_params(config, item, 1, 0.6, (-1,), validation=True)
    assert (val.top_k, val.top_p) == (0, 0.9)
    k = sampling_params(_job("rollout.top_k=20"), item, 4, 1.0, (0,))
    assert k.top_k == 20
    assert sampling_params(_job("rollout.val_kwargs.top_k=5"), item, 1, 0.5, (-1,), True).top_k == 5
    with pytest.raises(ConfigError, match=r"rollout\.top_k"):
        _job("rollout.top_k=-2")


def test_val_only_and_the_dump_dirs_are_verls_and_val_only_needs_val_before_train() -> None:
    config = _job(
        "trainer.val_only=True",
        "trainer.rollout_data_dir=/tmp/r",
        "trainer.validation_data_dir=/tmp/v",
    )
    assert config.trainer.val_only and config.trainer.rollout_data_dir == "/tmp/r"
    assert config.trainer.validation_data_dir == "/tmp/v"
    with pytest.raises(ConfigError, match=r"trainer.val_only=true with trainer.val_before_train"):
        _job("trainer.val_only=True", "trainer.val_before_train=False")


def test_verls_max_samples_keys_are_read() -> None:
    config = _job("data.train_max_samples=100", "data.val_max_samples=20")
    assert (config.data.train_max_samples, config.data.val_max_samples) == (100, 20)
    with pytest.raises(ConfigError, match=r"data.train_max_samples"):
        _job("data.train_max_samples=-5")
    none = _job("data.train_max_samples=null", "data.val_max_samples=null")  # verl: all rows
    assert (none.data.train_max_samples, none.data.val_max_samples) == (-1, -1)


def test_val_kwargs_n_above_one_needs_sampling_and_says_so() -> None:
    config = _job(
        "actor_rollout_ref.rollout.val_kwargs.n=4",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
    )
    assert config.rollout.val_kwargs.n == 4
    with pytest.raises(ConfigError, match=r"val_kwargs.n=4 with rollout.val_kwargs.temperature=0"):
        _job("actor_rollout_ref.rollout.val_kwargs.n=4")


@pytest.mark.parametrize(
    ("test_freq", "before", "validated"),
    [
        (5, True, [0, 5, 10, 12]),  # every 5 steps, and the last
        (4, False, [4, 8, 12]),
        (-1, True, [0]),  # verl: no validation after steps; before training still
        (0, False, []),
        (20, False, [12]),
    ],
)
def test_validation_cadence_is_verls(test_freq: int, before: bool, validated: list[int]) -> None:
    config = resolve_schedule(
        _job(
            "trainer.total_training_steps=12",
            f"trainer.test_freq={test_freq}",
            f"trainer.val_before_train={before}",
        ),
        8,
    )
    assert [s for s in range(13) if validates(config, s)] == validated


@pytest.mark.parametrize(
    ("save_freq", "saved"), [(5, [5, 10, 12]), (4, [4, 8, 12]), (0, [12]), (-1, [])]
)
def test_save_cadence(save_freq: int, saved: list[int]) -> None:
    config = resolve_schedule(
        _job("trainer.total_training_steps=12", f"trainer.save_freq={save_freq}"), 8
    )
    assert [s for s in range(1, 13) if saves(config, s)] == saved


def test_lr_warmup_steps_minus_one_is_accepted_and_below_is_not() -> None:
    assert _job("actor.optim.lr_warmup_steps=-1").actor.optim.num_warmup_steps == 0
    with pytest.raises(ConfigError, match="lr_warmup_steps"):
        _job("actor.optim.lr_warmup_steps=-2")


# ------------------------------------------------------------------------- world and dirs


def test_n_gpus_per_node_and_nnodes_are_checked_against_the_world() -> None:
    config = _job("trainer.n_gpus_per_node=4", "trainer.nnodes=2")
    assert world_problems(config, 8, 4) == []
    (problem,) = world_problems(config, 4, 4)
    assert problem.startswith("trainer.nnodes=2 do not match the world torchrun started")
    assert "WORLD_SIZE=4 with LOCAL_WORLD_SIZE=4" in problem
    assert "torchrun --nnodes 2 --nproc_per_node 4" in problem
    (both,) = world_problems(config, 2, 2)
    assert both.startswith("trainer.n_gpus_per_node=4 and trainer.nnodes=2")
    assert world_problems(_job(), 8, 4) == []  # unset: any world


def test_default_local_dir_is_the_run_folder_holding_the_checkpoints(tmp_path: Path) -> None:
    from patrl.orchestrator import run_checkpoint

    config = _job(f"trainer.default_local_dir={tmp_path / 'ckpt'}")
    assert config.run_dir == tmp_path / "ckpt"
    assert run_checkpoint.step_dir(config.run_dir, 7) == tmp_path / "ckpt" / "global_step_7"
    default = _job("trainer.project_name=p", "trainer.experiment_name=e")
    assert default.run_dir == Path("runs") / "p" / "e"


def test_use_dynamic_bsz_cuts_micro_batches_by_tokens_alone() -> None:
    fixed = _job("actor.ppo_micro_batch_size_per_gpu=2")
    assert trainer_config(fixed).ppo_micro_batch_size_per_gpu == 2
    dynamic = _job("actor.ppo_micro_batch_size_per_gpu=2", "actor.use_dynamic_bsz=true")
    assert trainer_config(dynamic).ppo_micro_batch_size_per_gpu is None
    assert critic_config(dynamic).ppo_micro_batch_size_per_gpu is None  # the critic follows


# ----------------------------------------------------------------------------- assets


def test_model_path_without_train_files_is_refused_and_demo_is_explicit() -> None:
    with pytest.raises(ConfigError, match=r"would train your model on the embedded demo task"):
        load_config(None, ["actor_rollout_ref.model.path=/my/model"])
    config = load_config(None, ["model.path=/my/model", "data.train_files=demo"])
    demo = types.SimpleNamespace(model_dir="/demo/model", train_file="/demo/t", val_file="/demo/v")
    assert choose_assets(config, demo) == ("/my/model", "/demo/t", "/demo/v")
    mine = load_config(None, ["model.path=/m", "data.train_files=/t", "data.val_files=demo"])
    assert choose_assets(mine, demo) == ("/m", "/t", "/demo/v")
    assert choose_assets(load_config(None, []), demo) == ("/demo/model", "/demo/t", "/demo/v")


# ---------------------------------------------------------------------------- loggers


def test_logger_takes_one_name_and_a_missing_wandb_is_a_note(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _job("trainer.logger=console").trainer.logger == ["console"]
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed, whatever this machine has
    notices: list[str] = []
    config = load_config(None, ["trainer.logger=[console,wandb]"], notices)
    assert config.trainer.logger == ["console", "wandb"]
    assert notices == [
        "trainer.logger has wandb, but wandb is not installed (pip install wandb): "
        "metrics go to metrics.jsonl and the other loggers only"
    ]


def test_the_wandb_logger_gets_each_rows_finite_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, Any]] = []

    class Run:
        def log(self, row: dict[str, float], step: int) -> None:
            calls.append(("log", (row, step)))

        def finish(self) -> None:
            calls.append(("finish", None))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = MetricsLogger(
        tmp_path, ["jsonl", "wandb"], 2, wandb_init={"project": "p", "name": "e"}
    )
    logger.log(1, {"critic/score/mean": 0.5, "actor/kl": float("nan")})
    logger.close()
    assert calls == [
        ("init", {"dir": str(tmp_path), "project": "p", "name": "e"}),
        ("log", ({"critic/score/mean": 0.5}, 1)),
        ("finish", None),
    ]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_without_wandb_installed_the_logger_warns_and_keeps_going(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    logger = MetricsLogger(tmp_path, ["jsonl", "wandb"], 1)
    logger.log(1, {"critic/score/mean": torch.tensor(1.0).item()})
    logger.close()
    assert "wandb is not installed (pip install wandb)" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").is_file()


# ------------------------------------------------------------------------- val_batch_size


def test_validation_batches_cover_every_prompt_in_order() -> None:
    from patrl.orchestrator.data import PromptDataset
    from patrl.orchestrator.sampling import validation_batches

    items = [PromptItem(i, [1, i], f"p{i}", str(i)) for i in range(7)]
    val = PromptDataset(items, num_rows=7, num_filtered_overlong=0)
    batches = validation_batches(_job("data.val_batch_size=3"), val)
    assert [[it.index for it in b] for b in batches] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [[it.index for it in b] for b in validation_batches(_job(), val)] == [list(range(7))]


def test_async_validation_runs_batch_after_batch_and_scores_every_prompt() -> None:
    """The async schedule's validation (rollout rank 0): `data.val_batch_size` requests in the
    engine at a time, the next batch when one is done, one result for all prompts."""
    import pickle

    from patrl.orchestrator.async_rl.validation import Validation
    from patrl.orchestrator.data import PromptDataset
    from patrl.rollout.outputs import CompletionOutput, RequestOutput

    class Engine:
        weight_version = 3

        def __init__(self) -> None:
            self.waiting: list[tuple[str, Any]] = []
            self.added: list[list[str]] = []

        def add_request(self, ids: list[int], params: Any, request_id: str) -> None:
            self.waiting.append((request_id, params))

        def run_batch(self) -> list[RequestOutput]:
            batch, self.waiting = self.waiting, []
            self.added.append([rid for rid, _ in batch])
            return [  # `params.n` responses, all right on prompts 0 and 2
                RequestOutput(
                    rid,
                    [1],
                    [CompletionOutput(j, [5], [-0.1], "stop", text=text) for j in range(params.n)],
                )
                for (rid, params), text in zip(
                    batch,
                    ["\\boxed{4}" if rid.endswith(("0", "2")) else "no" for rid, _ in batch],
                    strict=True,
                )
            ]

    class Control:
        def __init__(self) -> None:
            self.put_values: dict[str, bytes] = {}

        def put(self, key: str, value: bytes) -> None:
            self.put_values[key] = value

    sources = ["a", "a", "a", "b", "b"]
    items = [PromptItem(i, [1, i], f"p{i}", str(i), {"data_source": sources[i]}) for i in range(5)]
    config = _job(
        "data.val_batch_size=2", "rollout.val_kwargs.temperature=0.5", "rollout.val_kwargs.n=2"
    )
    control, engine = Control(), Engine()
    with RewardManager([("format", 1.0)], num_workers=0) as rewards:
        validation = Validation(config, PromptDataset(items, 5, 0), rewards, control)  # type: ignore[arg-type]
        validation.begin(engine)  # type: ignore[arg-type]
        while validation.pending:
            for out in engine.run_batch():
                validation.finish(out, engine)  # type: ignore[arg-type]
    assert engine.added == [["val-3-0", "val-3-1"], ["val-3-2", "val-3-3"], ["val-3-4"]]
    metrics = pickle.loads(control.put_values["val/3"])
    assert metrics["val-core/acc/mean@1"] == pytest.approx(2 / 5)  # every response scored once
    # verl's per-source metrics over each prompt's 2 responses: source a has prompts 0 and 2
    # right, 1 wrong; b none right (all a prompt's responses agree, so no spread)
    assert metrics["val-core/a/reward/mean@2"] == pytest.approx(2 / 3)
    assert metrics["val-core/b/reward/mean@2"] == 0.0
    assert metrics["val-core/a/reward/best@2/mean"] == pytest.approx(2 / 3)
    assert metrics["val-aux/a/reward/std@2"] == 0.0


def test_docs_verl_md_lists_the_rule_table_as_the_code_has_it() -> None:
    text = (Path(__file__).resolve().parents[3] / "docs" / "verl.md").read_text()
    start, end = "<!-- verl-keys:start -->\n", "<!-- verl-keys:end -->"
    embedded = text.split(start, 1)[1].split(end, 1)[0]
    assert embedded.strip() == verl_keys.rules_table().strip(), (
        "docs/verl.md's table is stale: regenerate it from "
        "patrl.orchestrator.verl_keys.rules_table()"
    )
