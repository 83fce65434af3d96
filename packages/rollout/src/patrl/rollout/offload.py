"""Tensors' storages moved to host memory and back in place, bit for bit (`Engine.sleep(2)`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class HostCopy:
    """The storages of `tensors`, each copied once to host memory (pinned when it is on
    CUDA) and then shrunk to nothing on its device; `restore` regrows and refills them.
    Every tensor keeps its storage object, so views that share one (a shard inside a kept
    full weight, tied embeddings) share it again after `restore`, at a new address."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self._saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        seen: set[int] = set()
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            pinned = storage.device.type == "cuda"
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
            host.copy_(_bytes(storage))
            self._saved.append((storage, host))
        for storage, _ in self._saved:
            storage.resize_(0)

    @property
    def nbytes(self) -> int:
        """Bytes held on the host."""
        return sum(host.numel() for _, host in self._saved)

    def restore(self) -> None:
        """Give every storage back its bytes on its device; the host copies are dropped."""
        for storage, host in self._saved:
            storage.resize_(host.numel())
            _bytes(storage).copy_(host)
        self._saved = []


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """`storage` as a flat uint8 tensor over the same memory."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
