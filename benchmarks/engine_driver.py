"""Run one engine over a benchmark spec in this process and write its timings as JSON.

throughput.py starts one of these per engine, so each engine loads alone and its peak resident
memory is its own. It imports only the standard library at the top and the engine it runs
later, so the same file serves vLLM and llama-cpp-python from their own venvs:

    python benchmarks/engine_driver.py --spec spec.json --out result.json

With --reply-fd (throughput.py --interleave) it loads, warms up and answers "ready" on that file
descriptor, then runs one timed repeat of workload i for each line "i" read from stdin, answering
each with a JSON line, until stdin closes; then it writes the result as above. The orchestrator
takes turns among the engines, so drift in the machine's speed (a VM's memory bandwidth moves by
a third over minutes here) falls on every engine alike instead of on whichever ran at a bad time.

spec: {"engine": "expertmesh" | "transformers" | "vllm" | "llama.cpp", "model", "gguf" (llama.cpp's
converted weights), "dtype", "threads", "max_model_len", "max_num_seqs", "kv_cache_bytes", "repeats",
"workloads": [{"name", "prompts": [[token ids]], "max_tokens": [int], "hf_batch_size", "count"}]}
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable

# A generate function: (prompts as token-id lists, max new tokens of each) -> generated ids of each.
GenerateFn = Callable[[list[list[int]], list[int]], list[list[int]]]


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def load_expertmesh(spec: dict) -> GenerateFn:
    _set_threads(spec["threads"])
    from expertmesh import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        kv_cache_memory_bytes=spec["kv_cache_bytes"],
        max_num_seqs=spec["max_num_seqs"],
        quantization=spec.get("quantization"),  # benchmarks/quantized.py: online int8 / int4
        native_decode=spec.get("native_decode", True),  # throughput.py --native-decode
        # Repeats reuse the same prompts: a prefix cache would skip their prefill (as for vLLM).
        enable_prefix_caching=False,
    )

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


def load_vllm(spec: dict) -> GenerateFn:
    # Run the engine core in this process: no fork, and its peak RSS covers it.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{spec['threads'] - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        kv_cache_memory_bytes=spec["kv_cache_bytes"],
        max_num_seqs=spec["max_num_seqs"],
        enforce_eager=True,
        skip_tokenizer_init=True,
        # Repeats reuse the same prompts: a prefix cache would skip their prefill.
        enable_prefix_caching=False,
        seed=0,
    )

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [
            SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, detokenize=False) for m in max_tokens
        ]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


def load_transformers(spec: dict) -> Callable[[list[list[int]], list[int], int], list[list[int]]]:
    _set_threads(spec["threads"])
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"])).eval()
    pad = model.config.pad_token_id or 0

    @torch.inference_mode()
    def run_batch(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        # Static batching: left-pad, and every row runs until the batch's longest request is done.
        width, new = max(map(len, prompts)), max(max_tokens)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad,
        )
        return [out[i, width : width + m].tolist() for i, m in enumerate(max_tokens)]

    def generate(prompts: list[list[int]], max_tokens: list[int], batch_size: int) -> list[list[int]]:
        outs: list[list[int]] = []
        for s in range(0, len(prompts), batch_size):
            outs += run_batch(prompts[s : s + batch_size], max_tokens[s : s + batch_size])
        return outs

    return generate


LLAMA_BATCH = 2048  # tokens per llama_decode call (prefills of many prompts go in several)


def load_llamacpp(spec: dict) -> GenerateFn:
    """llama.cpp through llama-cpp-python's low-level API: one sequence id per request, every
    running request's next token in one llama_batch per step, greedy by argmax over the logits."""
    import llama_cpp as L
    import numpy as np

    L.llama_backend_init()
    model = L.llama_model_load_from_file(spec["gguf"].encode(), L.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {spec['gguf']}")
    cp = L.llama_context_default_params()
    n_seq = spec["max_num_seqs"]
    # KV cells are split evenly over the sequences (kv_unified off): each gets max_model_len.
    cp.n_ctx, cp.n_seq_max, cp.n_batch = n_seq * spec["max_model_len"], n_seq, LLAMA_BATCH
    cp.n_threads = cp.n_threads_batch = spec["threads"]
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(LLAMA_BATCH, 0, 1)
    memory = L.llama_get_memory(ctx)

    def run(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """(token, position, sequence, wants logits) in batches -> argmax of each wanted row."""
        picked = []
        for s in range(0, len(entries), LLAMA_BATCH):
            chunk = entries[s : s + LLAMA_BATCH]
            for i, (tok, pos, seq, want) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, want
            batch.n_tokens = len(chunk)
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            outputs = sum(e[3] for e in chunk)
            if outputs:
                logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(outputs, n_vocab))
                picked += logits.argmax(axis=1).tolist()
        return picked

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        L.llama_memory_clear(memory, True)
        prefill = [(t, p, s, p == len(q) - 1) for s, q in enumerate(prompts) for p, t in enumerate(q)]
        outs = [[t] for t in run(prefill)]
        live = [s for s in range(len(prompts)) if max_tokens[s] > 1]
        while live:
            step = run([(outs[s][-1], len(prompts[s]) + len(outs[s]) - 1, s, True) for s in live])
            for s, t in zip(live, step, strict=True):
                outs[s].append(t)
            live = [s for s in live if len(outs[s]) < max_tokens[s]]
        return outs

    return generate


LOADERS = {
    "expertmesh": load_expertmesh,
    "transformers": load_transformers,
    "vllm": load_vllm,
    "llama.cpp": load_llamacpp,
}


def _call(engine: str, generate: Callable, workload: dict) -> list[list[int]]:
    if engine == "transformers":
        return generate(workload["prompts"], workload["max_tokens"], workload["hf_batch_size"])
    return generate(workload["prompts"], workload["max_tokens"])


def time_once(engine: str, generate: Callable, workload: dict) -> tuple[float, float, list[list[int]]]:
    """(wall s, CPU s, outputs) of one generate call."""
    start, cpu0 = time.perf_counter(), _cpu_s()
    outs = _call(engine, generate, workload)
    return time.perf_counter() - start, _cpu_s() - cpu0, outs


def time_workload(engine: str, generate: Callable, workload: dict, repeats: int) -> dict:
    """Wall time of each generate call (load excluded); tokens counted are the requested ones."""
    times, cpu, outs = [], [], []
    for _ in range(repeats):
        wall, cpu_s, outs = time_once(engine, generate, workload)
        times.append(wall)
        cpu.append(cpu_s)
    return workload_result(workload, times, cpu, outs)


def workload_result(workload: dict, times: list[float], cpu: list[float], outs: list[list[int]]) -> dict:
    got = [len(o) for o in outs]
    wanted = workload["max_tokens"]
    # A prefill workload (one long prompt, one new token) is rated by the prompt tokens it read.
    counted = sum(map(len, workload["prompts"])) if workload.get("count") == "prompt" else sum(wanted)
    return {
        "name": workload["name"],
        "times_s": times,
        "median_s": statistics.median(times),
        "cpu_s": cpu,
        "median_cpu_s": statistics.median(cpu),
        "tokens": counted,
        "lengths_ok": got == wanted,
        "first_output": outs[0][:64],
    }


def _cpu_s() -> float:
    """CPU seconds of this process, all threads: with one thread, the time it held a core (load on
    a shared machine does not inflate it); with more, it also counts threads spinning at barriers."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def warm_up(engine: str, generate: Callable, workload: dict) -> None:
    """One short untimed call: first-call costs (thread pools, kernel selection) stay out of the timings."""
    small = dict(workload, prompts=workload["prompts"][:2], max_tokens=[4] * len(workload["prompts"][:2]))
    _call(engine, generate, small)


def peak_rss_bytes() -> int:
    """This process's peak RSS. VmHWM belongs to the process's own address space; ru_maxrss does not:
    Linux carries it over from the parent at fork, so a driver forked by a parent that had just
    built a large checkpoint would report the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def run(spec: dict, reply_fd: int | None = None) -> dict:
    start = time.perf_counter()
    generate = LOADERS[spec["engine"]](spec)
    load_s = time.perf_counter() - start
    warm_up(spec["engine"], generate, spec["workloads"][0])
    if reply_fd is None:
        results = [time_workload(spec["engine"], generate, w, spec["repeats"]) for w in spec["workloads"]]
    else:
        results = serve_turns(spec, generate, reply_fd)
    return {
        "engine": spec["engine"],
        "load_s": load_s,
        "maxrss_bytes": peak_rss_bytes(),
        "python": sys.executable,
        "versions": _versions(spec["engine"]),
        "workloads": results,
    }


def serve_turns(spec: dict, generate: Callable, reply_fd: int) -> list[dict]:
    """--reply-fd: one timed repeat per workload index read from stdin (see the module doc)."""
    workloads = spec["workloads"]
    times: list[list[float]] = [[] for _ in workloads]
    cpu: list[list[float]] = [[] for _ in workloads]
    outs: list[list[list[int]]] = [[] for _ in workloads]
    with os.fdopen(reply_fd, "w", buffering=1) as reply:
        reply.write("ready\n")
        for line in sys.stdin:
            i = int(line)
            wall, cpu_s, outs[i] = time_once(spec["engine"], generate, workloads[i])
            times[i].append(wall)
            cpu[i].append(cpu_s)
            reply.write(json.dumps({"wall_s": wall, "cpu_s": cpu_s}) + "\n")
    return [workload_result(w, times[i], cpu[i], outs[i]) for i, w in enumerate(workloads) if times[i]]


def _versions(engine: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    extra = {"vllm": "vllm-cpu", "llama.cpp": "llama_cpp_python"}.get(engine, "")
    for pkg in ("torch", "transformers", "expertmesh", extra):
        try:
            found[pkg] = version(pkg) if pkg else ""
        except PackageNotFoundError:
            continue
    return {k: v for k, v in found.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser(description="Run one engine over a benchmark spec (see module doc).")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reply-fd", type=int, default=None, help="take turns (throughput.py --interleave)")
    args = ap.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    result = run(spec, args.reply_fd)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
