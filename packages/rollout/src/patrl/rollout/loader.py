"""Read a Hugging Face model directory and load full tensors into a TP-sharded model.

`load_weights(model, named_tensors)` is the only weight path: checkpoint loading feeds it the
directory's safetensors, and weight sync feeds it the trainer's full tensors under their HF
names. Each parameter's `weight_loader` cuts the tensor for this rank's layout.
`check_model_dir` validates a directory from its headers alone (no tensor is read), so a job
can reject a wrong one before it starts any work.
Nothing here touches the network: directories are read with `local_files_only=True`.
LoRA adapters (layers/lora.py) load through `load_weights` too, under the trainer's or PEFT's
names (`<module>.lora_A.weight`); a LoRA run's sync sends only those, so the base never changes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoTokenizer

from patrl.rollout.layers.attention.backend import AttentionBackend
from patrl.rollout.layers.lora import (
    adapter_param_name,
    enable_lora,
    is_adapter_key,
    is_merged,
    merge_lora,
    unmerge_lora,
)
from patrl.rollout.model_config import SUPPORTED_MODEL_TYPES, ModelArch
from patrl.rollout.models import build_model
from patrl.rollout.models.causal_lm import CausalLM
from patrl.tpreshard import ParallelLayout, forget_full

# Checkpoint entries that are derived, not learned (old Llama checkpoints carry these).
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# How many names to show when a directory has many missing / unexpected / mis-shaped tensors.
_SHOWN = 3


def read_config(model_dir: str | Path) -> Any:
    """The directory's transformers config (config.json)."""
    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def read_tokenizer(model_dir: str | Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def read_tokenizer_if_any(model_dir: str | Path) -> Any:
    """The tokenizer, or None for a weights-only directory (tests, exported checkpoints)."""
    try:
        return read_tokenizer(model_dir)
    except (OSError, ValueError, TypeError):
        return None


def read_eos_token_ids(model_dir: str | Path) -> list[int]:
    """Stop ids: generation_config.json's eos_token_id if present, else config.json's."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a directory, through the shard index when there is one."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [root / f for f in sorted(set(weight_map.values()))]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {root}")
    return files


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every tensor in the directory, one at a time."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name)


def load_weights(model: CausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Load full tensors under their HF names; return the keys loaded (see `weight_keys`).
    A model in LoRA's merged mode is unmerged for the load and merged again after it."""
    forget_full(model)  # full tensors kept by a fold would go stale as the shards change
    merged = is_merged(model)
    if merged:
        unmerge_lora(model)
    try:
        return _load(model, named_tensors)
    finally:
        if merged:
            merge_lora(model)


def _load(model: CausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for hf_name, full in named_tensors:
        if hf_name.endswith(_DERIVED_SUFFIXES):
            continue
        adapter = adapter_param_name(hf_name)
        name, part = _map_name(adapter or hf_name, model)
        param = params.get(name)
        if param is None and adapter is not None:
            raise KeyError(
                f"adapter tensor {hf_name!r}: this engine has no LoRA adapter {name!r}; build "
                "it with EngineConfig.lora_rank > 0 and lora_target_modules naming the module"
            )
        if param is None:
            raise KeyError(
                f"checkpoint tensor {hf_name!r} matches no parameter of this "
                f"{model.config.model_type} model (looked for {name!r}); parameters are named "
                "like 'model.layers.0.self_attn.q_proj.weight', 'model.norm.weight', "
                "'lm_head.weight'"
            )
        param.weight_loader(param, full, part)  # type: ignore[attr-defined]
        loaded.add(name if part is None else f"{name}:{part}")
    return loaded


def weight_keys(model: CausalLM) -> set[str]:
    """Every key `load_weights` must see for a complete load (fused parts counted separately)."""
    keys: set[str] = set()
    for name, param in model.named_parameters():
        spec = param.shard_spec  # type: ignore[attr-defined]
        if spec.parts:
            keys.update(f"{name}:{p.name}" for p in spec.parts)
        else:
            keys.add(name)
    return keys


def load_model(
    model_dir: str | Path,
    layout: ParallelLayout | None = None,
    *,
    attention: str | AttentionBackend = "auto",
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    lora: tuple[int, float, Sequence[str]] | None = None,
    lora_merged: bool = False,
) -> CausalLM:
    """Build the model for `model_dir`'s config and load its safetensors, cut for `layout`.
    `lora` (rank, alpha, target HF projections): adapters on those layers, zero (no update)
    until `load_weights` brings them; `lora_merged`: in merged mode from the start."""
    config = read_config(model_dir)
    model = build_model(
        config, layout, attention=attention, dtype=dtype or _config_dtype(config), device=device
    )
    if lora is not None and lora[0] > 0:
        enable_lora(model, lora[0], lora[1], lora[2], model.packed_modules_mapping)
    expected = {k for k in weight_keys(model) if not is_adapter_key(k)}
    missing = expected - load_weights(model, iter_checkpoint(model_dir))
    if missing:
        raise ValueError(f"{model_dir} lacks {len(missing)} weights, e.g. {sorted(missing)[:5]}")
    if lora_merged:
        merge_lora(model)
    return model


def check_model_dir(model_dir: str | Path) -> ModelArch:
    """The architecture of `model_dir`, after checking from file headers alone that it exists,
    holds a config.json of a supported family, and that its safetensors hold exactly the tensors
    that config implies, each of the shape it implies. Raises FileNotFoundError or ValueError
    naming the directory, the file, the tensor and both shapes."""
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"model directory {str(root)!r} does not exist; give a Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer files, as save_pretrained writes them)"
        )
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{str(root)!r} has no config.json, so it is not a Hugging Face model directory; "
            f"it holds {sorted(p.name for p in root.iterdir())}"
        )
    model_type = _read_model_type(config_file)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{config_file}: model_type {model_type!r} is not supported; supported: "
            f"{list(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        config = ModelArch.from_hf(read_config(root))
    except ValueError as err:
        raise ValueError(f"{config_file}: {err}") from None
    _check_tensors(root, config)
    return config


def expected_shapes(config: ModelArch) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(HF name -> full shape of every tensor a checkpoint of `config` must hold, names it may
    also hold). Derived from the rollout model itself, built on the meta device at TP 1, so it
    is by construction the set `load_weights` needs."""
    model = build_model(config, None, device="meta")
    hf_module = {fused_part: hf for hf, fused_part in model.packed_modules_mapping.items()}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in model.named_parameters():
        spec = param.shard_spec  # type: ignore[attr-defined]
        if not spec.parts:
            shapes[name] = tuple(param.shape)
            continue
        fused = name.split(".")[-2]
        for p in spec.parts:
            hf_name = name.replace(f".{fused}.", f".{hf_module[fused, p.name]}.")
            shapes[hf_name] = (p.size, *param.shape[1:])
    # A tied LM head is the embedding: save_pretrained omits it, other writers keep a copy.
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    return shapes, optional


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[tuple[int, ...], Path]]:
    """HF name -> (shape, file) of every tensor in the directory's safetensors, from headers."""
    found: dict[str, tuple[tuple[int, ...], Path]] = {}
    for path in checkpoint_files(model_dir):
        if not path.is_file():
            raise FileNotFoundError(
                f"{path.parent / 'model.safetensors.index.json'} names {path.name}, "
                "which does not exist"
            )
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    found[name] = (tuple(f.get_slice(name).get_shape()), path)
        except SafetensorError as err:
            raise ValueError(f"{path} is not a readable safetensors file: {err}") from None
    return found


def _read_model_type(config_file: Path) -> Any:
    try:
        return json.loads(config_file.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as err:
        raise ValueError(f"{config_file} is not a JSON object: {err}") from None


def _check_tensors(root: Path, config: ModelArch) -> None:
    expected, optional = expected_shapes(config)
    found = checkpoint_shapes(root)
    shaped = [n for n, (shape, _) in found.items() if n in expected and shape != expected[n]]
    problems = [
        f"tensor {name!r} has shape {list(found[name][0])} in {found[name][1].name}, but "
        f"config.json implies {list(expected[name])}"
        for name in shaped[:_SHOWN]
    ]
    if len(shaped) > _SHOWN:
        problems.append(f"{len(shaped)} tensors differ in shape in all")
    missing = sorted(expected.keys() - found.keys())
    if missing:
        problems.append(f"{len(missing)} tensors missing, e.g. {missing[:_SHOWN]}")
    unexpected = sorted(
        n for n in found.keys() - expected.keys() - optional if not n.endswith(_DERIVED_SUFFIXES)
    )
    if unexpected:
        problems.append(
            f"{len(unexpected)} tensors that a {config.model_type} model of this config.json "
            f"does not have, e.g. {unexpected[:_SHOWN]}"
        )
    if problems:
        raise ValueError(
            f"{str(root)!r}: the safetensors do not match config.json "
            f"(model_type={config.model_type}, hidden_size={config.hidden_size}, "
            f"num_hidden_layers={config.num_layers}, vocab_size={config.vocab_size}): "
            + "; ".join(problems)
        )


def _map_name(hf_name: str, model: CausalLM) -> tuple[str, str | None]:
    for hf_module, (fused, part) in model.packed_modules_mapping.items():
        if f".{hf_module}." in hf_name:
            return hf_name.replace(f".{hf_module}.", f".{fused}."), part
    return hf_name, None


def checkpoint_dtype(model_dir: str | Path) -> torch.dtype:
    """The dtype `model_dir`'s config.json names for its weights (float32 when it names none)."""
    return _config_dtype(read_config(model_dir))


def _config_dtype(config: Any) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"config dtype {dtype!r} is not supported; supported: {list(_DTYPES)}")
    return _DTYPES[dtype]
