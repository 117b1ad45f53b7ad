"""Decode with DeepSeek Sparse Attention: the indexer's top-k in the latent space, against the
same selection expanded, and against dense latent attention.

The model has DeepSeek-V3.2's attention blocks at a smaller width (hidden 2048, 16 heads,
q_lora_rank 768, kv_lora_rank 512, qk_nope 128 + qk_rope 64, v 128; the indexer's published 64
heads x 128 and index_topk 2048) over 4 layers, with small MLPs and experts so that attention
dominates; random weights from transformers' own class, cached. Each context length gets one
engine: `--batch` prompts are prefilled, then decode steps rotate over the modes on the same cache
(A B C A B C ..., so a load change on the machine hits all alike); the median step time of each
gives its tokens per second.

- sparse: the engine's path (index scores over the context, then absorbed attention over the
  kept rows alone, gathered by slot);
- expanded: the same selection, the whole cached context expanded through kv_b_proj and masked;
- dense: the indexer switched off for the step (absorbed attention over every row, our CPU
  kernel's path); the index keys of those steps are not cached, so its tokens are not DSA's (a
  timing, not a correctness, comparison).

The indexer's share: the time each step spends in the indexer (its projections, the index scores
over the cached keys, the sum over TP and the top-k: `LightningIndexer.step` and
`IndexerStep.select`, timed around the calls) over the step's time, in the sparse mode. `--tp 1 2`
runs one process and TP2 (two spawned gloo ranks, their heads split; rank 0's times), in rounds
that alternate the layouts (`--rounds`), each round a fresh engine per layout.

    .venv/bin/python benchmarks/dsa_decode.py --contexts 1024 4096 --steps 4     # quick (< 5 min)
    .venv/bin/python benchmarks/dsa_decode.py --quick --tp 1 2                   # share, 1 vs TP2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from checkpoint_cache import cached_checkpoint  # noqa: E402

from expertmesh import LLM, SamplingParams  # noqa: E402
from expertmesh.layers import sparse_indexer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPE = {  # on top of tests/real_configs/2026/deepseek-v3.2.json
    "num_hidden_layers": 4, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
    "q_lora_rank": 768, "intermediate_size": 1024, "moe_intermediate_size": 256, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "vocab_size": 3072, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    "max_position_embeddings": 16384,
}  # fmt: skip
SEED = 0
MODES = ("sparse", "expanded", "dense")


def make_model(cache_dir: str) -> str:
    """The checkpoint (config.json + safetensors, no tokenizer), built once and cached."""
    config = json.loads((ROOT / "tests" / "real_configs" / "2026" / "deepseek-v3.2.json").read_text())
    config.pop("quantization_config")
    config.update(SHAPE)
    path = Path(cache_dir) / "deepseek-v3.2-attention"
    return cached_checkpoint(path, config, "DeepseekV32ForCausalLM", torch.float32, SEED)


class IndexerClock:
    """Seconds spent in the indexer's calls (projections and selection) since the last `take`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.saved = (sparse_indexer.LightningIndexer.step, sparse_indexer.IndexerStep.select)
        for cls, name in ((sparse_indexer.LightningIndexer, "step"), (sparse_indexer.IndexerStep, "select")):
            setattr(cls, name, self._timed(getattr(cls, name)))

    def _timed(self, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return call

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def close(self) -> None:
        sparse_indexer.LightningIndexer.step, sparse_indexer.IndexerStep.select = self.saved


def measure(model: str, context: int, batch: int, steps: int, modes=MODES, **layout) -> dict:
    """Per mode at `context` tokens: (tokens per second, the indexer's median share of a step)."""
    length = context + len(modes) * (steps + 1) + 4
    # KV budget: 4 layers x (576 latent + 128 index-key values) x 4 bytes a token, twice over.
    llm = LLM(
        model=model, max_model_len=length, max_num_seqs=batch, max_num_batched_tokens=batch * length,
        kv_cache_memory_bytes=batch * length * 4 * 704 * 4 * 2, **layout,
    )  # fmt: skip
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=length - context - 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(3, 3072) for _ in range(context)], params)
    engine.step()  # the prefill
    mlas = [layer.self_attn for layer in engine.runner.model.model.layers.values()]
    indexers = [m.indexer for m in mlas]
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    shares: dict[str, list[float]] = {mode: [] for mode in modes}
    clock = IndexerClock()
    try:
        for step in range(len(modes) * (steps + 1)):
            mode = modes[step % len(modes)]
            for m, indexer in zip(mlas, indexers, strict=True):
                m.indexer = None if mode == "dense" else indexer
                m.attn.absorbed = mode != "expanded"
            clock.take()
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            if step >= len(modes):  # one warm-up step of each
                times[mode].append(seconds)
                shares[mode].append(clock.take() / seconds)
    finally:
        clock.close()
    return {
        mode: (batch / statistics.median(t), statistics.median(shares[mode])) for mode, t in times.items()
    }


def _tp_rank(rank: int, world: int, model: str, context: int, batch: int, steps: int, modes) -> dict:
    torch.set_num_threads(1)
    return measure(
        model, context, batch, steps, modes, tensor_parallel_size=world,
        distributed_executor_backend="external_launcher",
    )  # fmt: skip


def run_layout(tp: int, model: str, context: int, batch: int, steps: int, modes) -> dict:
    """One process (this one), or TP `tp` over spawned gloo ranks (rank 0's figures)."""
    if tp == 1:
        return measure(model, context, batch, steps, modes)
    from expertmesh.executor.spawn import run_spmd

    return run_spmd(_tp_rank, tp, model, context, batch, steps, modes, timeout=3600, gloo_timeout=600)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4, help="timed decode steps of each mode")
    ap.add_argument("--tp", type=int, nargs="+", default=[1], help="layouts: 1 (one process), 2 (TP2), ...")
    ap.add_argument("--rounds", type=int, default=1, help="rounds over the layouts (alternating)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--quick", action="store_true", help="context 4096, 3 steps, sparse and dense")
    ap.add_argument("--cache-dir", default="/tmp/expertmesh-bench")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.steps, args.modes = [4096], 3, ["sparse", "dense"]
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = tuple(args.modes)
    model = make_model(args.cache_dir)
    print(f"threads {torch.get_num_threads()} (TP ranks: 1 each), batch {args.batch}, float32, "
          f"{args.steps} steps of each mode, load average {os.getloadavg()}")  # fmt: skip
    head = " ".join(f"{m + ' tok/s':>15}" for m in modes)
    print(f"{'round':>5} {'tp':>3} {'context':>8} {head} {'indexer share':>14}")
    results: dict[tuple[int, int], list[dict]] = {}
    for r in range(args.rounds):
        for context in args.contexts:
            for tp in args.tp:
                got = run_layout(tp, model, context, args.batch, args.steps, modes)
                results.setdefault((tp, context), []).append(got)
                cells = " ".join(f"{got[m][0]:>15.2f}" for m in modes)
                share = got["sparse"][1] if "sparse" in got else float("nan")
                print(f"{r:>5} {tp:>3} {context:>8} {cells} {share:>13.1%}", flush=True)
    if "sparse" in modes and len(args.tp) > 1:
        print(f"medians over {args.rounds} round(s), load average {os.getloadavg()}")
        for context in args.contexts:
            base = statistics.median(g["sparse"][0] for g in results[args.tp[0], context])
            for tp in args.tp:
                got = results[tp, context]
                tok = statistics.median(g["sparse"][0] for g in got)
                share = statistics.median(g["sparse"][1] for g in got)
                print(f"  tp {tp} context {context}: sparse {tok:.2f} tok/s ({tok / base:.2f}x tp "
                      f"{args.tp[0]}), indexer {share:.1%} of a step")  # fmt: skip


if __name__ == "__main__":
    main()
