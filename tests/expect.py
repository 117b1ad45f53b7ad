"""Comparisons that cannot pass on a short or empty output (issue 41, point 1).

`zip` stops at the shorter side, and a loop over the engine's own tokens compares nothing when the
engine returns none: every comparison here first asserts the lengths it expects.
"""

import os
from collections.abc import Sequence
from typing import NoReturn

import pytest


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """The first step where the two differ (a length difference counts at the shorter's end)."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):  # lengths may differ: that is reported too
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def assert_length(tokens: Sequence[int], expected: int, what: str = "") -> None:
    """The engine produced exactly `expected` tokens (and `expected` is not zero)."""
    assert expected > 0, f"{what}: a comparison of zero tokens proves nothing"
    assert len(tokens) == expected, f"{what}: {len(tokens)} tokens, expected {expected}: {list(tokens)}"


def assert_tokens_equal(
    got: Sequence[int], want: Sequence[int], what: str = "", length: int | None = None
) -> None:
    """Engine output equals the reference: both non-empty, the same length (`length` when given),
    the same tokens; the message names the first differing step."""
    got, want = list(got), list(want)
    assert want, f"{what}: the reference is empty"
    if length is not None:
        assert_length(want, length, f"{what} (reference)")
    step = first_difference(got, want)
    assert step is None, (
        f"{what}: {len(got)} tokens against the reference's {len(want)}, first difference at step {step}: "
        f"ours {got[step : step + 4]}, reference {want[step : step + 4]}"
    )


def kernels_disabled() -> bool:
    """EXPERTMESH_DISABLE_CPU_KERNELS set deliberately: the only reason a kernel test may skip."""
    return os.environ.get("EXPERTMESH_DISABLE_CPU_KERNELS", "0") not in ("", "0")


def no_kernels() -> NoReturn:
    """cpu_kernels.load() gave None: a skip only when switched off on purpose, else a build failure."""
    from expertmesh.cpu import cpu_kernels

    if kernels_disabled():
        pytest.skip("CPU kernels switched off by EXPERTMESH_DISABLE_CPU_KERNELS")
    pytest.fail(f"the CPU kernels did not build or load: {cpu_kernels.last_error}")


# A time bound is asserted only where it is the behaviour (a watchdog names a stopped rank within
# its timeout, a failing rank ends the run before the collective timeout); such tests carry the
# `time_bound` marker, and every limit is generous and multiplied by this scale (set it above 1 on
# an overloaded machine, or deselect them with -m 'not time_bound').
TIME_SCALE = float(os.environ.get("EXPERTMESH_TEST_TIME_SCALE", "1"))


def assert_within(elapsed: float, limit: float, what: str) -> None:
    """A watchdog-style bound: `what` happened within `limit` seconds (times TIME_SCALE)."""
    assert elapsed < limit * TIME_SCALE, f"{what} took {elapsed:.1f} s, bound {limit * TIME_SCALE:.0f} s"
