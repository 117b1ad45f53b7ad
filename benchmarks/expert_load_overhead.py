"""What counting the expert load costs: decode with the counters attached against detached.

One process on one thread, the embedded default model (or --model), greedy decode of a batch;
rounds alternate counting on and off (ABAB) and the script prints each side's median CPU seconds
(this process's, so other jobs on a shared machine disturb it less than wall time) and their
ratio, and the cost of the counter alone (one index_add of n x top_k pairs) per layer call.

    .venv/bin/python benchmarks/expert_load_overhead.py --rounds 8 --batch 1 --max-tokens 32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from expertmesh import LLM, SamplingParams


def _generate(llm: LLM, batch: int, max_tokens: int) -> float:
    prompts = [{"prompt_token_ids": [5 + i, 17, 42, 99]} for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.process_time()
    llm.generate(prompts, params, use_tqdm=False)
    return time.process_time() - start


def _counter_alone(slots: int, pairs: int, reps: int = 20000) -> float:
    """Seconds per index_add of `pairs` ids into a [slots] int64 row (what a layer call adds)."""
    row, ids = torch.zeros(slots, dtype=torch.int64), torch.randint(0, slots, (pairs,))
    start = time.process_time()
    for _ in range(reps):
        row.index_add_(0, ids, ids.new_ones(1).expand(pairs))
    return (time.process_time() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=8, help="rounds per side (ABAB)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(args.model, kv_cache_memory_bytes=1 << 26, max_model_len=256)
    load = llm.llm_engine.expert_load
    views = [m.load for m in load.moes]
    _generate(llm, args.batch, args.max_tokens)  # warm-up
    times: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(2 * args.rounds):
        side = "on" if r % 2 == 0 else "off"
        for moe, view in zip(load.moes, views, strict=True):
            moe.load = view if side == "on" else None
        times[side].append(_generate(llm, args.batch, args.max_tokens))
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    k, slots = load.top_k, load.counts.shape[1]
    print(
        f"{len(load.moes)} MoE layers, batch {args.batch}, {args.max_tokens} tokens, "
        f"{args.rounds} rounds a side"
    )
    print(f"median CPU seconds: counting {on:.4f}, not counting {off:.4f}, ratio {on / off:.3f}")
    for n in (1, 32, 512):
        print(
            f"counter alone, {n} tokens x top-{k}: {_counter_alone(slots, n * k) * 1e6:.1f} us per layer call"
        )


if __name__ == "__main__":
    main()
