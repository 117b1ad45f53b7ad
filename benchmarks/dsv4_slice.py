"""Three DeepSeek-V4-Flash layers at full attention width against transformers: prefill and decode.

The slice: deepseek-ai/DeepSeek-V4-Flash's published config (hidden 4096; 64 query heads of 512
over one shared K=V head; q LoRA 1024; 8 output groups of 1024; hc_mult 4; window 128; indexer
64 x 128, top 512) with 3 layers, one of each attention kind (sliding, compressed sparse at 4,
heavily compressed at 128; the first hash-routed), 8 experts of width 512 instead of 256 of 2048,
and the test tokenizer's 512-token vocabulary; random bf16 weights from transformers' class,
cached (~0.7 GB).

Both engines are loaded once and timed in turns (`--rounds`, interleaved: the machine's load moves
both alike): prefill = time to the first token of one `--prompt`-token prompt; decode = tokens per
second over `--new` more tokens (greedy, batch 1). Read the ratios.

    .venv/bin/python benchmarks/dsv4_slice.py --prompt 1024 --new 32 --rounds 3
    .venv/bin/python benchmarks/dsv4_slice.py --quick   # < 5 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from checkpoint_cache import cached_checkpoint  # noqa: E402

from expertmesh import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPE = {
    "num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 0], "num_hash_layers": 1,
    "n_routed_experts": 8, "moe_intermediate_size": 512, "vocab_size": 512, "bos_token_id": 1,
    "eos_token_id": 2, "torch_dtype": "bfloat16",
}  # fmt: skip


def make_model(cache_dir: str) -> str:
    config = json.loads((ROOT / "tests/real_configs/2026/deepseek-v4-flash.json").read_text())
    config.pop("quantization_config")  # random bf16 weights
    config.update(SHAPE)
    path = Path(cache_dir) / "deepseek-v4-flash-slice"
    return cached_checkpoint(path, config, "DeepseekV4ForCausalLM", torch.bfloat16, tokenizer=True)


class Ours:
    name = "expertmesh"

    def __init__(self, path: str, length: int) -> None:
        self.llm = LLM(
            path, dtype="bfloat16", max_model_len=length, max_num_seqs=4, enable_prefix_caching=False
        )

    def run(self, prompt: list[int], n: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        return time.perf_counter() - t0


class Theirs:
    name = "transformers"

    def __init__(self, path: str, length: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()

    def run(self, prompt: list[int], n: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            self.model.generate(
                torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="--prompt 128 --new 4 --rounds 2")
    ap.add_argument("--cache", default="/tmp/expertmesh-bench")
    args = ap.parse_args()
    if args.quick:
        args.prompt, args.new, args.rounds = 128, 4, 2
    path = make_model(args.cache)
    prompt = torch.randint(3, 512, (args.prompt,), generator=torch.Generator().manual_seed(2)).tolist()
    engines = [Ours(path, args.prompt + args.new + 8), Theirs(path, 0)]
    for e in engines:
        e.run(prompt[:16], 2)  # warm-up
    prefill: dict[str, list[float]] = {e.name: [] for e in engines}
    decode: dict[str, list[float]] = {e.name: [] for e in engines}
    for _ in range(args.rounds):
        for e in engines:  # interleaved
            first = e.run(prompt, 1)
            prefill[e.name].append(first)
            decode[e.name].append(args.new / max(e.run(prompt, args.new + 1) - first, 1e-9))
    p = {k: statistics.median(v) for k, v in prefill.items()}
    d = {k: statistics.median(v) for k, v in decode.items()}
    for name in p:
        print(f"{name:12s} prefill {args.prompt} tokens: {p[name]:.3f} s; decode {d[name]:.2f} tokens/s "
              f"(bf16, batch 1, median of {args.rounds}, {torch.get_num_threads()} threads)")  # fmt: skip
    ratios = p["expertmesh"] / p["transformers"], d["expertmesh"] / d["transformers"]
    print(f"expertmesh / transformers: prefill time {ratios[0]:.2f}x, decode speed {ratios[1]:.2f}x; "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
