"""The policy's (prompt, response) as the reward model's token ids.

When the RM's tokenizer is the policy's (same vocabulary and chat template) the policy's ids
are used as they are. Otherwise the text is re-encoded with the RM's own tokenizer: with the
RM's chat template over the prompt's messages plus the response as the assistant turn when it
has one, else the decoded prompt text followed by the response text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class RewardModelEncoder:
    """Maps policy samples to RM token ids (see the module for the rule)."""

    def __init__(self, policy_tokenizer: Any, rm_tokenizer: Any) -> None:
        self.policy = policy_tokenizer
        self.rm = rm_tokenizer
        self.same = same_tokenizer(policy_tokenizer, rm_tokenizer)

    def encode(
        self,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        messages: Sequence[dict[str, str]] | None = None,
    ) -> list[int]:
        """RM ids of one sample; `messages` are the prompt's chat messages, if known."""
        if self.same:
            return [*prompt_ids, *response_ids]
        response = self.policy.decode(list(response_ids), skip_special_tokens=True)
        if messages and getattr(self.rm, "chat_template", None):
            chat = [*messages, {"role": "assistant", "content": response}]
            text = self.rm.apply_chat_template(chat, tokenize=False)
            return list(self.rm(text, add_special_tokens=False)["input_ids"])
        prompt = self.policy.decode(list(prompt_ids), skip_special_tokens=True)
        return list(self.rm(prompt + response)["input_ids"])


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers map text to the same ids and share a chat template."""
    if getattr(a, "chat_template", None) != getattr(b, "chat_template", None):
        return False
    return bool(len(a) == len(b) and a.get_vocab() == b.get_vocab())
