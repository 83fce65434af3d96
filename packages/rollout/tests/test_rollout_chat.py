"""`Engine.chat`: conversations through the tokenizer's chat template, as vLLM's `LLM.chat`,
against its slow twin (render the template by hand, encode, `generate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rollout_tokenizers import bpe_tokenizer, save_text_model

from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.sampler import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
HELLO = [{"role": "user", "content": "the cat sat on"}]
TWO_TURNS = [
    {"role": "system", "content": "Answer: yes"},
    {"role": "user", "content": "numbers 12 345"},
    {"role": "assistant", "content": "sum"},
    {"role": "user", "content": "total"},
]


def engine(model_dir: Path) -> Engine:
    config = EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=128, max_model_len=128)
    return Engine(config)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_text_model(tmp_path_factory.mktemp("chat"), bpe_tokenizer())


@pytest.fixture(scope="module")
def chat_engine(chat_dir: Path) -> Engine:
    return engine(chat_dir)


def by_hand(tokenizer: Any, conversation: list[dict[str, str]], generation: bool = True) -> str:
    """The template of rollout_tokenizers written out."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conversation)
    return text + ("<|im_start|>assistant\n" if generation else "")


def test_chat_renders_the_template_and_generates_what_generate_does(chat_engine: Engine) -> None:
    tok = chat_engine.tokenizer
    outs = chat_engine.chat([HELLO, TWO_TURNS], GREEDY)
    prompts = [tok.encode(by_hand(tok, c), add_special_tokens=False) for c in (HELLO, TWO_TURNS)]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert tok.convert_ids_to_tokens(prompts[0][:1]) == ["<|im_start|>"]  # one special token
    ref = chat_engine.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]


def test_one_conversation_gives_one_output(chat_engine: Engine) -> None:
    tok = chat_engine.tokenizer
    (out,) = chat_engine.chat(TWO_TURNS, [GREEDY])
    assert out.prompt_token_ids == tok.encode(by_hand(tok, TWO_TURNS), add_special_tokens=False)


def test_template_options_as_vllm_passes_them(chat_engine: Engine) -> None:
    tok = chat_engine.tokenizer
    (closed,) = chat_engine.chat(HELLO, GREEDY, add_generation_prompt=False)
    assert closed.prompt_token_ids == tok.encode(
        by_hand(tok, HELLO, generation=False), add_special_tokens=False
    )
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (own,) = chat_engine.chat(HELLO, GREEDY, chat_template=plain)
    assert own.prompt_token_ids == tok.encode("user: the cat sat on\n", add_special_tokens=False)
    lead = "{% for m in messages %}{{ lead }}{{ m['content'] }}{% endfor %}"
    (led,) = chat_engine.chat(
        HELLO, GREEDY, chat_template=lead, chat_template_kwargs={"lead": "Answer: "}
    )
    assert tok.decode(led.prompt_token_ids) == "Answer: the cat sat on"


def test_chat_without_a_template_names_the_model_dir(tmp_path: Path) -> None:
    model_dir = save_text_model(tmp_path, bpe_tokenizer(chat_template=None))
    eng = engine(model_dir)
    with pytest.raises(ValueError, match=rf"the tokenizer of {tmp_path} has no chat template"):
        eng.chat(HELLO, GREEDY)
    (out,) = eng.chat(HELLO, GREEDY, chat_template="{{ messages[0]['content'] }}")
    assert eng.tokenizer.decode(out.prompt_token_ids) == "the cat sat on"


def test_chat_without_a_tokenizer_names_the_model_dir(tmp_path: Path) -> None:
    from patrl_testkit.models import save_tiny_model

    eng = engine(save_tiny_model(tmp_path))
    with pytest.raises(ValueError, match=rf"chat\(\) needs a tokenizer .* {tmp_path} has none"):
        eng.chat(HELLO, GREEDY)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "chat\\(\\) got no messages"),
        ([HELLO, []], "conversation 1 must be a non-empty list of message dicts"),
        (
            [[{"content": "no role"}]],
            "conversation 0, message 0: a message is a dict with a 'role'",
        ),
        ([HELLO, "text"], "conversation 1 must be a non-empty list of message dicts, got 'text'"),
    ],
)
def test_bad_messages_are_named(chat_engine: Engine, messages: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chat_engine.chat(messages, GREEDY)
    assert not chat_engine.has_unfinished()


def test_the_engine_modules_example_runs(
    chat_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The library example in patrl.rollout.engine's docstring, on a real model directory."""
    import textwrap

    import patrl.rollout.engine as module

    assert module.__doc__ is not None
    block = module.__doc__.split("::\n\n", 1)[1].split("\n\n")
    code = textwrap.dedent("\n\n".join(b for b in block[:2]))
    assert "engine.chat(" in code and "engine.generate(" in code
    namespace: dict[str, Any] = {}
    exec(code.replace("path/to/hf_model_dir", str(chat_dir)), namespace)
    assert len(namespace["chat"]) == 1 and namespace["chat"][0].outputs[0].token_ids
    assert capsys.readouterr().out.strip()  # the loop printed a completion
