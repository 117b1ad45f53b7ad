"""Micro-benchmark of expertmesh's CPU kernels at a model's shapes, against torch's own matmul.

For each product (qkv, o_proj, expert gate+up, expert down, lm_head) and row count it prints
ms per call, GFLOP/s and GB/s of weights streamed, for our panel GEMM and for torch (F.linear on
the dense weight; oneDNN where it has a path for the dtype). `--moe` also times the routed
experts of one layer in one call. Kernels can be A/B-compared by building another source
(`--source`, e.g. cpu/csrc/cpu_kernels.c in a saved copy of cpu/csrc/) in the same run: every engine of
a row is timed in the same alternated rounds. `--cold-mb`: each product cycles through copies of
its weights (the experts through copies of the layer), so few-row products read them from memory
as decode does in a model larger than the caches, not from cache.

    .venv/bin/python benchmarks/kernel_bench.py --dtype bfloat16 --rows 1,32,512 --moe
    .venv/bin/python benchmarks/kernel_bench.py --shape qwen3-30b-a3b --dtype bfloat16 --rows 1,32
    .venv/bin/python benchmarks/kernel_bench.py --dtype bfloat16 --rows 1,8,32 --moe --cold-mb 192
    .venv/bin/python benchmarks/kernel_bench.py --shape gpt-oss-20b --dtype bfloat16 --rows 1 --cold-mb 512
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from roofline import read_bandwidth  # benchmarks/, the script's folder

from expertmesh import huge_pages
from expertmesh.cpu import cpu_kernels, kernel_library

# (name, out_features, in_features) per model shape; "moe" = (hidden, inter, experts, top_k).
SHAPES = {
    "small": {
        "linears": [("qkv", 1024, 512), ("o_proj", 512, 512), ("w13", 2048, 512), ("w2", 512, 1024)],
        "lm_head": (3072, 512),
        "moe": (512, 1024, 8, 2),
    },
    "qwen3-30b-a3b": {
        "linears": [("qkv", 5120, 2048), ("o_proj", 2048, 4096), ("w13", 1536, 2048), ("w2", 2048, 768)],
        "lm_head": (16384, 2048),
        "moe": (2048, 768, 128, 8),
    },
    # published size; its experts are MXFP4 (quant_kernel_bench.py --shape gpt-oss-20b times them)
    "gpt-oss-20b": {
        "linears": [("qkv", 5120, 2880), ("o_proj", 2880, 4096), ("w13", 5760, 2880), ("w2", 2880, 2880)],
        "lm_head": (201088, 2880),
        "moe": (2880, 2880, 32, 4),
    },
}


# Wall time by default; --cpu-time takes this process's CPU time instead, which on a shared machine
# does not count the time other processes hold the core (use it with --threads 1: with more
# threads it also counts OpenMP's spin-waiting).
CLOCK = time.perf_counter
ONLY: set[str] | None = None
COLD_MB = 0.0


def copies(nbytes: int) -> int:
    """Copies of `nbytes` of weights that together read COLD_MB a cycle (1 with COLD_MB 0)."""
    return max(1, -(-int(COLD_MB * 2**20) // nbytes))


def rotating(fns: list):
    """A call that runs the next of `fns` each time (one: that one)."""
    if len(fns) == 1:
        return fns[0]
    it = itertools.cycle(fns)
    return lambda: next(it)()


def timed(fns: dict, min_s: float = 0.3, repeats: int = 5) -> dict:
    """Median seconds per call of each function, over `repeats` rounds of enough calls to fill
    `min_s`, the functions alternated within each round (A/B runs on a noisy machine: a slow
    spell slows every engine's round, not one engine's whole measurement)."""
    counts = {}
    for name, fn in fns.items():
        fn()
        start, n = CLOCK(), 0
        while CLOCK() - start < min_s / repeats or n < 2:
            fn()
            n += 1
        counts[name] = n
    rounds: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = CLOCK()
            for _ in range(counts[name]):
                fn()
            rounds[name].append((CLOCK() - t0) / counts[name])
    return {name: statistics.median(r) for name, r in rounds.items()}


def on_huge_pages(p: cpu_kernels.PanelWeight) -> cpu_kernels.PanelWeight:
    """The panels copied onto huge pages, where the engine holds its weights (huge_pages.py): on 4 KiB
    pages a streaming product also pays a page walk a page, and reads slower."""
    data = huge_pages.empty(tuple(p.data.shape), p.data.dtype).copy_(p.data)
    return dataclasses.replace(p, data=data, ptr=data.data_ptr())


def bench_linears(kernels_by_name: dict, shape: dict, dtype: torch.dtype, rows: list[int]) -> None:
    size = 2 if dtype == torch.bfloat16 else 4
    print(f"{'product':<10}{'rows':>6}{'engine':>12}{'ms':>10}{'GFLOP/s':>10}{'GB/s':>8}")
    for name, out_f, in_f in [*shape["linears"], ("lm_head", *shape["lm_head"])]:
        if ONLY is not None and name not in ONLY:
            continue
        w = (torch.randn(out_f, in_f) * in_f**-0.5).to(dtype)
        n = copies(w.numel() * size)
        packed = {k: [on_huge_pages(kern.pack(w)) for _ in range(n)] for k, kern in kernels_by_name.items()}
        dense = [w] + [w.clone() for _ in range(n - 1)]
        for m in rows:
            x = torch.randn(m, in_f).to(dtype)
            calls = {
                k: rotating([partial(kernels_by_name[k].linear, x, p) for p in packs])
                for k, packs in packed.items()
            }
            calls["torch"] = rotating([partial(F.linear, x, d) for d in dense])
            for engine, s in timed(calls).items():
                flops, nbytes = 2 * m * out_f * in_f, out_f * in_f * size
                rates = f"{flops / s / 1e9:>10.1f}{nbytes / s / 1e9:>8.1f}"
                print(f"{name:<10}{m:>6}{engine:>12}{s * 1e3:>10.3f}{rates}")


def bench_moe(kernels_by_name: dict, shape: dict, dtype: torch.dtype, rows: list[int]) -> None:
    hidden, inter, experts, top_k = shape["moe"]
    size = 2 if dtype == torch.bfloat16 else 4
    w13 = (torch.randn(experts, 2 * inter, hidden) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter) * inter**-0.5).to(dtype)
    print(f"\nrouted experts, one layer: H={hidden}, {experts} experts of {inter}, top-{top_k}")
    print(f"{'rows':>6}{'engine':>12}{'ms':>10}{'GB/s':>8}")
    packed = {}
    for name, kern in kernels_by_name.items():
        if not kern.moe_supports(dtype, "silu"):
            print(f"{'':>6}{name:>12}  no fused {dtype} experts in this build")
            continue
        p13 = torch.stack([kern.pack(w13[e]).data for e in range(experts)])
        p2 = torch.stack([kern.pack(w2[e]).data for e in range(experts)])
        n = copies(3 * experts * hidden * inter * size)
        packed[name] = (kern, [(p13.clone(), p2.clone()) for _ in range(n - 1)] + [(p13, p2)])
    for m in rows:
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, hidden, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(m)])
        ids = ids.to(torch.int32)
        wts = torch.rand(m, top_k, generator=g)
        # Cold: each call also routes to other experts (the ids shifted by 0..experts-1 in turn), so
        # the cycle reads the copies' every expert, not the same top-k of each copy: with few rows
        # a call touches top_k experts, and the copies of a whole layer alone (4 x 50 MB for the
        # small MoE in fp32) would read 25 MB a cycle, within the L3, the moe then looking faster
        # than the products beside it (measured 40 GB/s against their 30-33).
        shifts = range(experts) if COLD_MB else range(1)
        routed = [((ids + s) % experts).to(torch.int32) for s in shifts]
        calls = {
            n: rotating([partial(k.moe, x, r, wts, a, b, inter, "silu") for a, b in layers for r in routed])
            for n, (k, layers) in packed.items()
        }
        touched = len(set(ids.flatten().tolist()))
        nbytes = touched * 3 * hidden * inter * size
        for name, s in timed(calls).items():
            print(f"{m:>6}{name:>12}{s * 1e3:>10.3f}{nbytes / s / 1e9:>8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", default="1,8,32,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--moe", action="store_true", help="also time the routed experts of one layer")
    ap.add_argument("--source", action="append", default=[], help="another kernel source to compare")
    ap.add_argument("--cpu-time", action="store_true", help="process CPU time, not wall time (see CLOCK)")
    ap.add_argument("--only", default=None, help="comma-separated products to time (default: all)")
    ap.add_argument(
        "--cold-mb", type=float, default=0,
        help="cycle through copies of each weight, this many MB a cycle (past the L3: weights from memory)",
    )  # fmt: skip
    args = ap.parse_args()
    global CLOCK, ONLY, COLD_MB
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    ONLY = set(args.only.split(",")) if args.only else None
    COLD_MB = args.cold_mb
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    main_k = cpu_kernels.load()
    if main_k is None:
        raise SystemExit("the CPU kernels did not build (see the warning above)")
    kernels_by_name = {"ours": main_k}
    for i, src in enumerate(args.source):
        kernels_by_name[f"src{i}"] = build_from(Path(src))
    bandwidth = read_bandwidth(1024)
    print(f"memory read bandwidth (sum over 1 GiB, {args.threads} threads): {bandwidth / 1e9:.1f} GB/s")
    bench_linears(kernels_by_name, SHAPES[args.shape], dtype, rows)
    if args.moe:
        bench_moe(kernels_by_name, SHAPES[args.shape], dtype, rows)


def build_from(source: Path) -> cpu_kernels.CpuKernels:
    """Kernels compiled from another source file (A/B runs), cached beside it."""
    compiler = kernel_library.compiler()
    out = Path("/tmp/expertmesh-kernel-ab") / f"{source.stem}-{kernel_library.source_digest(source)[:16]}.so"
    return cpu_kernels.build(out, compiler, source=source)


if __name__ == "__main__":
    main()
