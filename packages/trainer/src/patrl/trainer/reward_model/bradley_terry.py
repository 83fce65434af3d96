"""A Bradley-Terry reward-model trainer: loss = -log sigmoid(r(chosen) - r(rejected)).

The model is an HF `AutoModelForSequenceClassification` with one label, started from a
sequence-classification checkpoint or from a causal LM (its backbone, a new seeded score head),
built whole on every rank and FSDP2-sharded over an optional 1-D mesh (`model.parallelize`). A
global batch of pairs is split evenly across ranks; FSDP averages the gradients, so N ranks take
the same step as one process. `save` writes an HF directory that `from_pretrained` loads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from patrl.trainer.model import parallelize
from patrl.trainer.reward_model.preferences import Pair
from patrl.trainer.reward_model.scorer import pad_token_id, right_pad
from patrl.trainer.weights import iter_full_weights


class BradleyTerryTrainer:
    """Trains a reward model on preference pairs (see the module); AdamW, fp32 parameters."""

    def __init__(
        self,
        source: str | os.PathLike[str],
        *,
        mesh: DeviceMesh | None = None,
        device: torch.device | str = "cpu",
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        seed: int = 0,
        param_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.mesh = mesh
        self.device = torch.device(device)
        self.model = load_classifier(source, seed)
        self.architecture = type(self.model).__name__
        self.pad_id = pad_token_id(self.model.config, _tokenizer_or_none(source))
        self.model.config.pad_token_id = self.pad_id
        self.model.to(self.device)
        parallelize(self.model, mesh, param_dtype, activation_checkpointing=False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, weight_decay=weight_decay
        )

    @property
    def rank_and_size(self) -> tuple[int, int]:
        return (0, 1) if self.mesh is None else (self.mesh.get_local_rank(), self.mesh.size())

    def scores(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """The model's fp32 score of each sequence (HF pooling: the last non-pad token)."""
        ids, mask = right_pad(sequences, self.pad_id)
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        return out.logits[:, 0].float()

    def pair_loss(self, pairs: Sequence[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean Bradley-Terry loss, per-pair correctness) of `pairs`, one forward."""
        r = self.scores([c for c, _ in pairs] + [r for _, r in pairs])
        margin = r[: len(pairs)] - r[len(pairs) :]
        return -F.logsigmoid(margin).mean(), (margin > 0).float()

    def train_step(self, pairs: Sequence[Pair]) -> dict[str, float]:
        """One optimizer step on a global batch; each rank takes its own equal share."""
        rank, size = self.rank_and_size
        if len(pairs) % size:
            raise ValueError(
                f"a batch of {len(pairs)} pairs does not split evenly over {size} ranks"
            )
        self.model.train()
        loss, correct = self.pair_loss(pairs[rank::size])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return {"loss": float(loss.detach()), "accuracy": float(correct.mean())}

    @torch.no_grad()
    def evaluate(self, pairs: Sequence[Pair], micro_batch_size: int = 16) -> dict[str, float]:
        """Held-out loss and accuracy (chosen scored above rejected); every rank scores all."""
        self.model.eval()
        losses, correct = [], []
        for start in range(0, len(pairs), micro_batch_size):
            chunk = pairs[start : start + micro_batch_size]
            loss, right = self.pair_loss(chunk)
            losses.append(float(loss) * len(chunk))
            correct.append(right)
        n = max(1, len(pairs))
        return {"loss": sum(losses) / n, "accuracy": float(torch.cat(correct).sum()) / n}

    def save(self, out_dir: str | os.PathLike[str], tokenizer: Any = None) -> Path | None:
        """Write config.json, model.safetensors (and the tokenizer) to `out_dir` on rank 0;
        every rank must call it (gathering the shards is a collective)."""
        from safetensors.torch import save_file

        state = {
            name: t.detach().to("cpu", copy=True).contiguous()
            for bucket in iter_full_weights(self.model, 1 << 28)
            for name, t in bucket
        }
        if self.rank_and_size[0] != 0:
            return None
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = self.model.config
        config.architectures = [self.architecture]
        config.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        return out


def load_classifier(source: str | os.PathLike[str], seed: int) -> Any:
    """An fp32 one-label sequence classifier from `source` (a sequence-classification or causal
    LM directory); a new score head is initialised from `seed`, identically on every rank."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    path = Path(source)
    if not (path / "config.json").is_file():
        raise ValueError(f"reward model source {str(path)!r} has no config.json")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if config.num_labels != 1 and any(
        a.endswith("ForSequenceClassification") for a in config.architectures or []
    ):
        raise ValueError(
            f"{path / 'config.json'} has num_labels={config.num_labels}; a reward model has one"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=torch.float32, local_files_only=True
        )
    model.config.use_cache = False
    return model


def _tokenizer_or_none(source: str | os.PathLike[str]) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError, TypeError):
        return None


def log_line(path: Path | None, record: dict[str, Any]) -> None:
    """Print `record` as one JSON line, and append it to `path` when given."""
    line = json.dumps(record)
    print(line, flush=True)
    if path is not None:
        with path.open("a") as f:
            f.write(line + "\n")
