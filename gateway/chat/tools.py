"""Tool calling: the request's ``tools`` and ``tool_choice``, checked and turned into
what the engine and the reply need.

- ``tool_choice: "none"`` (or no tools): the tools go into the template (a template that
  renders them tells the model), the reply is content.
- a named function, or ``"required"``: the engine's structured outputs constrain the reply
  to the function's parameters, or to vLLM's array of ``{"name", "parameters"}`` (at most
  one item when ``parallel_tool_calls`` is false). Any model serves these: the constraint,
  not the model's training, makes the reply a call.
- ``"auto"`` (OpenAI's default when tools are given): the model decides, so a parser must
  know the model's format; the gateway's is set by ``CHARSERVE_TOOL_PARSER`` (``hermes``).
  Without one, ``auto`` is a 400 that says to use ``required`` or a named function.

:mod:`gateway.streaming.tool_calls` shapes the reply.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.http.errors import BadRequest
from gateway.streaming.tool_calls import TOOL_PARSERS, ToolMode

MAX_TOOLS = 64
MAX_TOOL_DESCRIPTION = 4096
# A function name as OpenAI allows it.
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDef(BaseModel):
    """``tools[].function``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = Field(default=None, max_length=MAX_TOOL_DESCRIPTION)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One entry of ``tools``: a function the model may call."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    """``tool_choice.function``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the function the reply must call."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    """``messages[].tool_calls[].function``: a call the model made earlier."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=NAME_PATTERN)
    arguments: str


class MessageToolCall(BaseModel):
    """One of an assistant message's ``tool_calls`` (sent back with the tool's result)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"]
    function: CalledFunction

    def template(self) -> dict[str, Any]:
        """The call as chat templates take it: arguments as an object where they parse
        (templates write them with ``tojson``), as vLLM passes them."""
        arguments: Any = self.function.arguments
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def effective_choice(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolChoice | None:
    """What the request asks: None without tools; OpenAI's default ``auto`` with them."""
    if not tools:
        return None
    return choice if choice is not None else "auto"


def choice_contradiction(
    tools: list[Tool] | None, choice: ToolChoice | None
) -> tuple[str, str] | None:
    """(param, why) when ``tool_choice`` cannot be served with ``tools``."""
    if choice not in (None, "none") and not tools:
        return ("tool_choice", "tool_choice needs tools")
    names = [tool.function.name for tool in tools or []]
    if len(set(names)) != len(names):
        return ("tools", "two tools have the same name")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        return ("tool_choice", f"tool_choice names {choice.function.name!r}, not in tools")
    return None


def constraint(
    tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None
) -> dict[str, Any] | None:
    """The JSON schema that makes the reply a call (named, required), else None."""
    choice = effective_choice(tools, choice)
    if tools is None or choice is None:
        return None
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        return _parameters(chosen[0]) if chosen else None  # unknown: a contradiction
    if choice != "required":
        return None
    item = {
        "type": "object",
        "anyOf": [
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": _parameters(tool),
                },
                "required": ["name", "parameters"],
            }
            for tool in tools
        ],
    }
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def tool_mode(
    tools: list[Tool] | None, choice: ToolChoice | None, parser: str | None
) -> ToolMode | None:
    """How the reply becomes tool calls (None: it is content); 400 for ``auto`` without
    a parser."""
    choice = effective_choice(tools, choice)
    if choice is None or choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        return ToolMode("named", name=choice.function.name)
    if choice == "required":
        return ToolMode("required")
    if parser not in TOOL_PARSERS:
        raise BadRequest(
            "tool_choice auto (the default with tools) needs the model's tool-call format, "
            "and no tool parser is configured on this server (CHARSERVE_TOOL_PARSER); ask "
            'tool_choice "required" or a named function, which the engine\'s structured '
            'outputs serve with any model, or "none"',
            param="tool_choice",
            code="unsupported_field",
        )
    return ToolMode("auto", parser=parser)


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (OpenAI's shape)."""
    if not tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools]


def tools_chars(tools: list[Tool] | None) -> int:
    """About how many characters the tools add to the rendered prompt."""
    return sum(len(json.dumps(tool.model_dump(exclude_none=True))) for tool in tools or [])
