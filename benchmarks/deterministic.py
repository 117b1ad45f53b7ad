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

--layouts: the issue's measured run instead. Phi-mini-MoE at its published width (hidden 4,096,
16 experts of 960; tests/real_configs/phi-mini-moe.json) with --layers random bf16 layers, 4
requests of --new-tokens greedy tokens with top-8 logprobs: one process, then TP2, DP2 + EP
(alltoall), PP2, TP4 and DP2 x TP2 (naive, allgather_reducescatter, EP + alltoall), all with
deterministic=True; per rank, whether the tokens
equal one process's and the largest |logprob difference| over every position (0: bit-equal).

    .venv/bin/python benchmarks/deterministic.py --layouts --layers 8 --new-tokens 32
    .venv/bin/python benchmarks/deterministic.py --layouts --quick   # 2 layers, 8 tokens
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
    ap.add_argument("--layouts", action="store_true", help="the layouts' bit-equality run (see above)")
    ap.add_argument("--layers", type=int, default=8, help="--layouts: Phi-mini-MoE layers")
    ap.add_argument("--cache", default="/tmp/expertmesh-phi-mini-bitwise", help="--layouts: checkpoint dir")
    ap.add_argument("--with-default", action="store_true", help="--layouts: also without the option")
    ap.add_argument(
        "--worlds", default="2,4", help="--layouts: 2 (TP2, DP2 + EP, PP2), 4 (TP4, DP2 x TP2 per backend)"
    )
    args = ap.parse_args(argv)
    if args.quick and args.layouts:
        args.layers, args.new_tokens = 2, 8
    elif args.quick:
        args.repeats, args.new_tokens, args.prompt_len = 2, 8, 32
    args.worlds = [int(w) for w in args.worlds.split(",")]
    args.dtypes = args.dtypes.split(",")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    return args


def timed(llm, prompts: list[list[int]], new_tokens: int) -> float:
    from expertmesh import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


LAYOUTS = {  # world -> [(DP, PP, TP, expert parallel, backend)]
    2: [(1, 1, 2, False, "allgather_reducescatter"), (2, 1, 1, True, "alltoall"), (1, 2, 1, False, "naive")],
    4: [
        (1, 1, 4, False, "allgather_reducescatter"),
        (2, 1, 2, False, "naive"),
        (2, 1, 2, False, "allgather_reducescatter"),
        (2, 1, 2, True, "alltoall"),
    ],
}
TOP = 8


def phi_checkpoint(cache: str, layers: int) -> str:
    """Phi-mini-MoE at its published width with `layers` random bf16 layers, built once."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from checkpoints import train_tokenizer
    from test_bf16_layouts import build_checkpoint

    path = Path(cache) / f"layers{layers}"
    if not (path / "READY").exists():
        train_tokenizer(str(path / "tokenizer"))
        build_checkpoint(str(path), str(path / "tokenizer"), layers)
        (path / "READY").write_text("ok")
    return str(path)


def _prompts(n: int = 4) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(3)
    return [
        torch.randint(3, 500, (int(k),), generator=g).tolist()
        for k in torch.randint(3, 40, (n,), generator=g)
    ]


def _generate(llm, batch: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[dict[int, float]]]]:
    from expertmesh import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, logprobs=TOP, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs],
        )
        for o in outs
    ]


def _engine(path: str, det: bool, dp=1, pp=1, tp=1, ep=False, backend="allgather_reducescatter"):
    from expertmesh import LLM

    return LLM(
        path, dtype="bfloat16", data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
        enable_expert_parallel=ep, all2all_backend=backend, deterministic=det, max_model_len=128,
        kv_cache_memory_bytes=1 << 26, warmup=False,
        distributed_executor_backend="external_launcher" if dp * pp * tp > 1 else None,
    )  # fmt: skip


def _layout_rank(rank, world, path, batch, layouts, new_tokens):
    results = []
    for det, layout in layouts:
        llm = _engine(path, det, *layout)
        dp_rank = llm.llm_engine.vllm_config.parallel_config.data_parallel_rank
        mine = list(range(len(batch)))[dp_rank :: layout[0]]
        start = time.perf_counter()
        got = _generate(llm, [batch[i] for i in mine], new_tokens)
        results.append((det, layout, dict(zip(mine, got, strict=True)), time.perf_counter() - start))
        del llm
    return results


def _reference(path: str, batch: list[list[int]], dets: list[bool], new_tokens: int) -> list:
    """One process's results per deterministic setting, in a process of its own."""
    out = []
    for det in dets:
        llm = _engine(path, det)
        start = time.perf_counter()
        got = _generate(llm, batch, new_tokens)
        out.append((det, None, dict(enumerate(got)), time.perf_counter() - start))
        del llm
    return out


def layouts_main(args: argparse.Namespace) -> int:
    from expertmesh.executor.spawn import run_spmd

    path = phi_checkpoint(args.cache, args.layers)
    batch, dets = _prompts(), ([True, False] if args.with_default else [True])
    # The one-process reference runs in a process of its own (this one stays small while the
    # layouts' ranks run), and is kept beside the checkpoint for reruns of --worlds.
    saved = Path(path) / f"reference-{args.new_tokens}.json"
    refs = {}
    if saved.exists():
        refs = {det == "True": v for det, v in json.loads(saved.read_text()).items()}
    todo = [det for det in dets if det not in refs]
    if todo:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(1) as pool:
            results = pool.apply(_reference, (path, batch, todo, args.new_tokens))
        for det, _, got, seconds in results:
            refs[det] = [list(got[i]) for i in range(len(batch))]
            print(f"one process, deterministic={det}: {seconds:.1f} s", flush=True)
        saved.write_text(json.dumps({str(det): v for det, v in refs.items()}))
    refs = {det: [(tokens, [{int(t): v for t, v in pos.items()} for pos in lps]) for tokens, lps in r]
            for det, r in refs.items()}  # fmt: skip
    rows = []
    for world, layouts in LAYOUTS.items():
        if world not in args.worlds:
            continue
        cases = [(det, layout) for layout in layouts for det in dets]
        per_rank = run_spmd(
            _layout_rank, world, path, batch, cases, args.new_tokens, timeout=7200, gloo_timeout=1800
        )
        for rank, results in enumerate(per_rank):
            for det, layout, got, seconds in results:
                diff, same = 0.0, True
                for i, (tokens, lps) in got.items():
                    ref_tokens, ref_lps = refs[det][i]
                    same = same and tokens == ref_tokens
                    for pos, ref_pos in zip(lps, ref_lps, strict=True):
                        diff = max([diff] + [abs(pos.get(t, float("inf")) - v) for t, v in ref_pos.items()])
                rows.append(dict(rank=rank, layout=layout, deterministic=det, tokens_equal=same,
                                 max_logprob_difference=diff, seconds=seconds))  # fmt: skip
                print(rows[-1], flush=True)
    print(f"Phi-mini-MoE published width, {args.layers} layers, bf16, {len(batch)} requests x "
          f"{args.new_tokens} tokens, top-{TOP} logprobs; load average {os.getloadavg()}")  # fmt: skip
    print(f"{'(DP, PP, TP, EP, backend)':<48}{'rank':>5}{'det':>6}{'tokens equal':>14}{'max |diff|':>12}")
    for r in rows:
        print(f"{str(r['layout']):<48}{r['rank']:>5}{str(r['deterministic']):>6}{str(r['tokens_equal']):>14}"
              f"{r['max_logprob_difference']:>12.4g}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    bad = [
        r
        for r in rows
        if r["deterministic"] and (r["max_logprob_difference"] != 0.0 or not r["tokens_equal"])
    ]
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    import torch
    from make_small_moe import make_small_moe

    from expertmesh import LLM

    args = parse_args(argv)
    if args.layouts:
        return layouts_main(args)
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
