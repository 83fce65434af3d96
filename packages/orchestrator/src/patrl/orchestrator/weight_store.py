"""Versioned policy weights on disk, for rollout ranks that pull them at their own pace.

The trainer writes version v as bucketed safetensors files (full tensors under their Hugging
Face names) into `v<v>.tmp/`, then renames the directory to `v<v>/`: a reader that sees `v<v>/`
sees all of it. The version becomes visible to readers only after the rename (the caller then
announces it), so a rollout rank keeps generating with what it has until a version is whole.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

Bucket = list[tuple[str, torch.Tensor]]


class WeightStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def publish(self, version: int, buckets: Iterable[Bucket]) -> Path:
        """Write every bucket, then make the version visible by one rename."""
        final = self.path(version)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a writer that died mid-way
        tmp.mkdir(parents=True)
        for i, bucket in enumerate(buckets):
            tensors = {name: t.detach().contiguous().cpu() for name, t in bucket}
            save_file(tensors, str(tmp / f"bucket-{i:05d}.safetensors"))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return final

    def load(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """The version's tensors, one bucket file in memory at a time."""
        folder = self.path(version)
        files = sorted(folder.glob("bucket-*.safetensors"))
        if not files:
            raise FileNotFoundError(f"weights version {version}: no bucket files in {folder}")
        for f in files:
            yield from load_file(str(f)).items()

    def versions(self) -> list[int]:
        found = [p.name[1:] for p in self.root.glob("v*") if p.is_dir()]
        return sorted(int(v) for v in found if v.isdigit())

    def prune(self, keep_from: int) -> None:
        """Delete every version older than `keep_from` (nobody will read them again)."""
        for v in self.versions():
            if v < keep_from:
                shutil.rmtree(self.path(v), ignore_errors=True)
