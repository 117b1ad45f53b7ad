"""Quantized weights side by side: expertmesh's online int8 / int4 (weight-only) and w8a8 / w4a8
(int8 activations too, as llama.cpp's CPU dot products compute) against llama.cpp's Q8_0 / Q4_0 of
the same checkpoint (and both engines' float32), batch 1 and 32, tokens/s and bytes read per token.

Same bits per weight on both sides: our int8 and int4 keep a float32 scale and offset per 128
weights (1.0625 and 0.5625 bytes a weight), llama.cpp's Q8_0 and Q4_0 an fp16 scale per 32 (34 and
18 bytes per 32: 1.0625 and 0.5625). The GGUFs come from llama.cpp's own converter (Q8_0,
benchmarks/gguf_convert.py) and its quantizer (Q4_0, llama_model_quantize through llama-cpp-python;
from the f32 GGUF). Engines run one at a time in their own subprocess (benchmarks/engine_driver.py),
greedy, the median of --repeats generate calls; on a shared machine read the per-CPU-second table.
With --interleave every run is loaded first and they take turns, one repeat each per round (as
throughput.py --interleave), and a ratio is the median of each round's.

    .venv/bin/python benchmarks/quantized.py --llama-python /work/peers/llama-venv/bin/python \\
        --threads 1 --json quantized.json
    # native decode on against off (EngineArgs.native_decode), batch 1:
    .venv/bin/python benchmarks/quantized.py --threads 1 --batch-sizes 1 --native-decode both \\
        --runs "expertmesh int8,expertmesh int4,llama.cpp Q8_0,llama.cpp Q4_0" --llama-python ...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import roofline
import throughput
from make_small_moe import DEFAULT_CACHE, SHAPES, make_small_moe

# name -> (engine, expertmesh quantization or GGUF type, bytes a weight of the quantized matmuls,
# bytes a weight of the LM head: float32 for ours unless "+head"; llama.cpp's Q8_0 stores output.weight
# as Q8_0, its Q4_0 as Q6_K, 210 bytes per 256)
Q6_K = 210 / 256
RUNS = {
    "expertmesh fp32": ("expertmesh", None, 4.0, 4.0),
    "expertmesh int8": ("expertmesh", "int8", 1.0625, 4.0),
    "expertmesh int4": ("expertmesh", "int4", 0.5625, 4.0),
    "expertmesh w8a8": ("expertmesh", "w8a8", 1.0625, 4.0),
    "expertmesh w4a8": ("expertmesh", "w4a8", 0.5625, 4.0),
    "expertmesh int8+head": ("expertmesh", "int8+head", 1.0625, 1.0625),
    "expertmesh int4+head": ("expertmesh", "int4+head", 0.5625, 0.5625),
    "expertmesh w8a8+head": ("expertmesh", "w8a8+head", 1.0625, 1.0625),
    "expertmesh w4a8+head": ("expertmesh", "w4a8+head", 0.5625, 0.5625),
    # e4m3 codes with a scale per 128 (as DeepSeek-V3's fp8 checkpoints are held); a bf16 model's on
    # bf16 pairs (code kind 9). Compared with Q8_0, the same bytes a weight
    "expertmesh fp8": ("expertmesh", "fp8", 1.0625, 4.0),
    "expertmesh fp8+head": ("expertmesh", "fp8+head", 1.0625, 1.0625),
    "llama.cpp F32": ("llama.cpp", "f32", 4.0, 4.0),
    "llama.cpp Q8_0": ("llama.cpp", "q8_0", 1.0625, 1.0625),
    "llama.cpp Q4_0": ("llama.cpp", "q4_0", 0.5625, Q6_K),
}
DEFAULT_RUNS = [r for r in RUNS if "+head" not in r and "fp8" not in r]
LLAMA_FTYPE_Q4_0 = 2  # llama.h's LLAMA_FTYPE_MOSTLY_Q4_0
QUANTIZE = """
import sys, llama_cpp as L
p = L.llama_model_quantize_default_params(); p.ftype = int(sys.argv[3]); p.nthread = 2
rc = L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p)
sys.exit(rc)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"comma-separated, of {list(RUNS)}")
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"],
        help="the checkpoint's (and so our activations'); llama.cpp's GGUFs are made from it",
    )  # fmt: skip
    ap.add_argument("--llama-python", default=None, help="python of a venv with llama-cpp-python")
    ap.add_argument("--llama-converter", default=throughput.LLAMA_CONVERTER)
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", default=None)
    ap.add_argument("--interleave", action="store_true", help="take turns, as throughput.py --interleave")
    ap.add_argument("--pause", type=float, default=0.5, help="--interleave: seconds idle before each turn")
    ap.add_argument(
        "--native-decode", default="on", choices=["on", "off", "both"],
        help="expertmesh's EngineArgs.native_decode; both: each expertmesh run twice (A/B, alternated)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.runs = args.runs.split(",")
    unknown = [r for r in args.runs if r not in RUNS]
    if unknown:
        ap.error(f"unknown runs {unknown}; known: {list(RUNS)}")
    if any(RUNS[r][0] == "llama.cpp" for r in args.runs) and not args.llama_python:
        ap.error("llama.cpp runs need --llama-python")
    floats = [r for r in args.runs if RUNS[r][1] in (None, "f32")]
    if args.dtype != "float32" and floats:
        ap.error(f"{floats} are float32 runs; with --dtype {args.dtype} compare floats with throughput.py")
    return args


def gguf(args: argparse.Namespace, model: str, kind: str) -> str:
    """The checkpoint as llama.cpp's converter (f32, q8_0) or quantizer (q4_0, from f32) writes it."""
    out = Path(f"{model}.{kind}.gguf")
    ready = out.with_suffix(".gguf.ready")
    stamp = (Path(model) / "READY").read_text()
    if ready.exists() and ready.read_text() == stamp:
        return str(out)
    print(f"[llama.cpp] writing {out}", file=sys.stderr, flush=True)
    if kind == "q4_0":
        src = gguf(args, model, "f32")
        subprocess.run([args.llama_python, "-c", QUANTIZE, src, str(out), str(LLAMA_FTYPE_Q4_0)], check=True)
    else:
        cmd = [
            args.llama_python,
            str(throughput.HERE / "gguf_convert.py"),
            "--converter",
            args.llama_converter,
        ]
        cmd += [model, "--outtype", kind, "--outfile", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    ready.write_text(stamp)
    return str(out)


def weight_mb_per_token(shape: roofline.MoEShape, per_weight: float, head: float, floats: float = 4) -> float:
    """Weights read by one batch-1 decode step: the quantized matmuls at `per_weight` bytes, the LM
    head at `head`, the router, norms and embedding row at `floats` bytes."""
    quantized = shape.layers * (shape.attn_params + shape.top_k * shape.expert_params)
    rest = shape.layers * (shape.hidden * shape.experts + 2 * shape.hidden) + shape.hidden
    return (quantized * per_weight + shape.vocab * shape.hidden * head + rest * floats) / 1e6


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = make_small_moe(args.cache_dir, args.dtype, args.shape)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    workloads = [
        throughput.fixed_workload(b, args.prompt_len, args.new_tokens, vocab, 0) for b in args.batch_sizes
    ]
    spec = throughput.make_spec(args, model, workloads)
    workdir = Path(args.cache_dir) / "runs" / f"quantized-{time.strftime('%Y%m%d-%H%M%S')}"
    workdir.mkdir(parents=True, exist_ok=True)
    shape = roofline.MoEShape.from_model_dir(model)
    jobs, sizes = {}, {}
    for run, native in _schedule(args):
        engine, fmt, per_weight, head = RUNS[run]
        both = native is not None and args.native_decode == "both"
        name = f"{run} native-{'on' if native else 'off'}" if both else run
        floats = 2.0 if args.dtype == "bfloat16" and engine == "expertmesh" else 4.0  # our float parts
        sizes[name] = weight_mb_per_token(shape, per_weight, min(head, floats), floats)
        run_spec = dict(spec)
        if native is not None:
            run_spec["native_decode"] = native
        if engine == "llama.cpp":
            run_spec["gguf"] = gguf(args, model, fmt)
            python = args.llama_python
        else:
            run_spec["quantization"] = fmt
            python = sys.executable
        jobs[name] = (engine, python, run_spec)
    if args.interleave:
        results = throughput.run_interleaved(jobs, workdir, args.timeout, args.pause)
    else:
        results = {}
        for name, (engine, python, run_spec) in jobs.items():
            sub = workdir / name.replace(" ", "-")
            sub.mkdir(exist_ok=True)
            results[name] = throughput.run_engine(engine, python, run_spec, sub, args.timeout)
    rows = []
    for name in jobs:
        row = {"run": name, "MB/token b1": sizes[name]}
        for w in workloads:
            row[f"{w['name']} tok/s"] = throughput.tokens_per_s(results[name], w["name"])
            row[f"{w['name']} tok/cpu-s"] = throughput.tokens_per_s(results[name], w["name"], "median_cpu_s")
        rss = results[name].get("maxrss_bytes")
        row["peak RSS MB"] = rss / 1e6 if rss else None
        rows.append(row)
    _print(rows, workloads, args, results)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "rows": rows, "results": results}, indent=1)
        )


def _schedule(args: argparse.Namespace) -> list[tuple[str, bool | None]]:
    """(run, native_decode or None for llama.cpp) in order; with both, on and off back to back."""
    order = []
    for name in args.runs:
        if RUNS[name][0] != "expertmesh":
            order.append((name, None))
        elif args.native_decode == "both":
            order += [(name, True), (name, False)]
        else:
            order.append((name, args.native_decode == "on"))
    return order


def _peer(run: str) -> str | None:
    """The llama.cpp run of the same bits a weight as an expertmesh run (its "+head" and native
    suffixes aside)."""
    fmt = RUNS.get(run.split(" native-")[0], (None, None))[1]
    if fmt is None:
        return "llama.cpp F32" if run.startswith("expertmesh fp32") else None
    weight_bits = {"int8": 8, "w8a8": 8, "fp8": 8, "int4": 4, "w4a8": 4}[fmt.split("+")[0]]
    return {8: "llama.cpp Q8_0", 4: "llama.cpp Q4_0"}[weight_bits]


def _print(rows: list[dict], workloads: list[dict], args: argparse.Namespace, results: dict) -> None:
    how = "interleaved, ratios the median of each round's" if args.interleave else "one run after another"
    print(f"\n{args.shape} MoE, {args.threads} thread(s), median of {args.repeats} ({how}), "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens")  # fmt: skip
    cols = ["MB/token b1"] + [f"{w['name']} {c}" for c in ("tok/s", "tok/cpu-s") for w in workloads]
    print("| run | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for r in rows:
        print(f"| {r['run']} | " + " | ".join(throughput._fmt(r.get(c), 1) for c in cols) + " |")
    pairs = [(r, _peer(r)) for r in results if r.startswith("expertmesh")]
    if args.native_decode == "both":
        pairs += [(f"{r} native-on", f"{r} native-off") for r in args.runs if RUNS[r][0] == "expertmesh"]
    for ours, theirs in pairs:
        if theirs not in results or "error" in results[ours] or "error" in results[theirs]:
            continue
        ratios = []
        for w in workloads:
            for c, clock in (("tok/s", "median_s"), ("tok/cpu-s", "median_cpu_s")):
                ratio = throughput.speed_ratio(results[ours], results[theirs], w["name"], clock)
                ratios.append(f"{w['name']} {c} " + ("-" if ratio is None else f"{ratio:.2f}x"))
        print(f"{ours} / {theirs}: " + ", ".join(ratios))


if __name__ == "__main__":
    main()
