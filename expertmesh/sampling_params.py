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
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured outputs hook: a JSON schema / regex / choice / grammar the output must follow
    structured_outputs: StructuredOutputsParams | None = None
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_types()
        self._check_ranges()
        self._stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        if self.top_k == -1:  # vLLM's older spelling of "disabled"
            self.top_k = 0

    def _bad(self, name: str, rule: str, kind: type[Exception] = ValueError) -> Exception:
        return kind(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {rule}")

    def _check_types(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            self._int(name)
        for name in ("seed", "max_tokens", "logprobs"):
            if getattr(self, name) is not None:
                self._int(name)
        for name in ("temperature", "top_p", "min_p"):
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
        stops = (self.stop,) if isinstance(self.stop, str) else self.stop or ()
        if not all(stops):
            raise self._bad("stop", "every stop string must be non-empty (an empty one matches at once)")
        if not all(0 <= int(t) <= MAX_STOP_TOKEN_ID for t in self.stop_token_ids or ()):
            raise self._bad("stop_token_ids", "token ids must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop


def _is_int(value: Any) -> bool:
    """An integer, numpy's included, but not a bool (True is not a count)."""
    return isinstance(value, Integral) and not isinstance(value, bool)
