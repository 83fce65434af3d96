"""A test mode that proves on CPU that every tensor collective would be accepted by NCCL.

On a GPU world the TP and trainer groups are NCCL, which takes device tensors only; object
traffic goes over the gloo half of a `cpu:gloo,cuda:nccl` group. On CPU every tensor is a CPU
tensor, so the mode tracks *provenance* instead: inside `check_collective_devices()` a tensor
the code deliberately put on the host (`.cpu()`, `.to("cpu")`, `device="cpu"`, a factory such
as `torch.tensor`/`torch.zeros` without `device=`, `torch.from_numpy`) is a host tensor, and so
is whatever is computed from host tensors only. A tensor collective (`check_tensors`, and
`torch.distributed`'s tensor collectives, patched while the mode is on) given a host tensor
raises `CollectiveDeviceError`; object collectives are not checked.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["CollectiveDeviceError", "check_collective_devices", "check_tensors", "is_host_tensor"]

_HOST = "_patrl_host_tensor"
_FACTORIES = frozenset(
    {
        torch.tensor,
        torch.as_tensor,
        torch.zeros,
        torch.ones,
        torch.empty,
        torch.full,
        torch.arange,
        torch.linspace,
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
        torch.eye,
        torch.from_numpy,
    }
)
_TO_HOST = frozenset({torch.Tensor.cpu, torch.Tensor.pin_memory, torch.Tensor.numpy})
_MOVES = frozenset({torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu})
_TENSOR_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "send",
    "recv",
    "isend",
    "irecv",
)
_active = False


class CollectiveDeviceError(RuntimeError):
    """A tensor collective was given a host tensor: an NCCL group would reject it."""


def is_host_tensor(t: torch.Tensor) -> bool:
    """Whether the mode saw `t` made on (or moved to) the host on purpose."""
    return bool(getattr(t, _HOST, False))


def check_tensors(op: str, *tensors: torch.Tensor) -> None:
    """Raise `CollectiveDeviceError` when the mode is on and one of `tensors`, the tensors of
    the tensor collective `op`, is a host tensor; a no-op otherwise."""
    if not _active:
        return
    for t in tensors:
        if is_host_tensor(t):
            raise CollectiveDeviceError(
                f"{op} was given a host tensor ({tuple(t.shape)}, {t.dtype}): an NCCL group "
                "takes tensors on the compute device only"
            )


@contextlib.contextmanager
def check_collective_devices() -> Iterator[None]:
    """Track host tensors and check every tensor collective while inside, in this process
    (enter it in each rank). Tensors made before entering count as device tensors."""
    global _active
    originals = {name: getattr(dist, name) for name in _TENSOR_COLLECTIVES}
    for name, fn in originals.items():
        setattr(dist, name, _checked(name, fn))
    _active = True
    try:
        with _HostProvenance():
            yield
    finally:
        _active = False
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _checked(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tensors, _ = tree_flatten((args, kwargs))
        check_tensors(f"torch.distributed.{name}", *[t for t in tensors if _is_tensor(t)])
        return fn(*args, **kwargs)

    return wrapper


class _HostProvenance(TorchFunctionMode):
    """Marks each op's tensor outputs host or not, by the rules of the module docstring."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if _is_tensor(t)]
        host = _made_on_host(func, args, kwargs, inputs)
        if func in _MOVES and out is args[0]:
            # a move to where the tensor already is returns it; on a GPU world it would be a
            # new tensor: an alias keeps the original's mark
            out = out.view_as(out)
        for t in tree_flatten(out)[0]:
            if _is_tensor(t) and not any(t is i for i in inputs):
                setattr(t, _HOST, host)
        return out


def _made_on_host(func: Any, args: Any, kwargs: dict[str, Any], inputs: list[Any]) -> bool:
    if func in _TO_HOST:
        return True
    if func is torch.Tensor.cuda:
        return False
    if "device" in kwargs:
        return _names_host(kwargs["device"])
    if func in _FACTORIES:
        return True
    if func is torch.Tensor.to:
        for a in args[1:]:
            if _is_tensor(a):
                return is_host_tensor(a)
            if isinstance(a, (str, torch.device, int)):
                return _names_host(a)
    return bool(inputs) and all(is_host_tensor(t) for t in inputs)


def _names_host(device: Any) -> bool:
    """A device spelled as the host on purpose: the string "cpu" (a `torch.device` is taken
    to be the code's compute device, which on a CPU run is the CPU too)."""
    return device is None or (isinstance(device, str) and device.startswith("cpu"))


def _is_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor)
