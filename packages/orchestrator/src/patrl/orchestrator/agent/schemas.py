"""OpenAI-style tool schemas and the tool response, with verl's names (`verl.tools.schemas`), so
a verl tool's `tool_schema` YAML and its `ToolResponse` mean the same here.

Unlike verl's, the parameter schema accepts any further JSON-schema keys (`items`, `minimum`,
...) and keeps them: a schema is handed to the chat template as written."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter of a function: its JSON type, description and allowed values."""

    model_config = ConfigDict(extra="allow")

    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    """A function's parameters: a JSON-schema object."""

    model_config = ConfigDict(extra="allow")

    type: str = "object"
    properties: dict[str, OpenAIFunctionPropertySchema] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(BaseModel):
    """A function the model may call: `name` (what a call names), description, parameters."""

    name: str = Field(min_length=1)
    description: str = ""
    parameters: OpenAIFunctionParametersSchema = Field(
        default_factory=OpenAIFunctionParametersSchema
    )
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """A tool in OpenAI's format: {"type": "function", "function": {...}}."""

    type: Literal["function"] = "function"
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    """A parsed call: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolResponse(BaseModel):
    """What a tool answers: text (what the model reads). verl's image/video fields are kept
    for a ported tool to set; patrl's agent loop renders text only."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None
