"""The package logger: INFO lines like vLLM's, once per process, on stderr."""

from __future__ import annotations

import logging
import sys

_configured = False


def setup_logging(rank: int | None = None) -> logging.Logger:
    global _configured
    log = logging.getLogger("expertmesh")
    if not _configured and not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        prefix = f"[rank{rank}] " if rank is not None else ""
        handler.setFormatter(logging.Formatter(f"%(levelname)s %(asctime)s {prefix}%(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
        _configured = True
    return log
