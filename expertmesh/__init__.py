"""expertmesh: Mixture-of-Experts inference over data, tensor, pipeline and expert parallel
processes, with vLLM's offline API.

The names below are imported on first use (PEP 562), so that importing a submodule does not load
torch: the `expertmesh` command sets the OpenMP runtime's environment before torch loads it
(entrypoints/openmp_env.py)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from expertmesh.entrypoints.llm import LLM
    from expertmesh.outputs import CompletionOutput, Logprob, RequestOutput
    from expertmesh.sampling_params import SamplingParams

_HOMES = {
    "LLM": "expertmesh.entrypoints.llm",
    "SamplingParams": "expertmesh.sampling_params",
    "RequestOutput": "expertmesh.outputs",
    "CompletionOutput": "expertmesh.outputs",
    "Logprob": "expertmesh.outputs",
}
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'expertmesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
