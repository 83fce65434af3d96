"""Tool calls run off the rollout's thread, each under a deadline, at most `max_workers` at
once: a tool that raises, hangs or answers at length costs its own sample one error
observation or a truncated answer, and never stalls the engine or the other samples.

Each call (`create` -> `execute` -> `release`, verl's order) runs its coroutines on an event
loop of its own in a daemon thread, so a tool that blocks inside `async def` blocks only
itself. A call past its deadline is answered with a timeout observation at once; its thread
cannot be stopped and is left to finish (daemon: it never holds the process open), its worker
slot freed. This is the reward pool's contract (patrl.orchestrator.rewards) for calls that
keep per-trajectory state in the tool object, which a process pool could not share.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from patrl.orchestrator.agent.base_tool import BaseTool
from patrl.orchestrator.agent.schemas import ToolResponse
from patrl.orchestrator.agent.tool_parser import FunctionCall

TruncateSide = Literal["left", "middle", "right"]
ErrorKind = Literal["malformed", "unknown_tool", "exception", "timeout"]
ERROR_PREFIX = "Error when executing tool: "


@dataclass(slots=True)
class ToolOutcome:
    """One call's answer: `text` (what the model reads, truncated), the tool's step reward
    and metrics, and `error` (None, or what went wrong: the text then is verl's error
    observation, "Error when executing tool: ...")."""

    text: str
    reward: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    error: ErrorKind | None = None
    truncated: bool = False


def truncate(text: str, max_length: int, side: TruncateSide) -> str:
    """verl's truncation of a tool answer longer than `max_length` characters: keep the
    start ("left"), the end ("right") or both halves ("middle"), marking the cut."""
    if len(text) <= max_length:
        return text
    if side == "left":
        return text[:max_length] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-max_length:]
    half = max_length // 2
    return text[:half] + "...(truncated)..." + text[-half:]


class ToolPool:
    """Runs parsed calls on `tools` (by name): `await pool.call(call)` -> ToolOutcome, never
    raising for the tool's faults. `timeout_s`: each call's deadline (create to release);
    `max_workers`: calls running at once; answers are cut to `max_response_length`
    characters on `truncate_side`."""

    def __init__(
        self,
        tools: Sequence[BaseTool],
        timeout_s: float = 30.0,
        max_workers: int = 8,
        max_response_length: int = 256,
        truncate_side: TruncateSide = "middle",
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if max_response_length < 1:
            raise ValueError(f"max_response_length must be >= 1, got {max_response_length}")
        if truncate_side not in ("left", "middle", "right"):
            raise ValueError(f"truncate_side must be left, middle or right, got {truncate_side!r}")
        self.tools: dict[str, BaseTool] = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self.max_response_length = max_response_length
        self.truncate_side: TruncateSide = truncate_side
        self.num_abandoned = 0  # timed-out calls whose threads may still run
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    async def call(
        self, call: FunctionCall, create_kwargs: Mapping[str, Any] | None = None
    ) -> ToolOutcome:
        """Answer one call: a parse error, an unknown name, an exception or the deadline give
        verl's error observation; a long answer is truncated."""
        if call.error is not None or call.name is None or call.arguments is None:
            return ToolOutcome(ERROR_PREFIX + (call.error or "malformed call"), error="malformed")
        tool = self.tools.get(call.name)
        if tool is None:
            known = sorted(self.tools)
            return ToolOutcome(
                f"{ERROR_PREFIX}unknown tool {call.name!r}; the tools are {known}",
                error="unknown_tool",
            )
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:  # each run has its own loop
            self._slots = (loop, asyncio.Semaphore(self.max_workers))
        async with self._slots[1]:
            future = _start(tool, call.arguments, dict(create_kwargs or {}))
            try:
                response, reward, metrics = await asyncio.wait_for(
                    asyncio.wrap_future(future), self.timeout_s
                )
            except TimeoutError:
                self.num_abandoned += 1
                return ToolOutcome(
                    f"{ERROR_PREFIX}{call.name} timed out after {self.timeout_s}s", error="timeout"
                )
            except Exception as e:
                return ToolOutcome(f"{ERROR_PREFIX}{e}", error="exception")
        text = response.text if isinstance(response, ToolResponse) else str(response)
        text = text or ""
        cut = truncate(text, self.max_response_length, self.truncate_side)
        return ToolOutcome(cut, float(reward), dict(metrics or {}), truncated=cut != text)


def _start(
    tool: BaseTool, arguments: dict[str, Any], create_kwargs: dict[str, Any]
) -> concurrent.futures.Future[Any]:
    """Run create -> execute -> release of one call in a daemon thread; its future."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    async def sequence() -> Any:
        instance_id, _ = await tool.create(create_kwargs=create_kwargs)
        try:
            return await tool.execute(instance_id, arguments)
        finally:
            await tool.release(instance_id)

    def work() -> None:
        future.set_running_or_notify_cancel()  # running: a deadline no longer cancels it
        try:
            result = asyncio.run(sequence())
        except BaseException as e:  # the tool's fault is its sample's answer, not ours
            future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
        else:
            future.set_result(result)

    threading.Thread(target=work, name=f"tool-{tool.name}", daemon=True).start()
    return future
