"""`expertmesh verify`: runs the layouts that fit, exits 0 when every rank equals one process, and
exits 1 (naming where) on a layout broken on purpose."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from expertmesh.config import ModelConfig
from expertmesh.entrypoints import verify

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def double_tp_all_reduce() -> None:
    """The vLLM DP2 x TP2 bug's second half: the TP partial sums reduced twice (every token 2x)."""
    from expertmesh.layers import linear

    original = linear.RowParallelLinear.forward

    def forward(self, x):
        y = original(self, x)
        return self.group.all_reduce(y) if self.tp_size > 1 else y

    linear.RowParallelLinear.forward = forward


def _cli(args: list[str], timeout: float = 170) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    exe = os.path.join(os.path.dirname(sys.executable), "expertmesh")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_factorizations_and_fit():
    assert verify.factorizations(4) == [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2), (1, 1, 4)]
    mc = ModelConfig("MixtralForCausalLM", 512, 64, 2, 6, 2, 8, 96, 512, 1e-5, num_experts=3, top_k=2,
                     moe_intermediate_size=96)  # fmt: skip
    run, skipped = verify.cases_for(4, mc)
    reasons = {(c.dp, c.pp, c.tp, c.ep): why for c, why in skipped}
    assert reasons[(1, 1, 4, False)] == "6 attention heads over TP 4"
    assert reasons[(1, 4, 1, False)] == "2 layers over PP 4"
    assert reasons[(4, 1, 1, True)] == "3 experts over EP 4"
    assert all(c.backend == "allgather_reducescatter" for c in run if c.dp == 1)  # no exchange to vary
    assert {c.backend for c in run if c.dp > 1 and c.ep} == {"naive", "allgather_reducescatter", "alltoall"}


@pytest.mark.timeout(180)
def test_verify_world4_exits_0_and_reports_every_layout(checkpoint):
    path = checkpoint("mixtral", num_hidden_layers=2)
    res = _cli(["verify", "--world", "4", "--model", path, "--json"])
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["ok"]
    rows = out["rows"]
    assert len(rows) >= 15
    assert all(r["ranks_agreeing"] == r["ranks"] == 4 and r["first_difference"] is None for r in rows)
    assert all(r["logprobs_bitwise"] for r in rows)  # deterministic=True, verify's default
    assert {(r["dp"], r["pp"], r["tp"]) for r in rows} == {
        (4, 1, 1),
        (2, 1, 2),
        (1, 1, 4),
        (2, 2, 1),
        (1, 2, 2),
    }
    assert [n["reason"] for n in out["not_run"]] == ["2 layers over PP 4"] * 2  # with and without EP
    alltoall = [r for r in rows if r["backend"] == "alltoall"]
    assert alltoall and all(r["bytes_sent"] > 0 for r in alltoall)


@pytest.mark.timeout(120)
def test_verify_exits_1_on_a_broken_layout(checkpoint):
    path = checkpoint("mixtral", num_hidden_layers=2)
    rows, skipped = verify.verify(path, 2, setup=double_tp_all_reduce)
    broken = {(r["dp"], r["pp"], r["tp"], r["ep"]) for r in rows if r["ranks_agreeing"] < r["ranks"]}
    # Exactly the layouts with a TP all-reduce disagree, on the first token already.
    assert broken == {(1, 1, 2, False), (1, 1, 2, True)}
    diff = next(r["first_difference"] for r in rows if r["first_difference"])
    assert diff["token"] == 0 and diff["got"] != diff["want"]
    assert verify.report(rows, skipped, as_json=False) == 1


@pytest.mark.timeout(170)
def test_verify_with_eplb_moves_experts_and_keeps_every_token(checkpoint):
    path = checkpoint("mixtral", num_hidden_layers=2)
    rows, skipped = verify.verify(path, 2, eplb=True)
    balanced = [r for r in rows if r["eplb"]]
    ag = "allgather_reducescatter"
    assert {(r["dp"], r["tp"], r["backend"]) for r in balanced} == {
        (2, 1, "naive"), (2, 1, ag), (2, 1, "alltoall"), (1, 2, ag),
    }  # fmt: skip
    assert all(r["ranks_agreeing"] == r["ranks"] == 2 for r in rows)
    assert [why for c, why in skipped if c.eplb] == ["EPLB over a single EP rank"]  # PP2 EP: EP size 1
    assert "DP2 PP1 TP1 EP EPLB" in verify.table(rows, skipped)
    assert verify.report(rows, skipped, as_json=True) == 0


@pytest.mark.timeout(150)
def test_verify_under_torchrun(checkpoint):
    path = checkpoint("mixtral", num_hidden_layers=2)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m",
           "expertmesh.entrypoints.cli", "verify", "--model", path]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=140, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "every rank of every layout equals one process" in res.stdout
    assert res.stdout.count("2/2") == 9  # 9 layouts at world 2, each printed once (by rank 0)


def test_verify_needs_a_world():
    res = _cli(["verify"], timeout=60)
    assert res.returncode == 2 and "give --world N" in res.stderr
