"""Small byte-level BPE tokenizers built in the test, and a tiny model that speaks one.

Tokens hold several characters, so a stop string can end inside a token or span several;
`byte_alphabet=True` keeps all 256 byte tokens, so a multi-byte character can arrive one
byte token at a time (the model's random outputs are then mostly invalid UTF-8, which is
why the engine tests use the corpus-only alphabet).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from patrl_testkit.models import save_tiny_model

SPECIAL = ["<|eos|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "then",
    "it",
    "ran",
    "to",
    "the",
    "red",
    "barn",
    "where",
    "many",
    "cows",
    "ate",
    "green",
    "hay",
    "while",
    "rain",
    "fell;",
    "stop,",
    "go,",
    "wait!",
    "numbers",
    "12",
    "345",
    "6789",
    "=",
    "sum",
    "+",
    "total",
    "-",
    "diff",
    "*",
    "2",
    "/",
    "3",
    "Answer:",
    "yes",
    "no",
    "maybe.",
    "The",
    "end.",
]


def corpus(lines: int = 400, seed: int = 0, extra: str = "") -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=12)) + extra for _ in range(lines)]


def bpe_tokenizer(
    vocab_size: int = 200, byte_alphabet: bool = False, chat_template: str | None = CHAT_TEMPLATE
) -> Any:
    """A byte-level BPE tokenizer trained on `corpus()` (plus some CJK text with
    `byte_alphabet`), with EOS and chat special tokens, as transformers loads one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_alphabet else []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=alphabet
    )
    tok.train_from_iterator(corpus(extra=" 日本語" if byte_alphabet else ""), trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|eos|>",
        additional_special_tokens=SPECIAL[1:],
    )
    hf.chat_template = chat_template
    return hf


def save_text_model(path: Path, tokenizer: Any, seed: int = 0) -> Path:
    """The kit's tiny Llama with `tokenizer`'s vocabulary and EOS, saved with it to `path`."""
    eos = tokenizer.eos_token_id
    return save_tiny_model(path, "llama", seed=seed, tokenizer=tokenizer, eos_token_id=eos)
