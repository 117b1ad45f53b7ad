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

    .venv/bin/python benchmarks/dsa_decode.py --contexts 1024 4096 --steps 4     # quick (< 5 min)
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


def measure(model: str, context: int, batch: int, steps: int) -> dict[str, float]:
    """Median decode-step time of each mode at `context` tokens -> tokens per second."""
    length = context + len(MODES) * (steps + 1) + 4
    # KV budget: 4 layers x (576 latent + 128 index-key values) x 4 bytes a token, twice over.
    llm = LLM(
        model=model, max_model_len=length, max_num_seqs=batch, max_num_batched_tokens=batch * length,
        kv_cache_memory_bytes=batch * length * 4 * 704 * 4 * 2,
    )  # fmt: skip
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=length - context - 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(3, 3072) for _ in range(context)], params)
    engine.step()  # the prefill
    mlas = [layer.self_attn for layer in engine.runner.model.model.layers.values()]
    indexers = [m.indexer for m in mlas]
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for step in range(len(MODES) * (steps + 1)):
        mode = MODES[step % len(MODES)]
        for m, indexer in zip(mlas, indexers, strict=True):
            m.indexer = None if mode == "dense" else indexer
            m.attn.absorbed = mode != "expanded"
        start = time.perf_counter()
        engine.step()
        if step >= len(MODES):  # one warm-up step of each
            times[mode].append(time.perf_counter() - start)
    return {mode: batch / statistics.median(t) for mode, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4, help="timed decode steps of each mode")
    ap.add_argument("--cache-dir", default="/tmp/expertmesh-bench")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = make_model(args.cache_dir)
    print(f"threads {torch.get_num_threads()}, batch {args.batch}, float32, {args.steps} steps of each mode")
    print(f"{'context':>8} " + " ".join(f"{m + ' tok/s':>15}" for m in MODES) + f" {'sparse/expanded':>16}")
    for context in args.contexts:
        r = measure(model, context, args.batch, args.steps)
        cells = " ".join(f"{r[m]:>15.2f}" for m in MODES)
        print(f"{context:>8} {cells} {r['sparse'] / r['expanded']:>15.1f}x", flush=True)


if __name__ == "__main__":
    main()
