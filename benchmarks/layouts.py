"""What summing partial results in float32 costs, per layout: bytes per step and step time.

Every partial sum that crosses ranks (row-parallel outputs, the MoE combine, reduce-scatter, the
TP all-reduce after the MoE block) travels in float32 by default (``Group.reduce_dtype``). The
alternative is to round each rank's partial to the model's dtype first: half the bytes on those
collectives, and the rounding error of every rank added up (docs/layouts.md). For each layout
this starts one torchrun, builds the engine once and alternates the two settings (ABAB, so load
from other processes hits both alike), timing greedy generate calls at each batch size.

    .venv/bin/python benchmarks/layouts.py                       # the small MoE (bf16), 3 layouts
    .venv/bin/python benchmarks/layouts.py --layouts tp2,dp2tp2-naive --batch-sizes 1,32 --repeats 5

Reported per layout, batch size and setting: bytes this rank sent per step through every group
(the counters of distributed/group.py, control messages included), ms per generated token
(median and minimum of the generate calls' wall time / new tokens; prefill included, the same
for both), and one all-reduce of a [batch, hidden] partial over the layout's widest group, timed
alone (median of 10 blocks of 20, ABAB): a decode step has about two such sums a layer, so twice
that difference per layer is the step's extra cost, which noise in the step times can hide.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

LAYOUTS = {  # name -> (DP, PP, TP, EP, backend)
    "tp2": (1, 1, 2, False, "allgather_reducescatter"),
    "dp2tp2-naive": (2, 1, 2, False, "naive"),
    "dp2tp2-agrs": (2, 1, 2, False, "allgather_reducescatter"),
    "dp2tp2-ep-alltoall": (2, 1, 2, True, "alltoall"),
    "dp2-ep-alltoall": (2, 1, 1, True, "alltoall"),
    "tp4": (1, 1, 4, False, "allgather_reducescatter"),
}
SETTINGS = ("float32", "bfloat16")  # Group.reduce_dtype


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the small MoE in bf16)")
    ap.add_argument("--layouts", default="tp2,dp2tp2-naive,dp2tp2-agrs", help=f"of {','.join(LAYOUTS)}")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per setting; medians reported")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a layout name, under torchrun
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.layouts = args.layouts.split(",")
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    return args


def _sent(groups) -> int:
    """Bytes this rank sent through all its (distinct) groups so far."""
    distinct = {id(g): g for g in (groups.tp, groups.pp, groups.dp, groups.ep, groups.world)}
    return sum(g.traffic.bytes_sent for g in distinct.values())


def _all_reduce_us(group, batch: int, hidden: int) -> dict[str, float]:
    """Median µs of one all-reduce of a float32 [batch, hidden] partial, per reduce_dtype."""
    import torch

    x = torch.randn(batch, hidden)
    times: dict[str, list[float]] = {s: [] for s in SETTINGS}
    for _ in range(10):
        for setting in SETTINGS:
            group.reduce_dtype = getattr(torch, setting)
            group.barrier()
            start = time.perf_counter()
            for _ in range(20):
                group.all_reduce(x.clone())
            times[setting].append((time.perf_counter() - start) / 20 * 1e6)
    group.reduce_dtype = torch.float32
    return {s: statistics.median(t) for s, t in times.items()}


def worker(args: argparse.Namespace) -> None:
    import torch

    from expertmesh import LLM, SamplingParams

    torch.set_num_threads(1)  # the ranks share the machine's cores
    dp, pp, tp, ep, backend = LAYOUTS[args.worker]
    llm = LLM(
        args.model,
        dtype="bfloat16",
        data_parallel_size=dp,
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        enable_expert_parallel=ep,
        all2all_backend=backend,
        distributed_executor_backend="external_launcher",
        max_model_len=args.prompt_len + args.new_tokens + 8,
        kv_cache_memory_bytes=1 << 28,
    )
    groups = llm.llm_engine.groups
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    vocab = llm.llm_engine.config.model_config.vocab_size
    g = torch.Generator().manual_seed(groups.global_rank // tp)  # DP replicas get different prompts
    results = []
    for batch in args.batch_sizes:
        prompts = [
            {"prompt_token_ids": torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()}
            for _ in range(batch)
        ]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        times: dict[str, list[float]] = {s: [] for s in SETTINGS}
        sent: dict[str, int] = {}
        for _ in range(args.repeats):
            for setting in SETTINGS:  # ABAB
                groups.set_reduce_dtype(getattr(torch, setting))
                steps, before = llm.llm_engine.num_steps, _sent(groups)
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                times[setting].append(time.perf_counter() - start)
                sent[setting] = (_sent(groups) - before) // max(1, llm.llm_engine.num_steps - steps)
        widest = max((groups.tp, groups.ep), key=lambda grp: grp.world_size)
        us = _all_reduce_us(widest, batch, llm.llm_engine.config.model_config.hidden_size)
        for setting in SETTINGS:
            results.append(
                {
                    "batch": batch,
                    "reduce_dtype": setting,
                    "bytes_per_step": sent[setting],
                    "ms": 1000 * statistics.median(times[setting]) / args.new_tokens,
                    "ms_min": 1000 * min(times[setting]) / args.new_tokens,
                    "all_reduce_us": us[setting],
                    "group": f"{widest.name}{widest.world_size}",
                }
            )
    if groups.global_rank == 0:
        Path(args.out).write_text(json.dumps(results))


def run_layout(args: argparse.Namespace, name: str) -> list[dict]:
    dp, pp, tp, _, _ = LAYOUTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={dp * pp * tp}", __file__]
        cmd += ["--worker", name, "--out", out, "--model", args.model]
        cmd += ["--batch-sizes", ",".join(map(str, args.batch_sizes)), "--repeats", str(args.repeats)]
        cmd += ["--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return json.loads(Path(out).read_text())


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    if args.model is None:
        from make_small_moe import make_small_moe

        args.model = make_small_moe(dtype="bfloat16")
    table = {name: run_layout(args, name) for name in args.layouts}
    print(f"\nmodel {args.model}, bf16, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"median of {args.repeats} (ABAB); rank 0's bytes sent per step, all groups")  # fmt: skip
    print(f"{'layout':19} {'batch':>5} {'bytes/step fp32':>15} {'bf16':>10} {'ratio':>5} | "
          f"{'ms/token fp32':>13} {'bf16':>6} {'ratio':>5} | {'min fp32':>8} {'bf16':>6} | "
          f"{'all-reduce µs fp32':>18} {'bf16':>6} {'group':>6}")  # fmt: skip
    for name, rows in table.items():
        for batch in args.batch_sizes:
            f, b = (next(r for r in rows if r["batch"] == batch and r["reduce_dtype"] == s) for s in SETTINGS)
            print(
                f"{name:19} {batch:>5} {f['bytes_per_step']:>15,} {b['bytes_per_step']:>10,} "
                f"{f['bytes_per_step'] / max(1, b['bytes_per_step']):>5.2f} | {f['ms']:>13.2f} "
                f"{b['ms']:>6.2f} {f['ms'] / b['ms']:>5.2f} | {f['ms_min']:>8.2f} {b['ms_min']:>6.2f} | "
                f"{f['all_reduce_us']:>18.0f} {b['all_reduce_us']:>6.0f} {f['group']:>6}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": table}, indent=2))


if __name__ == "__main__":
    main()
