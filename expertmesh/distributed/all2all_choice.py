"""The one place VLLM_ALL2ALL_BACKEND is read: a logged compatibility alias; an argument wins.
The name is checked by ParallelConfig, with the other parallel rules."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("expertmesh")
DEFAULT = "allgather_reducescatter"


def choose_all2all_backend(explicit: str | None) -> str:
    env = os.environ.get("VLLM_ALL2ALL_BACKEND")
    name = explicit or env or DEFAULT
    if env and not explicit:
        log.info("all2all backend %r taken from VLLM_ALL2ALL_BACKEND", name)
    return name
