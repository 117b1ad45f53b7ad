"""Build the benchmarks' "small" MoE with transformers' own Mixtral classes (random, seeded).

8 layers, hidden 512, 8 experts of FFN 1024, top-2, 8 query / 4 KV heads of dim 64,
vocab 3072. No tokenizer: every engine is given token-id prompts. The checkpoint is cached:
a directory with a READY file holding the same spec is reused as it is.

    .venv/bin/python benchmarks/make_small_moe.py --cache-dir /tmp/expertmesh-bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_CACHE = "/tmp/expertmesh-bench"
SPEC = {
    "vocab_size": 3072,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
SEED = 0
DIR_NAMES = {"float32": "small-moe-fp32", "bfloat16": "small-moe-bf16"}


def _ready(path: Path, dtype: str) -> bool:
    marker = path / "READY"
    return marker.exists() and json.loads(marker.read_text()) == {"spec": SPEC, "seed": SEED, "dtype": dtype}


def _build(dtype: str):
    """A random MixtralForCausalLM in eval mode; float32 init, then cast (same weights for both dtypes)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(SEED)
    model = MixtralForCausalLM(MixtralConfig(**SPEC)).eval()
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    model.config.dtype = getattr(torch, dtype)  # written to config.json, so dtype="auto" picks it
    return model


def make_small_moe(cache_dir: str = DEFAULT_CACHE, dtype: str = "float32") -> str:
    """Path of the cached checkpoint for `dtype` ("float32" or "bfloat16"); built when missing."""
    if dtype not in DIR_NAMES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DIR_NAMES)}")
    path = Path(cache_dir) / DIR_NAMES[dtype]
    if _ready(path, dtype):
        return str(path)
    # Build next to the target and rename, so a killed run never leaves a half-written model.
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _build(dtype).save_pretrained(tmp)
    (tmp / "READY").write_text(json.dumps({"spec": SPEC, "seed": SEED, "dtype": dtype}))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE)
    ap.add_argument("--dtype", default="float32,bfloat16", help="comma-separated: float32,bfloat16")
    args = ap.parse_args()
    for dtype in args.dtype.split(","):
        print(make_small_moe(args.cache_dir, dtype))


if __name__ == "__main__":
    main()
