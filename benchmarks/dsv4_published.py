"""DeepSeek-V4-Flash's published weight formats at full attention width: held compressed against
dequantized at load.

The slice of benchmarks/dsv4_slice.py (3 layers, one of each attention kind, hidden 4096, 8
experts of 512, bf16 random weights) rewritten in the published layout: attention (wq_a, wq_b,
wkv, wo_a, wo_b), the indexer's wq_b and the shared expert as block FP8 (e4m3, 128 x 128, ue8m0
scales stored as e8m0 under `X.scale`), the routed experts as FP4 ([O, I / 2] int8 of e2m1 pairs,
an e8m0 scale per 32 inputs), the rest as stored (docs/quantization.md). Two engines on the same
files, bf16: the default (FP8 / FP4 held as stored) and `quantization="dequantize"`. Printed:
resident weight bytes of each, then prefill time of one `--prompt`-token prompt and decode
tokens/s over `--new` tokens (greedy, batch 1), the two engines in turns (`--rounds`, interleaved:
the machine's load moves both alike; read the ratios), and whether their greedy tokens agree.

`--variants held,per-expert` compares instead the routed FP4 experts in one moe_q_ex call (the
default, its clamped SiLU in the kernel) against the per-expert path they took before (gemm_q per
expert, the clamped SiLU in torch), both held as stored.

    .venv/bin/python benchmarks/dsv4_published.py --prompt 256 --new 16 --rounds 3
    .venv/bin/python benchmarks/dsv4_published.py --quick   # --prompt 64 --new 4 --rounds 2
    .venv/bin/python benchmarks/dsv4_published.py --quick --variants held,per-expert
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from dsv4_slice import ROOT, make_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from expertmesh import LLM, SamplingParams  # noqa: E402
from expertmesh.layers.activation import ClampedGatedActivation  # noqa: E402
from expertmesh.layers.quantization.accounting import resident_weight_bytes  # noqa: E402
from expertmesh.layers.quantization.mxfp4 import E2M1  # noqa: E402

FP8 = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[123]\.weight$"
)
FP4 = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[O, I] -> e4m3 codes and e8m0 scales per 128 x 128 block (amax / 448 rounded up to 2^k)."""
    (o, i), b = w.shape, 128
    go, gi = -(-o // b), -(-i // b)
    padded = torch.zeros(go * b, gi * b)
    padded[:o, :i] = w.float()
    amax = padded.view(go, b, gi, b).abs().amax((1, 3)).clamp(min=2.0**-100)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    full = scale.repeat_interleave(b, 0)[:o].repeat_interleave(b, 1)[:, :i]
    return (w.float() / full).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def _fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[O, I] -> [O, I / 2] int8 of e2m1 pairs (the low nibble first), e8m0 scales per 32 inputs."""
    g = w.float().unflatten(-1, (-1, 32))
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=2.0**-100) / 6.0))
    scaled = g / torch.exp2(exp)[..., None]
    lut = torch.tensor(E2M1)
    codes = torch.stack([(row[..., None] - lut).abs().argmin(-1) for row in scaled]).to(torch.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).flatten(-2)
    return packed.view(torch.int8), torch.exp2(exp).to(torch.float8_e8m0fnu)


def make_published(src: str, cache: str) -> str:
    dst = Path(cache) / "deepseek-v4-flash-slice-published"
    if (dst / "READY").exists():
        return str(dst)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    out = {}
    for key, t in load_file(Path(src) / "model.safetensors").items():
        if FP8.search(key) or FP4.search(key):
            q, s = (_fp8 if FP8.search(key) else _fp4)(t)
            out[key], out[key.removesuffix(".weight") + ".scale"] = q, s
        else:
            out[key] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    published = json.loads((ROOT / "tests/real_configs/2026/deepseek-v4-flash.json").read_text())
    config["quantization_config"] = published["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    (dst / "READY").write_text("1")
    return str(dst)


@contextlib.contextmanager
def _per_expert():
    """Engines built inside run V4's clamped experts on the per-expert path (no fused kernel form)."""
    saved = ClampedGatedActivation.moe_q_form
    ClampedGatedActivation.moe_q_form = property(lambda self: None)
    try:
        yield
    finally:
        ClampedGatedActivation.moe_q_form = saved


def _engine(variant: str, path: str, common: dict) -> LLM:
    if variant == "dequantized":
        return LLM(path, quantization="dequantize", **common)
    with _per_expert() if variant == "per-expert" else contextlib.nullcontext():
        return LLM(path, **common)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="--prompt 64 --new 4 --rounds 2")
    ap.add_argument("--cache", default="/tmp/expertmesh-bench")
    ap.add_argument("--variants", default="held,dequantized", help="two of held, dequantized, per-expert")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if len(variants) != 2 or not set(variants) <= {"held", "dequantized", "per-expert"}:
        ap.error(f"--variants: two of held, dequantized, per-expert, not {args.variants!r}")
    if args.quick:
        args.prompt, args.new, args.rounds = 64, 4, 2
    path = make_published(make_model(args.cache), args.cache)
    prompt = torch.randint(3, 512, (args.prompt,), generator=torch.Generator().manual_seed(2)).tolist()
    common = dict(dtype="bfloat16", max_model_len=args.prompt + args.new + 8, enable_prefix_caching=False)
    engines = {v: _engine(v, path, common) for v in variants}
    tokens = {}
    for name, llm in engines.items():
        counts = resident_weight_bytes(llm.llm_engine.runner.model)
        total, quantized = counts["total"] / 1e6, counts["quantized"] / 1e6
        forms = sorted({type(m.experts_form).__name__ for m in llm.llm_engine.runner.model.modules()
                        if hasattr(m, "experts_form")})  # fmt: skip
        print(f"{name:12s} resident weights {total:.1f} MB ({quantized:.1f} MB quantized); experts {forms}")
        sp = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
        tokens[name] = (
            llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids
        )
    prefill: dict[str, list[float]] = {n: [] for n in engines}
    decode: dict[str, list[float]] = {n: [] for n in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():  # interleaved
            times = []
            for n in (1, args.new + 1):
                sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                t0 = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
                times.append(time.perf_counter() - t0)
            prefill[name].append(times[0])
            decode[name].append(args.new / max(times[1] - times[0], 1e-9))
    p = {k: statistics.median(v) for k, v in prefill.items()}
    d = {k: statistics.median(v) for k, v in decode.items()}
    for name in engines:
        print(f"{name:12s} prefill {args.prompt} tokens {p[name]:.3f} s; decode {d[name]:.2f} tokens/s "
              f"(median of {args.rounds}, {torch.get_num_threads()} threads)")  # fmt: skip
    a, b = variants
    same, load = tokens[a] == tokens[b], os.getloadavg()[0]
    print(f"{a} / {b}: prefill time {p[a] / p[b]:.2f}x, decode speed "
          f"{d[a] / d[b]:.2f}x; greedy tokens equal: {same}; load {load:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
