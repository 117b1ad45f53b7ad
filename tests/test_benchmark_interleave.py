"""benchmarks/throughput.py --interleave: engines loaded one after another, then taking turns (one
repeat of a workload each per round), every round's timings kept in order so a ratio can be paired
by round; an engine that dies is reported as failed, naming its exit, and the others finish."""

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import throughput  # noqa: E402


def _spec(model: str, repeats: int) -> dict:
    workloads = [throughput.fixed_workload(b, 5, 3, 200, 0) for b in (1, 2)]
    spec = {
        "model": model, "dtype": "float32", "threads": 1, "max_model_len": 64, "max_num_seqs": 2,
        "kv_cache_bytes": 1 << 22, "repeats": repeats, "workloads": workloads,
    }  # fmt: skip
    return spec


@pytest.mark.timeout(120)
def test_engines_take_turns_and_a_dead_one_is_named(checkpoint, tmp_path):
    model = checkpoint("mixtral")
    spec = _spec(model, repeats=2)
    jobs = {
        "first": ("expertmesh", sys.executable, spec),
        "dead": ("expertmesh", "/bin/false", spec),  # exits before it is ready
        "second": ("expertmesh", sys.executable, dict(spec, native_decode=False)),
    }
    results = throughput.run_interleaved(jobs, tmp_path, timeout=60, pause=0.0)
    assert list(results) == ["first", "dead", "second"]
    assert results["dead"]["error"] == "exit 1" and Path(results["dead"]["log"]).exists()
    for name in ("first", "second"):
        r = results[name]
        assert r["interleaved"] and [w["name"] for w in r["workloads"]] == ["fixed b=1", "fixed b=2"]
        for w in r["workloads"]:
            assert len(w["times_s"]) == len(w["cpu_s"]) == 2 and w["lengths_ok"]
    # the same greedy tokens either way (native decode on and off), and ratios paired by round
    for a, b in zip(results["first"]["workloads"], results["second"]["workloads"], strict=True):
        assert a["first_output"] == b["first_output"]
        expected = sorted(tb / ta for ta, tb in zip(a["times_s"], b["times_s"], strict=True))
        ratio = throughput.speed_ratio(results["first"], results["second"], a["name"])
        assert ratio == pytest.approx(sum(expected) / 2)
    assert throughput.speed_ratio(results["first"], results["dead"], "fixed b=1") is None


def test_ratio_of_medians_without_interleaving():
    a = {"workloads": [{"name": "w", "times_s": [1.0, 3.0, 2.0], "median_s": 2.0}]}
    b = {"workloads": [{"name": "w", "times_s": [5.0, 4.0, 6.0], "median_s": 5.0}]}
    assert throughput.speed_ratio(a, b, "w") == 2.5
    paired = [dict(r, interleaved=True) for r in (a, b)]
    assert throughput.speed_ratio(*paired, "w") == 3.0  # round by round: 5/1, 4/3, 6/2
