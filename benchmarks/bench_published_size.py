"""expertmesh and llama.cpp (llama-cpp-python) on the same GGUF file, one engine after the other:
what the README's published-size table needs, each engine in its own process (peak RSS read from
outside by /usr/bin/time -v), never two engines at once.

Per engine, two children:
- cold: the file dropped from the page cache first (posix_fadvise DONTNEED: no root needed), then
  load, time to first token (load + the first 1-token request), prefill of 512 and 2,000 tokens
  (the faster of two prompts), decode tokens/s at batch 1, 8 and 32 (greedy, token ids as
  prompts);
- warm: the file read into the page cache first, then load and time to first token only.

Before expertmesh loads, its peak RSS is estimated from the file's tensor table (the held codes,
their float32 scales and offsets, the embedding and head in the model dtype, the KV budget, the
runtime): a file that does not fit in MemAvailable is reported as such, not loaded (a 24 GB machine
would otherwise kill whatever runs beside it). `--estimate` prints the estimate alone.

The file comes from benchmarks/write_published_size.py (random weights at the published shape, or
a slice of its layers). Prompts are token ids, so the placeholder vocabulary does not matter.

    # quick (a few minutes on a 1-layer slice): prefill 128, decode 8, batch 1, 8 and 32
    python benchmarks/bench_published_size.py --file /work/bigfiles/qwen3-1of48.gguf --quick
    # the table (prefill 512 and 2,000, decode 32 at batch 1, 8 and 32, cold and warm)
    python benchmarks/bench_published_size.py --file /work/bigfiles/qwen3-48of48.gguf
    python benchmarks/bench_published_size.py --file /work/bigfiles/qwen3-48of48.gguf --estimate

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
GIB = 2**30
KV_BYTES = 256 << 20  # expertmesh's KV budget here (kv_cache_memory_bytes)
# what an expertmesh process holds besides its weights and KV (torch, kernels, rope tables, the
# tokenizer, thread scratch): measured on the 1- and 2-layer Qwen3-30B-A3B slices as their peak RSS
# less the estimate of their weights
RUNTIME_BYTES = 0.75 * GIB


# ---- the children: one engine each, JSON on the last stdout line ------------------------------------
def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1000, min(vocab, 100_000)) for _ in range(n)]


def _vocab(path: str) -> int:
    if os.path.isdir(path):  # a checkpoint directory: its config's vocabulary
        return int(json.load(open(os.path.join(path, "config.json")))["vocab_size"])
    from expertmesh.models.gguf.reader import open_file

    meta = open_file(path).metadata
    arch = meta["general.architecture"]
    if f"{arch}.vocab_size" in meta:
        return int(meta[f"{arch}.vocab_size"])
    return int(meta["tokenizer.ggml.tokens"])  # a string array not asked for: its length


def _ctx(args: argparse.Namespace) -> int:
    return max(args.prefill) + args.decode + 64


def child_expertmesh(args: argparse.Namespace) -> dict:
    from expertmesh import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        args.expertmesh_model or args.file, dtype=args.dtype, max_model_len=_ctx(args),
        kv_cache_memory_bytes=KV_BYTES, max_num_seqs=max(args.batch),
    )  # fmt: skip
    out = {"load_s": time.perf_counter() - t0}
    vocab = _vocab(args.expertmesh_model or args.file)

    def gen(prompts: list[list[int]], n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t

    out["first_token_s"] = gen([_prompt(8, vocab, 1)], 1)  # the first request after load (warm-up in it)
    out["ttft_s"] = out["load_s"] + out["first_token_s"]
    if args.warm_only:
        return out
    for n in args.prefill:
        # the faster of two prompts (as decode below): the first big request can pay first touches
        out[f"prefill_{n}_tok_s"] = n / min(gen([_prompt(n, vocab, 2 + n + r)], 1) for r in (0, 1))
    for b in args.batch:
        prompts = [_prompt(8, vocab, 100 * b + i) for i in range(b)]
        # the faster of two runs each: other processes' bursts only ever add time; less a 1-token
        # run, so prefill and the request's own overhead are not counted as decoding
        one = min(gen(prompts, 1) for _ in range(2))
        many = min(gen(prompts, args.decode + 1) for _ in range(2))
        out[f"decode_b{b}_tok_s"] = b * args.decode / (many - one) if many > one else None  # None: noise won
    return out


def child_llama_cpp(args: argparse.Namespace) -> dict:
    import ctypes

    import numpy as np
    from llama_cpp import Llama
    from llama_cpp import _internals as internals
    from llama_cpp import llama_cpp as C

    threads = os.cpu_count()
    t0 = time.perf_counter()
    llm = Llama(model_path=args.file, n_ctx=_ctx(args), n_threads=threads, n_batch=512, verbose=False)
    out = {"load_s": time.perf_counter() - t0}
    vocab = llm.n_vocab()

    def run(prompt: list[int]) -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        return time.perf_counter() - t

    out["first_token_s"] = run(_prompt(8, vocab, 1))
    out["ttft_s"] = out["load_s"] + out["first_token_s"]
    if args.warm_only:
        return out
    for n in args.prefill:
        out[f"prefill_{n}_tok_s"] = n / min(run(_prompt(n, vocab, 2 + n + r)) for r in (0, 1))
    llm._ctx.close()  # the batch contexts below take its place (one KV cache at a time)
    for b in args.batch:
        # b sequences in one context (one sequence id each), one token each a step, greedy
        params = C.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = b * (8 + args.decode + 8), 512, 512
        params.n_seq_max, params.n_threads, params.n_threads_batch = b, threads, threads
        ctx = internals.LlamaContext(model=llm._model, params=params, verbose=False)
        batch = internals.LlamaBatch(n_tokens=max(8 * b, 512), embd=0, n_seq_max=b, verbose=False)

        def argmax(i: int, ctx=ctx) -> int:
            logits = ctypes.cast(C.llama_get_logits_ith(ctx.ctx, i), ctypes.POINTER(ctypes.c_float))
            return int(np.argmax(np.ctypeslib.as_array(logits, shape=(vocab,))))

        batch.reset()
        for s in range(b):
            batch.add_sequence(_prompt(8, vocab, 100 * b + s), s, False)
        ctx.decode(batch)
        last = [argmax(8 * s + 7) for s in range(b)]
        steps = []
        for step in range(args.decode):
            batch.reset()
            batch.batch.n_tokens = b
            for s in range(b):
                batch.batch.token[s], batch.batch.pos[s] = last[s], 8 + step
                batch.batch.seq_id[s][0], batch.batch.n_seq_id[s], batch.batch.logits[s] = s, 1, True
            t = time.perf_counter()
            ctx.decode(batch)
            steps.append(time.perf_counter() - t)
            last = [argmax(s) for s in range(b)]
        out[f"decode_b{b}_tok_s"] = b / float(np.median(steps))  # the median step: others' bursts left out
        batch.close()
        ctx.close()
    return out


# ---- expertmesh's peak RSS from the file's tensor table ----------------------------------------------
def estimate_expertmesh(path: str, dtype_bytes: int = 2) -> dict:
    """Bytes expertmesh holds for this file: held types as codes (a byte, or a nibble) plus float32
    scale and offset per group (layers/quantization/packed.py; MXFP4's offsets one shared zero
    tensor), a fused parameter whose parts differ widened to int8 in the smaller group
    (quants.held_kinds), the embedding, the head and unheld types in the model dtype, float tensors
    as stored; then the KV budget and the runtime."""
    import numpy as np

    from expertmesh.models.gguf.quants import FLOAT_TYPES, HELD, ZERO_OFFSETS, held_kinds
    from expertmesh.models.gguf.reader import GGUFFile

    f = GGUFFile(path)
    tensors = {t.name: t for t in f.tensors}
    widened = held_kinds({n: t.tensor_type.name for n, t in tensors.items()})
    weights = zero_stack = 0  # zero_stack: the one zero offsets stack the shared ones point at
    for name, t in tensors.items():
        n, qtype = int(np.prod(t.shape)), t.tensor_type.name
        if name.startswith(("token_embd.", "output.")) or len(t.shape) < 2:
            weights += n * (dtype_bytes if len(t.shape) >= 2 else 4)
        elif qtype in FLOAT_TYPES:
            weights += n * {"F32": 4}.get(qtype, 2)
        elif qtype in HELD:
            kind, group = widened.get(name, HELD[qtype])
            code = 0.5 if kind in ("int4", "fp4") else 1.0
            # offsets zero by the format: one shared zero tensor for an experts stack (held.py _weight)
            shared = "_exps." in name and (
                kind == "fp4" or (qtype in ZERO_OFFSETS and kind == HELD[qtype][0])
            )
            weights += n * (code + (4 if shared else 8) / group)
            zero_stack = max(zero_stack, n * 4 / group if shared and kind != "fp4" else 0)
        else:
            weights += n * dtype_bytes
    f.close()
    weights += zero_stack
    total = weights + KV_BYTES + RUNTIME_BYTES
    return {"weights_gib": weights / GIB, "peak_gib": total / GIB}


def estimate_checkpoint(path: str, dtype_bytes: int = 2) -> dict:
    """The same for a compressed-tensors int checkpoint directory (benchmarks/write_qwen3_int4.py):
    each packed linear held as codes plus a float32 scale and offset per group, every other tensor
    in the model dtype."""
    import glob

    from safetensors import safe_open

    weights = 0
    for shard in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(shard, "np") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118 -- not a dict
        for name, shape in shapes.items():
            if name.endswith(".weight_packed"):
                rows, words = shape
                groups = shapes[name.replace("_packed", "_scale")][1]
                weights += rows * words * 4 + rows * groups * 8  # int32 words of codes; scale, offset
            elif not name.endswith((".weight_scale", ".weight_shape", ".weight_zero_point")):
                n = 1
                for d in shape:
                    n *= d
                weights += n * (dtype_bytes if len(shape) >= 2 else 4)
    total = weights + KV_BYTES + RUNTIME_BYTES
    return {"weights_gib": weights / GIB, "peak_gib": total / GIB}


def _available_gib() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


# ---- the parent -----------------------------------------------------------------------------------
def _page_cache(path: str, warm: bool) -> None:
    """The file (or every file of a directory) dropped from the page cache (cold), or read through
    it (warm)."""
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            _page_cache(os.path.join(path, name), warm)
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        if warm:
            while os.read(fd, 64 << 20):
                pass
        else:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _measure(engine: str, python: str, args: argparse.Namespace, warm: bool) -> dict:
    cmd = ["/usr/bin/time", "-v", python, HERE, "--child", engine, "--file", args.file, "--decode",
           str(args.decode), "--dtype", args.dtype, "--prefill", *map(str, args.prefill), "--batch",
           *map(str, args.batch)] + (["--warm-only"] if warm else [])  # fmt: skip
    own = args.expertmesh_model if engine == "expertmesh" else None
    if own:
        cmd += ["--expertmesh-model", own]
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    _page_cache(own or args.file, warm)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode or not lines:
        own = p.stderr.split("\tCommand being timed")[0]
        return {"engine": engine, "error": (own or p.stdout)[-800:]}
    out = json.loads(lines[-1])
    out.update(engine=engine, peak_rss_gib=int(rss.group(1)) / 2**20 if rss else None)
    return out


def _size(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    return os.path.getsize(path)


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return platform.processor()


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "noise" if x is None else format(x, spec)


def table(results: list[dict], prefill: list[int], batch: list[int]) -> str:
    """The README table: one row an engine (cold run's figures, the warm run's load and TTFT)."""
    cols = ["engine", "load s (cold / warm)", "TTFT s (cold / warm)", "peak RSS GiB"]
    cols += [f"prefill {n} tok/s" for n in prefill] + [f"decode b{b} tok/s" for b in batch]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for engine in dict.fromkeys(r["engine"] for r in results):
        cold = next((r for r in results if r["engine"] == engine and not r["warm"]), {})
        warm = next((r for r in results if r["engine"] == engine and r["warm"]), {})
        err = cold.get("error") or warm.get("error")
        if err:
            why = err.strip().splitlines()[-1][:100]
            lines.append(f"| {engine} | failed: {why} |" + " |" * (len(cols) - 2))
            continue
        rss = max(r["peak_rss_gib"] for r in (cold, warm) if r)
        row = [engine, f"{cold['load_s']:.1f} / {warm.get('load_s', float('nan')):.1f}",
               f"{cold['ttft_s']:.1f} / {warm.get('ttft_s', float('nan')):.1f}", f"{rss:.2f}"]  # fmt: skip
        row += [_fmt(cold.get(f"prefill_{n}_tok_s")) for n in prefill]
        row += [_fmt(cold.get(f"decode_b{b}_tok_s"), ".2f") for b in batch]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", required=True)
    ap.add_argument("--prefill", type=int, nargs="+", default=[512, 2000])
    ap.add_argument("--decode", type=int, default=32, help="tokens decoded a run")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--dtype", default="bfloat16", help="expertmesh's model dtype (float parts: head, norms)")
    ap.add_argument("--engines", default="expertmesh,llama.cpp")
    ap.add_argument(
        "--expertmesh-model", help="what expertmesh loads instead of --file: a checkpoint of the same "
        "weights in another format (benchmarks/write_qwen3_int4.py's compressed-tensors directory)"
    )  # fmt: skip
    ap.add_argument("--llama-python", default="/work/peers/llamacpp/bin/python")
    ap.add_argument("--quick", action="store_true", help="prefill 128, decode 8")
    ap.add_argument("--no-warm", action="store_true", help="the cold run only")
    ap.add_argument("--estimate", action="store_true", help="expertmesh's estimated peak RSS, nothing run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        fn = child_expertmesh if args.child == "expertmesh" else child_llama_cpp
        print(json.dumps(fn(args)))
        return
    if args.expertmesh_model:
        est = estimate_checkpoint(args.expertmesh_model)
    else:
        est = estimate_expertmesh(args.file)
    avail = _available_gib()
    print(f"# expertmesh's estimated peak RSS: {est['peak_gib']:.1f} GiB (weights {est['weights_gib']:.1f}); "
          f"MemAvailable now {avail:.1f} GiB")  # fmt: skip
    if args.estimate:
        return
    if args.quick:
        args.prefill, args.decode = [128], 8
    pythons = {"expertmesh": sys.executable, "llama.cpp": args.llama_python}
    files = [p for p in (args.file, args.expertmesh_model) if p and os.path.exists(p)]
    sizes = ", ".join(f"{os.path.basename(p.rstrip('/'))} {_size(p) / GIB:.2f} GiB" for p in files)
    print(f"# {sizes}; CPU: {_cpu()}; load average at start: "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")  # fmt: skip
    results = []
    for engine in args.engines.split(","):
        for warm in (False,) if args.no_warm else (False, True):
            if engine == "expertmesh" and est["peak_gib"] > _available_gib():
                res = {"engine": engine, "error": f"does not fit: needs ~{est['peak_gib']:.1f} GiB, "
                       f"{_available_gib():.1f} GiB available (--estimate)"}  # fmt: skip
            else:
                t = time.perf_counter()
                res = _measure(engine, pythons[engine], args, warm)
                res["wall_s"] = time.perf_counter() - t
            res["warm"] = warm
            results.append(res)
            print(json.dumps(res), flush=True)
    print(f"# load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("\n" + table(results, args.prefill, args.batch))


if __name__ == "__main__":
    main()
