"""Python cost of a layer's product on the per-op path, where a weight form's or the model's ops'
dispatch (layers/ops.py) would show: at tiny shapes (a packed linear, 1 x 64 times 64 x 64; a
fused-experts block, one token, 8 experts of 64 x 64, top-2; an RMSNorm over 64; an int8 linear
64 x 64, whose product goes through the ops' gemm_q) each layer's forward against the bare kernel
call it makes (the int8 linear: its forward alone), alternated in one process (so the machine's
load hits both alike); best of `--rounds` means, in microseconds, one thread. The forward's excess
over the kernel call is the layer's own Python.

Quick (about 10 s). It runs on a tree from before the weight forms too (the `.packed` / `.fused`
slots), so two trees compare by alternating PYTHONPATH:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/form_dispatch.py
    for i in 1 2 3; do for t in /path/before /path/after; do
        PYTHONPATH=$t .venv/bin/python benchmarks/form_dispatch.py; done; done
"""

from __future__ import annotations

import argparse
import time

import torch

from expertmesh.cpu import cpu_kernels
from expertmesh.layers.fused_moe import FusedExperts
from expertmesh.layers.linear import ReplicatedLinear
from expertmesh.layers.norm import RMSNorm
from expertmesh.layers.quantization.online import OnlineScheme

try:  # a tree with the model's ops (layers/ops.py); before them, layers took the kernels themselves
    from expertmesh.cpu.ops import ops_for
except ImportError:
    ops_for = None


def _use(layer: torch.nn.Module, k: cpu_kernels.CpuKernels, scheme: OnlineScheme | None = None) -> None:
    """The layer on our kernels (its weights packed or quantized for them), in either tree's API."""
    backend = k if ops_for is None else ops_for(k)
    if scheme is not None:
        layer.use_quantized(scheme, backend)
    elif ops_for is None:
        layer.use_cpu_kernels(k)
    else:
        layer.use_ops(backend)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(1)
    k = cpu_kernels.load()
    if k is None:
        raise SystemExit("the CPU kernels did not build (see the warning above)")
    experts = FusedExperts(8, list(range(8)), 64, 64, 0, 1, "silu")
    experts.w13.data.normal_()
    experts.w2.data.normal_()
    _use(experts, k)
    linear = ReplicatedLinear(64, 64)
    linear.weight.data.normal_()
    _use(linear, k)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.normal_()
    _use(norm, k)
    q8 = ReplicatedLinear(64, 64)
    q8.weight.data.normal_()
    _use(q8, k, OnlineScheme.parse("int8"))
    form = getattr(experts, "experts_form", None)  # None: a tree from before the weight forms
    w13, w2, act = (form.w13, form.w2, form.act) if form is not None else experts.fused[1:4]
    panels = getattr(linear, "weight_form", None) or linear.packed
    x, ids, weights = torch.randn(1, 64), torch.tensor([[1, 5]]), torch.rand(1, 2)
    cases = {
        "experts forward": lambda: experts(x, ids, weights),
        "experts kernel call": lambda: k.moe(x, ids.to(torch.int32), weights, w13, w2, experts.inter, act),
        "linear forward": lambda: linear(x),
        "linear kernel call": lambda: k.linear(x, panels, None, None),
        "rmsnorm forward": lambda: norm(x),
        "rmsnorm kernel call": lambda: k.rms_norm(x, norm.weight, norm.eps),
        "int8 linear forward": lambda: q8(x),
    }
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(args.rounds):
        for name, fn in cases.items():
            t = time.perf_counter()
            for _ in range(args.calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t) / args.calls * 1e6)
    for name, us in best.items():
        print(f"{name:22s} {us:7.2f} us")
    print(f"experts forward - kernel call {best['experts forward'] - best['experts kernel call']:.2f} us; "
          f"linear {best['linear forward'] - best['linear kernel call']:.2f} us; "
          f"rmsnorm {best['rmsnorm forward'] - best['rmsnorm kernel call']:.2f} us")  # fmt: skip


if __name__ == "__main__":
    main()
