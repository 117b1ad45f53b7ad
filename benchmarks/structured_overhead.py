"""Decode throughput with every request of a batch grammar-constrained (structured outputs) against
the same batch unconstrained: the overhead of filling and applying the token masks.

Both runs generate exactly --new-tokens per request (unconstrained: ignore_eos; constrained: a JSON
schema too long to end sooner), so they do the same forward passes; tokens/s is generated tokens /
wall time of the generate call, the median of --repeats calls after one warm-up (which also puts
the compiled grammar in the cache).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/structured_overhead.py --batch 32 --new-tokens 64

--model embedded uses the embedded toy model (its forward is so small that the mask dominates);
the default is the small MoE of make_small_moe.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "name": {"type": "string", "maxLength": 8},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
        },
        "required": ["id", "name", "tags"],
        "additionalProperties": False,
    },
    "minItems": 200,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="'small' (make_small_moe.py), 'embedded', or a path")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()

    from expertmesh import LLM, SamplingParams
    from expertmesh.structured_outputs import StructuredOutputsParams

    if args.model == "small":
        from make_small_moe import make_small_moe

        path = make_small_moe()
    else:
        path = None if args.model == "embedded" else args.model
    llm = LLM(path, max_model_len=512, kv_cache_memory_bytes=1 << 28, seed=0)
    tok = llm.get_tokenizer()
    words = "the of and to in a is that for it as was with be by on not he this are".split()
    prompts = []
    for i in range(args.batch):
        ids = tok(" ".join(words[(i + j) % len(words)] for j in range(args.prompt_len)))["input_ids"]
        prompts.append({"prompt_token_ids": ids[: args.prompt_len]})
    common = dict(temperature=args.temperature, max_tokens=args.new_tokens, ignore_eos=True)
    runs = {
        "unconstrained": [SamplingParams(seed=i, **common) for i in range(args.batch)],
        "constrained": [
            SamplingParams(seed=i, structured_outputs=StructuredOutputsParams(json=SCHEMA), **common)
            for i in range(args.batch)
        ],
    }
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for params in runs.values():  # warm-up (and grammar compile)
        llm.generate(prompts, params, use_tqdm=False)
    for _ in range(args.repeats):
        for name, params in runs.items():  # interleaved, so drifting load hits both alike
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            assert tokens == args.batch * args.new_tokens, (name, tokens)
            rates[name].append(tokens / wall)
    base, con = (statistics.median(rates[k]) for k in ("unconstrained", "constrained"))
    print(f"model={args.model} batch={args.batch} prompt={args.prompt_len} new_tokens={args.new_tokens}")
    for name in runs:
        print(f"  {name:14s} {statistics.median(rates[name]):8.1f} tok/s  (runs: "
              + ", ".join(f"{r:.1f}" for r in rates[name]) + ")")  # fmt: skip
    print(f"  overhead       {100 * (1 - con / base):6.1f} % of unconstrained throughput")


if __name__ == "__main__":
    main()
