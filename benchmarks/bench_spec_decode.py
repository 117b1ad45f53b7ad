"""Decode tok/s with and without n-gram speculative decoding, interleaved in one run.

Two workloads: copy-heavy (prompts that ask to repeat or continue a given text, the default model's
counting prompts) and plain (open-ended prompts); batch 1 and batch 8. Both engines are loaded
first; each round times every cell on both, in alternating order, and a ratio is the median of the
rounds' ratios (absolute numbers drift with the machine's load: the load average is printed).
Greedy outputs of the two engines are compared too (they must be equal).

With `--llamacpp FILE.gguf` (the same weights as `--model`, converted by benchmarks/gguf_convert.py)
the batch-1 cells also time llama.cpp without and with its prompt-lookup decoding
(llama-cpp-python's LlamaPromptLookupDecoding, k and the longest n-gram as ours), in the same
rounds, on the same token ids (the prompts are tokenized once, by the model's tokenizer), with the
same thread count (`--threads`, also given to torch).

    .venv/bin/python benchmarks/bench_spec_decode.py --quick --threads 1 \
        --model /tmp/expertmesh-bench/mixtral-448-fp32 \
        --llamacpp /tmp/expertmesh-bench/mixtral-448-fp32.f32.gguf

    .venv/bin/python benchmarks/bench_spec_decode.py --quick      # about 2-4 minutes
    .venv/bin/python benchmarks/bench_spec_decode.py --rounds 5 --max-tokens 256 --model PATH
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

COPY = [
    "Repeat this text: The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
    "Copy the list: apple, banana, cherry, apple, banana, cherry, apple, banana,",
    "The capital of Denmark is Copenhagen. The capital of Sweden is Stockholm. The capital of",
    "Summarise: Anna has a cat. The cat is happy. Anna has a dog. The dog is happy. Anna has",
    "one two three four five one two three four five one two",
    "A B C D E F G A B C D E F G A B C",
    "Say it again: I like riding my bike. I like riding my bike. I like",
]
PLAIN = [
    "Hello, my name is",
    "Once upon a time",
    "The weather today",
    "My favourite food is",
    "In the morning I",
    "The best thing about school",
    "Yesterday we went to",
    "A good friend is",
]


# The clock calls are timed by: wall time, or with --cpu-time this process's CPU time, which on a
# machine shared with other jobs counts the work done rather than the time spent waiting for a core
# (sound with --threads 1: with more, idle threads' spinning counts too).
CLOCK = [time.perf_counter]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class LlamaCpp:
    """benchmarks/llamacpp_lookup.py in llama-cpp-python's venv, kept running across rounds."""

    def __init__(self, python: str, gguf: str, threads: int, k: int, ngram: int) -> None:
        driver = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamacpp_lookup.py")
        cmd = [python, driver, gguf, "--threads", str(threads), "--k", str(k), "--ngram", str(ngram)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        json.loads(self.proc.stdout.readline())  # {"ready": true} once both contexts are loaded

    def timed(self, prompt: list[int], max_tokens: int, lookup: bool) -> tuple[float, int, list[int]]:
        self.proc.stdin.write(
            json.dumps({"prompt": prompt, "max_tokens": max_tokens, "lookup": lookup}) + "\n"
        )
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        return out["seconds"], len(out["tokens"]), out["tokens"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def timed(llm, prompts: list[list[int]], params) -> tuple[float, int, list[list[int]]]:
    start = CLOCK[0]()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = CLOCK[0]() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return elapsed, sum(len(t) for t in tokens), tokens


class KnownOutput:
    """A proposer drafting the plain engine's greedy output itself (every draft right), exactly
    `length` tokens a step: the verify steps then have a known row count."""

    def __init__(self, prompt: list[int], out: list[int], length: int) -> None:
        self.prompt, self.out, self.length = list(prompt), list(out), length

    def propose(self, tokens, limit: int) -> list[int]:
        done = len(tokens) - len(self.prompt)
        return self.out[done : done + min(self.length, limit)]


def step_timer(llm, record: list) -> None:
    """Wrap `llm`'s engine step: each decode-only step appends (tokens in it, seconds)."""
    engine = llm.llm_engine
    schedule, step = engine.scheduler.schedule, engine.step
    batch = {}

    def timed_schedule():
        batch["b"] = schedule()
        return batch["b"]

    def timed_step():
        start = CLOCK[0]()
        out = step()
        b = batch.pop("b", None)
        if b is not None and b and not b.prefills:
            record.append((b.num_tokens, CLOCK[0]() - start))
        return out

    engine.scheduler.schedule, engine.step = timed_schedule, timed_step


def row_costs(
    plain_llm, spec_llm, prompts: list[list[int]], max_tokens: int, rounds: int
) -> dict[int, float]:
    """Batch-1 decode step time by verify rows (1 + draft length; drafts always right, gate off),
    interleaved with the plain engine round by round: each row count's median step time over the
    plain engine's one-row step's."""
    from expertmesh import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    drafter = spec_llm.llm_engine.drafter
    saved = drafter.proposer, drafter.gate
    drafter.gate = None
    lengths = [d for d in (1, 2, 3, 4, 8, 16) if d <= drafter.config.num_speculative_tokens]
    plain_steps, spec_steps = [], []
    step_timer(plain_llm, plain_steps)
    step_timer(spec_llm, spec_steps)
    for r in range(rounds):
        prompt = prompts[r % len(prompts)]
        outs = plain_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        out = list(outs[0].outputs[0].token_ids)
        for d in lengths if r % 2 == 0 else lengths[::-1]:
            drafter.proposer = KnownOutput(prompt, out, d)
            spec_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    drafter.proposer, drafter.gate = saved
    base = statistics.median(t for n, t in plain_steps if n == 1)
    by_rows: dict[int, list[float]] = {}
    for n, t in spec_steps:
        by_rows.setdefault(n, []).append(t)
    return {n: statistics.median(by_rows[n]) / base for n in sorted(by_rows) if len(by_rows[n]) >= rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=16, help="num_speculative_tokens (the longest draft)")
    ap.add_argument(
        "--fixed-k",
        type=int,
        default=None,
        help="also time an engine drafting this many tokens whenever it drafts (the adaptive gate's "
        "pauses on, its draft-length rule off: the behaviour before adaptive lengths)",
    )
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--no-adaptive", action="store_true", help="draft at every step (no per-sequence gate)")
    ap.add_argument("--quick", action="store_true", help="6 rounds of 64 tokens")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--llamacpp", default=None, help="a GGUF of --model: also time llama.cpp (batch 1)")
    ap.add_argument("--llamacpp-python", default="/work/peers/llamacpp/bin/python")
    ap.add_argument("--llamacpp-k", type=int, default=4, help="llama.cpp's draft length (it drafts fixed k)")
    ap.add_argument("--threads", type=int, default=None, help="torch's and llama.cpp's threads")
    ap.add_argument("--batches", default="1,8", help="batch sizes to time (comma-separated)")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by this process's CPU time, not wall time (a shared machine; use with --threads 1)",
    )
    ap.add_argument(
        "--row-costs",
        action="store_true",
        help="also time batch-1 verify steps by row count (drafts always right) against a one-row step",
    )
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.max_tokens = 6, 64
    if args.cpu_time:
        CLOCK[0] = time.process_time
    import torch

    from expertmesh import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.llamacpp and not args.model:
        ap.error("--llamacpp needs --model: the checkpoint the GGUF was converted from")

    spec_config = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
    }
    common = dict(max_model_len=512, max_num_seqs=16)
    plain_llm = LLM(args.model, **common)
    spec_llm = LLM(args.model, **common, speculative_config=spec_config)
    if args.no_adaptive:
        spec_llm.llm_engine.drafter.gate = None
    engines = [("plain", plain_llm), ("spec", spec_llm)]
    if args.fixed_k:
        fixed_config = {**spec_config, "num_speculative_tokens": args.fixed_k}
        fixed_llm = LLM(args.model, **common, speculative_config=fixed_config)
        gate = fixed_llm.llm_engine.drafter.gate
        if gate is not None and not args.no_adaptive:
            gate.length = lambda state, k: k  # pauses only, as before the length rule
        else:
            fixed_llm.llm_engine.drafter.gate = None
        engines.append(("fixed", fixed_llm))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    tokenizer = plain_llm.get_tokenizer()
    cells = [(w, b) for w in ("copy", "plain") for b in map(int, args.batches.split(","))]
    prompts = {
        name: [tokenizer.encode(p) for p in texts] for name, texts in (("copy", COPY), ("plain", PLAIN))
    }
    rates: dict[tuple, dict[str, list[float]]] = {
        c: {"plain": [], "spec": [], "fixed": [], "llama": [], "llama_lookup": []} for c in cells
    }
    llama = None
    if args.llamacpp:
        threads = args.threads or torch.get_num_threads()
        llama = LlamaCpp(args.llamacpp_python, args.llamacpp, threads, args.llamacpp_k, args.lookup_max)
    agree = [0, 0]  # batch-1 calls where llama.cpp's greedy tokens equal ours, calls
    acceptance: dict[tuple, dict[str, list[int]]] = {c: {"spec": [0, 0], "fixed": [0, 0]} for c in cells}
    # per cell and engine: tokens, steps
    steps: dict[tuple, dict[str, list[int]]] = {c: {n: [0, 0] for n, _ in engines} for c in cells}
    mismatches = 0
    for r in range(args.rounds):
        for cell in cells:
            work, batch = cell
            ps = prompts[work][:batch] if batch > 1 else [prompts[work][r % len(prompts[work])]]
            order = engines[r % len(engines) :] + engines[: r % len(engines)]  # each goes first in turn
            if r // len(engines) % 2:
                order.reverse()
            outs = {}
            for name, llm in order:
                before = dict(llm.llm_engine.stats())
                elapsed, tokens, outs[name] = timed(llm, ps, params)
                rates[cell][name].append(tokens / elapsed)
                steps[cell][name][0] += tokens
                steps[cell][name][1] += llm.llm_engine.stats()["steps"] - before["steps"]
                if name != "plain":
                    after = llm.llm_engine.stats()
                    acceptance[cell][name][0] += (
                        after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
                    )
                    acceptance[cell][name][1] += (
                        after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
                    )
            mismatches += sum(outs["plain"] != outs[name] for name in outs if name != "plain")
            if llama is not None and batch == 1:
                runs = [False, True] if r % 2 else [True, False]
                for lookup in runs:
                    elapsed, tokens, got = llama.timed(ps[0], args.max_tokens, lookup)
                    rates[cell]["llama_lookup" if lookup else "llama"].append(tokens / elapsed)
                    agree[0] += got == list(outs["plain"][0])
                    agree[1] += 1
    if llama is not None:
        llama.close()
    load = os.getloadavg()
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} cores; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print(
        f"model: {args.model or 'the embedded default model'}; n-gram {spec_config}; "
        f"adaptive={'off' if args.no_adaptive else 'on'}; {'CPU' if args.cpu_time else 'wall'} time; "
        f"{args.rounds} rounds of {args.max_tokens} tokens"
    )
    if llama is not None:
        print(
            f"llama.cpp: {args.llamacpp}, prompt lookup k={args.llamacpp_k}, max_ngram_size={args.lookup_max}"
        )
    fixed = args.fixed_k is not None
    print(
        f"{'workload':<8} {'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} {'accepted':>16}"
        f" {'tok/step':>8}"
        + (f" {'fixed k=' + str(args.fixed_k):>10} {'accepted':>16} {'tok/step':>8}" if fixed else "")
        + (f" {'llama.cpp':>10} {'lookup':>8} {'spec/lookup':>11}" if llama is not None else "")
    )
    results = []
    for cell in cells:
        p, s = rates[cell]["plain"], rates[cell]["spec"]
        ratio = statistics.median(b / a for a, b in zip(p, s, strict=True))
        acc, drafted = acceptance[cell]["spec"]
        rate = f"{acc}/{drafted}" + (f" ({acc / drafted:.2f})" if drafted else "")
        per_step = {n: t / max(1, k) for n, (t, k) in steps[cell].items()}
        extra, vs, fixed_ratio = "", None, None
        if fixed:
            fixed_ratio = statistics.median(b / a for a, b in zip(p, rates[cell]["fixed"], strict=True))
            fa, fd = acceptance[cell]["fixed"]
            frate = f"{fa}/{fd}" + (f" ({fa / fd:.2f})" if fd else "")
            extra = f" {fixed_ratio:>9.2f}x {frate:>16} {per_step['fixed']:>8.2f}"
        if llama is not None and rates[cell]["llama"]:
            lp, ll = rates[cell]["llama"], rates[cell]["llama_lookup"]
            vs = statistics.median(b / a for a, b in zip(ll, s, strict=True))
            extra += f" {statistics.median(lp):>10.1f} {statistics.median(ll):>8.1f} {vs:>10.2f}x"
        print(
            f"{cell[0]:<8} {cell[1]:>5} {statistics.median(p):>12.1f} {statistics.median(s):>11.1f} "
            f"{ratio:>5.2f}x {rate:>16} {per_step['spec']:>8.2f}{extra}"
        )
        results.append(
            dict(
                workload=cell[0],
                batch=cell[1],
                plain_tok_s=statistics.median(p),
                spec_tok_s=statistics.median(s),
                ratio=ratio,
                accepted=acc,
                drafted=drafted,
                tokens_per_step=per_step,
                fixed_ratio=fixed_ratio,
                llamacpp_tok_s=statistics.median(rates[cell]["llama"]) if vs is not None else None,
                llamacpp_lookup_tok_s=statistics.median(rates[cell]["llama_lookup"])
                if vs is not None
                else None,
                spec_over_llamacpp_lookup=vs,
            )
        )
    print(
        f"greedy outputs differing from the plain engine's: {mismatches} of "
        f"{args.rounds * len(cells) * (len(engines) - 1)} calls"
    )
    if llama is not None:
        print(f"llama.cpp's greedy tokens equal ours in {agree[0]} of {agree[1]} batch-1 calls")
    costs = None
    if args.row_costs:
        costs = row_costs(plain_llm, spec_llm, prompts["copy"], args.max_tokens, args.rounds)
        print("verify step cost by rows (1 + draft length), over a one-row step (the plain engine's):")
        print("  " + "  ".join(f"{rows}: {c:.2f}x" for rows, c in costs.items()))
    if args.json:
        with open(args.json, "w") as f:
            dump = {
                "cpu": cpu_name(),
                "load": load,
                "args": vars(args),
                "results": results,
                "row_costs": costs,
            }
            json.dump(dump, f, indent=1)


if __name__ == "__main__":
    main()
