"""What a reward-model directory must be, checked before any rank loads it.

A directory passes when it holds a Hugging Face config whose architecture is a
`...ForSequenceClassification` with `num_labels == 1`, and a tokenizer that loads. Each failure
is a ValueError naming the directory, the file or key and what is accepted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def check_reward_model_dir(
    path: str | os.PathLike[str], key: str = "reward_model.model.path"
) -> Any:
    """The HF config of the reward model in `path` after checking it (see the module); `key`
    names the setting in error messages."""
    from transformers import AutoConfig

    root = Path(path)
    if not (root / "config.json").is_file():
        raise ValueError(
            f"{key}={str(root)!r}: no config.json there; give a local Hugging Face "
            "sequence-classification directory (save_pretrained of "
            "AutoModelForSequenceClassification with num_labels=1)"
        )
    config = AutoConfig.from_pretrained(root, local_files_only=True)
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(
            f"{key}={str(root)!r}: {root / 'config.json'} lists architectures {architectures}, "
            "not a ...ForSequenceClassification model; a reward model is "
            "AutoModelForSequenceClassification with num_labels=1 (train one with "
            "`python -m patrl.trainer.reward_model`)"
        )
    if config.num_labels != 1:
        raise ValueError(
            f"{key}={str(root)!r}: {root / 'config.json'} has num_labels={config.num_labels}; "
            "a reward model scores with one label (num_labels=1)"
        )
    load_tokenizer(root, key)
    return config


def load_tokenizer(path: str | os.PathLike[str], key: str = "reward_model.model.path") -> Any:
    """The tokenizer saved in `path`, or a ValueError naming the directory and the files wanted."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    # ImportError: transformers 4.x, finding no tokenizer file, converts a slow tokenizer, which
    # needs protobuf or tiktoken
    except (OSError, ValueError, TypeError, ImportError) as err:
        raise ValueError(
            f"{key}={str(path)!r}: no usable tokenizer (tokenizer.json / tokenizer_config.json, "
            f"as save_pretrained writes them): {err}"
        ) from None
