"""Decode with multi-head latent attention: the absorbed latent path against the expanded one.

The model has DeepSeek-V2-Lite's published attention (hidden 2048, 16 heads, kv_lora_rank 512,
qk_nope 128 + qk_rope 64, v 128, YaRN) over 4 layers, with small MLPs and experts (8 of width 256,
top-2, 2 shared) so that attention dominates; random weights from transformers' own class, cached.
Each context length gets one engine: `--batch` prompts of that length are prefilled, then decode
steps alternate between the two paths on the same cache (A B A B ..., so a load change on the
machine hits both alike), and the median step time of each gives its tokens per second.

- absorbed: attention in the latent space (q x W_UK against the cached 576-wide rows, out through
  W_UV), what the engine does;
- expanded: every step expands the whole cached context through kv_b_proj into per-head K and V
  (what transformers does with its latent cache).

    .venv/bin/python benchmarks/mla_decode.py --contexts 512 4096 --steps 6
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
SHAPE = {  # on top of tests/real_configs/deepseek-v2-lite.json
    "num_hidden_layers": 4, "intermediate_size": 1024, "moe_intermediate_size": 256,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "vocab_size": 3072,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}  # fmt: skip
SEED = 0


def make_model(cache_dir: str) -> str:
    """The checkpoint (config.json + safetensors, no tokenizer), built once and cached."""
    config = json.loads((ROOT / "tests" / "real_configs" / "deepseek-v2-lite.json").read_text())
    config.update(SHAPE)
    path = Path(cache_dir) / "deepseek-v2-lite-attention"
    return cached_checkpoint(path, config, "DeepseekV2ForCausalLM", torch.float32, SEED)


def measure(model: str, dtype: str, context: int, batch: int, steps: int) -> dict[str, float]:
    """Median decode-step time of each path at `context` tokens -> tokens per second."""
    length = context + 2 * steps + 4
    # KV budget: 4 layers x 576 latent values x 4 bytes a token, twice over (bf16 needs half).
    llm = LLM(
        model=model, dtype=dtype, max_model_len=length, max_num_seqs=batch,
        max_num_batched_tokens=batch * length, kv_cache_memory_bytes=batch * length * 4 * 576 * 4 * 2,
    )  # fmt: skip
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 3, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(3, 3072) for _ in range(context)], params)
    engine.step()  # the prefill
    layers = [layer.self_attn.attn for layer in engine.runner.model.model.layers.values()]
    times: dict[str, list[float]] = {"absorbed": [], "expanded": []}
    for step in range(2 * steps + 2):
        mode = "absorbed" if step % 2 == 0 else "expanded"
        for attn in layers:
            attn.absorbed = mode == "absorbed"
        start = time.perf_counter()
        engine.step()
        if step >= 2:  # one warm-up step of each
            times[mode].append(time.perf_counter() - start)
    return {mode: batch / statistics.median(t) for mode, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="timed decode steps of each path")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--cache-dir", default="/tmp/expertmesh-bench")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = make_model(args.cache_dir)
    threads = torch.get_num_threads()
    print(f"threads {threads}, batch {args.batch}, {args.dtype}, {args.steps} steps of each path")
    print(f"{'context':>8} {'absorbed tok/s':>15} {'expanded tok/s':>15} {'ratio':>7}")
    for context in args.contexts:
        r = measure(model, args.dtype, context, args.batch, args.steps)
        ratio = r["absorbed"] / r["expanded"]
        print(f"{context:>8} {r['absorbed']:>15.1f} {r['expanded']:>15.2f} {ratio:>6.1f}x", flush=True)


if __name__ == "__main__":
    main()
