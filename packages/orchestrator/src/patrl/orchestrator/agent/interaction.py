"""verl's interactions (`verl.interactions`): a simulated user that answers the model's final
(non-tool) assistant turn, so that a sample gets several attempts in one trajectory.

A verl interaction class ports by changing its import: `verl.interactions.base` becomes
`patrl.orchestrator.agent.interaction`. The config is verl's YAML
(`rollout.multi_turn.interaction_config_path`)::

    interaction:
      - name: gsm8k                 # optional: else the class name, less "Interaction", lowered
        class_name: patrl.orchestrator.agent.gsm8k_interaction.Gsm8kInteraction
        config: {}

and a data row picks one by `extra_info.interaction_kwargs.name` (verl's); the whole
`interaction_kwargs` (name included, as verl passes it) goes to `start_interaction`.

Calls run as tool calls do (`InteractionRunner`): each in a daemon thread on an event loop of
its own under a deadline, so an interaction that blocks or hangs costs its own sample only.
Every problem of the config is an `InteractionConfigError` naming the file and key.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any
from uuid import uuid4

import yaml

from patrl.orchestrator.agent.tool_config import dotted_class
from patrl.orchestrator.errors import JobError


class InteractionConfigError(JobError):
    """An interaction config that cannot be loaded; the message names the file and key."""


class BaseInteraction:
    """verl's `BaseInteraction`: `config` is the YAML entry's `config` mapping with `name` set
    to the entry's name. Every method is async; one instance serves every sample, keyed by
    `instance_id` (the sample's request id)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start the state of one sample's conversation (kwargs: the row's interaction_kwargs);
        returns its id (the given one, or a fresh uuid)."""
        return instance_id if instance_id is not None else str(uuid4())

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """The user's answer to the conversation `messages` (the prompt's messages, then each
        assistant turn as decoded text, each tool and user message as appended):
        (should_terminate_sequence, response_content, current_turn_score, additional_data)."""
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        """The instance's score so far (turn level)."""
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Free the instance's state (called once per started instance, also on errors and
        cuts)."""


def default_name(class_name: str) -> str:
    """verl's name for an entry without one: the class's name less "Interaction", lowered."""
    simple = class_name.rsplit(".", 1)[-1]
    return (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def load_interactions(path: str | Path) -> dict[str, BaseInteraction]:
    """The interactions of verl's YAML at `path` by name, in the file's order;
    InteractionConfigError naming the file and key on any problem (no file, not YAML, no
    `interaction` list, a class_name that does not import or is not a BaseInteraction, a
    config that is not a mapping, two entries of one name, a constructor that raises)."""
    file = Path(path)
    if not file.is_file():
        raise InteractionConfigError(
            f"interaction config {path}: no such file (rollout.multi_turn.interaction_config_path)"
        )
    try:
        data = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise InteractionConfigError(f"interaction config {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("interaction"), list):
        raise InteractionConfigError(
            f"{path}: an interaction config is a mapping with an `interaction` list (each item: "
            "name, class_name, config)"
        )
    found: dict[str, BaseInteraction] = {}
    for i, entry in enumerate(data["interaction"]):
        where = f"{path}: interaction.{i}"
        if not isinstance(entry, dict):
            raise InteractionConfigError(
                f"{where}: each item is a mapping of name, class_name, config"
            )
        unknown = sorted(set(entry) - {"name", "class_name", "config"})
        if unknown:
            raise InteractionConfigError(
                f"{where}: unknown keys {unknown}; use name, class_name, config"
            )
        cls = interaction_class(entry.get("class_name"), f"{where}.class_name")
        name = entry.get("name")
        if name is None:
            name = default_name(entry["class_name"])
        if not isinstance(name, str) or not name:
            raise InteractionConfigError(f"{where}.name={name!r}: a non-empty string")
        if name in found:
            raise InteractionConfigError(
                f"{where}.name={name!r}: a second interaction of that name; names must be unique"
            )
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise InteractionConfigError(f"{where}.config: a mapping, got {config!r:.80}")
        try:
            found[name] = cls(config={**config, "name": name})
        except Exception as e:
            raise InteractionConfigError(f"{where}: {cls.__name__}(config) raised {e!r}") from e
    return found


def interaction_class(name: Any, where: str) -> type[BaseInteraction]:
    """The class a dotted `class_name` names; InteractionConfigError naming `where` when it
    does not import or is not a BaseInteraction."""
    return dotted_class(
        name,
        where,
        BaseInteraction,
        InteractionConfigError,
        "patrl.orchestrator.agent.interaction.BaseInteraction (a verl interaction ports by "
        "importing BaseInteraction from there)",
    )


def check_interaction_config(path: str | Path) -> list[str]:
    """The problems of the interaction config at `path` (empty: it loads), for preflight."""
    try:
        load_interactions(path)
    except InteractionConfigError as e:
        return [str(e)]
    return []


def interaction_kwargs(extra: Mapping[str, Any]) -> dict[str, Any] | None:
    """A row's verl `extra_info.interaction_kwargs` (or an `interaction_kwargs` column), None
    where it has none."""
    info = extra.get("extra_info")
    found = info.get("interaction_kwargs") if isinstance(info, dict) else None
    found = found if found is not None else extra.get("interaction_kwargs")
    return dict(found) if isinstance(found, dict) else None


def interaction_row_problem(kwargs: Any, names: Mapping[str, Any] | list[str]) -> str | None:
    """What is wrong with a row's interaction_kwargs against the configured interaction
    `names` (None: nothing): not a mapping, no `name`, or an unknown name."""
    if not isinstance(kwargs, dict):
        return f"extra_info.interaction_kwargs={kwargs!r:.80} is not a mapping"
    if kwargs.get("name") is None:  # a column file fills a row's missing key with null
        return (
            "extra_info.interaction_kwargs has no `name` (verl's: it picks the interaction; "
            f"configured: {sorted(names)})"
        )
    if kwargs["name"] not in names:
        return (
            f"extra_info.interaction_kwargs.name={kwargs['name']!r} is not a configured "
            f"interaction; configured: {sorted(names)} (rollout.multi_turn.interaction_config_path)"
        )
    return None


class InteractionFailed(Exception):
    """An interaction call raised or passed its deadline: `kind` is "exception" or
    "timeout", the message says which call and why."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


async def call_interaction(what: str, make: Callable[[], Awaitable[Any]], timeout_s: float) -> Any:
    """Run the coroutine `make()` (one interaction call, named `what` in errors) in a daemon
    thread on an event loop of its own, under `timeout_s`; its result, or InteractionFailed.
    A call past its deadline is left to finish in its thread (it cannot be stopped), as the
    tool pool's are: it never holds up the engine nor the other samples."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def work() -> None:
        future.set_running_or_notify_cancel()
        try:
            result = asyncio.run(_awaited(make))
        except BaseException as e:  # the interaction's fault is its sample's, not the run's
            future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
        else:
            future.set_result(result)

    threading.Thread(target=work, name=f"interaction-{what}", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
    except TimeoutError:
        raise InteractionFailed("timeout", f"{what} timed out after {timeout_s}s") from None
    except Exception as e:
        raise InteractionFailed("exception", f"{what} raised {e!r}") from e


class InteractionCalls:
    """How an agent loop makes its interaction calls (`ToolAgentLoop.interaction_calls`):
    `call` runs one (`call_interaction`). The async schedule's samples swap in one that
    records each answer and answers a replayed sample from its record
    (`async_rl.agent_tickets.RecordingInteractions`)."""

    async def call(self, what: str, make: Callable[[], Awaitable[Any]], timeout_s: float) -> Any:
        """The result of the interaction call `what` ("start_interaction",
        "generate_response", "finalize_interaction"), or InteractionFailed."""
        return await call_interaction(what, make, timeout_s)


async def _awaited(make: Callable[[], Awaitable[Any]]) -> Any:
    return await make()
