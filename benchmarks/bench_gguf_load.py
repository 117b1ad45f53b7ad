"""Loading a GGUF file vs loading the same weights from safetensors: load time and peak RSS, each
load in its own process (peak RSS read from outside by /usr/bin/time -v), the two interleaved round
by round so the machine's load falls on both alike.

The safetensors side is the GGUF's own values: every tensor dequantized (gguf's values, bit for bit)
and stored in the model dtype, with the config made from the file's metadata. So the GGUF load
holds Q4_K / Q6_K / Q8_0 matrices as codes (less memory) and the safetensors load holds bf16.

    # quick (<= 5 min): a 1-layer slice of Qwen3-30B-A3B as Q4_K_M, one round
    python benchmarks/write_published_size.py --layers 1 --out /work/bigfiles/qwen3-1of48.gguf
    python benchmarks/bench_gguf_load.py --file /work/bigfiles/qwen3-1of48.gguf --quick
    # the measurement: the 2-layer slice, three rounds
    python benchmarks/bench_gguf_load.py --file /work/bigfiles/qwen3-2of48.gguf --rounds 3

`--profile` runs one GGUF load under cProfile in this process and prints the top of it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def _llm(model: str, dtype: str):
    from expertmesh import LLM

    return LLM(model, dtype=dtype, max_model_len=256, kv_cache_memory_bytes=64 << 20, max_num_seqs=2)


def child(args: argparse.Namespace) -> dict:
    from expertmesh import SamplingParams

    t0 = time.perf_counter()
    llm = _llm(args.model, args.dtype)
    load = time.perf_counter() - t0
    t1 = time.perf_counter()
    prompt = {"prompt_token_ids": [1000, 2000, 3000]}
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
    return {"load_s": load, "first_request_s": time.perf_counter() - t1, "tokens": out}


def write_safetensors(gguf_path: str, out: str, dtype: str) -> str:
    """The GGUF's dequantized values as a sharded safetensors checkpoint in `dtype`, one tensor at a
    time (shards of ~512 MB), with the config from the file's metadata (no quantization_config)."""
    import torch
    from safetensors.torch import save_file

    from expertmesh.models.gguf import GGUFTensorFile, gguf_info, gguf_model_dir

    if os.path.exists(os.path.join(out, "READY")):
        return out
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    model_dir = gguf_model_dir(gguf_path)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = dtype
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    info = gguf_info(model_dir)
    weight_map, shard, size, n = {}, {}, 0, 0

    def flush() -> None:
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, os.path.join(out, name))
            weight_map.update({k: name for k in shard})
            shard, size, n = {}, 0, n + 1

    for path in info["files"]:
        f = GGUFTensorFile(path, info)
        for key in f.keys():
            src = f.get_slice(key)
            t = src[:]
            t = t.to(getattr(torch, dtype)) if t.is_floating_point() and t.dim() >= 2 else t.float()
            shard[key] = t.contiguous()
            size += t.numel() * t.element_size()
            if size > 512 << 20:
                flush()
    flush()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    open(os.path.join(out, "READY"), "w").close()
    return out


def _measure(name: str, model: str, args: argparse.Namespace, root: str = ROOT) -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, HERE, "--child", "--model", model, "--dtype", args.dtype]
    env = dict(os.environ, PYTHONPATH=root, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode or not lines:
        return {"source": name, "error": (p.stderr.split("\tCommand being timed")[0] or p.stdout)[-800:]}
    res = json.loads(lines[-1])
    res.update(source=name, peak_rss_gib=int(rss.group(1)) / 2**20 if rss else None)
    # CPU seconds of the whole process (imports and the first request included): on a shared
    # machine far steadier than the wall-clock load time
    cpu = [float(x) for x in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", p.stderr)]
    res["cpu_s"] = sum(cpu) if len(cpu) == 2 else None
    return res


def profile(args: argparse.Namespace) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    _llm(args.file, args.dtype)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(40)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", help="the GGUF file")
    ap.add_argument("--safetensors", help="where its safetensors copy is (written if missing)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="one round")
    ap.add_argument("--baseline-root", help="also load both with the expertmesh at this root")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.profile:
        return profile(args)
    if args.quick:
        args.rounds = 1
    st = args.safetensors or os.path.splitext(args.file)[0] + f".{args.dtype}.safetensors.d"
    t = time.perf_counter()
    write_safetensors(args.file, st, args.dtype)
    print(f"# safetensors copy in {st} ({time.perf_counter() - t:.0f} s)")
    names = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")]
    cpu = names[0] if names else "?"
    print(f"# {os.path.basename(args.file)} ({os.path.getsize(args.file) / 2**30:.2f} GiB); CPU: {cpu}, "
          f"{os.cpu_count()} cores, OMP_NUM_THREADS={args.threads}; load average at start: "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")  # fmt: skip
    rows = []
    for r in range(args.rounds):
        runs = [("gguf", args.file, ROOT), ("safetensors", st, ROOT)]
        if args.baseline_root:  # both sources with the other tree too (the loaders share code)
            base = args.baseline_root
            runs[:0] = [("gguf-baseline", args.file, base), ("safetensors-baseline", st, base)]
        for name, model, root in runs:
            res = _measure(name, model, args, root)
            res["round"] = r
            rows.append(res)
            print(json.dumps(res), flush=True)
    print(f"# load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("\n| round | source | load s | process CPU s | peak RSS GiB | first request s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for res in rows:
        if "error" in res:
            why = res["error"].splitlines()[-1][:80]
            print(f"| {res['round']} | {res['source']} | failed: {why} | | | |")
        else:
            print(f"| {res['round']} | {res['source']} | {res['load_s']:.1f} | {res['cpu_s']:.1f} | "
                  f"{res['peak_rss_gib']:.2f} | "
                  f"{res['first_request_s']:.2f} |")  # fmt: skip
    ok = [r for r in rows if "error" not in r]
    for r in range(args.rounds):
        pair = {x["source"]: x for x in ok if x["round"] == r}
        if "gguf" in pair and "safetensors" in pair:
            g, s = pair["gguf"], pair["safetensors"]
            if "gguf-baseline" in pair:
                b = pair["gguf-baseline"]
                print(f"# round {r}: gguf-baseline / safetensors load {b['load_s'] / s['load_s']:.2f}x, "
                      f"peak RSS {b['peak_rss_gib'] / s['peak_rss_gib']:.2f}x")  # fmt: skip
            for src in ("gguf", "safetensors"):
                b, n = pair.get(src + "-baseline"), pair[src]
                if b is not None:
                    print(f"# round {r}: {src} this tree / baseline load {n['load_s'] / b['load_s']:.2f}x, "
                          f"process CPU {n['cpu_s'] / b['cpu_s']:.2f}x, "
                          f"peak RSS {n['peak_rss_gib'] / b['peak_rss_gib']:.2f}x")  # fmt: skip
            same = g["tokens"] == s["tokens"]
            print(f"# round {r}: gguf / safetensors load {g['load_s'] / s['load_s']:.2f}x, peak RSS "
                  f"{g['peak_rss_gib'] / s['peak_rss_gib']:.2f}x, same tokens: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
