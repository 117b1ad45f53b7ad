"""Build the benchmarks' MoE checkpoints with transformers' own classes (random, seeded).

Shapes (`--shape`):
- `small`: a Mixtral of 8 layers, hidden 512, 8 experts of FFN 1024, top-2, 8 query / 4 KV heads of
  dim 64, vocab 3072 (about 110 M parameters).
- `mixtral-448`: the serving benchmark's Mixtral (issue 40): 8 layers, hidden 448, 8 experts of FFN
  1,024, top-2, 7 query / 7 KV heads of dim 64, vocab 3072.
- `qwen3-30b-a3b`: a Qwen3-MoE with Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts of 768,
  top-8 renormalised, 32 query / 4 KV heads of dim 128, q/k RMSNorm) but 2 of its 48 layers and a
  vocabulary of 16,384 instead of 151,936, so the LM head weighs in a step about what it does in
  the whole model (a tenth of the bytes) rather than dominating two layers.
- `deepseek-v2-lite-qlora`: a DeepSeek-V2 with DeepSeek-V2-Lite's layer shape (MLA with a
  512-wide latent KV, 16 heads, 64 routed experts of 1,408 and 2 shared, top-6, YaRN), its first
  layer dense as published, then 2 MoE layers (3 of 27), vocabulary 16,384, and queries through a
  1,536-wide latent as in DeepSeek-V2 and V3 (llama.cpp reads a DeepSeek-V2 without `q_lora_rank`
  only when it has V2-Lite's 27 layers): about 1.3 B parameters.

Each checkpoint ships a byte-level BPE tokenizer (trained in seconds on text that comes with
CPython), which llama.cpp's GGUF converter needs; engines are still given token-id prompts. A
directory with a READY file holding the same spec is reused as it is.

    .venv/bin/python benchmarks/make_small_moe.py --cache-dir /tmp/expertmesh-bench
    .venv/bin/python benchmarks/make_small_moe.py --shape qwen3-30b-a3b --dtype bfloat16
    .venv/bin/python benchmarks/make_small_moe.py --shape deepseek-v2-lite-qlora --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_CACHE = "/tmp/expertmesh-bench"
SHAPES = {
    "small": (
        "MixtralForCausalLM",
        {
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
        },
    ),
    "mixtral-448": (
        "MixtralForCausalLM",
        {
            "vocab_size": 3072,
            "hidden_size": 448,
            "intermediate_size": 1024,
            "num_hidden_layers": 8,
            "num_attention_heads": 7,
            "num_key_value_heads": 7,
            "head_dim": 64,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 2048,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "tie_word_embeddings": False,
        },
    ),
    "qwen3-30b-a3b": (
        "Qwen3MoeForCausalLM",
        {
            "vocab_size": 16384,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 2,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "tie_word_embeddings": False,
        },
    ),
    # DeepSeek-V2-Lite's published layer shape (MLA with kv_lora_rank 512, 64 routed experts of 1,408
    # and 2 shared, top-6, softmax routing, YaRN), its first layer dense: 1 dense + 2 MoE layers;
    # queries through a 1,536 latent as DeepSeek-V2 and V3 (llama.cpp reads a DeepSeek-V2 without
    # q_lora_rank only when it has V2-Lite's 27 layers).
    "deepseek-v2-lite-qlora": (
        "DeepseekV2ForCausalLM",
        {
            "vocab_size": 16384,
            "hidden_size": 2048,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 64,
            "n_shared_experts": 2,
            "num_experts_per_tok": 6,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 4096,
            },
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 8192,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "tie_word_embeddings": False,
        },
    ),
}
TOKENIZER_TEXTS = 200  # pydoc topics the tokenizer is trained on
SEED = 0
DTYPE_SUFFIX = {"float32": "fp32", "bfloat16": "bf16"}


def dir_name(shape: str, dtype: str) -> str:
    return f"{'small-moe' if shape == 'small' else shape}-{DTYPE_SUFFIX[dtype]}"


def _marker(shape: str, dtype: str) -> dict:
    return {"spec": SHAPES[shape][1], "seed": SEED, "dtype": dtype, "tokenizer": TOKENIZER_TEXTS}


def _ready(path: Path, shape: str, dtype: str) -> bool:
    marker = path / "READY"
    return marker.exists() and json.loads(marker.read_text()) == _marker(shape, dtype)


def _build(shape: str, dtype: str):
    """The random model in eval mode. The small one is initialised in float32, then cast (the same
    weights in both dtypes); the Qwen3 shape (1.2 B parameters) is initialised in its dtype."""
    import torch
    import transformers

    arch, spec = SHAPES[shape]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    torch.manual_seed(SEED)
    td = getattr(torch, dtype)
    init_dtype = torch.float32 if shape in ("small", "mixtral-448") else td
    default = torch.get_default_dtype()
    torch.set_default_dtype(init_dtype)
    try:
        model = getattr(transformers, arch)(config_cls(**spec)).eval()
    finally:
        torch.set_default_dtype(default)
    model = model.to(td)
    model.config.dtype = td  # written to config.json, so dtype="auto" picks it
    return model


def _save_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE of at most `vocab_size` ids (llama.cpp's converter pads the rest)."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(topics.values())[:TOKENIZER_TEXTS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def make_small_moe(cache_dir: str = DEFAULT_CACHE, dtype: str = "float32", shape: str = "small") -> str:
    """Path of the cached checkpoint of `shape` in `dtype` ("float32" or "bfloat16"); built when missing."""
    if dtype not in DTYPE_SUFFIX:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DTYPE_SUFFIX)}")
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r}: choose one of {sorted(SHAPES)}")
    path = Path(cache_dir) / dir_name(shape, dtype)
    if _ready(path, shape, dtype):
        return str(path)
    # Build next to the target and rename, so a killed run never leaves a half-written model.
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _build(shape, dtype).save_pretrained(tmp)
    _save_tokenizer(tmp, SHAPES[shape][1]["vocab_size"])
    (tmp / "READY").write_text(json.dumps(_marker(shape, dtype)))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE)
    ap.add_argument("--dtype", default="float32,bfloat16", help="comma-separated: float32,bfloat16")
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    args = ap.parse_args()
    for dtype in args.dtype.split(","):
        print(make_small_moe(args.cache_dir, dtype, args.shape))


if __name__ == "__main__":
    main()
