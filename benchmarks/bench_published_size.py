"""expertmesh and llama.cpp (llama-cpp-python) on the same GGUF file, side by side: load time,
peak RSS, a 512-token prefill and batch-1 decode tokens/s, each engine in its own process
(peak RSS read from outside by /usr/bin/time -v), engines interleaved round by round.

The file comes from benchmarks/write_published_size.py (random weights at the published shape, or
a slice of its layers). Prompts are token ids, so the placeholder vocabulary does not matter.

    # quick (<= 5 min): a 1-layer file, short runs
    python benchmarks/write_published_size.py --layers 1 --out /work/bigfiles/qwen3-1of48.gguf
    python benchmarks/bench_published_size.py --file /work/bigfiles/qwen3-1of48.gguf --quick
    # the measurement
    python benchmarks/bench_published_size.py --file /work/bigfiles/qwen3-12of48.gguf --rounds 1

llama.cpp runs under its own venv's python (`--llama-python`, default /work/peers/llamacpp/bin/python);
an engine whose python cannot import it is reported as missing, not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


# ---- the children: one engine each, JSON on the last stdout line ------------------------------------
def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1000, min(vocab, 100_000)) for _ in range(n)]


def _vocab(path: str) -> int:
    import gguf

    fields = gguf.GGUFReader(path, "r").fields
    arch = fields["general.architecture"].contents()
    if f"{arch}.vocab_size" in fields:
        return int(fields[f"{arch}.vocab_size"].contents())
    return len(fields["tokenizer.ggml.tokens"].data)  # gpt-oss files carry no vocab_size


def child_expertmesh(args: argparse.Namespace) -> dict:
    from expertmesh import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        args.file, dtype=args.dtype, max_model_len=args.prefill + args.decode + 64,
        kv_cache_memory_bytes=256 << 20, max_num_seqs=4,
    )  # fmt: skip
    load = time.perf_counter() - t0
    vocab = _vocab(args.file)

    def gen(prompt: list[int], n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - t

    first = gen(_prompt(8, vocab, 1), 1)  # the first request after load (warm-up included)
    prefill = gen(_prompt(args.prefill, vocab, 2), 1)
    short = _prompt(8, vocab, 3)
    # the fastest of two runs each: other processes' bursts only ever add time
    one = min(gen(short, 1) for _ in range(2))
    many = min(gen(short, args.decode + 1) for _ in range(2))
    return {
        "load_s": load,
        "first_token_s": first,
        "prefill_s": prefill,
        "decode_tok_s": args.decode / (many - one) if many > one else None,  # None: noise won
    }


def child_llama_cpp(args: argparse.Namespace) -> dict:
    import numpy as np
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(
        model_path=args.file, n_ctx=args.prefill + args.decode + 64, n_threads=os.cpu_count(),
        n_batch=512, verbose=False,
    )  # fmt: skip
    load = time.perf_counter() - t0
    vocab = llm.n_vocab()

    steps: list[float] = []

    def run(prompt: list[int], n: int) -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        for _ in range(n - 1):  # greedy, one token at a time, each step timed
            s = time.perf_counter()
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
            steps.append(time.perf_counter() - s)
        return time.perf_counter() - t

    first = run(_prompt(8, vocab, 1), 1)
    prefill = run(_prompt(args.prefill, vocab, 2), 1)
    run(_prompt(8, vocab, 3), args.decode + 1)
    return {
        "load_s": load,
        "first_token_s": first,
        "prefill_s": prefill,
        "decode_tok_s": 1.0 / float(np.median(steps)),  # the median step: bursts of the others' load left out
    }


# ---- the parent -----------------------------------------------------------------------------------
def _measure(engine: str, python: str, args: argparse.Namespace) -> dict:
    cmd = ["/usr/bin/time", "-v", python, HERE, "--child", engine, "--file", args.file,
           "--prefill", str(args.prefill), "--decode", str(args.decode), "--dtype", args.dtype]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode or not lines:
        own = p.stderr.split("\tCommand being timed")[0]
        return {"engine": engine, "error": (own or p.stdout)[-800:]}
    out = json.loads(lines[-1])
    out.update(engine=engine, peak_rss_gib=int(rss.group(1)) / 2**20 if rss else None)
    return out


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", required=True)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", help="expertmesh's model dtype (float parts: head, norms)")
    ap.add_argument("--engines", default="expertmesh,llama.cpp")
    ap.add_argument("--llama-python", default="/work/peers/llamacpp/bin/python")
    ap.add_argument("--quick", action="store_true", help="prefill 128, decode 8, one round")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        fn = child_expertmesh if args.child == "expertmesh" else child_llama_cpp
        print(json.dumps(fn(args)))
        return
    if args.quick:
        args.prefill, args.decode, args.rounds = 128, 8, 1
    pythons = {"expertmesh": sys.executable, "llama.cpp": args.llama_python}
    size = os.path.getsize(args.file) / 2**30
    print(f"# {os.path.basename(args.file)} ({size:.2f} GiB); CPU: {_cpu()}; load average at start: "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")  # fmt: skip
    results = []
    for r in range(args.rounds):
        for engine in args.engines.split(","):
            res = _measure(engine, pythons[engine], args)
            res["round"] = r
            results.append(res)
            print(json.dumps(res), flush=True)
    print(f"# load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    cols = [
        "engine",
        "load s",
        "peak RSS GiB",
        "first token s",
        f"prefill {args.prefill} tok/s",
        "decode tok/s",
    ]
    print("\n| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols))
    for res in results:
        if "error" in res:
            print(f"| {res['engine']} | failed: {res['error'].splitlines()[-1][:80]} | | | | |")
            continue
        print(
            f"| {res['engine']} | {res['load_s']:.1f} | {res['peak_rss_gib']:.2f} | "
            f"{res['first_token_s']:.2f} | {args.prefill / res['prefill_s']:.1f} | "
            f"{'noise' if res['decode_tok_s'] is None else format(res['decode_tok_s'], '.2f')} |"
        )


if __name__ == "__main__":
    main()
