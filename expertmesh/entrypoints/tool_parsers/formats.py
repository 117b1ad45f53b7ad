"""The tool-call formats of the families we serve, each as published by its chat template:

- hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
- deepseek_v3: `<｜tool▁calls▁begin｜>`, then per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`
  and a ```json fenced object, `<｜tool▁call▁end｜>`; `<｜tool▁calls▁end｜>` at the end
- deepseek_v31 (V3.1, V3.2): the same markers, each call
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`
- glm45 (GLM-4.5, 4.6): `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>`
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or (v11+ tokenizers)
  `[TOOL_CALLS]NAME[ARGS]{...}` repeated
- llama3_json / llama4_json: the whole reply is `{"name": ..., "parameters": {...}}` (several joined
  by `;`), optionally after `<|python_tag|>`
- pythonic / llama4_pythonic: the whole reply is `[f(a=1, b="x"), g()]`, optionally inside
  `<|python_start|>...<|python_end|>`
- openai (gpt-oss): harmony commentary messages to `functions.NAME` (entrypoints/harmony.py)
"""

from __future__ import annotations

import ast
import json
import re

from expertmesh.entrypoints.harmony import is_harmony, messages
from expertmesh.entrypoints.tool_parsers.base import ToolCall, ToolParser, call_of, register


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _blocks(text: str, pattern: re.Pattern, one) -> tuple[str, list[ToolCall]]:
    """Calls from every match of `pattern` that `one(match)` accepts; the rest of the text (bad
    calls included) is content."""
    content, calls, at = [], [], 0
    for m in pattern.finditer(text):
        call = one(m)
        if call is None:
            continue
        content.append(text[at : m.start()])
        calls.extend(call if isinstance(call, list) else [call])
        at = m.end()
    content.append(text[at:])
    return "".join(content) if calls else text, calls


# ---- hermes -----------------------------------------------------------------------------------
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    return _blocks(text, _HERMES, lambda m: call_of(_json(m.group(1))))


register(ToolParser("hermes", ("<tool_call>",), parse_hermes, end="</tool_call>"))


# ---- deepseek -----------------------------------------------------------------------------------
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DS_V3 = re.compile(
    re.escape(DS_CALL) + r"\s*function\s*" + re.escape(DS_SEP)
    + r"\s*([^\n]+?)\s*\n```(?:json)?\s*\n?(.*?)\s*```\s*" + re.escape(DS_CALL_END),
    re.S,
)  # fmt: skip
_DS_V31 = re.compile(
    re.escape(DS_CALL) + r"\s*(.+?)\s*" + re.escape(DS_SEP) + r"(.*?)" + re.escape(DS_CALL_END), re.S
)


def _deepseek(pattern: re.Pattern):
    def parse(text: str) -> tuple[str, list[ToolCall]]:
        if DS_BEGIN not in text:
            return text, []
        head, tail = text.split(DS_BEGIN, 1)
        body = tail.split(DS_END, 1)
        calls = [
            call_of({"name": m.group(1), "arguments": _json(m.group(2))}) for m in pattern.finditer(body[0])
        ]
        if (
            not calls
            or any(c is None for c in calls)
            or len(body) < 2
            and not body[0].rstrip().endswith(DS_CALL_END)
        ):
            return text, []  # any bad call: the whole section is content
        return head + (body[1] if len(body) > 1 else ""), calls

    return parse


register(ToolParser("deepseek_v3", (DS_BEGIN,), _deepseek(_DS_V3)))
register(ToolParser("deepseek_v31", (DS_BEGIN,), _deepseek(_DS_V31)), "deepseek_v32")


# ---- glm45 -----------------------------------------------------------------------------------
_GLM = re.compile(r"<tool_call>\s*([^\n<]+?)\s*(?:\n(.*?))?</tool_call>", re.S)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _glm_call(m: re.Match) -> ToolCall | None:
    body = m.group(2) or ""
    args = {}
    for k, v in _GLM_ARG.findall(body):
        value = _json(v)
        args[k.strip()] = v if value is None else value  # strings come unquoted
    if _GLM_ARG.sub("", body).strip():
        return None  # text that is not an argument: malformed
    return call_of({"name": m.group(1), "arguments": args})


def parse_glm45(text: str) -> tuple[str, list[ToolCall]]:
    return _blocks(text, _GLM, _glm_call)


register(ToolParser("glm45", ("<tool_call>",), parse_glm45, end="</tool_call>"), "glm4_moe")


# ---- mistral -----------------------------------------------------------------------------------
MISTRAL = "[TOOL_CALLS]"
_MISTRAL_V11 = re.compile(r"\s*([A-Za-z0-9_.:-]+)\[ARGS\]")


def parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    if MISTRAL not in text:
        return text, []
    head, tail = text.split(MISTRAL, 1)
    tail = tail.replace(MISTRAL, "")
    calls: list[ToolCall | None] = []
    data = _json(tail.strip())
    if isinstance(data, list):
        calls = [call_of(c) for c in data]
    elif isinstance(data, dict):
        calls = [call_of(data)]
    else:  # NAME[ARGS]{...} repeated
        decoder, at = json.JSONDecoder(), 0
        while at < len(tail) and tail[at:].strip():
            m = _MISTRAL_V11.match(tail, at)
            if m is None:
                return text, []
            try:
                args, at = decoder.raw_decode(tail, m.end())
            except json.JSONDecodeError:
                return text, []
            calls.append(call_of({"name": m.group(1), "arguments": args}))
    if not calls or any(c is None for c in calls):
        return text, []
    return head, calls  # type: ignore[return-value]


register(ToolParser("mistral", (MISTRAL,), parse_mistral))


def _lead(text: str) -> str:
    """The blanks before a whole-reply call: content (a stream has sent them already)."""
    return text[: len(text) - len(text.lstrip())]


# ---- llama json -----------------------------------------------------------------------------------
def parse_llama_json(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    decoder, at, calls = json.JSONDecoder(), 0, []
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        call = call_of(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        rest = body[at:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        at = len(body) - len(rest)
    return _lead(text), calls


register(
    ToolParser("llama3_json", ("{", "<|python_tag|>"), parse_llama_json, at_start_only=True), "llama4_json"
)


# ---- pythonic -----------------------------------------------------------------------------------
def _literal(node: ast.AST):
    return ast.literal_eval(node)


def parse_pythonic(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not body.startswith("["):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args:
                return text, []
            name = ast.unparse(node.func)
            args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg}
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    except (SyntaxError, ValueError, TypeError):
        return text, []
    return _lead(text), calls


register(
    ToolParser("pythonic", ("[", "<|python_start|>"), parse_pythonic, at_start_only=True), "llama4_pythonic"
)


# ---- gpt-oss harmony -------------------------------------------------------------------------------
def _harmony(text: str) -> tuple[str, list[ToolCall]]:
    if not is_harmony(text):
        return text, []
    content, calls = [], []
    for m in messages(text):
        if not m.complete or m.channel == "analysis":
            continue
        if m.recipient is not None:
            try:
                args = json.loads(m.body)
            except json.JSONDecodeError:
                args = None
            if isinstance(args, dict):
                calls.append(ToolCall(m.recipient, json.dumps(args, ensure_ascii=False)))
                continue
        content.append(m.body)  # final answer, a preamble, or a malformed call
    return "".join(content), calls


register(ToolParser("openai", ("<|channel|>", "<|start|>", "<|message|>"), _harmony))
