"""SamplingParams with vLLM's field names.

Every field is checked when the object is made: a value of the wrong type is a `TypeError`, a
value out of range a `ValueError`, and both messages start with `SamplingParams.<field>=` so a
caller (the server) can name the parameter. Temperatures below `GREEDY_TEMPERATURE` (1e-5),
denormals included, are treated as greedy: dividing float32 logits by them overflows, and the
distribution they describe is the argmax anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

from expertmesh.structured_outputs.params import StructuredOutputsParams

GREEDY_TEMPERATURE = 1e-5  # below this (and above 0) a temperature samples greedily
SEED_RANGE = (0, 2**63 - 1)  # what torch.Generator.manual_seed takes (seed + n - 1 must fit too)
MAX_STOP_TOKEN_ID = 2**31 - 1


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured outputs hook: a JSON schema / regex / choice / grammar the output must follow
    structured_outputs: StructuredOutputsParams | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_types()
        self._check_ranges()
        self._stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        if self.top_k == -1:  # vLLM's older spelling of "disabled"
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        # bad_words as token-id sequences: filled by the engine, which has the tokenizer.
        self.bad_words_token_ids: list[list[int]] = []

    def _bad(self, name: str, rule: str, kind: type[Exception] = ValueError) -> Exception:
        return kind(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {rule}")

    def _check_types(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            self._int(name)
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            if getattr(self, name) is not None:
                self._int(name)
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real):
                raise self._bad(name, "must be a number", TypeError)
            if not math.isfinite(float(value)):
                raise self._bad(name, "must be a finite number")
            setattr(self, name, float(value))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise self._bad(name, "must be a bool", TypeError)
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise self._bad("stop", "must be a string or a list of strings", TypeError)
        if isinstance(self.stop, (list, tuple)) and not all(isinstance(s, str) for s in self.stop):
            raise self._bad("stop", "every stop string must be a string", TypeError)
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise self._bad("structured_outputs", "must be a StructuredOutputsParams", TypeError)
        bias = self.logit_bias
        if bias is not None and (
            not isinstance(bias, dict)
            or not all(_is_int_like(t) for t in bias)
            or not all(isinstance(b, Real) and not isinstance(b, bool) for b in bias.values())
        ):
            raise self._bad("logit_bias", "must map token ids (integers) to numbers", TypeError)
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, (list, tuple)) or not all(_is_int(t) for t in allowed)
        ):
            raise self._bad("allowed_token_ids", "must be a list of integers", TypeError)
        words = self.bad_words
        if words is not None and (
            not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words)
        ):
            raise self._bad("bad_words", "must be a list of strings", TypeError)
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids)):
            raise self._bad("stop_token_ids", "must be a list of integers", TypeError)

    def _int(self, name: str) -> None:
        value = getattr(self, name)
        if not _is_int(value):
            raise self._bad(name, "must be an integer", TypeError)
        setattr(self, name, int(value))

    def _check_ranges(self) -> None:
        if self.n < 1:
            raise self._bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            raise self._bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise self._bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise self._bad("top_k", "must be >= 0 (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            raise self._bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1] - (self.n - 1):
            raise self._bad("seed", f"must be in [{SEED_RANGE[0]}, 2**63 - n] (each of n sequences adds one)")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise self._bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise self._bad("min_tokens", "must be in [0, max_tokens]")
        if self.logprobs is not None and self.logprobs < 0:
            raise self._bad("logprobs", "must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise self._bad("prompt_logprobs", "must be >= 0")
        if not -2 <= self.presence_penalty <= 2:
            raise self._bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise self._bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise self._bad("repetition_penalty", "must be > 0 (1 disables it)")
        if self.logit_bias is not None and not all(
            math.isfinite(float(b)) and -100 <= float(b) <= 100 for b in self.logit_bias.values()
        ):
            raise self._bad("logit_bias", "biases must be finite numbers in [-100, 100]")
        if self.logit_bias is not None and not all(0 <= int(t) <= MAX_STOP_TOKEN_ID for t in self.logit_bias):
            raise self._bad("logit_bias", "token ids must be >= 0")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or not all(0 <= t <= MAX_STOP_TOKEN_ID for t in self.allowed_token_ids)
        ):
            raise self._bad("allowed_token_ids", "must be a non-empty list of token ids >= 0")
        if self.bad_words is not None and not all(w.strip() for w in self.bad_words):
            raise self._bad("bad_words", "every bad word must be non-empty")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise self._bad("truncate_prompt_tokens", "must be >= 1")
        stops = (self.stop,) if isinstance(self.stop, str) else self.stop or ()
        if not all(stops):
            raise self._bad("stop", "every stop string must be non-empty (an empty one matches at once)")
        if not all(0 <= int(t) <= MAX_STOP_TOKEN_ID for t in self.stop_token_ids or ()):
            raise self._bad("stop_token_ids", "token ids must be >= 0")

    @property
    def uses_logits_processors(self) -> bool:
        """Whether the sampler must change this row's logits before temperature (else untouched)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words_token_ids
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop


def _is_int_like(value: Any) -> bool:
    """An integer, or a string of one (JSON object keys are strings: OpenAI's logit_bias)."""
    return _is_int(value) or (isinstance(value, str) and value.strip().lstrip("-").isdigit())


def _is_int(value: Any) -> bool:
    """An integer, numpy's included, but not a bool (True is not a count)."""
    return isinstance(value, Integral) and not isinstance(value, bool)
