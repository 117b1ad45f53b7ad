"""The `expertmesh` command bounds how long OpenMP workers spin before they sleep
(entrypoints/openmp_pool.py, `bound_waiting`), before torch loads libgomp, unless the user chose a
wait policy or spin count; libgomp's own report of its settings (OMP_DISPLAY_ENV) is the reference."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from expertmesh.entrypoints import openmp_pool
from expertmesh.entrypoints.openmp_pool import DEFAULT_WAIT, WAIT_SETTINGS, bound_waiting


@pytest.fixture
def not_loaded(monkeypatch):
    monkeypatch.setattr(openmp_pool, "loaded_libgomp", lambda: None)


def test_sets_the_default_when_nothing_is_chosen(not_loaded):
    env = {"PATH": "/bin"}
    assert bound_waiting(env) == DEFAULT_WAIT
    assert env == {"PATH": "/bin", **DEFAULT_WAIT}


@pytest.mark.parametrize("key", WAIT_SETTINGS)
def test_a_users_choice_is_kept(not_loaded, key):
    env = {key: "12345"}
    assert bound_waiting(env) == {}
    assert env == {key: "12345"}


def test_too_late_once_libgomp_is_loaded(monkeypatch):
    monkeypatch.setattr(openmp_pool, "loaded_libgomp", lambda: "/x/libgomp.so.1")
    env: dict[str, str] = {}
    assert bound_waiting(env) == {} and env == {}


def _libgomp_settings(extra: dict[str, str]) -> dict[str, str]:
    """What libgomp says it read, in a fresh `python -m expertmesh.entrypoints.cli --help`."""
    env = {k: v for k, v in os.environ.items() if k not in WAIT_SETTINGS}
    env.update(extra, OMP_DISPLAY_ENV="VERBOSE")
    cmd = [sys.executable, "-m", "expertmesh.entrypoints.cli", "--help"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(re.findall(r"^\s*(\w+) = '([^']*)'", done.stderr, re.MULTILINE))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp is Linux's")
@pytest.mark.timeout(240)
def test_the_command_sets_it_before_libgomp_reads_it():
    shown = _libgomp_settings({})
    if "GOMP_SPINCOUNT" not in shown:
        pytest.skip("torch here does not use libgomp")
    assert {k: shown[k] for k in DEFAULT_WAIT} == DEFAULT_WAIT, shown
    # A user's choice wins: neither setting is changed then.
    assert _libgomp_settings({"GOMP_SPINCOUNT": "123"})["GOMP_SPINCOUNT"] == "123"
    active = _libgomp_settings({"OMP_WAIT_POLICY": "ACTIVE"})
    assert active["OMP_WAIT_POLICY"] == "ACTIVE" and active["GOMP_SPINCOUNT"] != DEFAULT_WAIT.get(
        "GOMP_SPINCOUNT"
    ), active
