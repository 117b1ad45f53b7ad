"""Constraints -> llguidance grammars -> matchers, with an LRU cache keyed by the constraint.

Why llguidance (not xgrammar): it installs as one self-contained wheel with no dependencies,
while xgrammar pulls triton and apache-tvm-ffi next to our pinned CPU torch; it builds the token
trie from the Hugging Face tokenizer itself (byte-level BPE included) and computes a mask in
tens of microseconds with lazy lexing, so compiling a schema is cheap and needs no warm-up.
vLLM ships it as its `guidance` backend, so constraints behave as they do there.

A compiled constraint is a template matcher; each sequence gets a `deep_copy` of it. Compiling
is bounded by llguidance's parser limits (its "fuel") and, on the server, by a wall-clock limit
(`compile_async`), so one pathological grammar fails only its own request.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
from llguidance import LLMatcher, LLTokenizer

from expertmesh.structured_outputs.params import StructuredOutputsParams

CACHE_SIZE = 256
COMPILE_TIMEOUT_S = 10.0
# Compact JSON: no whitespace between tokens unless a pattern is asked for (bounded anyway).
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


_LITERALS = ("enum", "const", "default", "examples")  # values, not schemas: never rewritten
SAFE_INT = (-(2**53 - 1), 2**53 - 1)  # the integers JSON carries exactly everywhere (RFC 8259)


def _rewrite(schema: Any, fix: Any) -> Any:
    """A copy of `schema` with `fix(subschema)` applied to every subschema, innermost first."""
    if isinstance(schema, list):
        return [_rewrite(s, fix) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return fix({k: v if k in _LITERALS else _rewrite(v, fix) for k, v in schema.items()})


def _closed_object(schema: dict) -> dict:
    """Objects without `additionalProperties` admit no other keys (OpenAI's strict mode)."""
    if schema.get("type") == "object" or isinstance(schema.get("properties"), dict):
        schema.setdefault("additionalProperties", False)
    return schema


def _bounded_integer(schema: dict) -> dict:
    """An integer without bounds is held to the interoperable range (+-(2**53 - 1)), so its digits
    end (a small model would otherwise write digits until max_tokens)."""
    kind = schema.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            schema["maximum"] = SAFE_INT[1]
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            schema["minimum"] = SAFE_INT[0]
    return schema


def _prepared(schema: Any, params: StructuredOutputsParams) -> Any:
    schema = _rewrite(schema, _bounded_integer)
    return _rewrite(schema, _closed_object) if params.disable_additional_properties else schema


def _json_options(params: StructuredOutputsParams) -> dict[str, Any]:
    if params.whitespace_pattern is not None:
        return {"whitespace_flexible": False, "whitespace_pattern": params.whitespace_pattern}
    return dict(_JSON_OPTIONS)


def grammar_for(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (a JSON string) of a constraint; ValueError if it cannot be built."""
    kind, value = params.kind, getattr(params, params.kind)
    if kind in ("json", "structural_tag") and isinstance(value, str):
        value = json.loads(value)
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(_prepared(value, params), defaults=_json_options(params))
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_json_options(params))
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(value))
    if kind == "grammar":
        return llguidance.grammar_from("grammar", value)  # Lark, or GBNF converted to Lark
    return _structural_tag(value, params)


def _structural_tag(spec: dict, params: StructuredOutputsParams) -> str:
    """vLLM's structural tag: free text in which each `begin` (starting with a trigger) is followed
    by JSON for its schema and then `end`."""
    triggers, structures = spec.get("triggers"), spec.get("structures")
    if not isinstance(triggers, list) or not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag needs a non-empty `structures` list and a `triggers` list")
    tags = []
    for s in structures:
        if not isinstance(s, dict) or not {"begin", "end"} <= s.keys():
            raise ValueError("each structural_tag structure needs `begin`, `schema` and `end`")
        trigger = next((t for t in triggers if isinstance(t, str) and t and s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structural_tag: no trigger starts the begin {s['begin']!r}")
        schema = _prepared(s.get("schema", {}), params)
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    return llguidance.StructTag.to_grammar(tags)


class GrammarCompiler:
    """One tokenizer's compiled constraints (thread-safe: the server compiles in a pool)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and this model has none")
        # The model's vocabulary can be wider than the tokenizer's (padded embeddings): ids past
        # the tokenizer are never allowed by a mask.
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.ll_tokenizer: LLTokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size)
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> LLMatcher:
        """The template matcher of `params` (cached); ValueError with llguidance's message if the
        schema, regex or grammar is invalid."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            grammar = grammar_for(params)
        except (ValueError, TypeError, AssertionError, KeyError) as exc:
            raise ValueError(f"invalid {params.kind} constraint: {exc}") from exc
        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {params.kind} constraint: {matcher.get_error()}")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, params: StructuredOutputsParams) -> LLMatcher:
        """A fresh matcher for one sequence."""
        return self.compile(params).deep_copy()

    async def compile_async(
        self, params: StructuredOutputsParams, timeout: float = COMPILE_TIMEOUT_S
    ) -> None:
        """Compile in a worker thread (off the event loop); ValueError if invalid or slower than `timeout`."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self.compile, params), timeout)
        except asyncio.TimeoutError as exc:
            raise ValueError(
                f"the {params.kind} constraint took longer than {timeout:g} s to compile"
            ) from exc


_compilers: dict[tuple, GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def get_compiler(tokenizer: Any, vocab_size: int) -> GrammarCompiler:
    """The process's compiler for this tokenizer, built once (llguidance's token trie is slow to
    build: docs/benchmarks.md, "Dispatch figures"). Keyed by what the tokenizer is, not the object:
    the server copies tokenizers per thread."""
    key = (
        getattr(tokenizer, "name_or_path", None),
        len(tokenizer) if tokenizer is not None else 0,
        vocab_size,
    )
    with _compilers_lock:
        if key not in _compilers:
            _compilers[key] = GrammarCompiler(tokenizer, vocab_size)
        return _compilers[key]
