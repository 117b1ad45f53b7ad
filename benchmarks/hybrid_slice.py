"""Prefill and decode of a Qwen3.5-35B-A3B-shaped slice: expertmesh against transformers.

Four layers of Qwen/Qwen3.5-35B-A3B's published text config at full width (hidden 2048; three
Gated DeltaNet layers with 16 key / 32 value heads of 128, one gated attention layer with 16 query
/ 2 KV heads of 256; MoE of expert width 512, top-8, with the gated shared expert), with 64
experts instead of 256 (memory: the slice stays ~1.6 GB in bf16) and the test tokenizer's 512-token
vocabulary. Random weights from transformers' class, cached. One prompt of `--prompt` tokens:
prefill = time to the first token; decode = tokens per second over `--new` more tokens (greedy,
batch 1). Both engines run in this process with the same torch threads.

    .venv/bin/python benchmarks/hybrid_slice.py --prompt 512 --new 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from expertmesh import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPE = {"num_hidden_layers": 4, "num_experts": 64, "vocab_size": 512, "dtype": "bfloat16",
         "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip


def make_model(cache_dir: str) -> str:
    path = Path(cache_dir) / "qwen3.5-35b-a3b-slice"
    text = json.loads((ROOT / "tests/real_configs/2026/qwen3.5-35b-a3b.json").read_text())["text_config"]
    config = {**text, **SHAPE, "layer_types": text["layer_types"][:4],
              "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text"}  # fmt: skip
    marker = path / "READY"
    if marker.exists() and json.loads(marker.read_text()) == config:
        return str(path)
    from transformers import AutoConfig, Qwen3_5MoeForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import train_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM._from_config(AutoConfig.from_pretrained(path)).to(torch.bfloat16).eval()
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config))
    train_tokenizer(str(path))
    marker.write_text(json.dumps(config))
    return str(path)


def ours(path: str, prompt: list[int], new: int) -> tuple[float, float]:
    llm = LLM(path, dtype="bfloat16", max_model_len=len(prompt) + new + 8, max_num_seqs=4)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt[:16]}], one, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    many = SamplingParams(temperature=0.0, max_tokens=new + 1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], many, use_tqdm=False)
    return prefill, new / (time.perf_counter() - t0 - prefill)


def theirs(path: str, prompt: list[int], new: int) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompt])

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    gen(1)  # warm-up
    prefill = gen(1)
    return prefill, new / (gen(new + 1) - prefill)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--cache", default="/tmp/expertmesh-bench")
    args = ap.parse_args()
    path = make_model(args.cache)
    prompt = torch.randint(3, 512, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    for name, fn in (("expertmesh", ours), ("transformers", theirs)):
        prefill, tps = fn(path, prompt, args.new)
        print(f"{name:12s} prefill {args.prompt} tokens: {prefill:.3f} s; decode: {tps:.2f} tokens/s "
              f"(bf16, batch 1, {torch.get_num_threads()} threads)")  # fmt: skip


if __name__ == "__main__":
    main()
