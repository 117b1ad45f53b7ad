"""Two nodes (network namespaces joined by a veth pair), torchrun's static rendezvous across them:
the seed script at DP2 x TP2 and at TP4 gives, on every rank, what one process gives; and
`expertmesh serve` at DP2 x TP2 across them (rank 0 on node 0 answers HTTP) answers the `openai`
client, run inside node 0, as one process does."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from netns import run_on_both, skip_reason, torchrun_on, two_nodes
from serve_utils import CLI, ENGINE_FLAGS, one_process_refs

from expertmesh import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "offline_inference", "torchrun_dp_example.py")
CLIENT = os.path.join(ROOT, "tests", "serve_client.py")
# The example's own prompts and sampling (greedy: temperature 0), so one process can replay them.
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "1 2 3 4 5",
    "Monday Tuesday Wednesday",
    "The president of the United States is",
    "The future of AI is",
]
LINE = re.compile(r"Rank: (\d+) DP Rank: (\d+) Prompt: (.*)\nGenerated text: (.*)\n")

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))


@pytest.fixture(scope="module")
def one_process() -> dict[str, str]:
    llm = LLM(None, seed=1)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, top_p=0.95, seed=1, max_tokens=24))
    return {repr(o.prompt): repr(o.outputs[0].text) for o in outs}


def _run_two_nodes(args: list[str], env: dict[str, str], timeout: float = 150) -> list[str]:
    """Both nodes' torchrun, each in its namespace; returns their stdouts (node 0, node 1)."""
    with two_nodes() as nodes:
        results = run_on_both(nodes, 29555, 2, [SCRIPT, *args], env, timeout)
    for code, _, err in results:
        assert code == 0, f"torchrun exited {code}:\n{err[-3000:]}"
    return [out for _, out, _ in results]


def _check(stdouts: list[str], world: int, dp: int, expected: dict[str, str]) -> None:
    seen: dict[int, list[tuple[str, str]]] = {}
    for node, out in enumerate(stdouts):
        for rank, dp_rank, prompt, text in LINE.findall(out):
            rank, dp_rank = int(rank), int(dp_rank)
            assert rank // (world // 2) == node, f"rank {rank} printed on node {node}"
            seen.setdefault(rank, []).append((prompt, text))
            assert text == expected[prompt], f"rank {rank} (DP rank {dp_rank}): {prompt} -> {text}"
    assert sorted(seen) == list(range(world)), f"ranks that printed: {sorted(seen)}"
    per_dp = world // dp
    for rank, pairs in seen.items():
        want = [repr(p) for i, p in enumerate(PROMPTS) if i % dp == rank // per_dp]
        assert [p for p, _ in pairs] == want, f"rank {rank} ran {pairs}"


ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow  # the CI budget: the server test below runs DP2 x TP2 over the two nodes too
@pytest.mark.timeout(200)
def test_dp2_tp2_naive_across_two_nodes(one_process):
    """The seed bug's layout (DP2 x TP2, naive all2all, no EP), one DP replica per node."""
    outs = _run_two_nodes(
        ["--dp-size=2", "--tp-size=2", "--print-all-ranks"], {**ENV, "VLLM_ALL2ALL_BACKEND": "naive"}
    )
    _check(outs, 4, 2, one_process)


@pytest.mark.slow  # the CI budget: the two-node server test keeps collectives across the nodes (DP there)
@pytest.mark.timeout(200)
def test_tp4_across_two_nodes(one_process):
    """One replica whose TP all-reduces cross the link (KV heads replicated: 2 KV heads, TP 4)."""
    outs = _run_two_nodes(["--dp-size=1", "--tp-size=4", "--print-all-ranks"], ENV)
    _check(outs, 4, 1, one_process)


@pytest.mark.timeout(240)
def test_server_dp2_tp2_across_two_nodes_equals_one_process():
    """`serve -tp 2 -dp 2` over both nodes: one DP replica a node; the openai client, inside node 0
    (the test's own namespace cannot reach the nodes), gets one process's answers."""
    refs = one_process_refs()
    port = 8123
    with two_nodes() as (n0, n1):
        serve = [*CLI, "-tp", "2", "-dp", "2", "--host", n0.address, "--port", str(port), *ENGINE_FLAGS]
        procs = [
            subprocess.Popen(
                torchrun_on(node, k, n0, 29556, 2, serve, ENV),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )  # fmt: skip
            for k, node in enumerate((n0, n1))
        ]
        try:
            asked = subprocess.run(
                n0.command([sys.executable, CLIENT, f"http://{n0.address}:{port}"], ENV),
                capture_output=True, text=True, timeout=200, cwd=os.path.join(ROOT, "tests"),
            )  # fmt: skip
            assert asked.returncode == 0, f"client: {asked.stderr[-3000:]}\nnode 0: {_drain(procs[0])}"
            got = json.loads(asked.stdout.strip().splitlines()[-1])
        finally:
            logs = [_stop(p) for p in procs]
    want = [[o.text, o.finish_reason] for o in refs["completions"]]
    assert got["completions"] == want[:4] and got["streamed"] == want[:4], logs[0][-3000:]
    assert got["chat"] == [o.text for o in refs["chat"]]
    assert got["concurrent"] == want
    per_replica = sorted(got["metrics"]["requests_added"].values())
    assert len(per_replica) == 2 and min(per_replica) >= 1, got["metrics"]
    assert got["metrics"]["kv_blocks_used"] == 0
    assert "rank 2 pid" in logs[1] and "rank 0 pid" in logs[0]  # a replica on each node


def _stop(proc: subprocess.Popen) -> str:
    """Interrupt a node's torchrun (and kill what is left of it); its output."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.communicate()[0]


def _drain(proc: subprocess.Popen) -> str:
    return "(still running)" if proc.poll() is None else proc.communicate()[0][-3000:]
