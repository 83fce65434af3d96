"""Stop strings and stop ids, as vLLM has them: each against a slow twin that generates
without stops, then cuts the tokens and text where the first stop appears in the full decode.
The incremental detokenizer against a full decode of every prefix."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from rollout_tokenizers import WORDS, bpe_tokenizer, save_text_model

from patrl.rollout.config import EngineConfig
from patrl.rollout.detokenizer import StopStringChecker, find_stop_string
from patrl.rollout.engine import Engine
from patrl.rollout.outputs import CompletionOutput
from patrl.rollout.sampler import SamplingParams

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    return save_text_model(tmp_path_factory.mktemp("text_llama"), tokenizer)


def engine(model_dir: Path) -> Engine:
    config = EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=256, max_model_len=128)
    return Engine(config)


PROMPTS = ["the cat sat on", "numbers 12 345", "Answer: yes", "while rain fell;"]


def params(seed: int, **extra: Any) -> SamplingParams:
    return SamplingParams(**{"seed": seed, "max_tokens": MAX_TOKENS, "ignore_eos": True, **extra})


def reference(
    tokenizer: Any, out: CompletionOutput, stops: list[str], include: bool
) -> tuple[list[int], str, str | None]:
    """Slow twin: the shortest token prefix whose full decode contains a stop string (the
    first listed, of those that appear at once), its text cut there; else everything."""
    ids = out.token_ids
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        for stop in stops:
            at = text.find(stop)
            if at != -1:
                return ids[:n], text[: at + len(stop)] if include else text[:at], stop
    return ids, tokenizer.decode(ids, skip_special_tokens=True), None


def result(c: CompletionOutput) -> tuple[Any, ...]:
    """What a completion says but its timings and its logprobs (compared on their own)."""
    return (c.token_ids, c.text, c.finish_reason, c.stop_reason)


def stops_from(text: str, rng: random.Random) -> list[str]:
    """A stop list for a text: a string that is not in it, then a piece of its second half
    (often ending inside a token), then one from its first half (listed later: the earlier
    position must still win)."""
    half = len(text) // 2
    a = rng.randrange(half, len(text) - 3)
    b = rng.randrange(1, half - 3)
    return ["#never#", text[a : a + rng.randint(2, 4)], text[b : b + rng.randint(2, 4)]]


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_where_the_full_decode_first_contains_one(
    model_dir: Path, tokenizer: Any, include: bool
) -> None:
    free = engine(model_dir).generate(PROMPTS, [params(s, n=2) for s in range(len(PROMPTS))])
    rng = random.Random(int(include))
    stop_lists = [stops_from(o.outputs[0].text or "", rng) for o in free]
    stopped = engine(model_dir).generate(
        PROMPTS,
        [
            params(s, n=2, stop=stops, include_stop_str_in_output=include)
            for s, stops in enumerate(stop_lists)
        ],
    )
    matched = inside = 0
    for a, b, stops in zip(free, stopped, stop_lists, strict=True):
        for whole, cut in zip(a.outputs, b.outputs, strict=True):
            ids, text, stop = reference(tokenizer, whole, stops, include)
            assert cut.token_ids == ids
            # Not bit-equal: the stopped run's sequences leave earlier, so its batches have
            # fewer rows, and a CPU GEMM's reduction order (hence the last bits) depends on the
            # batch shape. float32 logprobs of magnitude ~10 then differ by ~1e-6; a wrong
            # position or a wrong token would be off by far more than 1e-5.
            assert cut.logprobs == pytest.approx(whole.logprobs[: len(ids)], rel=1e-5, abs=1e-5)
            assert cut.text == text
            assert cut.stop_reason == stop
            assert cut.finish_reason == ("stop" if stop is not None else "length")
            matched += stop is not None
            ends = {tokenizer.decode(ids[:n], skip_special_tokens=True) for n in (-1, None)}
            inside += stop is not None and text not in ends
    assert matched >= len(PROMPTS)  # every first sample stops, the text it stops in is its own
    assert inside > 0  # and some cuts fall inside the last token's text


def test_a_stop_string_never_reached_changes_nothing(model_dir: Path) -> None:
    free = engine(model_dir).generate(PROMPTS, params(3, logprobs=1))
    never = engine(model_dir).generate(PROMPTS, params(3, logprobs=1, stop="#never#"))
    for a, b in zip(free, never, strict=True):
        assert [result(c) for c in a.outputs] == [result(c) for c in b.outputs]
        # Bit-equal: a stop string that never matches changes no batch (same rows, same
        # shapes, same kernels in the same process), so every float is computed identically.
        assert [(c.logprobs, c.top_logprobs) for c in a.outputs] == [
            (c.logprobs, c.top_logprobs) for c in b.outputs
        ]


def test_stop_token_ids_end_at_the_id_and_leave_its_text_out(
    model_dir: Path, tokenizer: Any
) -> None:
    free = engine(model_dir).generate(PROMPTS, params(5))
    stop_ids = [o.outputs[0].token_ids[MAX_TOKENS // 2] for o in free]
    for include in (False, True):
        cut = engine(model_dir).generate(
            PROMPTS,
            [params(5, stop_token_ids={t}, include_stop_str_in_output=include) for t in stop_ids],
        )
        for whole, part, t in zip(free, cut, stop_ids, strict=True):
            first = whole.outputs[0].token_ids.index(t)
            out = part.outputs[0]
            assert out.token_ids == whole.outputs[0].token_ids[: first + 1]
            assert (out.finish_reason, out.stop_reason) == ("stop", t)
            kept = out.token_ids if include else out.token_ids[:-1]
            assert out.text == tokenizer.decode(kept, skip_special_tokens=True)


def test_eos_stops_with_no_stop_reason_and_its_text_left_out(
    model_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    free = engine(model_dir).generate(PROMPTS, params(7))
    eos = free[0].outputs[0].token_ids[MAX_TOKENS // 2]  # a plain token, made the model's EOS
    for f in model_dir.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    honoured = engine(tmp_path).generate(PROMPTS, params(7, ignore_eos=False, stop="#never#"))
    for whole, out in zip(free, honoured, strict=True):
        ids = whole.outputs[0].token_ids
        n = ids.index(eos) + 1 if eos in ids else len(ids)
        got = out.outputs[0]
        assert got.token_ids == ids[:n]
        assert got.stop_reason is None
        assert got.finish_reason == ("stop" if eos in ids else "length")
        kept = ids[: n - 1] if eos in ids else ids
        assert got.text == tokenizer.decode(kept, skip_special_tokens=True)


def test_a_stopping_sample_moved_between_engines_stops_where_it_would_have(
    model_dir: Path,
) -> None:
    """Exported mid-generation (without KV) and continued in another engine, a sample with
    stop strings rebuilds its text from its tokens; a sample that already stopped travels
    with its stop reason and gives the same cut text."""
    prompt = PROMPTS[0]
    free = engine(model_dir).generate([prompt], params(11, n=2))[0]
    texts = [c.text or "" for c in free.outputs]
    stops = [texts[0][len(texts[0]) // 3 :][:3], texts[1][-6:-3]]
    sp = params(11, n=2, stop=stops)
    whole = engine(model_dir).generate([prompt], sp)[0]
    assert [c.finish_reason for c in whole.outputs] == ["stop", "stop"]
    assert len(whole.outputs[0].token_ids) < len(whole.outputs[1].token_ids)
    first = engine(model_dir)
    rid = first.add_request(prompt, sp)
    while not any(s.finish_reason for s in first.snapshot_requests([rid])):
        first.step()
    states = first.export_requests([rid], with_kv=False, include_finished=True)
    assert [s.finish_reason for s in states] == ["stop", None]
    second = engine(model_dir)
    second.import_requests(states)
    moved = []
    while second.has_unfinished():
        moved += second.step()
    assert [result(c) for c in moved[0].outputs] == [result(c) for c in whole.outputs]
    for a, b in zip(moved[0].outputs, whole.outputs, strict=True):
        # the moved sample's KV was recomputed by a prefill: the same values up to rounding
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_stop_strings_need_a_tokenizer(tmp_path: Path) -> None:
    from patrl_testkit.models import save_tiny_model

    bare = Engine(
        EngineConfig(model=str(save_tiny_model(tmp_path)), block_size=4, num_kv_blocks=64)
    )
    with pytest.raises(ValueError, match=r"stop strings \['x'\] need a tokenizer, and .* none"):
        bare.generate([[1, 2, 3]] * 2, [SamplingParams(max_tokens=2), SamplingParams(stop="x")])
    assert not bare.has_unfinished()  # checked before anything was queued


# ----------------------------------------------------------------- the detokenizer itself


@pytest.mark.parametrize("byte_alphabet", [False, True])
def test_incremental_text_is_the_full_decode_of_every_prefix(byte_alphabet: bool) -> None:
    """Text that is valid UTF-8 (here with CJK characters split across byte tokens): after
    each token the checker's text is the full decode of the prefix, except that a prefix
    ending inside a character is held back until the character completes."""
    tok = bpe_tokenizer(vocab_size=400, byte_alphabet=byte_alphabet)
    rng = random.Random(0)
    pieces = [*WORDS, *(["日本語", "本", "語"] if byte_alphabet else [])]
    for _ in range(5):
        ids = tok.encode(" ".join(rng.choices(pieces, k=30)), add_special_tokens=False)
        checker = StopStringChecker(tok, ["#never#"], False, True)
        held = 0
        for n in range(1, len(ids) + 1):
            assert checker.update(ids[:n]) is None
            full = tok.decode(ids[:n])
            if full.endswith("\ufffd"):
                held += 1
                assert full.startswith(checker.text)
            else:
                assert checker.text == full
        assert held > 0 if byte_alphabet else held == 0


def test_a_stop_string_completed_by_the_last_byte_of_a_character() -> None:
    tok = bpe_tokenizer(vocab_size=400, byte_alphabet=True)
    ids = tok.encode("the cat 猫犬", add_special_tokens=False)  # 猫 is not in the corpus
    decodes = [tok.decode(ids[:n]) for n in range(1, len(ids) + 1)]
    assert sum(d.endswith("\ufffd") for d in decodes) >= 2  # 猫 and 犬 arrive byte by byte
    checker = StopStringChecker(tok, ["cat 猫"], True, True)
    at = next(n for n in range(len(ids)) if checker.update(ids[: n + 1]) is not None)
    assert checker.stop == "cat 猫"
    assert "cat 猫" in decodes[at] and "cat 猫" not in decodes[at - 1]
    assert checker.text == "the cat 猫"
    replayed = StopStringChecker.replay(tok, ["cat 猫"], True, True, ids)
    assert (replayed.text, replayed.stop) == (checker.text, checker.stop)


def test_find_stop_string_searches_only_new_text_and_keeps_list_order() -> None:
    assert find_stop_string("abcab", 0, ["ab"], False) is None
    assert find_stop_string("xxab", 1, ["ab"], False) == ("ab", 2)  # ends in the new char
    assert find_stop_string("abxx", 1, ["ab"], False) is None  # old text: searched before
    assert find_stop_string("xxab", 2, ["b", "xab"], True) == ("b", 4)  # list order wins
    assert find_stop_string("xxab", 2, ["xab", "b"], False) == ("xab", 1)
