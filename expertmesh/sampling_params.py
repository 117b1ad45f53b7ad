"""SamplingParams with vLLM's field names; invalid values raise ValueError naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        self._check()
        if self.stop is None:
            self._stop = ()
        elif isinstance(self.stop, str):
            self._stop = (self.stop,)
        else:
            self._stop = tuple(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:  # vLLM's older spelling of "disabled"
            self.top_k = 0

    def _check(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: {rule}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be >= 0 (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", "must be in [0, max_tokens]")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "must be >= 0")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise bad("stop", "must be a string or a list of strings")
        if self.stop is not None and not isinstance(self.stop, str):
            if not all(isinstance(s, str) and s for s in self.stop):
                raise bad("stop", "every stop string must be a non-empty string")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop
