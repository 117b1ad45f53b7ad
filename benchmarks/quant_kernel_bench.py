"""A/B micro-benchmark of the quantized kernels (gemm_q, moe_q) against the float32 panel GEMM.

Each kernel source given (`--source`, e.g. cpu/csrc/cpu_kernels.c in a saved copy of cpu/csrc/;
the working tree's is "ours") is built once; then every (product, rows, kind) case is timed for
each source in turn, alternated A B A B over `--rounds` rounds, and the median is printed with
GB/s of weights read (codes + scales + offsets) and the ratio to the float32 GEMM of the same
source. One thread and process CPU time by default: on a shared machine CPU time does not count
other processes' turns.

    .venv/bin/python benchmarks/quant_kernel_bench.py --source /tmp/base/cpu_kernels.c --rows 1,4,32 --moe
    # weights read from memory, not cache (a decode step's weights exceed L3):
    .venv/bin/python benchmarks/quant_kernel_bench.py --rows 1 --only w13,w2,qkv --cold-mb 96
    # gpt-oss-20b's MXFP4 experts at one row, two threads, wall time:
    .venv/bin/python benchmarks/quant_kernel_bench.py --shape gpt-oss-20b --moe --only moe --kinds fp4-bf16 \
        --rows 1 --threads 2 --wall --cold-mb 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from expertmesh.cpu import cpu_kernels, kernel_library
from expertmesh.cpu.ops import ops_for
from expertmesh.cpu.quantized import QuantizedMoE
from expertmesh.layers.quantization.codes import BF16_PAIRS, KINDS
from expertmesh.layers.quantization.packed import QuantizedExperts, QuantizedWeight

# products (out, in) and the routed experts (hidden, inter, experts, top-k) by model
SHAPES = {
    "small": ({"w13": (2048, 512), "w2": (512, 1024), "qkv": (1024, 512)}, (512, 1024, 8, 2)),
    "gpt-oss-20b": ({"w13": (5760, 2880), "w2": (2880, 2880), "qkv": (5120, 2880)}, (2880, 2880, 32, 4)),
    "qwen3-30b-a3b": ({"w13": (1536, 2048), "w2": (2048, 768), "qkv": (5120, 2048)}, (2048, 768, 128, 8)),
}
PRODUCTS, MOE = SHAPES["small"]
# "int4-bf16", "int8-bf16", "fp4-bf16", "fp8-bf16": the weights times bf16 activations (a bf16
# model's: code kinds 6-9, on bf16 pairs)
CODES = {**KINDS, **{f"{kind}-bf16": code for kind, code in BF16_PAIRS.items()}}


def weight_kind(kind: str) -> str:
    return kind.removesuffix("-bf16")


def timed(fn, clock, calls: int) -> float:
    t0 = clock()
    for _ in range(calls):
        fn()
    return (clock() - t0) / calls


def calls_for(fn, clock, min_s: float) -> int:
    fn()
    n, t0 = 1, clock()
    while clock() - t0 < min_s:
        fn()
        n += 1
    return max(2, n)


class Rotating:
    """Calls fns in turn: with copies of a weight that together exceed the last-level cache, every
    call reads its weight from memory, as a decode step does (its weights do not fit in L3)."""

    def __init__(self, fns: list) -> None:
        self.fns, self.n = fns, 0

    def __call__(self) -> None:
        self.fns[self.n % len(self.fns)]()
        self.n += 1


def copies_for(nbytes: int, cold_mb: float) -> int:
    return max(1, -(-int(cold_mb * 2**20) // nbytes))


def cases(kernels: dict, kinds: list[str], rows: list[int], moe: bool, cold_mb: float = 0) -> dict:
    """{(label, rows, kind): {source: (callable, weight bytes, what it points into)}}; the products call
    the C entry points with raw pointers (one thread), the routed experts go through QuantizedMoE.
    cold_mb > 0: each product cycles through enough copies of its weight to read cold_mb a cycle."""
    out: dict = {}
    g = torch.Generator().manual_seed(0)
    for name, (o, i) in PRODUCTS.items():
        w = torch.randn(o, i, generator=g) * i**-0.5
        for m in rows:
            x = torch.randn(m, i, generator=g)
            y = torch.empty(m, o)
            for src, k in kernels.items():
                # the entry points called directly: no Python around the kernel
                packs = [k.pack(w) for _ in range(copies_for(o * i * 4, cold_mb) if cold_mb else 1)]
                f32s = [
                    partial(k.lib.gemm_f32, x.data_ptr(), p.data.data_ptr(), y.data_ptr(), m, o, i, None, 1)
                    for p in packs
                ]
                f32 = Rotating(f32s) if len(f32s) > 1 else f32s[0]
                out.setdefault((name, m, "f32"), {})[src] = (f32, o * i * 4, (packs, x, y))
                for kind in kinds:
                    if kind not in k.quant_kinds or weight_kind(kind) == "fp4":  # fp4: fp4_products, moe
                        continue
                    q = QuantizedWeight.quantize(w, weight_kind(kind), 128, ops_for(k))
                    held = [q] + [
                        QuantizedWeight.quantize(w, weight_kind(kind), 128, ops_for(k))
                        for _ in range(copies_for(q.nbytes, cold_mb) - 1 if cold_mb else 0)
                    ]
                    fns = [
                        partial(
                            k.lib.gemm_q,
                            CODES[kind],
                            x.data_ptr(),
                            c.codes.data_ptr(),
                            c.scales.data_ptr(),
                            c.offsets.data_ptr(),
                            128,
                            y.data_ptr(),
                            m,
                            o,
                            i,
                            None,
                            1,
                        )  # fmt: skip
                        for c in held
                    ]
                    fn = Rotating(fns) if len(fns) > 1 else fns[0]
                    out.setdefault((name, m, kind), {})[src] = (fn, q.nbytes, (held, x, y))
    if moe:
        hidden, inter, experts, top_k = MOE
        # fp4's codes are random (quantized() reads the shape only): no float copy of the experts
        fp4_only = all(weight_kind(kind) == "fp4" for kind in kinds)
        device = "meta" if fp4_only else "cpu"
        w13 = torch.randn(experts, 2 * inter, hidden, device=device) * hidden**-0.5
        w2 = torch.randn(experts, hidden, inter, device=device) * inter**-0.5
        for m in rows:
            x = torch.randn(m, hidden, generator=g)
            ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(m)]).int()
            wts = torch.rand(m, top_k, generator=g)
            touched = len(set(ids.flatten().tolist()))
            for src, k in kernels.items():
                for kind in kinds:
                    if kind not in k.quant_kinds:
                        continue
                    wk = weight_kind(kind)
                    a = QuantizedExperts.stack([quantized(w13[e], wk, 128, k, g) for e in range(experts)])
                    b = QuantizedExperts.stack([quantized(w2[e], wk, 128, k, g) for e in range(experts)])
                    nbytes = touched * (a.nbytes + b.nbytes) // experts
                    xk = x.bfloat16() if kind.endswith("-bf16") else x  # QuantizedMoE picks kinds 6-9 for it
                    # cold: every call routes to the next experts (ids shifted), so that a cycle reads
                    # all of them and experts larger than the cache come from memory, as in decode
                    shifts = range(experts) if cold_mb else range(1)
                    run = QuantizedMoE(k).moe
                    routed = [((ids + s) % experts).int() for s in shifts]
                    fn = Rotating([partial(run, xk, r, wts, a, b, inter, "silu") for r in routed])
                    out.setdefault(("moe", m, kind), {})[src] = (fn, nbytes, None)
    if "fp4" in kinds:
        fp4_products(kernels, rows, "int4" in kinds, out)
    return out


def quantized(w: torch.Tensor, kind: str, group: int, k, g: torch.Generator) -> QuantizedWeight:
    """fp4 as MXFP4 holds it: e2m1 codes and a 2^k scale per 32 inputs (quantize_rows has no fp4; the
    decode's cost does not depend on the values, so the codes are random); the other kinds quantized."""
    if kind != "fp4":
        return QuantizedWeight.quantize(w, kind, group, ops_for(k))
    o, i = w.shape
    codes = torch.randint(0, 16, (o, i), generator=g, dtype=torch.uint8)
    scales = torch.exp2(torch.randint(-9, -5, (o, -(-i // 32)), generator=g).float())
    return QuantizedWeight.from_rows(codes, scales, torch.zeros_like(scales), "fp4", 32, ops_for(k))


def fp4_products(kernels: dict, rows: list[int], with_int4: bool, out: dict) -> None:
    """The products with fp4 weights in MXFP4's groups of 32 inputs, and (with int4 asked) int4 in
    groups of 32 too as "int4/32", which separates the decode's cost from the group size's."""
    g = torch.Generator().manual_seed(1)
    for name, (o, i) in PRODUCTS.items():
        w = torch.randn(o, i, generator=g) * i**-0.5
        for m in rows:
            x, y = torch.randn(m, i, generator=g), torch.empty(m, o)
            for src, k in kernels.items():
                for kind in ("fp4", "int4") if with_int4 else ("fp4",):
                    if kind not in k.quant_kinds:
                        continue
                    q = quantized(w, kind, 32, k, g)
                    ptrs = (x.data_ptr(), q.codes.data_ptr(), q.scales.data_ptr(), q.offsets.data_ptr())
                    fn = partial(k.lib.gemm_q, KINDS[kind], *ptrs, 32, y.data_ptr(), m, o, i, None, 1)
                    label = "fp4" if kind == "fp4" else "int4/32"
                    out.setdefault((name, m, label), {})[src] = (fn, q.nbytes, (q, x, y))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", action="append", default=[], help="another kernel source (A/B)")
    ap.add_argument("--rows", default="1,4,32")
    ap.add_argument(
        "--kinds",
        default="int8,int4,fp8,fp4,w8a8,w4a8,int4-bf16,int8-bf16,fp4-bf16,fp8-bf16",
        help="fp4 in groups of 32; *-bf16: bf16 inputs (fp4-bf16: the routed experts only)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-s", type=float, default=0.05, help="seconds of calls per timing")
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES), help="products' and experts' shapes")
    ap.add_argument("--only", default=None, help="comma-separated products (w13,w2,qkv,moe)")
    ap.add_argument("--wall", action="store_true", help="wall time instead of process CPU time")
    ap.add_argument(
        "--cold-mb", type=float, default=0,
        help="products cycle through copies of their weight, this many MB a cycle (64: past a 32 MB L3)",
    )  # fmt: skip
    args = ap.parse_args()
    global PRODUCTS, MOE
    PRODUCTS, MOE = SHAPES[args.shape]
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.process_time
    kernels = {"ours": cpu_kernels.load()}
    for n, src in enumerate(args.source):
        digest = kernel_library.source_digest(Path(src))[:16]
        out = Path("/tmp/expertmesh-kernel-ab") / f"{Path(src).stem}-{digest}.so"
        kernels[f"src{n}"] = cpu_kernels.build(out, kernel_library.compiler(), source=Path(src))
    rows = [int(r) for r in args.rows.split(",")]
    table = cases(kernels, args.kinds.split(","), rows, args.moe, args.cold_mb)
    only = set(args.only.split(",")) if args.only else None
    results: dict = {}
    for key, by_src in table.items():
        if only and key[0] not in only:
            continue
        n = {s: calls_for(fn, clock, args.min_s) for s, (fn, *_) in by_src.items()}
        for _ in range(args.rounds):  # A B A B ...
            for s, (fn, *_) in by_src.items():
                results.setdefault(key, {}).setdefault(s, []).append(timed(fn, clock, n[s]))
    print(f"{'product':<8}{'rows':>5}{'kind':>8}{'source':>7}{'us':>10}{'GB/s':>8}{'x f32':>7}")
    for (name, m, kind), by_src in results.items():
        for s, ts in by_src.items():
            t = statistics.median(ts)
            f32 = results.get((name, m, "f32"), {}).get(s)
            ratio = f"{statistics.median(f32) / t:>7.2f}" if f32 else f"{'':>7}"
            nbytes = table[(name, m, kind)][s][1]
            print(f"{name:<8}{m:>5}{kind:>8}{s:>7}{t * 1e6:>10.1f}{nbytes / t / 1e9:>8.2f}{ratio}")


if __name__ == "__main__":
    main()
