"""What a tool-call parser is (ToolParser, the ToolCall it reads) and the registry by name; the
formats (formats.py, harmony.py) import this, the package's __init__ imports them."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass(frozen=True)
class ToolParser:
    name: str
    starts: tuple[str, ...]  # any of these opens the tool-call part of the text
    parse: Callable[[str], tuple[str, list[ToolCall]]]
    end: str | None = None  # closes one call (lets a stream send calls before the end)
    at_start_only: bool = False  # the markers count only at the start of the text (JSON, pythonic)


TOOL_PARSERS: dict[str, ToolParser] = {}


def register(parser: ToolParser, *aliases: str) -> ToolParser:
    for name in (parser.name, *aliases):
        TOOL_PARSERS[name] = parser
    return parser


def call_of(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """{"name": ..., "arguments"|"parameters": {...}} as a ToolCall, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models send the arguments already serialized
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
