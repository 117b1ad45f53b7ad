"""Faults across two nodes (network namespaces joined by a veth pair, torchrun's static
rendezvous, TP2 with one rank a node, gloo over the link): a rank on node 1 that is killed or
frozen in its third forward pass ends the job on both nodes within seconds, and node 0's rank
names it (test_faults.py checks the same faults on one host)."""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest
from netns import run_on_both, skip_reason, two_nodes

SCRIPT = os.path.join(os.path.dirname(__file__), "fault_script.py")
WATCHDOG_S = 3
ENV = {
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    # the tests folder and this checkout: the ranks run the package under test, not an installed one
    "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    ),
}

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))


def _two_node_fault(path: str, fault: str, port: int, limit: float = 100) -> tuple[list, list, float]:
    """fault_script.py on both nodes; (exit codes, outputs) by node, and when rank 1 froze."""
    with two_nodes() as nodes:
        script = [SCRIPT, path, fault, str(WATCHDOG_S)]
        results = run_on_both(nodes, port, 1, script, ENV, limit, stderr=subprocess.STDOUT)
        ended = time.time()
    outs = [out for _, out, _ in results]
    frozen = re.search(rf"rank 1 freezes \({fault}\) at ([\d.]+)", outs[1])
    assert frozen, outs[1][-3000:]
    return [code for code, _, _ in results], outs, ended - float(frozen.group(1))


@pytest.mark.timeout(120)
def test_a_rank_killed_on_the_other_node_ends_the_job_naming_it(checkpoint):
    codes, outs, after = _two_node_fault(checkpoint("mixtral"), "sigkill", 29561)
    assert codes[0] != 0 and codes[1] != 0, outs
    # Node 0's rank names the rank that went: its all-reduce fails as the link closes, or (when the
    # heartbeats stop first, seen in CI) its watchdog ends it.
    named = re.search(
        r"rank 0: tp\.all_reduce failed .*rank\(s\) \[1\] stopped beating|"
        r"watchdog, rank 0: rank 1 stopped responding",
        outs[0],
    )
    assert named, outs[0][-3000:]
    assert after < WATCHDOG_S + 20, f"the job ended {after:.1f} s after rank 1 was killed"


@pytest.mark.slow  # the CI budget: the killed rank above crosses the nodes too
@pytest.mark.timeout(120)
def test_a_rank_frozen_on_the_other_node_ends_the_job_naming_it(checkpoint):
    codes, outs, after = _two_node_fault(checkpoint("mixtral"), "sigstop", 29562)
    assert codes[0] != 0 and codes[1] != 0, outs
    assert re.search(r"watchdog, rank 0: rank 1 stopped responding: no heartbeat", outs[0]), outs[0][-3000:]
    assert after < WATCHDOG_S + 20, f"the job ended {after:.1f} s after rank 1 froze"
