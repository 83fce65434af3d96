"""Everything about a job's inputs that can be checked before any work starts.

`load` reads the configuration (config.yaml_settings, the one walk over the file), naming the
file line of bad YAML and unknown keys (with close matches) and the dotted key of wrong types.
`check` validates the model directory, data files, reward functions, TP layout, world shape,
resume checkpoint, critic and reward models, what the job's schedule does not run (support.py),
an explicit KV cache and the run directory's writability against the world the job will run in,
and returns the config with the run's length resolved (`trainer.total_epochs` needs the train
set's size). Both run on every rank before a process group is joined, write nothing of
the run (`datasets` may fill its own cache), and raise one PreflightError listing every problem:

    config = preflight.check(preflight.load("job.yaml", ["rollout.n=8"]), world_size=2)
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from patrl.lenpredict import usable_tp_sizes
from patrl.orchestrator import run_checkpoint, support, verl_keys
from patrl.orchestrator.build import tp_candidates
from patrl.orchestrator.config import (
    DEMO_FILES,
    ConfigError,
    JobConfig,
    Setting,
    config_from_settings,
    load_config,
    resolve_schedule,
    unknown_key,
    unknown_part,
    yaml_settings,
)
from patrl.orchestrator.data import PromptDataset, dataset_for
from patrl.orchestrator.demo_provider import (
    DemoAssets,
    DemoProvider,
    DemoUnavailable,
    load_demo_provider,
)
from patrl.orchestrator.learned_reward import reward_model_problems
from patrl.rollout.layers.lora import LORA_TARGETS
from patrl.rollout.loader import check_model_dir, expected_shapes, read_tokenizer
from patrl.rollout.model_config import ModelArch
from patrl.trainer.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    LoraConfig,
    select_targets,
)

T = TypeVar("T")
# What reading a user's files raises when the files are wrong (not when our code is).
_INPUT_ERRORS = (ValueError, OSError, KeyError, SafetensorError)


class PreflightError(ConfigError):
    """One or more problems with a job's inputs, each phrased for the user (`problems`)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        if len(problems) == 1:
            super().__init__(problems[0])
        else:
            super().__init__(f"{len(problems)} problems:\n  - " + "\n  - ".join(problems))


# ------------------------------------------------------------------------------ configuration


def load(
    path: str | Path | None,
    overrides: list[str] | None = None,
    notices: list[str] | None = None,
) -> JobConfig:
    """`load_config`, with the YAML's syntax and keys checked first so that errors carry lines;
    `notices` collects load_config's notices."""
    if path is None:
        return load_config(None, overrides, notices)
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"config file {str(path)!r}: {err.strerror}") from None
    try:
        settings = yaml_settings(text, str(path))
    except ConfigError as err:
        raise PreflightError([str(err)]) from None
    lines = key_lines(str(path), settings)
    try:
        return config_from_settings(settings, overrides, notices)
    except ConfigError as err:
        written = [item.partition("=")[0].strip() for item in overrides or []]
        overridden = set(written) | {_patrl_key(key) for key in written}
        raise ConfigError(str(err) + _locations(str(err), str(path), lines, overridden)) from None


def key_lines(path: str, settings: list[Setting]) -> dict[str, int]:
    """Patrl's dotted key -> line, for every known key of a YAML file's `settings` (a verl key
    under the patrl key it is read as); raises PreflightError for unknown or repeated keys (all
    of them, each with its line). A verl-spelled key that is no key is load_config's to name."""
    lines: dict[str, int] = {}
    problems: list[str] = []
    for s in settings:
        parts = s.key.split(".")
        depth = unknown_part(parts)
        if depth is None and s.key in lines:
            problems.append(
                f"{path} line {s.line}: key {s.key!r} is set twice (first on line "
                f"{lines[s.key]}); keep one"
            )
        elif depth is None:
            lines[s.key] = s.line
        elif verl_keys.is_section(verl_keys.patrl_parts(parts[: depth + 1])):
            if s.kind != "section":  # a verl key: where it lands
                lines.setdefault(_patrl_key(s.key), s.line)
        else:
            problems.append(f"{path} line {s.line}: {unknown_key(parts)}")
    if problems:
        raise PreflightError(problems)
    return lines


def _patrl_key(written: str) -> str:
    """The patrl key a verl-spelled key (on the command line or in the YAML) lands on: itself
    after the section rename, or the patrl key an alias reads it as."""
    parts = verl_keys.patrl_parts(written.split("."))
    rule = verl_keys.rule_for(parts)
    return rule.target if isinstance(rule, verl_keys.Alias) else ".".join(parts)


def _locations(message: str, path: str, lines: dict[str, int], overridden: set[str]) -> str:
    """Where each key the message names was set: on the command line (an override wins over
    the file), or in the file's line (the most specific key only). A section the message names
    (a check of several keys together) is blamed on the keys set beneath it."""
    keys = set(lines) | overridden
    named = [k for k in keys if re.search(rf"(?<![\w.]){re.escape(k)}(?=[:.'= ]|$)", message)]
    for section in set(re.findall(r"(?<![\w.])[a-z_]\w*(?:\.\w+)+(?=[: ]|$)", message)):
        named += [k for k in keys if k.startswith(section + ".")]
    named = [k for k in named if not any(o.startswith(k + ".") for o in named)]
    return "".join(
        f"\n  ({k} is set on the command line)"
        if k in overridden
        else f"\n  ({k} is set in {path} line {lines[k]})"
        for k in sorted(named)
    )


# ----------------------------------------------------------------------------------- inputs


def check(config: JobConfig, world_size: int, local_world_size: int | None = None) -> JobConfig:
    """Raise PreflightError listing every problem of the model, data, rewards, layout and
    checkpoint for a run on `world_size` ranks, `local_world_size` per node (default: one
    node); else return `config` with the run's length resolved (`resolve_schedule`; an epoch
    count stays unresolved where the train set is not read here).

    What comes from the embedded demo is checked when the demo is already built, and left to
    its build (which makes known-good assets) when not; data of the job's own given with the
    demo's model is read with the demo's tokenizer either way."""
    problems: list[str] = []
    demo = _demo_provider(config, problems)
    model_dir, train_files, val_files = choose_assets(config, _built_demo(demo))
    model, tokenizer = _model(model_dir, problems) if model_dir is not None else (None, None)
    num_train = None
    # The demo's model is built later (minutes of SFT): data given with it is read with the
    # demo's tokenizer now, so a bad file is named before that build, not after.
    data_tokenizer = tokenizer if model_dir is not None else _demo_tokenizer(config, demo)
    if data_tokenizer is not None:
        data_problems, num_train = _data_problems(config, data_tokenizer, train_files, val_files)
        problems += data_problems
    problems += run_dir_problems(config.run_dir)
    problems += _kv_problems(config)
    local = local_world_size or world_size
    problems += world_problems(config, world_size, local)
    problems += _reward_problems(config)
    problems += tool_config_problems(config)
    problems += interaction_config_problems(config)
    problems += support.unsupported(config, world_size)  # what the job's schedule does not run
    adaptive = config.rollout.adaptive_tp
    # what build.engine_config offers: no fold larger than a node; default candidates the
    # model cannot split into are dropped, explicit ones are judged below
    usable = (
        tp_candidates(config, world_size, local, model)
        if model is not None
        else usable_tp_sizes(adaptive.candidates, world_size, local)
    )
    if adaptive.enable and len(usable) >= 2:  # else the job runs static TP
        for t in usable:
            problems += layout_problems(
                t, world_size, local, model, "rollout.adaptive_tp.candidates"
            )
        if adaptive.profile is not None and not Path(adaptive.profile).is_file():
            problems.append(f"rollout.adaptive_tp.profile={adaptive.profile}: no such file")
    else:
        tp = config.rollout.tensor_model_parallel_size
        problems += layout_problems(tp, world_size, local, model)
    spec = config.rollout.speculative
    if (
        spec.enable
        and spec.latency_profile is not None
        and not Path(spec.latency_profile).is_file()
    ):
        problems.append(f"rollout.speculative.latency_profile={spec.latency_profile}: no such file")
    if model is not None:
        problems += _length_problems(config, model)
        problems += _resume_problems(config, model)
    problems += reward_model_problems(config)
    problems += _critic_problems(config, tokenizer)
    problems += lora_problems(config, model_dir if model is not None else None)
    if problems:
        raise PreflightError(problems)
    return resolve_schedule(config, num_train)


def world_problems(config: JobConfig, world_size: int, local_world_size: int) -> list[str]:
    """verl's `trainer.n_gpus_per_node` / `trainer.nnodes`, where set, against the world
    torchrun started (WORLD_SIZE ranks, LOCAL_WORLD_SIZE per node)."""
    t = config.trainer
    nodes = world_size // local_world_size if world_size % local_world_size == 0 else None
    wrong = []
    if t.n_gpus_per_node is not None and t.n_gpus_per_node != local_world_size:
        wrong.append(f"trainer.n_gpus_per_node={t.n_gpus_per_node}")
    if t.nnodes is not None and t.nnodes != nodes:
        wrong.append(f"trainer.nnodes={t.nnodes}")
    if not wrong:
        return []
    per_node = t.n_gpus_per_node or local_world_size
    count = t.nnodes or nodes or 1
    return [
        f"{' and '.join(wrong)} do not match the world torchrun started: WORLD_SIZE="
        f"{world_size} with LOCAL_WORLD_SIZE={local_world_size} per node; launch "
        f"`torchrun --nnodes {count} --nproc_per_node {per_node}`, or set "
        "trainer.n_gpus_per_node and trainer.nnodes to that world (or leave them unset)"
    ]


def multi_turn_problems(config: JobConfig) -> list[str]:
    """`rollout.multi_turn`: its tool config loads (`tool_config_problems`), and what
    `enable=true` needs (`support.multi_turn_refusals`)."""
    return [
        *tool_config_problems(config),
        *interaction_config_problems(config),
        *agent_loop_config_problems(config),
        *support.multi_turn_refusals(config),
    ]


def tool_config_problems(config: JobConfig) -> list[str]:
    """`rollout.multi_turn.tool_config_path`, where set: the file, each class_name's import,
    each schema's name."""
    path = config.rollout.multi_turn.tool_config_path
    if path is None:
        return []
    from patrl.orchestrator.agent.tool_config import check_tool_config

    return [f"rollout.multi_turn.tool_config_path: {p}" for p in check_tool_config(path)]


def interaction_config_problems(config: JobConfig) -> list[str]:
    """`rollout.multi_turn.interaction_config_path`, where set: the file, each entry's
    class_name import, names."""
    path = config.rollout.multi_turn.interaction_config_path
    if path is None:
        return []
    from patrl.orchestrator.agent.interaction import check_interaction_config

    return [
        f"rollout.multi_turn.interaction_config_path: {p}" for p in check_interaction_config(path)
    ]


def agent_loop_config_problems(config: JobConfig) -> list[str]:
    """`rollout.agent.agent_loop_config_path`, where set: the file and each entry's class."""
    if config.rollout.agent.agent_loop_config_path is None:
        return []
    from patrl.orchestrator.agent.multi_turn import agent_loop_classes
    from patrl.orchestrator.agent.tool_config import ToolConfigError

    try:
        agent_loop_classes(config)
    except ToolConfigError as e:
        return [f"rollout.agent.agent_loop_config_path: {e}"]
    return []


def _reward_problems(config: JobConfig) -> list[str]:
    """Each reward function's spec resolves (a module imports, a file exists, the function is
    there), as the reward workers will resolve it."""
    from patrl.orchestrator.rewards import resolve_reward_fn

    problems: list[str] = []
    for i, fn in enumerate(config.reward.functions):
        _attempt(problems, f"reward.functions.{i}.name", partial(resolve_reward_fn, fn.name))
    return problems


def choose_assets(config: JobConfig, demo: DemoAssets | None) -> tuple[str | None, Any, Any]:
    """(model dir, train files, val files): the configured ones, the demo's for what is not
    configured or is named `demo` (None where that is needed and `demo` is None)."""
    model, train, val = config.model.path, config.data.train_files, config.data.val_files
    on_demo = train is None or train == DEMO_FILES
    if model is None and demo is not None:
        model = str(demo.model_dir)
    if (val == DEMO_FILES or (val is None and on_demo)) and demo is not None:
        val = str(demo.val_file)
    elif val == DEMO_FILES:
        val = None
    if on_demo:
        train = str(demo.train_file) if demo is not None else None
    return model, train, val


def uses_demo(config: JobConfig) -> bool:
    """Whether the job takes anything from the demo task."""
    return bool(demo_keys(config))


def demo_keys(config: JobConfig) -> list[str]:
    """The settings that take something from the demo task, phrased for the user (e.g.
    "model.path is unset"); empty when the job brings its own model and data."""
    d = config.data
    keys = []
    if config.model.path is None:
        keys.append("model.path is unset")
    if d.train_files is None:
        keys.append("data.train_files is unset")
    elif d.train_files == DEMO_FILES:
        keys.append(f"data.train_files={DEMO_FILES}")
    if d.val_files == DEMO_FILES:
        keys.append(f"data.val_files={DEMO_FILES}")
    return keys


def demo_provider_for(config: JobConfig) -> DemoProvider:
    """The installed demo task's provider (`demo_provider.load_demo_provider`) for a job that
    uses it; DemoUnavailable naming the settings that ask for it when none is installed."""
    return load_demo_provider(" and ".join(demo_keys(config)))


def layout_problems(
    tp: int,
    world_size: int,
    local_world_size: int,
    model: ModelArch | None,
    key: str = "rollout.tensor_model_parallel_size",
) -> list[str]:
    """Why `tp` fits no layout of `world_size` ranks (`local_world_size` per node) for `model`,
    and the sizes that would. A TP group is contiguous ranks inside one node (its per-layer
    collectives need the node's links): its size divides the ranks per node."""

    def why_not(t: int) -> list[str]:
        why = [f"it does not divide the world size {world_size}"] if world_size % t else []
        if t > local_world_size:
            why.append(
                f"it is larger than a node (LOCAL_WORLD_SIZE={local_world_size}): a TP group "
                "stays inside one node"
            )
        elif local_world_size % t:
            why.append(f"its groups would straddle nodes of {local_world_size} ranks")
        if model is not None and (error := _split_error(model, t)) is not None:
            why.append(f"the model cannot be split {t} ways ({error})")
        return why

    why = why_not(tp)
    if not why:
        return []
    fits = [t for t in range(1, world_size + 1) if not why_not(t)]
    return [
        f"{key}={tp} fits no layout of world size {world_size}: "
        f"{' and '.join(why)}; with world size {world_size}"
        f"{' and this model' if model is not None else ''} it can be one of {fits}"
    ]


def _split_error(model: ModelArch, tp: int) -> str | None:
    try:
        model.check_tp(tp)
    except ValueError as err:
        return str(err)
    return None


def _model(model_dir: str, problems: list[str]) -> tuple[ModelArch | None, Any]:
    if Path(model_dir).is_file():
        problems.append(
            f"model.path: {model_dir} is a file, expected a directory (a Hugging Face model "
            f"directory: config.json, *.safetensors, tokenizer files); did you mean "
            f"{Path(model_dir).parent}?"
        )
        return None, None
    model = _attempt(problems, "model.path", lambda: check_model_dir(model_dir))
    if model is None:
        return None, None
    tokenizer = _attempt(problems, "model.path", lambda: _tokenizer(model_dir))
    if tokenizer is not None and len(tokenizer) > model.vocab_size:
        problems.append(
            f"model.path: {model_dir}: its tokenizer has {len(tokenizer)} tokens but the model's "
            f"vocab_size={model.vocab_size}: token ids past the embedding ({model.vocab_size} to "
            f"{len(tokenizer) - 1}) cannot be embedded; use the model's own tokenizer, or resize "
            "the model's embeddings (resize_token_embeddings) and save it"
        )
        return model, None
    return model, tokenizer


def _length_problems(config: JobConfig, model: ModelArch) -> list[str]:
    """A prompt and its response must fit the model's positions."""
    d = config.data
    if d.max_prompt_length + d.max_response_length <= model.max_position_embeddings:
        return []
    return [
        f"data.max_prompt_length={d.max_prompt_length} + data.max_response_length="
        f"{d.max_response_length} = {d.max_prompt_length + d.max_response_length} tokens exceed "
        f"the model's max_position_embeddings={model.max_position_embeddings}; lower either "
        "so that their sum fits"
    ]


def _kv_problems(config: JobConfig) -> list[str]:
    """An explicit KV cache (rollout.num_kv_blocks x rollout.block_size) must hold one whole
    sequence (data.max_prompt_length + data.max_response_length), as the engine requires."""
    r, d = config.rollout, config.data
    if r.num_kv_blocks is None or r.block_size is None:
        return []  # sized from memory, or the block size is the backend's: the engine checks
    tokens = d.max_prompt_length + d.max_response_length
    if r.num_kv_blocks * r.block_size >= tokens:
        return []
    need = -(-tokens // r.block_size)
    return [
        f"rollout.num_kv_blocks={r.num_kv_blocks} x rollout.block_size={r.block_size} = "
        f"{r.num_kv_blocks * r.block_size} tokens of KV cache cannot hold one sequence of "
        f"data.max_prompt_length + data.max_response_length = {tokens} tokens; use "
        f"rollout.num_kv_blocks >= {need} (or leave it unset to size the cache from memory)"
    ]


def _data_problems(
    config: JobConfig, tokenizer: Any, train_files: Any, val_files: Any
) -> tuple[list[str], int | None]:
    """The data's problems, and the train set's size (None where it was not read)."""
    problems: list[str] = []
    size = None
    names = [train_files] if isinstance(train_files, str) else list(train_files or [])
    if train_files is not None and (not names or not all(str(n).strip() for n in names)):
        problems.append(
            f"data.train_files={train_files!r} names no file; give one or more .jsonl / "
            f".parquet files (a path or a list of paths), or {DEMO_FILES} for the demo task"
        )
    elif train_files is not None:
        train = _attempt(
            problems, "data.train_files", lambda: _dataset(config, train_files, tokenizer)
        )
        if train is not None:
            problems += _batch_problems(config, train)
            problems += _agent_name_problems(config, "data.train_files", train)
            problems += _interaction_row_problems(config, "data.train_files", train)
            size = len(train)
    if val_files:
        val = _attempt(
            problems, "data.val_files", lambda: _dataset(config, val_files, tokenizer, True)
        )
        if val is not None:
            problems += _agent_name_problems(config, "data.val_files", val)
            problems += _interaction_row_problems(config, "data.val_files", val)
    return problems, size


def _agent_name_problems(config: JobConfig, key: str, data: PromptDataset) -> list[str]:
    """A multi-turn job's rows name registered agent loops (`agent_name`, verl's)."""
    if not config.rollout.multi_turn.enable:
        return []
    from patrl.orchestrator.agent.multi_turn import agent_loop_classes, agent_name_problems
    from patrl.orchestrator.agent.tool_config import ToolConfigError

    try:
        names = agent_loop_classes(config)
    except ToolConfigError:
        return []  # multi_turn_problems names it
    return [f"{key}: {p}" for p in agent_name_problems(data.items, names)]


def _interaction_row_problems(config: JobConfig, key: str, data: PromptDataset) -> list[str]:
    """A multi-turn job with interactions: each row's `extra_info.interaction_kwargs` (where
    it has one) names a configured interaction; one line per distinct problem, naming its
    first row."""
    mt = config.rollout.multi_turn
    if not mt.enable or mt.interaction_config_path is None:
        return []
    from patrl.orchestrator.agent.interaction import (
        InteractionConfigError,
        interaction_kwargs,
        interaction_row_problem,
        load_interactions,
    )

    try:
        names = list(load_interactions(mt.interaction_config_path))
    except InteractionConfigError:
        return []  # interaction_config_problems names it
    first: dict[str, int] = {}
    for item in data.items:
        info = item.extra.get("extra_info")
        raw = info.get("interaction_kwargs") if isinstance(info, dict) else None
        if raw is None:
            raw = item.extra.get("interaction_kwargs")
        if raw is None:
            continue
        problem = interaction_row_problem(
            interaction_kwargs(item.extra) if isinstance(raw, dict) else raw, names
        )
        if problem is not None:
            first.setdefault(problem, item.index)
    return [f"{key}: row {row}: {p}" for p, row in first.items()]


def _resume_problems(config: JobConfig, model: ModelArch) -> list[str]:
    t = config.trainer
    target = run_checkpoint.resume_target(config.run_dir, t.resume_mode, t.resume_from_path)
    if target is None:
        return []
    shapes, optional = expected_shapes(model)
    key = "trainer.resume_from_path" if t.resume_mode == "resume_path" else "trainer.resume_mode"
    problems: list[str] = []
    _attempt(problems, key, lambda: run_checkpoint.check_resumable(target, shapes, optional))
    return problems


def _batch_problems(config: JobConfig, train: PromptDataset) -> list[str]:
    d = config.data
    if len(train) >= d.train_batch_size:
        return []
    return [
        f"data.train_batch_size={d.train_batch_size} but data.train_files leaves "
        f"{len(train)} prompts ({train.num_filtered_overlong} of {train.num_rows} rows "
        f"filtered as longer than data.max_prompt_length={d.max_prompt_length}): no batch "
        f"can be drawn; lower data.train_batch_size to at most {len(train)}"
    ]


def _dataset(
    config: JobConfig, files: Any, tokenizer: Any, validation: bool = False
) -> PromptDataset:
    with _quiet_datasets():
        return dataset_for(config, tokenizer, files, validation)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No progress bars from `datasets` while checking: the user should see only the verdict."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _tokenizer(model_dir: str) -> Any:
    try:
        return read_tokenizer(model_dir)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{model_dir!r} has no usable tokenizer (tokenizer.json / tokenizer_config.json, "
            f"as save_pretrained writes them): {err}"
        ) from None


def _demo_provider(config: JobConfig, problems: list[str]) -> DemoProvider | None:
    """The demo task's provider if the run would use it; else None, with the problem added to
    `problems` when it would and none is installed."""
    if not uses_demo(config):
        return None
    try:
        return demo_provider_for(config)
    except DemoUnavailable as err:
        problems.append(str(err))
        return None


def _built_demo(demo: DemoProvider | None) -> DemoAssets | None:
    """The demo's assets if the run uses them (`demo` is its provider) and they are built;
    else None."""
    return demo.built_assets() if demo is not None else None


def _attempt(problems: list[str], key: str, fn: Callable[[], T]) -> T | None:
    """fn(), or None with its error, under `key`, added to `problems`."""
    try:
        return fn()
    except _INPUT_ERRORS as err:
        # KeyError's str() is the repr of its message; the message is what the user needs.
        text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        problems.append(f"{key}: {text}")
        return None


def _critic_problems(config: JobConfig, tokenizer: Any) -> list[str]:
    """With a critic (gae): its model directory, its vocabulary against the policy's
    `tokenizer` (None: not checked) as the policy's own is checked, and a checkpoint to
    resume that has none."""
    if not config.use_critic:
        return []
    problems = []
    path = config.critic.model.path
    if path is not None and not (Path(path) / "config.json").is_file():
        problems.append(
            f"critic.model.path={path}: no config.json there; name a Hugging Face model "
            "directory (a value model, or a causal LM to start a new value head), or leave it "
            "unset to use the policy's backbone"
        )
    elif path is not None and tokenizer is not None:
        vocab = _vocab_size(Path(path) / "config.json")
        if vocab is not None and len(tokenizer) > vocab:
            problems.append(
                f"critic.model.path={path}: its vocab_size={vocab} but the policy's tokenizer "
                f"(model.path) has {len(tokenizer)} tokens: the critic cannot embed token ids "
                f"{vocab} to {len(tokenizer) - 1} of the policy's prompts and responses; use a "
                "critic of the policy's family and tokenizer, or leave critic.model.path unset "
                "to start from the policy's backbone"
            )
    t = config.trainer
    target = run_checkpoint.resume_target(config.run_dir, t.resume_mode, t.resume_from_path)
    if (
        target is not None
        and (target / run_checkpoint.STATE_FILE).is_file()
        and not (target / run_checkpoint.CRITIC_DIR).is_dir()
    ):
        key = (
            "trainer.resume_from_path" if t.resume_mode == "resume_path" else "trainer.resume_mode"
        )
        problems.append(
            f"{key}: checkpoint {str(target)!r} has no {run_checkpoint.CRITIC_DIR}/ (saved without "
            "a critic) but algorithm.adv_estimator=gae trains one; resume with the estimator it "
            "was saved with, or start afresh (trainer.resume_mode=disable)"
        )
    return problems


def _vocab_size(config_json: Path) -> int | None:
    """The `vocab_size` a model's config.json records (None where it records none, or is
    unreadable: the critic's build reports that)."""
    import json

    try:
        value = json.loads(config_json.read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def _demo_tokenizer(config: JobConfig, demo: DemoProvider | None) -> Any:
    """The demo model's tokenizer (built in memory: no file is read or written) where the job
    uses the demo's model with data of its own (`demo` is its provider); else None."""
    d = config.data
    if demo is None or config.model.path is not None or d.train_files in (None, DEMO_FILES):
        return None
    return demo.build_tokenizer()


def run_dir_problems(run_dir: Path) -> list[str]:
    """Whether the job can write its run directory (`trainer.default_local_dir`, else
    runs/<project_name>/<experiment_name>): it, or the nearest part of its path that exists,
    must be a directory this process may write. Checked without writing anything."""
    import os

    existing = run_dir.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    key = "trainer.default_local_dir"
    if not existing.is_dir():
        return [
            f"{key}: the run directory {run_dir} cannot be made: {existing} is a file, not a "
            "directory; choose another trainer.default_local_dir"
        ]
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "is on a read-only filesystem" if _read_only(existing) else "is not writable"
        what = "it" if existing == run_dir.absolute() else "its ancestor"
        return [
            f"{key}: the run directory {run_dir} cannot be written: {what} {existing} {why} "
            "(checkpoints, metrics and the run lock go there); choose a writable "
            "trainer.default_local_dir"
        ]
    return []


def _read_only(path: Path) -> bool:
    import os

    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def lora_problems(config: JobConfig, model_dir: str | None) -> list[str]:
    """verl's LoRA keys: the policy's (`model.lora_*`, `_policy_lora_problems`) and the
    critic's (`critic.model.lora_*`: target_modules entries that match no linear layer of the
    critic's model). `model_dir` None (the demo, built later) skips the models' checks."""
    problems = _policy_lora_problems(config, model_dir)
    c = config.critic.model
    source = c.path or model_dir
    # a critic.model.path without a config.json is _critic_problems' to report
    if (
        config.use_critic
        and c.lora_rank > 0
        and source
        and (Path(source) / "config.json").is_file()
    ):
        lora = LoraConfig(
            lora_rank=c.lora_rank, lora_alpha=c.lora_alpha, target_modules=c.target_modules
        )
        key = "critic.model.target_modules"
        _attempt(problems, key, lambda: _meta_targets(source, lora, "critic.model"))
    return problems


def _meta_targets(model_dir: str, lora: LoraConfig, key: str) -> list[str]:
    """`select_targets` on `model_dir`'s model built on the meta device (no weights read)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return select_targets(model, lora, key)


def _policy_lora_problems(config: JobConfig, model_dir: str | None) -> list[str]:
    """verl's `model.lora_*` keys: a rank that is not 0 (off) or positive; adapter settings
    without a rank; target_modules entries that match no linear layer of the model (or one the
    engine cannot adapt); an adapter directory that is not a PEFT LoRA of this model (rank,
    base model, tensor shapes); `model.lora.merge` without a rank or with adaptive TP.
    `model_dir` None (the demo, built later) skips the model's checks."""
    m = config.model
    if m.lora_rank < 0:
        return [f"model.lora_rank={m.lora_rank}: accepted: 0 (LoRA off) or a positive rank"]
    if m.lora_rank == 0:
        if m.lora_adapter_path is not None:
            return [
                f"model.lora_adapter_path={m.lora_adapter_path} needs model.lora_rank > 0 "
                "(0 is full fine-tuning); set model.lora_rank to the adapter's r"
            ]
        if m.lora.merge:
            return [
                "model.lora.merge=true needs model.lora_rank > 0 (0 is full fine-tuning: "
                "there are no adapters to merge); set model.lora_rank or model.lora.merge=false"
            ]
        return []
    problems: list[str] = []
    if m.lora.merge and config.rollout.adaptive_tp.enable:
        problems.append(
            "model.lora.merge=true runs the engine at a static TP (a fold would re-cut merged "
            "weights whose unmerged copies keep the old cut); set "
            "rollout.adaptive_tp.enable=false or model.lora.merge=false"
        )
    if model_dir is None:
        return problems
    linears = _attempt(problems, "model.target_modules", lambda: _lora_targets(config, model_dir))
    if linears is not None and m.lora_adapter_path is not None:
        problems += _adapter_problems(config, model_dir, linears)
    return problems


def _lora_targets(config: JobConfig, model_dir: str) -> dict[str, tuple[int, int]]:
    """Full name -> (in, out) of each linear module LoRA adapts, from the model built on the
    meta device (no weights read). Raises ValueError naming the key and accepted values."""
    m = config.model
    lora = LoraConfig(
        lora_rank=m.lora_rank,
        lora_alpha=m.lora_alpha,
        target_modules=m.target_modules,
        exclude_modules=m.exclude_modules,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    targets = select_targets(model, lora)
    unsupported = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(LORA_TARGETS))
    if unsupported:
        raise ValueError(
            f"model.target_modules={m.target_modules!r} selects {unsupported}, which the rollout "
            f"engine cannot adapt; accepted: 'all-linear' or names among {list(LORA_TARGETS)}"
        )
    out = {}
    for name in targets:
        mod = model.get_submodule(name)
        out[name] = (int(mod.in_features), int(mod.out_features))
    return out


def _adapter_problems(
    config: JobConfig, model_dir: str, linears: dict[str, tuple[int, int]]
) -> list[str]:
    """The adapter directory against the model: a PEFT LoRA config of the same rank, a base
    model that is this one (where it names a local directory), and every tensor's shape."""
    m = config.model
    key = f"model.lora_adapter_path={m.lora_adapter_path}"
    root = Path(str(m.lora_adapter_path))
    cfg_file, weights = root / ADAPTER_CONFIG, root / ADAPTER_WEIGHTS
    if not cfg_file.is_file() or not weights.is_file():
        return [
            f"{key}: not a PEFT adapter directory (accepted: one holding {ADAPTER_CONFIG} and "
            f"{ADAPTER_WEIGHTS}, as save_pretrained writes them)"
        ]
    about = json.loads(cfg_file.read_text())
    if about.get("peft_type") not in (None, "LORA") or about.get("r") != m.lora_rank:
        return [
            f"{key}: a {about.get('peft_type')} adapter of r={about.get('r')}; accepted: a LORA "
            f"adapter of r = model.lora_rank={m.lora_rank}"
        ]
    problems = []
    base = about.get("base_model_name_or_path")
    if base and Path(base).is_dir() and not _same_model(Path(base), Path(model_dir)):
        problems.append(
            f"{key}: the adapter's base model {base} differs from model.path={model_dir} "
            "(config.json disagrees); accepted: an adapter trained on model.path"
        )
    try:
        with safe_open(str(weights), "pt") as f:
            shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
    except SafetensorError as err:
        return [*problems, f"{key}: {weights.name} is not readable safetensors: {err}"]
    for name, (fan_in, fan_out) in linears.items():
        want = {
            f"{PEFT_PREFIX}{name}.lora_A.weight": (m.lora_rank, fan_in),
            f"{PEFT_PREFIX}{name}.lora_B.weight": (fan_out, m.lora_rank),
        }
        for tensor, shape in want.items():
            if shapes.get(tensor) != shape:
                got = "missing" if tensor not in shapes else f"shape {list(shapes[tensor])}"
                problems.append(
                    f"{key}: {tensor} is {got}, this model's adapter needs {list(shape)}: the "
                    "adapter's base model, rank or target modules differ from model.path, "
                    "model.lora_rank and model.target_modules"
                )
                return problems
    return problems


def _same_model(a: Path, b: Path) -> bool:
    """Whether two model directories hold the same architecture (config.json's sizes)."""
    keys = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
    try:
        ca, cb = (json.loads((p / "config.json").read_text()) for p in (a, b))
    except (OSError, ValueError):
        return True  # nothing to compare: the shape check decides
    return all(ca.get(k) == cb.get(k) for k in keys)
