"""What chunked prefill and prefix caching buy, on the embedded model (float32), as ratios.

1. Prefix caching: N requests sharing a long system prefix (different short tails), generated in
   one call after a first request warmed the cache: wall time with caching off / on.
2. Chunked prefill: a request is decoding when a long prompt arrives; the longest gap between
   two of its tokens, unchunked / chunked (budget --budget).

Timings on a shared machine are noisy: each variant runs --reps times, alternating (ABAB), and
the medians are compared.

    .venv/bin/python benchmarks/scheduling.py [--prefix 900] [--requests 8] [--long 900] [--budget 128]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from expertmesh import LLM, SamplingParams


def prefix_run(llm: LLM, prefix: list[int], tails: list[list[int]]) -> float:
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prefix + [5]}], sp, use_tqdm=False)  # warms the cache (if on)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prefix + t} for t in tails], sp, use_tqdm=False)
    return time.perf_counter() - start


def longest_gap(llm: LLM, long_prompt: list[int]) -> float:
    """Seconds of the longest pause between two tokens of a decoding request while a long prompt
    prefills."""
    engine = llm.llm_engine
    engine.add_request("short", [7, 8, 9], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()
    engine.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=1))
    req, seen, last, gaps = engine.requests["short"], 0, time.perf_counter(), []
    while engine.has_unfinished_requests():
        engine.step()
        now, n = time.perf_counter(), len(req.seqs[0].output_token_ids)
        if n > seen:
            gaps.append(now - last)
            seen, last = n, now
    return max(gaps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=900)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--long", type=int, default=900)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(0)
    prefix = [rng.randrange(3, 2000) for _ in range(args.prefix)]
    tails = [[rng.randrange(3, 2000) for _ in range(20)] for _ in range(args.requests)]
    long_prompt = [rng.randrange(3, 2000) for _ in range(args.long)]
    common = dict(max_model_len=1024, kv_cache_memory_bytes=1 << 26, max_num_seqs=16)
    engines = {
        "prefix on": LLM(**common),
        "prefix off": LLM(enable_prefix_caching=False, **common),
        "chunked": LLM(max_num_batched_tokens=args.budget, enable_prefix_caching=False, **common),
        "unchunked": LLM(enable_chunked_prefill=False, enable_prefix_caching=False, **common),
    }
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(args.reps):
        for name in ("prefix off", "prefix on"):
            times[name].append(prefix_run(engines[name], prefix, tails))
        for name in ("unchunked", "chunked"):
            times[name].append(longest_gap(engines[name], long_prompt))
    med = {k: statistics.median(v) for k, v in times.items()}
    hits = engines["prefix on"].llm_engine.stats()
    print(f"prefix caching, {args.requests} requests sharing {args.prefix} tokens:")
    off, on = med["prefix off"], med["prefix on"]
    print(f"  off {off:.3f} s, on {on:.3f} s: {off / on:.2f}x")
    print(f"  hits {hits['prefix_cache_hits']} of {hits['prefix_cache_queries']} tokens queried")
    print(
        f"chunked prefill, longest gap between a decoding request's tokens while {args.long} tokens prefill:"
    )
    print(
        f"  unchunked {med['unchunked'] * 1e3:.1f} ms, chunked (budget {args.budget}) "
        f"{med['chunked'] * 1e3:.1f} ms: {med['unchunked'] / med['chunked']:.2f}x shorter"
    )


if __name__ == "__main__":
    main()
