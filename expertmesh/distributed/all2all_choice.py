"""The one place VLLM_ALL2ALL_BACKEND is read: a logged compatibility alias; an argument wins."""

from __future__ import annotations

import logging
import os

from expertmesh.config import ALL2ALL_BACKEND_NAMES

log = logging.getLogger("expertmesh")
DEFAULT = "allgather_reducescatter"


def choose_all2all_backend(explicit: str | None) -> str:
    env = os.environ.get("VLLM_ALL2ALL_BACKEND")
    name = explicit or env or DEFAULT
    if name not in ALL2ALL_BACKEND_NAMES:
        source = "all2all_backend" if explicit else "VLLM_ALL2ALL_BACKEND"
        raise ValueError(f"{source}={name!r} is unknown; valid: {list(ALL2ALL_BACKEND_NAMES)}")
    if env and not explicit:
        log.info("all2all backend %r taken from VLLM_ALL2ALL_BACKEND", name)
    return name
