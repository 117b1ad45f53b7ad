"""StructuredOutputsParams with vLLM's field names (vllm.sampling_params.StructuredOutputsParams).

Exactly one constraint is set: `json` (a JSON schema, dict or string), `regex`, `choice` (a list
of strings), `grammar` (Lark or EBNF/GBNF), `json_object=True` (any JSON object) or
`structural_tag` (vLLM's {"structures": [{"begin", "schema", "end"}], "triggers": [...]}).
Anything else is a ValueError naming the fields, raised when the object is made.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    # JSON is always whitespace-bounded here (compact separators, or at most this pattern between
    # tokens) so a small model cannot spend max_tokens on blanks; vLLM's flag is accepted as a no-op.
    disable_any_whitespace: bool = True
    whitespace_pattern: str | None = None
    # True: an object schema without `additionalProperties` admits no other keys (OpenAI strict).
    disable_additional_properties: bool = False
    disable_fallback: bool = False  # one backend here: nothing to fall back to

    def __post_init__(self) -> None:
        chosen = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            what = "none is set" if not chosen else f"{len(chosen)} are set ({', '.join(chosen)})"
            raise ValueError(f"StructuredOutputsParams takes exactly one of {', '.join(KINDS)}; {what}")
        kind = chosen[0]
        value = getattr(self, kind)
        if kind in ("regex", "grammar") and not isinstance(value, str):
            raise ValueError(f"StructuredOutputsParams.{kind} must be a string, got {type(value).__name__}")
        if kind == "choice":
            if (
                not isinstance(value, (list, tuple))
                or not value
                or not all(isinstance(c, str) for c in value)
            ):
                raise ValueError("StructuredOutputsParams.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", list(value))
        if kind == "json_object" and value is not True:
            raise ValueError("StructuredOutputsParams.json_object must be True when set")
        if kind in ("json", "structural_tag"):
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"StructuredOutputsParams.{kind} is not valid JSON: {exc}") from exc
            else:
                parsed = value
            if not isinstance(parsed, dict) and not (kind == "json" and isinstance(parsed, bool)):
                raise ValueError(f"StructuredOutputsParams.{kind} must be a JSON object")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """The cache key: the constraint and every option that changes its grammar."""
        value = getattr(self, self.kind)
        if isinstance(value, str) and self.kind in ("json", "structural_tag"):
            value = json.loads(value)
        spec: dict[str, Any] = {
            self.kind: value,
            "ws": self.whitespace_pattern,
            "no_extra": self.disable_additional_properties,
        }
        return json.dumps(spec, sort_keys=True, ensure_ascii=False)
