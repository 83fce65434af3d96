"""verl's `single_turn_agent`: one model turn over the chat-templated prompt, no tools. A data
row with `agent_name: single_turn_agent` runs it inside a multi-turn job (e.g. rows that need
no tool), its trajectory trained like the tool loop's."""

from __future__ import annotations

import dataclasses
from typing import Any
from uuid import uuid4

from patrl.orchestrator.agent.agent_loop import (
    AgentLoop,
    AgentLoopContext,
    AgentLoopOutput,
    register,
)
from patrl.rollout import SamplingParams


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoop):
    """One turn: `raw_prompt` rendered by the chat template with the assistant's turn opened
    (no tools), at most `response_length` tokens sampled; every response token is the
    model's (mask 1)."""

    def __init__(
        self,
        tokenizer: Any,
        response_length: int,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(tokenizer)
        if response_length < 1:
            raise ValueError(f"response_length must be >= 1, got {response_length}")
        self.response_length = response_length
        self.template_kwargs = dict(chat_template_kwargs or {})

    @classmethod
    def build(cls, context: AgentLoopContext) -> SingleTurnAgentLoop:
        return cls(context.tokenizer, context.response_length)

    async def run(self, sampling_params: SamplingParams, **kwargs: Any) -> AgentLoopOutput:
        """One sample: `raw_prompt` (its chat messages); `sample_index` names its request."""
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in kwargs["raw_prompt"]],
            tokenize=False,
            add_generation_prompt=True,
            **self.template_kwargs,
        )
        prompt_ids = list(self.tokenizer.encode(str(text), add_special_tokens=False))
        params = dataclasses.replace(
            sampling_params, n=1, max_tokens=min(sampling_params.max_tokens, self.response_length)
        )
        turn = await self.server_manager.generate(
            f"single-{kwargs.get('sample_index', 0)}-{uuid4().hex[:8]}",
            prompt_ids=prompt_ids,
            sampling_params=params,
        )
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=list(turn.token_ids),
            response_mask=[1] * len(turn.token_ids),
            response_logprobs=list(turn.log_probs),
            num_turns=2,
        )
