"""A character tokenizer with a hermes chat template, and tiny Llamas whose greedy turns are
scripted: the tokens each of them samples depend on the last token only (an embedding that is
one-hot, and an LM head that maps each scripted token to its successor), while its random
attention and MLP layers still move every logprob with the whole context (so a wrong KV shows).

After a user turn the prompt ends in "\\n" and the model writes `call` (a tool call); after a
tool turn the template ends the prompt in "\\n " and the model writes `answer` and then EOS.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

SPECIAL = ["<pad>", "<|im_end|>", "<|im_start|>"]
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CHARACTERS = "".join(c for c in string.printable if c not in "\x0b\x0c")
CALL = '{"name": "calculator", "arguments": {"expression": "6*7"}}'
MALFORMED = '{"name": "calculator", "arguments": {"expression": "6*7"}'
UNKNOWN = '{"name": "search", "arguments": {"query": "x"}}'
ANSWER = "The answer is 42."
SCRIPTS = [CALL, MALFORMED, UNKNOWN, ANSWER]
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user"
    "{% endif %}{{ '\\n<tool_response>\\n' }}{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if messages[-1]['role'] == 'tool' %} {% endif %}{% endif %}"
)


# HERMES_TEMPLATE, but the assistant's turn after a user message that follows the first one
# (an interaction's answer) opens with "\n " as after a tool answer: the scripted model then
# writes its `answer` where the first turn wrote `first_answer` (a second attempt)
RETRY_TEMPLATE = HERMES_TEMPLATE.replace(
    "{% if messages[-1]['role'] == 'tool' %}",
    "{% if messages[-1]['role'] == 'tool' or messages | length > 1 %}",
)
assert RETRY_TEMPLATE != HERMES_TEMPLATE


def hermes_tokenizer(extra_scripts: Sequence[str] = ()) -> Any:
    """Characters, the chat specials (EOS <|im_end|>), the hermes tags and the scripted
    texts (and `extra_scripts`) as single tokens (not special: they survive decoding, as
    Qwen's tags do)."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + list(CHARACTERS))}
    core = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    core.add_special_tokens(SPECIAL)
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.add_tokens(TAGS + SCRIPTS + list(extra_scripts))
    tok.chat_template = HERMES_TEMPLATE
    return tok


def one_token(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return int(ids[0])


def save_scripted_model(
    path: Path,
    tokenizer: Any,
    call: str | None = CALL,
    answer: str = ANSWER,
    seed: int = 0,
    eos_after_call: bool = False,
    call_after_tool: bool = False,
    max_position_embeddings: int = 1024,
    other_calls: Sequence[str] = (),
    first_answer: str | None = None,
) -> Path:
    """A tiny Llama (hidden = vocabulary size, rounded up to 4 heads) that writes
    `<tool_call>call</tool_call>` after "\\n" (nothing scripted there when `call` is None:
    it answers at once) and `answer<|im_end|>` after "\\n "; with `eos_after_call`, EOS
    after `</tool_call>` (verl's way to end a turn with calls); with `call_after_tool`, the
    call again after "\\n " (every turn calls, until a turn limit); `other_calls` tie with
    `call` after `<tool_call>` (a sampled call is any of them, each as likely); with `call`
    None and `first_answer`, that answer then EOS after "\\n" (and `answer` after "\\n ",
    e.g. after RETRY_TEMPLATE's user turn); saved with `tokenizer`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    v = len(tokenizer)
    hidden = -(-v // 8) * 8
    config = LlamaConfig(
        vocab_size=v,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    t = lambda s: one_token(tokenizer, s)  # noqa: E731
    eos = tokenizer.eos_token_id
    chain: list[tuple[int, int]] = []
    if call is not None:
        chain += [
            (t("\n"), t("<tool_call>")),
            (t("<tool_call>"), t(call)),
            (t(call), t("</tool_call>")),
        ]
        for other in other_calls:
            chain += [(t("<tool_call>"), t(other)), (t(other), t("</tool_call>"))]
    elif first_answer is not None and first_answer != answer:
        chain += [(t("\n"), t(first_answer)), (t(first_answer), eos)]
    else:
        chain += [(t("\n"), t(answer))]
    if eos_after_call:
        chain += [(t("</tool_call>"), eos)]
    if call_after_tool:
        chain += [(t(" "), t("<tool_call>"))]
    else:
        chain += [(t(" "), t(answer)), (t(answer), eos)]
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :v].copy_(torch.eye(v))
        model.lm_head.weight.zero_()
        for prev, nxt in chain:
            model.lm_head.weight[nxt, prev] = 0.5
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def script_ids(tokenizer: Any, texts: Sequence[str]) -> list[int]:
    return [one_token(tokenizer, s) for s in texts]


# ------------------------------------------------------------------------ test tools

import threading  # noqa: E402

from patrl.orchestrator.agent import BaseTool, ToolResponse  # noqa: E402


class RaisingTool(BaseTool):
    """Raises on every call."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        raise RuntimeError("the calculator is broken")


class HangingTool(BaseTool):
    """Blocks its thread until `release_hung` (a hang, not a slow answer)."""

    gate = threading.Event()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        HangingTool.gate.wait()
        return ToolResponse(text="too late"), 0.0, {}


class HugeTool(BaseTool):
    """Answers 10,000 characters: "0123456789" repeated."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        return ToolResponse(text="0123456789" * 1000), 0.0, {}


class GatedTool(BaseTool):
    """Answers "42"; the first call (of a run) waits until `gate` is set by the test, at most
    `patience` seconds, and says "stalled" if it was not (the others never got to finish)."""

    gate = threading.Event()
    patience = 120.0
    calls = 0
    lock = threading.Lock()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        with GatedTool.lock:
            GatedTool.calls += 1
            first = GatedTool.calls == 1
        if first and not GatedTool.gate.wait(GatedTool.patience):
            return ToolResponse(text="stalled"), 0.0, {}
        return ToolResponse(text="42"), 0.0, {}


class RememberingTool(BaseTool):
    """Answers with the create kwargs its call's instance got (verl's
    tools_kwargs[name]["create_kwargs"])."""

    seen: dict[str, Any] = {}  # noqa: RUF012

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> Any:
        instance_id, response = await super().create(instance_id, **kwargs)
        RememberingTool.seen[instance_id] = kwargs.get("create_kwargs")
        return instance_id, response

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        return ToolResponse(text=repr(RememberingTool.seen.pop(instance_id))), 0.0, {}


def tool_config(path: Path, class_name: str) -> Path:
    """A verl tool config of one tool `class_name` under the calculator's schema."""
    import yaml

    from patrl.orchestrator.agent.calculator import SCHEMA

    entry = {
        "class_name": class_name,
        "config": {"type": "native"},
        "tool_schema": SCHEMA.model_dump(),
    }
    path.write_text(yaml.safe_dump({"tools": [entry]}))
    return path


class FlakyTool(BaseTool):
    """Fails in turn by call number (of a process, all instances): the first calls follow
    `first` ("raise", "hang": blocks until `gate` or `patience` s, "huge": 10,000 characters,
    "ok": "42"), every later one `then`, cycled. `reset()` starts over."""

    first = ("raise", "hang", "huge", "ok")
    then = ("raise", "hang")
    gate = threading.Event()
    patience = 60.0
    calls = 0
    lock = threading.Lock()

    @classmethod
    def reset(cls) -> None:
        cls.gate.clear()
        cls.calls = 0

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        with FlakyTool.lock:
            i = FlakyTool.calls
            FlakyTool.calls += 1
        first, then = FlakyTool.first, FlakyTool.then
        what = first[i] if i < len(first) else then[(i - len(first)) % len(then)]
        if what == "raise":
            raise RuntimeError(f"call {i} broke")
        if what == "hang":
            FlakyTool.gate.wait(FlakyTool.patience)
            return ToolResponse(text="too late"), 0.0, {}
        if what == "huge":
            return ToolResponse(text="0123456789" * 1000), 0.0, {}
        return ToolResponse(text="42"), 0.0, {}
