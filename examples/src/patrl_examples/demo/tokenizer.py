"""A character-level tokenizer the project builds itself: every printable ASCII character is a
token, plus bos/eos/pad/unk and the two chat-role markers, padded with reserved tokens to a
vocabulary of 128 so that it divides evenly at any TP size."""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
VOCAB_SIZE = 128
# Printable ASCII without the form feed and vertical tab, which nothing here writes.
CHARACTERS = "".join(c for c in string.printable if c not in "\x0b\x0c")

# The user turn ends in a newline so the prompt and the answer never share a line.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}" + USER + "{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}"
    "{{ eos_token }}"
    "{% else %}{{ raise_exception('only user and assistant roles are supported, got ' "
    "+ message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def special_tokens() -> list[str]:
    named = [PAD, BOS, EOS, UNK, USER, ASSISTANT]
    reserved = VOCAB_SIZE - len(named) - len(CHARACTERS)
    return named + [f"<|reserved_{i}|>" for i in range(reserved)]


def build_tokenizer() -> PreTrainedTokenizerFast:
    # BPE without merges is a character model: each character of a word is its own token.
    specials = special_tokens()
    vocab = {tok: i for i, tok in enumerate(specials + list(CHARACTERS))}
    core = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.add_special_tokens(specials)
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=specials[4:],
        model_max_length=512,
        padding_side="right",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def prompt_text(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    """The chat-formatted prompt, ending where the assistant's answer begins."""
    messages = [{"role": "user", "content": prompt}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
