"""What bounds issue 40's serving targets on this machine: the engine's steps against the machine's
float32 matmul peak, and the HTTP side's CPU a token.

Offline (one process, the issue's random Mixtral, `OMP_NUM_THREADS` threads):
- the machine's float32 matmul peak: torch's own matmul of 2,048-square matrices, 1 and N threads;
- a lone 128-token prefill step, the same prefill in a step with 12 running decodes, and a 12-row
  decode step alone (what a request arriving at a moderate rate waits for);
- the saturation workload's steps (64 requests of 128 + 64 tokens at once): the prefill step(s),
  the median decode step, tokens/s; and the floor the measured peak puts under each.
With `--server`: `expertmesh serve` under the saturation workload (bench_serving.py's client),
each of its threads' CPU seconds from /proc (the main thread runs the event loop; the engine
thread and the OpenMP workers compute), so the HTTP side's CPU a generated token.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/serving_bounds.py --server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def matmul_peak(threads: int, size: int = 2048, repeats: int = 10) -> float:
    """GFLOP/s of torch's float32 matmul, best of three timings."""
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = min(best, (time.perf_counter() - t) / repeats)
    return 2 * size**3 / best / 1e9


def flop_per_token(cfg: dict) -> float:
    """Matmul FLOPs a token costs in the decoder layers (projections, router, the routed experts)."""
    h, n_layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv, hd = cfg["num_key_value_heads"], cfg.get("head_dim") or h // heads
    attn = h * (heads + 2 * kv) * hd + heads * hd * h
    moe = cfg["num_experts_per_tok"] * 3 * h * cfg["intermediate_size"] + h * cfg["num_local_experts"]
    return 2.0 * n_layers * (attn + moe)


def offline(args: argparse.Namespace, threads: int) -> dict:
    from expertmesh import LLM, SamplingParams

    llm = LLM(args.model, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=1 << 30, warmup=True)
    torch.set_num_threads(threads)  # matmul_peak's last setting must not leak into the engine's steps
    eng = llm.llm_engine
    rng = random.Random(0)
    ids = lambda: [rng.randrange(100, 3000) for _ in range(args.input_len)]  # noqa: E731
    one = SamplingParams(max_tokens=1, temperature=0.0)
    longer = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    def timed_step() -> float:
        t = time.perf_counter()
        eng.step()
        return (time.perf_counter() - t) * 1e3

    alone, mixed, decode = [], [], []
    for i in range(args.repeats):
        eng.add_request(f"a{i}", ids(), one)
        alone.append(timed_step())
    for k in range(12):
        eng.add_request(f"d{k}", ids(), longer)
    for _ in range(4):
        eng.step()
    for i in range(args.repeats):
        decode.append(timed_step())
        eng.add_request(f"m{i}", ids(), one)
        mixed.append(timed_step())
    for k in range(12):
        eng.abort_request(f"d{k}")
    while eng.has_unfinished_requests():
        eng.step()
    sat = []
    for r in range(args.rounds):
        for i in range(args.num_prompts):
            eng.add_request(
                f"s{r}-{i}",
                ids(),
                SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True),
            )
        t0, steps = time.perf_counter(), []
        while eng.has_unfinished_requests():
            steps.append(timed_step())
        wall = time.perf_counter() - t0
        prefill_steps = len(steps) - (args.output_len - 1)
        decodes = steps[prefill_steps:]
        sat.append({"wall_s": wall, "tok_s": args.num_prompts * args.output_len / wall,
                    "prefill_ms": sum(steps[:prefill_steps]), "decode_median_ms": statistics.median(decodes),
                    "decode_steps": len(decodes)})  # fmt: skip
    # (median, min): other processes' bursts only ever add time, so the min is the step's own cost
    med = lambda xs: (round(statistics.median(xs), 1), round(min(xs), 1))  # noqa: E731
    return {
        "prefill_alone_ms": med(alone), "prefill_with_12_decodes_ms": med(mixed), "decode_12_ms": med(decode),
        "saturation": min(sat, key=lambda s: s["wall_s"]),
    }  # fmt: skip


def thread_cpu(pid: int) -> dict[int, float]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def server(args: argparse.Namespace, threads: int) -> dict:
    import bench_serving as bs
    from transformers import AutoTokenizer

    port = bs.free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "expertmesh")
    cmd = [exe, "serve", args.model, "--port", str(port), "--max-model-len", "1024", "--dtype", "float32",
           "--served-model-name", "bench", "--kv-cache-memory-bytes", str(1 << 30)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=os.setpgrp
    )
    url = f"http://127.0.0.1:{port}"
    try:
        bs.wait_ready(url, proc, 600)
        tok = AutoTokenizer.from_pretrained(args.model)
        ns = argparse.Namespace(workload="fixed", input_len=args.input_len, output_len=args.output_len,
                                num_prompts=args.num_prompts, shared_prefix=0, seed=0)  # fmt: skip
        asyncio.run(bs.run_load(url, "expertmesh", bs.make_jobs(tok, ns, 1), float("inf"), 1, True))  # warm
        before, rows = thread_cpu(proc.pid), []
        for r in range(args.rounds):
            jobs = bs.make_jobs(tok, ns, 10 + r)
            results, wall = asyncio.run(bs.run_load(url, "expertmesh", jobs, float("inf"), 10 + r, True))
            rows.append(bs.summarize(results, wall))
        after = thread_cpu(proc.pid)
    finally:
        bs.stop_group(proc)
    spent = {t: after[t] - before.get(t, 0.0) for t in after}
    tokens = sum(r["output_tok_s"] * r["duration_s"] for r in rows)
    compute = sorted((s for t, s in spent.items() if t != proc.pid), reverse=True)
    return {
        "out_tok_s": [round(r["output_tok_s"], 1) for r in rows], "tokens": round(tokens),
        "event_loop_cpu_s": round(spent.get(proc.pid, 0.0), 2),
        "event_loop_ms_per_token": round(1e3 * spent.get(proc.pid, 0.0) / max(tokens, 1), 3),
        "busiest_other_threads_cpu_s": [round(s, 2) for s in compute[:3]],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default="/tmp/expertmesh-bench/mixtral-448-fp32",
        help="make_small_moe.py --shape mixtral-448",
    )
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--server", action="store_true", help="also the served saturation run's thread CPU")
    args = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))
    peak = {n: matmul_peak(n) for n in sorted({1, threads})}
    res = {"threads": threads, "matmul_gflop_s": {n: round(v, 1) for n, v in peak.items()}}
    res.update(offline(args, threads))
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    fpt, best = flop_per_token(cfg), peak[threads]
    sat = res["saturation"]
    prefill_floor_s = args.num_prompts * args.input_len * fpt / best / 1e9
    decode_s = sat["decode_steps"] * sat["decode_median_ms"] / 1e3
    res["floors"] = {
        "prefill_ms": round(args.input_len * fpt / best / 1e6, 1),
        "saturation_prefill_ms": round(args.num_prompts * args.input_len * fpt / best / 1e6),
        "saturation_tok_s_at_peak_prefill": round(
            args.num_prompts * args.output_len / (prefill_floor_s + decode_s)
        ),
    }  # fmt: skip
    if args.server:
        res["server"] = server(args, threads)
    print(json.dumps(res, indent=1, default=lambda x: round(x, 2) if isinstance(x, float) else str(x)))


if __name__ == "__main__":
    main()
