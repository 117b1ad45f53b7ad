"""Quantized copies of tiny checkpoints, written the way the published ones are, by code written
here from the formats' descriptions (not by expertmesh's packer):

- `to_fp8(src, dst, block)`: every 2-D `*_proj.weight` (and DeepSeek's `kv_a_proj_with_mqa`) as
  e4m3 with a float32 `weight_scale_inv` per (block[0] x block[1]) block (amax / 448; a last
  partial block covers the remainder), the quantization_config DeepSeek-V3 publishes with that
  block size;
- `to_mxfp4(src, dst)`: gpt-oss's fused expert weights as `*_blocks` (e2m1 nibbles, low first)
  and `*_scales` (e8m0 per 32 inputs), with its published modules_to_not_convert;
- `fake_quantized(src, dst, kind, group)`: the same checkpoint, unquantized, with each weight
  expertmesh's online scheme would quantize replaced by its dequantized value (the reference the
  int formats are compared with: the same weights dequantized to fp32).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's FP8 layout written here in plain torch (not the engine's packer): each
    [bo, bi] block of w scaled by its largest |value| / 448 into e4m3; returns the e4m3 weight and
    the float32 `weight_scale_inv` [ceil(O / bo), ceil(I / bi)] that multiplies it back."""
    (o, i), (bo, bi) = w.shape, block
    rows, cols = -(-o // bo), -(-i // bi)
    w = w.float()
    scale = torch.empty(rows, cols)
    full = torch.empty(o, i)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi]
            s = torch.clamp(tile.abs().max() / E4M3_MAX, min=1e-12)
            scale[r, c] = s
            full[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi] = s
    return (w / full).to(torch.float8_e4m3fn), scale


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _rewrite(src: str, dst: str, convert, quantization_config: dict | None) -> None:
    """Copy src to dst with every safetensors file's tensors passed through convert(key, t) -> dict."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    index_path = os.path.join(dst, "model.safetensors.index.json")
    index = json.load(open(index_path)) if os.path.exists(index_path) else None
    for name in sorted(os.listdir(dst)):
        if not name.endswith(".safetensors"):
            continue
        out = {}
        for key, t in load_file(os.path.join(dst, name)).items():
            for new_key, new in convert(key, t).items():
                out[new_key] = new.contiguous()
                if index is not None:
                    index["weight_map"].pop(key, None)
                    index["weight_map"][new_key] = name
        save_file(out, os.path.join(dst, name), metadata={"format": "pt"})
    if index is not None:
        json.dump(index, open(index_path, "w"))
    config_path = os.path.join(dst, "config.json")
    config = json.load(open(config_path))
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    json.dump(config, open(config_path, "w"), indent=1)


def to_fp8(src: str, dst: str, block: tuple[int, int] = (128, 128)) -> str:
    def convert(key: str, t: torch.Tensor) -> dict:
        if key.endswith(("_proj.weight", "_proj_with_mqa.weight")) and t.dim() == 2:  # DeepSeek's kv_a too
            q, s = quantize_blocks(t, block)
            return {key: q, key + "_scale_inv": s}
        return {key: t}

    config = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    _rewrite(src, dst, convert, config)
    return dst


def mxfp4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., R, C] float (C a multiple of 32) -> (blocks [..., R, C / 32, 16] uint8, scales
    [..., R, C / 32])."""
    g = w.float().unflatten(-1, (-1, 32))  # [..., R, G, 32]
    amax = g.abs().amax(-1).clamp(min=2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # e2m1's largest value is 6
    scaled = g / torch.exp2(exp)[..., None]
    codes = (scaled[..., None] - E2M1).abs().argmin(-1).to(torch.uint8)  # nearest e2m1 value
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def to_mxfp4(src: str, dst: str) -> str:
    def convert(key: str, t: torch.Tensor) -> dict:
        if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # stored [E, in, out]
            blocks, scales = mxfp4_blocks(t.transpose(1, 2))
            return {key + "_blocks": blocks, key + "_scales": scales}
        return {key: t}

    config = {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    }
    _rewrite(src, dst, convert, config)
    return dst


def fake_quantize(w: torch.Tensor, kind: str, group: int) -> torch.Tensor:
    """[O, I] -> its dequantized value under expertmesh's online scheme `kind`, written from the
    scheme's description (layers/quantization/online.py): int8 symmetric per channel (amax / 127),
    int4 asymmetric per `group` inputs ((max - min) / 15 and a rounded zero point), fp8 e4m3 per
    channel (amax / 448)."""
    o, i = w.shape
    group = group or i
    out = torch.empty(o, i)
    for g0 in range(0, i, group):
        x = w[:, g0 : g0 + group].float()
        if kind == "int4":
            mn, mx = x.amin(1, keepdim=True).clamp(max=0), x.amax(1, keepdim=True).clamp(min=0)
            s = torch.where(mx > mn, (mx - mn) / 15, torch.ones_like(mx))
            z = torch.round(-mn / s).clamp(0, 15)
            out[:, g0 : g0 + group] = ((torch.round(x / s) + z).clamp(0, 15) - z) * s
        else:
            top = 127.0 if kind == "int8" else 448.0
            amax = x.abs().amax(1, keepdim=True)
            s = torch.where(amax > 0, amax / top, torch.ones_like(amax))
            if kind == "int8":
                out[:, g0 : g0 + group] = torch.round(x / s).clamp(-127, 127) * s
            else:
                out[:, g0 : g0 + group] = (x / s).to(torch.float8_e4m3fn).float() * s
    return out


def fake_quantized(src: str, dst: str, kind: str, group: int, quantized) -> str:
    """dst: src with each tensor for which quantized(key, t) holds replaced by its dequantized value
    (fused 3-D expert tensors per expert, as [out, in])."""

    def convert(key: str, t: torch.Tensor) -> dict:
        if not quantized(key, t):
            return {key: t}
        return {key: fake_quantize(t, kind, group).to(t.dtype)}

    _rewrite(src, dst, convert, None)
    return dst


def from_fp8(src: str, dst: str, block: tuple[int, int]) -> str:
    """An fp8 checkpoint (to_fp8) dequantized back to float32 by the format's definition."""
    files = [n for n in sorted(os.listdir(src)) if n.endswith(".safetensors")]
    scales = {}
    for name in files:
        scales.update(
            {k: t for k, t in load_file(os.path.join(src, name)).items() if k.endswith("_scale_inv")}
        )

    def convert(key: str, t: torch.Tensor) -> dict:
        if key.endswith("_scale_inv"):
            return {}
        if t.dtype != torch.float8_e4m3fn:
            return {key: t}
        (o, i), (bo, bi) = t.shape, block
        s = scales[key + "_scale_inv"].repeat_interleave(bo, 0)[:o].repeat_interleave(bi, 1)[:, :i]
        return {key: t.float() * s}

    _rewrite(src, dst, convert, None)
    config_path = os.path.join(dst, "config.json")
    config = json.load(open(config_path))
    config.pop("quantization_config")
    json.dump(config, open(config_path, "w"), indent=1)
    return dst


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _int4_groups(w: torch.Tensor, group: int, g_idx: torch.Tensor):
    """Asymmetric 4-bit per group of inputs: (q [I, O], zeros [G, O] in 1..15, fp16 scales [G, O]).
    Zeros of 0 are avoided: GPTQ v1 stores zero - 1 in 4 bits."""
    wt = w.float().t()  # [I, O]
    groups = int(g_idx.max()) + 1
    scales, zeros = torch.empty(groups, wt.shape[1]), torch.empty(groups, wt.shape[1])
    for g in range(groups):
        x = wt[g_idx == g]
        mn, mx = x.amin(0).clamp(max=0), x.amax(0).clamp(min=0)
        scales[g] = torch.where(mx > mn, (mx - mn) / 15, torch.ones_like(mx))
        zeros[g] = torch.round(-mn / scales[g]).clamp(1, 15)
    scales = scales.half()
    q = (torch.round(wt / scales.float()[g_idx]) + zeros[g_idx]).clamp(0, 15)
    return q.to(torch.int64), zeros.to(torch.int64), scales


def _pack(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """int64 4-bit values -> int32 words of 8 along dim (slot j holds element 8w + order[j])."""
    v = values.movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)[..., list(order)]
    words = sum(v[..., j] << (4 * j) for j in range(8))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim)


def to_int4_packed(
    src: str, dst: str, ref_dst: str, method: str, group: int, desc_act: bool | str = False
) -> str:
    """`method` "gptq" or "awq": every 2-D *_proj.weight packed as that format writes it; `ref_dst`
    gets the same weights dequantized to fp32 (the reference). desc_act: each input's group in a
    random order (groups of scattered inputs), one order for the projections that share an input
    (q / k / v, gate / up: GPTQ orders by the inputs' Hessian, which they share); "independent":
    an order of its own for every tensor; "per-rank": shared, and within each half of the inputs
    (a TP 2 rank of a row-parallel layer then holds whole groups)."""
    g = torch.Generator().manual_seed(11)
    dequantized, orders = {}, {}

    def convert(key: str, t: torch.Tensor) -> dict:
        if not (key.endswith("_proj.weight") and t.dim() == 2):
            return {key: t}
        in_f = t.shape[1]
        shared = key if desc_act == "independent" else re.sub(r"\.(q|k|v|gate|up)_proj\.", ".in.", key)
        if shared not in orders and desc_act == "per-rank":
            half = in_f // 2
            orders[shared] = torch.cat(
                [torch.randperm(half, generator=g), half + torch.randperm(half, generator=g)]
            )
        if shared not in orders:
            orders[shared] = torch.randperm(in_f, generator=g) if desc_act else torch.arange(in_f)
        order = orders[shared]
        g_idx = torch.empty(in_f, dtype=torch.int64)
        g_idx[order] = torch.arange(in_f) // group  # with desc_act, groups of scattered inputs
        q, z, s = _int4_groups(t, group, g_idx)
        dequantized[key] = ((q - z[g_idx]).float() * s.float()[g_idx]).t().contiguous()
        base = key[: -len(".weight")]
        if method == "gptq":
            out = {f"{base}.qweight": _pack(q, 0), f"{base}.qzeros": _pack(z - 1, 1), f"{base}.scales": s}
            out[f"{base}.g_idx"] = g_idx.to(torch.int32)
            return out
        return {
            f"{base}.qweight": _pack(q, 1, AWQ_ORDER),
            f"{base}.qzeros": _pack(z, 1, AWQ_ORDER),
            f"{base}.scales": s,
        }

    if method == "gptq":
        config = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": False}
    else:
        config = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
        }
    _rewrite(src, dst, convert, config)
    _rewrite(src, ref_dst, lambda k, t: {k: dequantized.get(k, t)}, None)
    return dst


def to_compressed_tensors(src: str, dst: str, ref_dst: str, groups: dict, fmt: str, ignore: list[str]) -> str:
    """llm-compressor's format, written with the compressed-tensors package: each 2-D linear weight
    a config group targets (`groups`: name -> (targets, weight QuantizationArgs[, input activation
    ones]); "Linear" targets every
    linear) and `ignore` does not name is quantized (scale and zero point from the package's
    calculate_qparams over its groups / channels / tensor) and compressed by the package's `fmt`
    compressor; `ref_dst` gets the package's own decompression of each, in fp32 (the reference)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from compressed_tensors.utils.match import match_name

    schemes = {
        n: QuantizationScheme(targets=g[0], weights=g[1], input_activations=(*g, None)[2])
        for n, g in groups.items()
    }
    compressor = BaseCompressor.get_value_from_registry(fmt)
    dequantized = {}

    def scheme_of(module: str):
        if "embed_tokens" in module or any(match_name(module, i) for i in ignore):
            return None
        return next(
            (s for s in schemes.values() if any(t == "Linear" or match_name(module, t) for t in s.targets)),
            None,
        )

    def convert(key: str, t: torch.Tensor) -> dict:
        module, _, part = key.rpartition(".")
        scheme = scheme_of(module) if part == "weight" and t.dim() == 2 else None
        if scheme is None:
            return {key: t}
        args, w = scheme.weights, t.float()
        size = {"group": args.group_size, "channel": w.shape[1]}.get(args.strategy, w.numel())
        blocks = w.reshape(w.shape[0] if args.strategy != "tensor" else 1, -1, size)
        scale, zero = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args)
        if args.strategy == "tensor":
            scale, zero = scale.reshape(1), zero.reshape(1)
        state = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme)
        dequantized[key] = compressor.decompress(state, scheme)["weight"].float()
        return {f"{module}.{name}": v for name, v in state.items()}

    config = QuantizationConfig(
        config_groups=schemes, format=fmt, ignore=ignore, quantization_status="compressed"
    ).to_dict()
    _rewrite(src, dst, convert, config)
    _rewrite(src, ref_dst, lambda k, t: {k: dequantized.get(k, t)}, None)
    return dst


def to_block_fp8(
    src: str,
    dst: str,
    ref_dst: str,
    quantization_config: dict,
    quantized,
    scale_dtype: torch.dtype = torch.float32,
    scale_suffix: str = "_scale_inv",
    fp4=None,
) -> str:
    """A publisher's block FP8 written here in plain torch: each tensor for which quantized(key, t)
    holds as e4m3 with one scale per block of quantization_config's `weight_block_size` (amax / 448;
    with `scale_fmt: ue8m0` rounded up to a power of two, as DeepSeek-V3.2 / V4 publish), stored as
    `scale_dtype` (float32; torch.float8_e8m0fnu: the exponent byte) under key + `scale_suffix`
    (DeepSeek-V4's files say `.scale` for `.weight`); `quantization_config` copied verbatim into the
    config (a text tower's own: into text_config). fp4(key, t): DeepSeek-V4's FP4 experts, as
    transformers' FP8 integration reads them (expert_dtype "fp4"): [O, I / 2] int8, two e2m1 values
    a byte, the low nibble first, and an e8m0 scale per 32 inputs of a row [O, I / 32] (amax / 6
    rounded up to a power of two, as mxfp4_blocks). `ref_dst` gets the same weights dequantized in
    fp32 (codes x scale: the reference)."""
    bo, bi = quantization_config["weight_block_size"]
    pow2 = quantization_config.get("scale_fmt") == "ue8m0"
    dequantized = {}

    def scale_key(key: str) -> str:
        return key.removesuffix(".weight") + ".scale" if scale_suffix == ".scale" else key + scale_suffix

    def convert(key: str, t: torch.Tensor) -> dict:
        if fp4 is not None and fp4(key, t):
            blocks, exps = mxfp4_blocks(t)  # [O, I / 32, 16], [O, I / 32]
            lut = E2M1[torch.stack((blocks & 15, blocks >> 4), -1).long()].flatten(-3)  # [O, I]
            dequantized[key] = lut * torch.exp2(exps.float() - 127).repeat_interleave(32, -1)
            packed = blocks.flatten(-2).view(torch.int8)
            return {key: packed, scale_key(key): exps.view(torch.float8_e8m0fnu)}
        if not quantized(key, t):
            return {key: t}
        (o, i), w = t.shape, t.float()
        go, gi = -(-o // bo), -(-i // bi)
        padded = torch.zeros(go * bo, gi * bi)
        padded[:o, :i] = w
        scale = (padded.view(go, bo, gi, bi).abs().amax((1, 3)) / E4M3_MAX).clamp(min=2.0**-126)
        if pow2:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        full = scale.repeat_interleave(bo, 0)[:o].repeat_interleave(bi, 1)[:, :i]
        q = (w / full).to(torch.float8_e4m3fn)
        dequantized[key] = q.float() * full
        return {key: q, scale_key(key): scale.to(scale_dtype)}

    _rewrite(src, dst, convert, None)
    config_path = os.path.join(dst, "config.json")
    config = json.load(open(config_path))
    (config.get("text_config") or config)["quantization_config"] = quantization_config
    json.dump(config, open(config_path, "w"), indent=1)
    _rewrite(src, ref_dst, lambda k, t: {k: dequantized.get(k, t)}, None)
    return dst
