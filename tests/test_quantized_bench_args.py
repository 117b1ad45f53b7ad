"""benchmarks/quantized.py --dtype: a bf16 checkpoint's quantized runs against llama.cpp's GGUFs of
the same weights; its float32 runs are refused by name (they would not be float32), and the bytes
a step reads count our float parts at the model dtype's width."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import quantized  # noqa: E402
import roofline  # noqa: E402


def test_bf16_refuses_the_float32_runs_by_name(capsys):
    with pytest.raises(SystemExit):
        quantized.parse_args(["--dtype", "bfloat16", "--runs", "expertmesh int4,expertmesh fp32"])
    err = capsys.readouterr().err
    assert "['expertmesh fp32'] are float32 runs; with --dtype bfloat16" in err and "throughput.py" in err
    args = quantized.parse_args(["--dtype", "bfloat16", "--runs", "expertmesh int4,expertmesh int8+head"])
    assert args.dtype == "bfloat16" and args.runs == ["expertmesh int4", "expertmesh int8+head"]
    assert (
        quantized.parse_args(["--llama-python", "python3"]).dtype == "float32"
    )  # defaults: float32 runs too


def test_weight_bytes_count_the_float_parts_at_their_width():
    shape = roofline.MoEShape(
        hidden=8, inter=16, layers=2, experts=4, top_k=2, heads=2, kv_heads=1, head_dim=4, vocab=10
    )
    f32 = quantized.weight_mb_per_token(shape, 0.5, 4.0)
    bf16 = quantized.weight_mb_per_token(shape, 0.5, 2.0, 2.0)
    rest = (
        shape.layers * (shape.hidden * shape.experts + 2 * shape.hidden) + shape.hidden
    )  # router, norms, row
    assert f32 - bf16 == pytest.approx((shape.vocab * shape.hidden * 2 + rest * 2) / 1e6)


def test_every_expertmesh_run_is_compared_with_llama_cpp_at_its_weight_bits():
    peers = {run: quantized._peer(run) for run, spec in quantized.RUNS.items() if spec[0] == "expertmesh"}
    assert peers["expertmesh fp32"] == "llama.cpp F32"
    for run, peer in peers.items():
        bits = quantized.RUNS[run][2]  # bytes a weight of the quantized matmuls
        if bits < 4:
            assert peer == ("llama.cpp Q8_0" if bits > 1 else "llama.cpp Q4_0"), run
            assert quantized.RUNS[peer][2] == bits, run  # the same bytes a weight on both sides
    assert quantized._peer("expertmesh w4a8 native-on") == "llama.cpp Q4_0"
    assert quantized._peer("expertmesh fp8+head") == "llama.cpp Q8_0"
