"""DeepSeek-V4-Flash's routed FP4 experts alone: one fused moe_q_ex call (the clamped SiLU in the
kernel) against the per-expert path they took before (gemm_q per expert, the clamped SiLU in torch).

One MoE block at the published width (hidden 4096, experts of 2048, top-6, swiglu_limit 10) with
`--experts` local experts held as fp4 codes (random e2m1 codes, power-of-two scales per 32
inputs, as the published files hold them), bf16 activations. Each round times both forms on the
same tokens and routing, alternating (A B A B ...: load on the machine hits both alike); printed
per token count: the median milliseconds of each and their ratio, and the largest difference
between the two outputs.

    .venv/bin/python benchmarks/dsv4_experts.py --quick          # 1 and 32 tokens, 8 experts
    .venv/bin/python benchmarks/dsv4_experts.py --tokens 1 8 64 512 --experts 32 --rounds 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from expertmesh.cpu import cpu_kernels
from expertmesh.cpu.ops import ops_for
from expertmesh.layers.activation import ClampedGatedActivation
from expertmesh.layers.expert_weights import PerExpertWeights
from expertmesh.layers.fused_moe import FusedExperts
from expertmesh.layers.quantization.packed import QuantizedWeight

HIDDEN, INTER, TOP_K, LIMIT = 4096, 2048, 6, 10.0


def _fp4(out_f: int, in_f: int, ops, g: torch.Generator) -> QuantizedWeight:
    codes = torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8, generator=g)
    scales = torch.exp2(torch.randint(-9, -5, (out_f, in_f // 32), generator=g).float())
    return QuantizedWeight.from_rows(codes, scales, torch.zeros_like(scales), "fp4", 32, ops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="--tokens 1 32 --rounds 5")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.rounds = [1, 32], 5
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("no CPU kernels built: nothing to compare")
    ops, g = ops_for(kernels), torch.Generator().manual_seed(0)
    e = args.experts
    act = ClampedGatedActivation("silu", LIMIT)
    block = FusedExperts(e, list(range(e)), HIDDEN, INTER, 0, 1, act, dtype=torch.bfloat16)
    pairs = [(_fp4(2 * INTER, HIDDEN, ops, g), _fp4(HIDDEN, INTER, ops, g)) for _ in range(e)]
    block.hold_quantized(pairs, ops)
    forms = {"fused": block.experts_form, "per-expert": PerExpertWeights(pairs)}
    print(f"{e} experts of {INTER} (fp4), hidden {HIDDEN}, top-{TOP_K}, bf16, {args.threads} thread(s); "
          f"fused form {type(forms['fused']).__name__}; load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(
        f"{'tokens':>6} {'fused ms':>10} {'per-expert ms':>14} {'fused / per-expert':>19} {'max |diff|':>11}"
    )
    for n in args.tokens:
        x = (torch.randn(n, HIDDEN, generator=g) * 0.5).to(torch.bfloat16)
        ids = torch.rand(n, e, generator=g).argsort(dim=1)[:, : min(TOP_K, e)]
        weights = torch.rand(n, ids.shape[1], generator=g)
        times: dict[str, list[float]] = {name: [] for name in forms}
        outs = {}
        for r in range(args.rounds + 1):
            for name, form in forms.items():
                block.experts_form = form
                t0 = time.perf_counter()
                outs[name] = block(x, ids, weights)
                if r:  # the first round warms up
                    times[name].append(time.perf_counter() - t0)
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        diff = (outs["fused"] - outs["per-expert"]).abs().max().item()
        print(f"{n:>6} {ms['fused']:>10.2f} {ms['per-expert']:>14.2f} "
              f"{ms['fused'] / ms['per-expert']:>18.2f}x {diff:>11.3g}", flush=True)  # fmt: skip
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
