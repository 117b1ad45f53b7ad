"""Two nodes (network namespaces joined by a veth pair), torchrun's static rendezvous across them:
the seed script at DP2 x TP2 and at TP4 gives, on every rank, what one process gives."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest
from netns import skip_reason, torchrun_on, two_nodes

from expertmesh import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "offline_inference", "torchrun_dp_example.py")
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
    with two_nodes() as (n0, n1):
        procs = [
            subprocess.Popen(
                torchrun_on(node, k, n0, 29555, 2, [SCRIPT, *args], env),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,  # so a hang can be killed with every rank under it
            )
            for k, node in enumerate((n0, n1))
        ]
        outs = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=timeout)
                assert p.returncode == 0, f"torchrun exited {p.returncode}:\n{err[-3000:]}"
                outs.append(out)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        return outs


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


@pytest.mark.timeout(200)
def test_dp2_tp2_naive_across_two_nodes(one_process):
    """The seed bug's layout (DP2 x TP2, naive all2all, no EP), one DP replica per node."""
    outs = _run_two_nodes(
        ["--dp-size=2", "--tp-size=2", "--print-all-ranks"], {**ENV, "VLLM_ALL2ALL_BACKEND": "naive"}
    )
    _check(outs, 4, 2, one_process)


@pytest.mark.timeout(200)
def test_tp4_across_two_nodes(one_process):
    """One replica whose TP all-reduces cross the link (KV heads replicated: 2 KV heads, TP 4)."""
    outs = _run_two_nodes(["--dp-size=1", "--tp-size=4", "--print-all-ranks"], ENV)
    _check(outs, 4, 1, one_process)
