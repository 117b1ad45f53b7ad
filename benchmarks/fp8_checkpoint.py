"""An fp8 block-scaled checkpoint (DeepSeek-V3's format) run two ways: dequantized to the model dtype
at load (`quantization="dequantize"`) and held as fp8 (the default: the e4m3 bytes and block scales
as stored, run by gemm_q / moe_q). Batch 1 and 32 decode tokens/s and tokens per CPU second, the two
ways alternated (ABAB) and the median taken, since the machine may be shared; with --prefill-lens,
also the prefill of 32 prompts of each length (one new token). The engines cache no prefixes, so
every repeat computes its prompts (a batch-32 run includes the 32 prompts' prefill).

The checkpoint is the benchmarks' small MoE (make_small_moe.py) with every linear weight but the
router and the head written as e4m3 with a float32 scale per 128 x 128 block (amax / 448).

    .venv/bin/python benchmarks/fp8_checkpoint.py --threads 1 --repeats 3
    .venv/bin/python benchmarks/fp8_checkpoint.py --threads 1 --repeats 3 --dtype bfloat16 \
        --prefill-lens 16,64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
from make_small_moe import DEFAULT_CACHE, make_small_moe
from safetensors.torch import load_file, save_file

from expertmesh import LLM, SamplingParams
from expertmesh.layers.quantization.fp8 import quantize_blocks

BLOCK = 128


def to_fp8(src: str, dst: Path) -> str:
    if (dst / "READY").exists():
        return str(dst)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        out = {}
        for key, t in load_file(f).items():
            quantize = key.endswith(".weight") and t.dim() == 2 and "embed" not in key and "norm" not in key
            if quantize and not key.endswith((".gate.weight", "lm_head.weight")):
                out[key], out[key + "_scale_inv"] = quantize_blocks(t, (BLOCK, BLOCK))
            else:
                out[key] = t
        save_file({k: v.contiguous() for k, v in out.items()}, str(f), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    (dst / "READY").write_text("1")
    return str(dst)


def _decode(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """(tokens/s, tokens per CPU second) of one greedy generate of `batch` prompts."""
    prompts = [
        {"prompt_token_ids": [(7 * b + j) % 3000 + 1 for j in range(prompt_len)]} for b in range(batch)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.process_time()
    llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return batch * new_tokens / wall, batch * new_tokens / cpu


def parse_args(doc: str) -> argparse.Namespace:
    """The options of a held-against-dequantized benchmark (this one and mxfp4_checkpoint.py)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill-lens", default="", help="prompt lengths whose 32-prompt prefill is timed too")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE)
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"],
        help="the model dtype both runs load in (bfloat16: held codes times bf16 activations, on bf16 pairs)",
    )  # fmt: skip
    args = ap.parse_args()
    args.prefill_lens = [int(n) for n in args.prefill_lens.split(",") if n]
    torch.set_num_threads(args.threads)
    os.makedirs(args.cache_dir, exist_ok=True)
    return args


# Every repeat computes its prompts: no prefix cache (it would serve the repeats' prompts)
ENGINE = {"max_model_len": 256, "enable_prefix_caching": False}


def _alternated(runs: dict[str, LLM], repeats: int, *shape: int) -> dict[str, list[float]]:
    """Medians of _decode(llm, *shape) over `repeats` rounds of the runs in turn (ABAB)."""
    results: dict[str, list] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, llm in runs.items():
            results[name].append(_decode(llm, *shape))
    return {n: [statistics.median(x[k] for x in r) for k in range(len(r[0]))] for n, r in results.items()}


def compare(runs: dict[str, LLM], args: argparse.Namespace) -> None:
    """Two runs (dequantized, then held) alternated ABAB per batch size; medians and their ratio."""
    print(f"{'run':<20} {'batch':>5} {'tok/s':>8} {'tok/CPU-s':>10}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        med = _alternated(runs, args.repeats, batch, args.prompt_len, args.new_tokens)
        for name, (tps, cps) in med.items():
            print(f"{name:<20} {batch:>5} {tps:>8.1f} {cps:>10.1f}")
        a, b = med.values()
        print(f"{'held / dequantized':<20} {batch:>5} {b[0] / a[0]:>8.2f} {b[1] / a[1]:>10.2f}")
    for n in args.prefill_lens:
        med = _alternated(runs, args.repeats, 32, n, 1)  # one new token: the prefill and one step
        for name, (tps, cps) in med.items():
            print(f"{name:<20} prefill 32 x {n}: {32 / tps * 1e3:8.1f} ms, {32 / cps * 1e3:8.1f} CPU ms")
        a, b = med.values()
        ratio = f"{b[0] / a[0]:.2f}x, {b[1] / a[1]:.2f}x per CPU second"
        print(f"{'held / dequantized':<20} prefill 32 x {n}: {ratio}")


def main() -> None:
    args = parse_args(__doc__)
    path = to_fp8(make_small_moe(args.cache_dir), Path(args.cache_dir) / "small-moe-fp8-128")
    compare(
        {
            f"dequantized ({args.dtype})": LLM(path, dtype=args.dtype, quantization="dequantize", **ENGINE),
            "held as fp8": LLM(path, dtype=args.dtype, **ENGINE),
        },
        args,
    )


if __name__ == "__main__":
    main()
