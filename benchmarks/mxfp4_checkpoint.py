"""A gpt-oss MXFP4 checkpoint run two ways: its experts held as fp4 (the default: e2m1 codes and a
float32 scale per 32 inputs, the routed experts in one moe_q call with their biases and the clamped SwiGLU)
and the same weights dequantized, stored as float32 (what loading did before fp4 was held). Batch 1
and 32 decode tokens/s and tokens per CPU second, the two alternated (ABAB), median taken, since
the machine may be shared.

The model: gpt-oss-20b's config (tests/real_configs) at the benchmarks' small MoE's size (hidden
512, 8 layers alternating sliding / full attention, 8 experts of 1,024, top-4), random weights,
its experts quantized to MXFP4 (scale 2^ceil(log2(amax / 6)) per 32, nearest e2m1 value).

    .venv/bin/python benchmarks/mxfp4_checkpoint.py --threads 1 --repeats 3
    .venv/bin/python benchmarks/mxfp4_checkpoint.py --threads 1 --repeats 3 --dtype bfloat16
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from fp8_checkpoint import ENGINE, compare, parse_args
from make_small_moe import _save_tokenizer
from safetensors.torch import load_file, save_file

from expertmesh import LLM
from expertmesh.layers.quantization.mxfp4 import E2M1, decode
from expertmesh.models.build import log_weight_bytes

ROOT = Path(__file__).resolve().parent.parent
SIZES = {
    "vocab_size": 3072, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "num_local_experts": 8,
    "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128, "max_position_embeddings": 2048,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}  # fmt: skip


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., R, C] -> blocks [..., R, C / 32, 16] (low nibble first) and e8m0 scales [..., R, C / 32]."""
    g = w.float().unflatten(-1, (-1, 32))
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=2.0**-126) / 6.0)).clamp(-127, 127)
    lut = torch.tensor(E2M1)
    codes = ((g / torch.exp2(exp)[..., None]).unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).to(torch.uint8)


PUBLISHED = ROOT / "tests/real_configs/gpt-oss-20b.json"


def _build(dst: Path) -> None:
    import transformers

    config = json.loads(PUBLISHED.read_text())
    config.pop("quantization_config")
    config.update(
        SIZES, layer_types=["sliding_attention", "full_attention"] * (SIZES["num_hidden_layers"] // 2)
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**config)).eval()
    model.save_pretrained(dst)
    _save_tokenizer(dst, SIZES["vocab_size"])


def make(cache_dir: str) -> tuple[str, str]:
    """(mxfp4 checkpoint, the same weights dequantized to float32)."""
    root = Path(cache_dir)
    held, plain = root / "gpt-oss-small-mxfp4", root / "gpt-oss-small-mxfp4-dequantized"
    if (held / "READY").exists() and (plain / "READY").exists():
        return str(held), str(plain)
    for d in (held, plain):
        shutil.rmtree(d, ignore_errors=True)
    _build(plain)
    shutil.copytree(plain, held)
    for f in plain.glob("*.safetensors"):
        q, dq = {}, {}
        for key, t in load_file(f).items():
            if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # [E, in, out]
                blocks, scales = _mxfp4(t.transpose(1, 2))
                q[key + "_blocks"], q[key + "_scales"] = blocks, scales
                dq[key] = decode(blocks, scales).transpose(1, 2).contiguous()
            else:
                q[key] = dq[key] = t
        save_file(q, str(held / f.name), metadata={"format": "pt"})
        save_file(dq, str(f), metadata={"format": "pt"})
    config = json.loads((held / "config.json").read_text())
    config["quantization_config"] = json.loads(PUBLISHED.read_text())["quantization_config"]
    (held / "config.json").write_text(json.dumps(config, indent=1))
    for d in (held, plain):
        (d / "READY").write_text("1")
    return str(held), str(plain)


def main() -> None:
    args = parse_args(__doc__)
    held, plain = make(args.cache_dir)
    runs = {
        f"dequantized ({args.dtype})": LLM(plain, dtype=args.dtype, **ENGINE),
        "held as fp4": LLM(held, dtype=args.dtype, **ENGINE),
    }
    for name, llm in runs.items():
        model = llm.llm_engine.runner.model
        counts = log_weight_bytes(model, model.cfg)
        total, fp4 = counts["total"] / 1e6, counts["quantized"] / 1e6
        print(f"{name:<20} resident weights {total:.1f} MB ({fp4:.1f} MB fp4)")
    compare(runs, args)


if __name__ == "__main__":
    main()
