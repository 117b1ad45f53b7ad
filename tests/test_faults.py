"""Faults under torchrun (TP2, gloo): different inputs on the ranks of one replica are an error on
every rank naming the ranks and the first differing prompt (they printed wrong tokens, or died in
a gloo SIGABRT); a frozen or stuck rank ends the whole run within the watchdog's timeout, with a
message naming it and what its peer waited in (it hung for 300 s in silence)."""

import ast
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from distributed_utils import free_port
from expect import assert_tokens_equal, assert_within

SCRIPT = os.path.join(os.path.dirname(__file__), "fault_script.py")
WATCHDOG_S = 3
# the tests folder and this checkout first: the ranks run the package under test, not an installed one
PYTHONPATH = os.pathsep.join(
    [os.path.dirname(__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
)


def _torchrun(path: str, fault: str, limit: float = 80) -> tuple[int, str, float]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
        SCRIPT, path, fault, str(WATCHDOG_S),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH}
    start = time.monotonic()
    # Its own session: on a timeout every rank goes too (a stopped one would outlive torchrun).
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=limit)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, time.monotonic() - start


@pytest.mark.timeout(90)  # ~20 s each here; start-up is slow when the 2 cores are shared
@pytest.mark.parametrize("fault,index", [("different_prompts", 1), ("different_counts", 2)])
def test_different_inputs_in_a_replica_fail_on_every_rank(checkpoint, fault, index):
    code, out, _ = _torchrun(checkpoint("mixtral"), fault)
    assert code != 0, out
    message = f"rank 1 differs from rank 0 (DP replica 0) first at prompt index {index}"
    # Both ranks raise it (torchrun prints each failed rank's error), before any forward.
    assert len(re.findall(re.escape(message), out)) >= 2, out
    assert not re.search(r"rank \d tokens", out) and "SIGABRT" not in out


@pytest.mark.timeout(90)  # ~20 s each here; start-up is slow when the 2 cores are shared
def test_no_fault_same_tokens_on_both_ranks(checkpoint):
    """Both ranks print the tokens of rank 0's broadcast, so their equality alone proves little:
    each must equal a one-process run of the same prompts (fault_script.py's), 8 tokens each."""
    from expertmesh import LLM, SamplingParams

    path = checkpoint("mixtral")
    code, out, _ = _torchrun(path, "none")
    assert code == 0, out
    lines = sorted(re.findall(r"rank \d tokens (\[\[.*?\]\])", out))  # a list of lists, wherever lines break
    assert len(lines) == 2, out
    one = LLM(path, max_model_len=64, kv_cache_memory_bytes=1 << 22)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10]}]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, greedy, use_tqdm=False)]
    assert [len(t) for t in want] == [8, 8]
    for line in lines:
        got = ast.literal_eval(line)
        assert len(got) == len(want), line
        for g, w in zip(got, want, strict=True):
            assert_tokens_equal(g, w, "TP2 rank against one process", length=8)


@pytest.mark.time_bound
@pytest.mark.timeout(90)  # ~20 s each here; start-up is slow when the 2 cores are shared
def test_a_stopped_rank_ends_the_run_naming_it(checkpoint):
    start = time.time()
    code, out, elapsed = _torchrun(checkpoint("mixtral"), "sigstop")
    assert code != 0, out
    assert re.search(
        r"watchdog, rank 0: rank 1 stopped responding: no heartbeat for [\d.]+ s .*rank 0 was waiting for it "
        r"in tp\.all_reduce",
        out,
    ), out
    frozen_at = float(re.search(r"rank 1 freezes \(sigstop\) at ([\d.]+)", out).group(1))
    # Everything (rank 0 and the stopped rank 1, torchrun itself) is gone within a few seconds of
    # the watchdog's timeout, not torchrun's 30 s grace for a stopped process.
    assert_within(start + elapsed - frozen_at, WATCHDOG_S + 10, "the end of every process after the freeze")


@pytest.mark.time_bound
@pytest.mark.timeout(90)  # ~20 s each here; start-up is slow when the 2 cores are shared
def test_a_stuck_rank_ends_the_run_naming_it(checkpoint):
    start = time.time()
    code, out, elapsed = _torchrun(checkpoint("mixtral"), "stuck")
    assert code != 0, out
    assert re.search(
        r"watchdog, rank 0: rank 0 waited [\d.]+ s in tp\.all_reduce \(collective #\d+ on tp\[0, 1\]\) for "
        r"rank\(s\) \[1\], which never joined it \(rank 1 is not in a collective \(in generate\)\)",
        out,
    ), out
    # Rank 1 ends by its own watchdog (it reads rank 0's verdict in the store) or by torchrun.
    assert "watchdog, rank 1: another rank ended the run" in out or "closing signal" in out, out
    frozen_at = float(re.search(r"rank 1 freezes \(stuck\) at ([\d.]+)", out).group(1))
    assert_within(start + elapsed - frozen_at, WATCHDOG_S + 10, "the end of every process after the freeze")
