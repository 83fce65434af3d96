"""What a reward-model directory must be, checked before any rank loads it.

A directory passes when it holds a Hugging Face config whose architecture is a
`...ForSequenceClassification` with `num_labels == 1`, and a tokenizer that loads. Each failure
is a ValueError naming the directory, the file or key and what is accepted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# The files a Hugging Face tokenizer is loaded from; a directory with none of them has none.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


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

    wanted = "tokenizer.json / tokenizer_config.json, as tokenizer.save_pretrained writes them"
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        # transformers' own error here ends in a hint to install sentencepiece: no help.
        raise ValueError(
            f"{key}={str(path)!r}: no usable tokenizer: the directory holds no tokenizer files "
            f"(none of {list(TOKENIZER_FILES)}); save the tokenizer beside the model ({wanted})"
        )
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    # ImportError: transformers 4.x, finding no tokenizer.json, converts a slow tokenizer, which
    # needs protobuf or tiktoken
    except (OSError, ValueError, TypeError, ImportError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{key}={str(path)!r}: no usable tokenizer ({wanted}): {first}") from None
