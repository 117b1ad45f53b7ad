"""The server's structured-output and tool fields: `response_format`, vLLM's `structured_outputs`
extra field, `tools`, `tool_choice`, `parallel_tool_calls`; how they become a
StructuredOutputsParams, and its compilation off the event loop (a bad constraint is a 400 naming
the field, one that compiles too slowly fails only its request).

The request models of protocol.py mix in `StructuredFields` (completions) and `ToolFields` (chat).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from expertmesh.sampling_params import SamplingParams
from expertmesh.structured_outputs.params import StructuredOutputsParams

COMPILE_TIMEOUT_S = 10.0


class APIFieldError(ValueError):
    """A structured-output or tool field the server cannot honour: a 400 naming `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` extra field: the offline StructuredOutputsParams over HTTP."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionName


class StructuredFields(BaseModel):
    """Mixed into /v1/completions' and /v1/chat/completions' request models."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None


class ToolFields(StructuredFields):
    """Mixed into /v1/chat/completions' request model."""

    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


# ---- fields -> StructuredOutputsParams --------------------------------------------------------
def constraint_of(body: Any, auto_tool_choice: bool = False) -> tuple[StructuredOutputsParams | None, str]:
    """The request's constraint and the field it came from ("" when unconstrained)."""
    rf, so = getattr(body, "response_format", None), getattr(body, "structured_outputs", None)
    tool_kind = tool_choice_kind(body, auto_tool_choice)
    given = [
        name
        for name, on in (
            ("response_format", rf is not None and rf.type != "text"),
            ("structured_outputs", so is not None),
            ("tool_choice", tool_kind in ("required", "named")),
        )
        if on
    ]
    if len(given) > 1:
        raise APIFieldError(f"{' and '.join(given)} each constrain the output; give one of them", given[-1])
    if tool_kind in ("required", "named"):
        return tool_call_constraint(body, tool_kind), "tool_choice"
    if so is not None:
        fields = so.model_dump(by_alias=True, exclude_none=True)
        try:
            return StructuredOutputsParams(**fields), "structured_outputs"
        except ValueError as exc:
            raise APIFieldError(str(exc), "structured_outputs") from exc
    if rf is None or rf.type == "text":
        return None, ""
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise APIFieldError("response_format json_schema needs json_schema.schema", "response_format")
    schema = rf.json_schema.schema_
    # OpenAI's strict mode: no keys beyond the schema's (a small model would otherwise invent some).
    strict = bool(rf.json_schema.strict)
    return StructuredOutputsParams(json=schema, disable_additional_properties=strict), "response_format"


def tool_choice_kind(body: Any, auto_tool_choice: bool) -> str:
    """none, auto, required or named, OpenAI's default applied (auto with tools, else none)."""
    tools, choice = getattr(body, "tools", None), getattr(body, "tool_choice", None)
    if isinstance(choice, NamedToolChoice):
        return "named"
    if choice is None:
        return "auto" if tools and auto_tool_choice else "none"
    return choice


def tool_schema(tool: ToolDefinition) -> dict[str, Any]:
    params = tool.function.parameters
    return params if params is not None else {"type": "object", "properties": {}}


def tool_call_constraint(body: Any, kind: str) -> StructuredOutputsParams:
    """`required`: a JSON array of {"name", "parameters"} calls (vLLM's shape); a named function:
    its parameters object. Objects admit no undeclared keys, so a small model cannot wander."""
    tools = body.tools or []
    if not tools:
        raise APIFieldError(f"tool_choice {kind!r} needs `tools`", "tool_choice")
    if kind == "named":
        name = body.tool_choice.function.name
        match = [t for t in tools if t.function.name == name]
        if not match:
            raise APIFieldError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return StructuredOutputsParams(json=tool_schema(match[0]), disable_additional_properties=True)
    one_of = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "parameters": tool_schema(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": one_of}, "minItems": 1}
    if body.parallel_tool_calls is False:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array, disable_additional_properties=True)


async def constrain(
    engine: Any, body: Any, params: SamplingParams, auto_tool_choice: bool = False
) -> SamplingParams:
    """`params` with the request's constraint, compiled (and cached) in a worker thread first."""
    so, field = constraint_of(body, auto_tool_choice)
    if so is None:
        return params
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise APIFieldError("structured outputs need the model's tokenizer, and this model has none", field)

    def compile_it() -> None:
        from expertmesh.structured_outputs.compiler import get_compiler  # llguidance: on first use

        get_compiler(tokenizer, _vocab_size(engine)).compile(so)

    try:
        await asyncio.wait_for(asyncio.to_thread(compile_it), COMPILE_TIMEOUT_S)
    except asyncio.TimeoutError as exc:
        raise APIFieldError(
            f"the {field} constraint took longer than {COMPILE_TIMEOUT_S:g} s to compile", field
        ) from exc
    except ValueError as exc:
        raise APIFieldError(f"{field}: {exc}", field) from exc
    return dataclasses.replace(params, structured_outputs=so)


def _vocab_size(engine: Any) -> int:
    """The model's vocabulary (what the ranks compile against, so the compiled grammar is shared)."""
    client = engine.client
    inner = getattr(client, "engine", None)
    if inner is not None:
        return inner.config.model_config.vocab_size
    limits = getattr(client, "_limits", None) or {}
    return int(limits.get("vocab_size") or len(engine.tokenizer))
