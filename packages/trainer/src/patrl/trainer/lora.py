"""LoRA adapters on a Hugging Face model, in PEFT's math and file format, without PEFT.

Each chosen `nn.Linear` `m` gets two child linears, `m.lora_A` ([r, in]) and `m.lora_B`
([out, r]), and a forward hook that adds `lora_alpha / r * lora_B(lora_A(x))` to `m`'s output:
PEFT's LoRA (no dropout, no rsLoRA) with PEFT's init (A kaiming-uniform, B zero, so an adapter
starts as the identity update). The base keeps its Hugging Face names and modules, so the
meta-device build, the per-layer FSDP2 sharding, the sharded load, DCP checkpoints and weight
export see an ordinary model plus tensors named `<module>.lora_A.weight`; a PEFT adapter file
names the same tensors `base_model.model.<module>.lora_A.weight` (`peft_name`). Why not PEFT
itself: its wrapper renames every base parameter (`base_layer`), which each of those paths
would have to undo. Tests hold this module to PEFT's loss, gradients and files.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from patrl.trainer.shard_loader import shard_rows

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ALL_LINEAR = "all-linear"
# A LoRA run's trainer checkpoint holds its adapter as a PEFT directory under this name.
LORA_ADAPTER_DIR = "lora_adapter"
# The model's output layers, never adapted by "all-linear" (PEFT leaves the LM head out too).
_OUTPUT_LAYERS = ("lm_head", "score")


class LoraConfig(BaseModel):
    """verl's `actor_rollout_ref.model.lora_*` keys: rank 0 = full fine-tuning."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    lora_rank: int = Field(default=0, ge=0, description="LoRA rank r; 0 = off (full weights)")
    lora_alpha: float = Field(default=16.0, gt=0, description="scale = lora_alpha / lora_rank")
    target_modules: str | list[str] = Field(
        default=ALL_LINEAR,
        description="'all-linear' (every linear but the LM head), a list of module names or "
        "name suffixes (q_proj), or a regex a module's full name must match",
    )
    exclude_modules: str | list[str] | None = Field(
        default=None, description="modules left out: a list of names / suffixes or a regex"
    )
    lora_adapter_path: str | None = Field(
        default=None, description="a PEFT adapter directory to start from (None: fresh init)"
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not value:
            raise ValueError("target_modules is an empty list; accepted: 'all-linear' or names")
        return value

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.lora_rank


def _matches(pattern: str | list[str], name: str) -> bool:
    """PEFT's rule: a string is a regex the full name must match; a list entry matches the
    name itself or a `.`-separated suffix of it."""
    if isinstance(pattern, str):
        return re.fullmatch(pattern, name) is not None
    return any(name == t or name.endswith("." + t) for t in pattern)


def select_targets(model: nn.Module, cfg: LoraConfig, key: str = "model") -> list[str]:
    """Full names of the `nn.Linear` modules `cfg` adapts, in module order. Raises ValueError
    naming the key (`<key>.target_modules`: `model` is the policy's section, `critic.model`
    the critic's) when an entry matches no linear module, or nothing is left."""
    linears = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.split(".")[-1] not in ("lora_A", "lora_B")
    ]
    if cfg.target_modules == ALL_LINEAR:
        chosen = [n for n in linears if n.split(".")[-1] not in _OUTPUT_LAYERS]
    else:
        if isinstance(cfg.target_modules, list):
            unmatched = [
                t for t in cfg.target_modules if not any(_matches([t], n) for n in linears)
            ]
            if unmatched:
                raise ValueError(
                    f"{key}.target_modules entries {unmatched} match no linear module of "
                    f"{type(model).__name__}; accepted: 'all-linear' or names among "
                    f"{sorted({n.split('.')[-1] for n in linears})}"
                )
        chosen = [n for n in linears if _matches(cfg.target_modules, n)]
    if cfg.exclude_modules is not None:
        chosen = [n for n in chosen if not _matches(cfg.exclude_modules, n)]
    if not chosen:
        raise ValueError(
            f"{key}.target_modules={cfg.target_modules!r} with exclude_modules="
            f"{cfg.exclude_modules!r} leaves no linear module to adapt"
        )
    return chosen


def target_leaf_names(targets: list[str]) -> list[str]:
    """The distinct last components of `targets` (q_proj, down_proj, ...), sorted."""
    return sorted({t.split(".")[-1] for t in targets})


def add_adapters(model: nn.Module, cfg: LoraConfig, trainable: tuple[str, ...] = ()) -> list[str]:
    """Attach LoRA to the modules `select_targets` picks, freeze every other parameter but
    those of the modules named in `trainable` (PEFT's `modules_to_save`: a value model's new
    head trains whole) and return the adapted modules' names. The adapters are created in the
    dtype and on the device of their base weight (meta stays meta: `init_adapters` fills them
    after materialising)."""
    targets = select_targets(model, cfg)
    for name, p in model.named_parameters():
        p.requires_grad_(name.rsplit(".", 1)[0] in trainable)
    for name in targets:
        base = model.get_submodule(name)
        assert isinstance(base, nn.Linear)
        w = base.weight
        kw: dict[str, Any] = {"bias": False, "dtype": w.dtype, "device": w.device}
        base.lora_A = nn.Linear(base.in_features, cfg.lora_rank, **kw)
        base.lora_B = nn.Linear(cfg.lora_rank, base.out_features, **kw)
        setattr(base, "lora_scaling", cfg.scaling)  # noqa: B010 (plain attributes, not modules)
        setattr(base, "lora_enabled", True)  # noqa: B010
        base.register_forward_hook(_lora_hook)
    return targets


def cast_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """Hold every floating parameter that does not train (a LoRA run's frozen base) in `dtype`,
    in place; those that train (the adapters, a value model's head) keep theirs: the fp32
    masters AdamW updates. The parameter objects stay (only their data is replaced), so ties
    between them survive, and meta parameters stay meta. Why: a bf16 base halves the memory of
    the weights nothing updates; bf16 compute rounds them to bf16 anyway."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def _lora_hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    if not getattr(module, "lora_enabled"):  # noqa: B009
        return output
    a, b, scaling = lora_parts(module)
    delta = b(a(args[0].to(a.weight.dtype)))
    return output + (delta * scaling).to(output.dtype)


def lora_parts(module: nn.Module) -> tuple[nn.Linear, nn.Linear, float]:
    """(lora_A, lora_B, alpha / r) of an adapted module."""
    a, b = module.get_submodule("lora_A"), module.get_submodule("lora_B")
    assert isinstance(a, nn.Linear) and isinstance(b, nn.Linear)
    return a, b, float(getattr(module, "lora_scaling"))  # noqa: B009


def adapted_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every module `add_adapters` adapted."""
    for name, m in model.named_modules():
        if hasattr(m, "lora_A") and hasattr(m, "lora_scaling"):
            yield name, m


def has_adapters(model: nn.Module) -> bool:
    return next(adapted_modules(model), None) is not None


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter off inside the block (the KL reference policy)."""
    mods = [m for _, m in adapted_modules(model)]
    for m in mods:
        setattr(m, "lora_enabled", False)  # noqa: B010
    try:
        yield
    finally:
        for m in mods:
            setattr(m, "lora_enabled", True)  # noqa: B010


def init_adapters(model: nn.Module, seed: int) -> None:
    """PEFT's init, the same on every rank: A kaiming-uniform (a = sqrt(5), nn.Linear's) drawn
    from `seed` and the module's name on the host, B zero. Sharded tensors take their rows."""
    with torch.no_grad():
        for name, m in adapted_modules(model):
            g = torch.Generator().manual_seed((seed * 1_000_003 + _stable_hash(name)) % 2**63)
            lora_a, lora_b, _ = lora_parts(m)
            a = lora_a.weight
            full = torch.empty(tuple(a.shape), dtype=torch.float32)
            bound = 1.0 / math.sqrt(full.shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]
            full.uniform_(-bound, bound, generator=g)
            _copy_full(a, full)
            _copy_full(lora_b.weight, torch.zeros(tuple(lora_b.weight.shape)))


def _stable_hash(text: str) -> int:
    h = 0
    for ch in text.encode():
        h = (h * 131 + ch) % 2**61
    return h


def _copy_full(target: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        start, stop = shard_rows(target)
        target.to_local().copy_(full[start:stop])
    else:
        target.copy_(full)


def peft_name(name: str) -> str:
    """`model.layers.0.mlp.up_proj.lora_A.weight` as a PEFT adapter file names it."""
    return PEFT_PREFIX + name


def load_adapter(model: nn.Module, adapter_dir: str | os.PathLike[str]) -> None:
    """Fill the adapters from a PEFT adapter directory (every adapter tensor of `model` must be
    in the file, with its shape). Raises ValueError naming the file and tensor otherwise."""
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(
            f"model.lora_adapter_path: {str(adapter_dir)!r} holds no {ADAPTER_WEIGHTS}"
        )
    with safe_open(str(path), "pt") as f, torch.no_grad():
        names = set(f.keys())
        for name, p in model.named_parameters():
            if not is_adapter_name(name):
                continue
            key = peft_name(name)
            if key not in names:
                raise ValueError(f"{path} lacks adapter tensor {key!r}")
            full = f.get_tensor(key)
            if tuple(full.shape) != tuple(p.shape):
                raise ValueError(
                    f"{path}: {key!r} has shape {list(full.shape)}, the model's adapter "
                    f"{list(p.shape)} (model.lora_rank or the base model differ)"
                )
            _copy_full(p, full.to(p.dtype))


def adapter_config(
    cfg: LoraConfig,
    targets: list[str],
    base_model: str | None,
    task_type: str = "CAUSAL_LM",
    modules_to_save: list[str] | None = None,
) -> dict[str, Any]:
    """The `adapter_config.json` PEFT reads: the adapted modules by full name (exact under
    PEFT's matching, exclusions already applied). A value model is PEFT's "TOKEN_CLS" task
    with its head in `modules_to_save` (trained whole, saved whole beside the adapters)."""
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model,
        "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "exclude_modules": None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": modules_to_save,
        "inference_mode": True,
    }


def write_adapter_dir(
    out: str | os.PathLike[str], config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> Path:
    """Write a PEFT adapter directory atomically (a temporary sibling renamed into place):
    `tensors` are keyed by the model's names and written under PEFT's."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(
        {peft_name(n): t.detach().contiguous().cpu() for n, t in tensors.items()},
        str(tmp / ADAPTER_WEIGHTS),
        metadata={"format": "pt"},
    )
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def merged_delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """scaling * B @ A in fp32: what merging adds to the base weight."""
    return (b.float() @ a.float()) * scaling


def read_adapter_config(adapter_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(
            f"model.lora_adapter_path: {str(adapter_dir)!r} holds no {ADAPTER_CONFIG} (a PEFT "
            "adapter directory, as save_pretrained writes it)"
        )
    data: dict[str, Any] = json.loads(path.read_text())
    return data
