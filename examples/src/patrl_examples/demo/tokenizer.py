"""A character-level tokenizer the project builds itself: every printable ASCII character is a
token, plus bos/eos/pad/unk and the two chat-role markers, padded with reserved tokens to a
vocabulary of 128 so that it divides evenly at any TP size.

`build_tool_tokenizer` is the tool demo's (`patrl_examples.demo.tools`): the same vocabulary
with its first reserved token named `<|tool|>` (the tool role's marker, id for id where the
plain tokenizer has `<|reserved_0|>`) and a chat template that renders the `tools=` list and
`tool` messages, so a plain demo model's weights load under it unchanged."""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
TOOL = "<|tool|>"
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


# The tool demo's: a first line naming the tools when `tools=` is given (the model needs no
# JSON schema to call its one tool), and tool answers as `<|tool|>answer\n` turns. An assistant
# message's content is its text as the model wrote it (tool calls included, hermes format).
TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}tools:{% for tool in tools %} {{ tool['function']['name'] }}{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}" + USER + "{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}"
    "{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}" + TOOL + "{{ message['content'] }}\n"
    "{% else %}{{ raise_exception('only user, assistant and tool roles are supported, got ' "
    "+ message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def special_tokens(named_extra: tuple[str, ...] = ()) -> list[str]:
    named = [PAD, BOS, EOS, UNK, USER, ASSISTANT, *named_extra]
    reserved = VOCAB_SIZE - len(named) - len(CHARACTERS)
    # Numbered from the first slot past the plain tokenizer's named ones, so every reserved
    # token keeps its plain id.
    first = len(named_extra)
    return named + [f"<|reserved_{i}|>" for i in range(first, first + reserved)]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The plain demo's tokenizer (user and assistant turns only)."""
    return _build(special_tokens(), CHAT_TEMPLATE)


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    """The tool demo's tokenizer: the plain vocabulary with `<|reserved_0|>` named `<|tool|>`,
    and TOOL_CHAT_TEMPLATE."""
    return _build(special_tokens((TOOL,)), TOOL_CHAT_TEMPLATE)


def _build(specials: list[str], chat_template: str) -> PreTrainedTokenizerFast:
    # BPE without merges is a character model: each character of a word is its own token.
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
    tokenizer.chat_template = chat_template
    return tokenizer


def prompt_text(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    """The chat-formatted prompt, ending where the assistant's answer begins."""
    messages = [{"role": "user", "content": prompt}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
