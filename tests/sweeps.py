"""Parametrizations split between the default suite and the on-demand rest (`pytest -m slow`).

The default suite has a 15-minute budget on 2 cores; a family sweep keeps in it one family per
feature the test is about (an attention kind, a router, a layout) and runs the rest on demand.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def sweep(values: Iterable[str], default: Iterable[str]) -> list:
    """Every value as a parameter; those not in `default` marked slow."""
    values, default = list(values), set(default)
    unknown = default - set(values)
    if unknown:
        raise ValueError(f"default values {sorted(unknown)} are not among {values}")
    return [v if v in default else pytest.param(v, marks=pytest.mark.slow) for v in values]
