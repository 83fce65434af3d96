"""Stop strings: a sample's text, decoded a token at a time, searched for its stop strings.

Only samples whose `SamplingParams.stop` is non-empty pay for this (two decodes of a short
tail window of tokens per token, on the host); every other sample is decoded once, when it
finishes. The text is built as vLLM's and TGI's incremental detokenizers build it: the tail
from `prefix_offset` is decoded with and without the newest tokens, and the difference is
the new text, held back while it ends in an incomplete UTF-8 sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["StopStringChecker", "find_stop_string"]


def find_stop_string(
    text: str, new_chars: int, stops: Sequence[str], include: bool
) -> tuple[str, int] | None:
    """The first of `stops` (in their order) that ends in the last `new_chars` characters of
    `text`, and the length `text` is cut to: before the stop string, or after it with
    `include`; None when none does. vLLM's rule: only text that could hold a new match is
    searched, so earlier text is never searched twice."""
    if not new_chars:
        return None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        at = text.find(stop, start)
        if at != -1:
            return stop, at + len(stop) if include else at
    return None


class StopStringChecker:
    """The text of one sample's output tokens so far, and whether it has reached one of its
    stop strings. `update` is called once per output token, in order; a match truncates the
    text and is final (the sample then finishes). Rebuilt on another replica by `replay`."""

    __slots__ = (
        "_prefix",
        "_read",
        "include",
        "skip_special",
        "stop",
        "stops",
        "text",
        "tokenizer",
    )

    def __init__(
        self, tokenizer: Any, stops: Sequence[str], include: bool, skip_special_tokens: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.include = include
        self.skip_special = skip_special_tokens
        self.text = ""
        self.stop: str | None = None  # the stop string found
        self._prefix = 0  # output tokens before this one are in `text` for good
        self._read = 0  # output tokens before this one are decoded into `text`

    def update(self, token_ids: Sequence[int]) -> str | None:
        """Take in the newest of `token_ids` (the sample's output so far); the stop string it
        completed, else None."""
        before = len(self.text)
        self._decode_tail(token_ids)
        found = find_stop_string(self.text, len(self.text) - before, self.stops, self.include)
        if found is None:
            return None
        self.stop, cut = found
        self.text = self.text[:cut]
        return self.stop

    def _decode_tail(self, token_ids: Sequence[int]) -> None:
        decode = self.tokenizer.decode
        skip = self.skip_special
        prefix = decode(token_ids[self._prefix : self._read], skip_special_tokens=skip)
        full = decode(token_ids[self._prefix :], skip_special_tokens=skip)
        # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the bytes that complete it.
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix, self._read = self._read, len(token_ids)

    @classmethod
    def replay(
        cls,
        tokenizer: Any,
        stops: Sequence[str],
        include: bool,
        skip_special_tokens: bool,
        token_ids: Sequence[int],
    ) -> StopStringChecker:
        """The checker after `update` for each prefix of `token_ids`, stopping at a match:
        the state the sample's own checker reached, derived from its tokens."""
        checker = cls(tokenizer, stops, include, skip_special_tokens)
        seen: list[int] = []
        for token in token_ids:
            seen.append(token)
            if checker.update(seen) is not None:
                break
        return checker
