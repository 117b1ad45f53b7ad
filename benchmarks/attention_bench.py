"""A/B micro-benchmark of the prefill attention kernel (paged_prefill) against torch's SDPA.

One fresh causal prompt of `--length` tokens (the case the engine sends to torch's flash kernel
or to ours, layers/attention.py), at the small MoE's head layout (8 heads of 64 over 4 KV heads)
and Qwen3-30B-A3B's (32 of 128 over 4), float32 and bf16; each other kernel source (`--source`,
e.g. cpu/csrc/cpu_kernels.c in a saved copy of cpu/csrc/) is built and timed in the same rounds. One
thread and process CPU time by default; medians of `--rounds` alternated rounds.

    .venv/bin/python benchmarks/attention_bench.py --length 2000
    .venv/bin/python benchmarks/attention_bench.py --source /tmp/base/cpu_kernels.c --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from kernel_bench import build_from

from expertmesh.cpu import cpu_kernels

LAYOUTS = {"small": (8, 4, 64), "qwen3-30b-a3b": (32, 4, 128)}  # heads, KV heads, head dim


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The engine's torch path for a fresh prompt (Attention._prefill): [L, H, D] in and out."""
    q_, k_, v_ = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale, enable_gqa=True)
    return y[0].transpose(0, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=2000)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--source", action="append", default=[], help="another kernel source to compare")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wall", action="store_true", help="wall time instead of process CPU time")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.process_time
    ours = cpu_kernels.load()
    assert ours is not None, "the CPU kernels did not build"
    impls = {"ours": ours, **{f"src{i}": build_from(Path(s)) for i, s in enumerate(args.source)}}
    print(f"length {args.length}, {args.threads} thread(s), median of {args.rounds}, lanes {ours.lanes}")
    print(f"{'layout':<15}{'dtype':>10}{'impl':>8}{'ms':>10}{'GFLOP/s':>10}{'x sdpa':>8}")
    for layout in args.layouts.split(","):
        h, hk, d = LAYOUTS[layout]
        for dtype in (getattr(torch, n) for n in args.dtypes.split(",")):
            torch.manual_seed(0)
            q, k, v = (torch.randn(args.length, n, d).to(dtype) for n in (h, hk, hk))
            scale = d**-0.5
            args_ = (q, k, v, scale)
            fns = {"sdpa": lambda a=args_: sdpa(*a)}
            for name, kern in impls.items():
                fns[name] = lambda kern=kern, a=args_: kern.paged_prefill(*a)
            times: dict[str, list[float]] = {n: [] for n in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    fn()
                    t0 = clock()
                    fn()
                    times[name].append(clock() - t0)
            flops = 4 * args.length * (args.length + 1) / 2 * d * h  # QK^T and PV over the causal half
            base = statistics.median(times["sdpa"])
            for name, ts in times.items():
                t = statistics.median(ts)
                rate = flops / t / 1e9
                print(
                    f"{layout:<15}{str(dtype)[6:]:>10}{name:>8}{t * 1e3:>10.1f}{rate:>10.1f}{base / t:>8.2f}"
                )


if __name__ == "__main__":
    main()
