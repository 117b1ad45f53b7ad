"""What deterministic=True costs in one process: prefill and decode time, with and without.

deterministic=True takes every sum a layout could split over fixed chunks added by a fixed tree
(distributed/fixed_sum.py): a row-parallel product becomes 8 float32 GEMMs on an eighth of K, the
experts' down projection 8 calls of the fused kernel a pick, and whole decode layers no longer run
as one native call. This builds both engines on the same checkpoint in one process and alternates
them (ABAB) per measurement, so load from other processes hits both alike; ratios are reported.

    .venv/bin/python benchmarks/deterministic.py --quick          # <= 5 min on 2 busy cores
    .venv/bin/python benchmarks/deterministic.py --dtypes float32,bfloat16 --batch-sizes 1,32 --repeats 5

Per dtype and batch size: prefill ms (a generate of 1 new token on prompts of --prompt-len) and
decode ms per step ((generate of 1 + N tokens - generate of 1) / N), medians of the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the benchmarks' small MoE)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 repeats, 8 new tokens, prompts of 32")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.new_tokens, args.prompt_len = 2, 8, 32
    args.dtypes = args.dtypes.split(",")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    return args


def timed(llm, prompts: list[list[int]], new_tokens: int) -> float:
    from expertmesh import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    import torch
    from make_small_moe import make_small_moe

    from expertmesh import LLM

    args = parse_args(argv)
    rows = []
    for dtype in args.dtypes:
        model = args.model or make_small_moe(dtype=dtype)
        engines = {
            det: LLM(model, dtype=dtype, deterministic=det, max_model_len=256, kv_cache_memory_bytes=1 << 28)
            for det in (False, True)
        }
        g = torch.Generator().manual_seed(0)
        for batch in args.batch_sizes:
            vocab = engines[False].llm_engine.config.model_config.vocab_size
            prompts = [
                torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(batch)
            ]
            times = {(det, n): [] for det in engines for n in (1, 1 + args.new_tokens)}
            for _ in range(args.repeats):
                for n in (1, 1 + args.new_tokens):
                    for det, llm in engines.items():  # ABAB
                        times[(det, n)].append(timed(llm, prompts, n))
            for det in engines:
                prefill = statistics.median(times[(det, 1)])
                whole = statistics.median(times[(det, 1 + args.new_tokens)])
                decode = max(whole - prefill, 0.0) / args.new_tokens
                rows.append(dict(dtype=dtype, batch=batch, deterministic=det, prefill_ms=prefill * 1e3,
                                 decode_ms_per_step=decode * 1e3))  # fmt: skip
                print(f"{rows[-1]}", flush=True)  # as measured: a long run shows progress
        del engines
    print(f"load average {os.getloadavg()}, {os.cpu_count()} CPUs")
    print(
        f"{'dtype':<10}{'batch':>6}{'prefill ms':>14}{'det':>10}{'ratio':>8}"
        f"{'decode ms':>12}{'det':>10}{'ratio':>8}"
    )
    for dtype in args.dtypes:
        for batch in args.batch_sizes:
            a, b = (next(r for r in rows if (r["dtype"], r["batch"], r["deterministic"]) == (dtype, batch, d))
                    for d in (False, True))  # fmt: skip
            pr = b["prefill_ms"] / a["prefill_ms"]
            dr = b["decode_ms_per_step"] / max(a["decode_ms_per_step"], 1e-9)
            print(f"{dtype:<10}{batch:>6}{a['prefill_ms']:>14.1f}{b['prefill_ms']:>10.1f}{pr:>8.2f}"
                  f"{a['decode_ms_per_step']:>12.1f}{b['decode_ms_per_step']:>10.1f}{dr:>8.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
