"""Quantized codes as tensors, for the weights packed.py holds: each kind's gemm_q number, rounding
float rows to codes (int8, uint4, fp8; W8A8, W4A8) and decoding them, the panel layouts the CPU
kernels read (P panels of `lanes` output rows; W8A8's quads, W4A8's octs) and back, and W8A8's
dynamic activation quantization."""

from __future__ import annotations

import torch

from expertmesh.layers.quantization.mxfp4 import E2M1

# gemm_q's code kinds, a kind's number its index: weight-only int8, uint4, fp8 e4m3, fp4 e2m1; int8 and
# uint4 weights with activations quantized to int8 per row and group (W8A8, W4A8); uint4, int8, fp4 and
# fp8 weights with activations rounded to bf16, on bf16 pairs (cpu/csrc/quant_bf16.c). The one Python
# declaration (the weights' interface, which cpu/cpu_kernels.py imports): cpu/csrc/quant_kinds.h numbers
# them for C (tests/test_declared_interfaces.py checks they agree).
QUANT_KINDS = (
    "int8", "int4", "fp8", "fp4", "w8a8", "w4a8", "int4-bf16", "int8-bf16", "fp4-bf16", "fp8-bf16"
)  # fmt: skip

# A weight kind's gemm_q code (QUANT_KINDS numbers them, cpu/csrc/quant_kinds.h for C)
KINDS = {name: QUANT_KINDS.index(name) for name in ("int8", "int4", "fp8", "fp4", "w8a8", "w4a8")}
# uint4 / int8 / fp4 / fp8 codes (int4's / int8's / fp4's / fp8's) against activations rounded to
# bf16 (cpu/quantized.py product_kind)
INT4_BF16, INT8_BF16, FP4_BF16, FP8_BF16 = (
    QUANT_KINDS.index(f"{k}-bf16") for k in ("int4", "int8", "fp4", "fp8")
)
BF16_PAIRS = {"int4": INT4_BF16, "int8": INT8_BF16, "fp4": FP4_BF16, "fp8": FP8_BF16}
ACTIVATIONS_QUANTIZED = ("w8a8", "w4a8")  # the kernels quantize the inputs to int8 per row and group
NIBBLES = ("int4", "fp4")
FP8_MAX = 448.0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


ROUNDED_KINDS = ("int8", "int4", "fp8", "w8a8", "w4a8")


VALUES_AT_ONCE = (
    1 << 18
)  # values rounded per step: the float32 temporaries stay about 1 MB each (one-pass loading)


def quantize_rows(w: torch.Tensor, kind: str, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[O, I] float -> codes [O, I] uint8, scales and offsets [O, G] float32 (group 0: G = 1).
    Rows are rounded a block at a time (each row's codes depend on that row alone)."""
    if kind not in ROUNDED_KINDS:  # fp4 codes come from checkpoints (MXFP4) only
        raise ValueError(f"quantize_rows: no rounding to {kind!r} codes; it rounds to {list(ROUNDED_KINDS)}")
    out_f, in_f = w.shape
    step = max(1, VALUES_AT_ONCE // max(in_f, 1))
    if out_f <= step:
        return _quantize_rows(w, kind, group)
    g = cdiv(in_f, group or in_f)
    codes = torch.empty(out_f, in_f, dtype=torch.uint8)
    scales, offsets = torch.empty(out_f, g), torch.empty(out_f, g)
    for r in range(0, out_f, step):
        codes[r : r + step], scales[r : r + step], offsets[r : r + step] = _quantize_rows(
            w[r : r + step], kind, group
        )
    return codes, scales, offsets


def _quantize_rows(w: torch.Tensor, kind: str, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out_f, in_f = w.shape
    group = group or in_f
    g = cdiv(in_f, group)
    padded = torch.zeros(out_f, g * group, dtype=torch.float32)
    padded[:, :in_f] = w.float()
    blocks = padded.view(out_f, g, group)
    real = torch.arange(g * group).view(g, group) < in_f  # the padding of a partial last group is ignored
    if kind in ("int4", "w4a8"):
        mn = torch.where(real, blocks, torch.inf).amin(-1).clamp(max=0)
        mx = torch.where(real, blocks, -torch.inf).amax(-1).clamp(min=0)
        scale = torch.where(mx > mn, (mx - mn) / 15, torch.ones_like(mx))
        zero = torch.round(-mn / scale).clamp(0, 15)
        codes = (torch.round(blocks / scale[..., None]) + zero[..., None]).clamp(0, 15).to(torch.uint8)
        offset = -zero * scale
    else:  # int8 and w8a8 (int8 weights, int8 activations): symmetric
        amax = blocks.abs().amax(-1)
        top = FP8_MAX if kind == "fp8" else 127.0
        scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
        x = blocks / scale[..., None]
        if kind != "fp8":
            codes = torch.round(x).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        else:
            codes = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        offset = torch.zeros_like(scale)
    return codes.view(out_f, g * group)[:, :in_f].contiguous(), scale, offset


def decode_codes(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """uint8 codes (one a value) -> their float32 values before scale and offset."""
    if kind in ("int8", "w8a8"):
        return codes.view(torch.int8).float()
    if kind == "fp8":
        return codes.view(torch.float8_e4m3fn).float()
    if kind == "fp4":
        return torch.tensor(E2M1, dtype=torch.float32)[codes.long()]
    return codes.float()


def to_panels(t: torch.Tensor, lanes: int) -> torch.Tensor:
    """[O, C] -> [P, C, lanes], rows past O zero."""
    out_f, c = t.shape
    p = cdiv(out_f, lanes)
    padded = torch.zeros(p * lanes, c, dtype=t.dtype)
    padded[:out_f] = t
    return padded.view(p, lanes, c).transpose(1, 2).contiguous()


def panels_into(t: torch.Tensor, dst: torch.Tensor) -> None:
    """to_panels(t, lanes) written into dst [P, C, lanes] (no padded temporary; rows past O zero)."""
    p, c, lanes = dst.shape
    out_f = t.shape[0]
    full = out_f // lanes
    if full:
        dst[:full].copy_(t[: full * lanes].view(full, lanes, c).transpose(1, 2))
    if full < p:
        dst[full:].zero_()
        dst[full, :, : out_f - full * lanes].copy_(t[full * lanes :].t())


def nibble_panels_into(codes: torch.Tensor, dst: torch.Tensor) -> None:
    """Codes [O, I] (values 0-15) into nibble panels dst [P, I, lanes / 2]: byte j of a panel's
    input holds lane 2j in its low nibble, lane 2j + 1 in its high one."""
    p, in_f, half = dst.shape
    if codes.shape[0] != p * 2 * half:  # a last panel part-filled: its missing rows are zeros
        padded = torch.zeros(p * 2 * half, in_f, dtype=torch.uint8)
        padded[: codes.shape[0]] = codes
        codes = padded
    v = codes.view(p, half, 2, in_f)
    pairs = torch.bitwise_left_shift(v[:, :, 1], 4)  # [P, lanes / 2, I]
    pairs |= v[:, :, 0]
    dst.copy_(pairs.transpose(1, 2))


def from_panels(t: torch.Tensor, out_f: int) -> torch.Tensor:
    """[P, C, lanes] -> [O, C]."""
    p, c, lanes = t.shape
    return t.transpose(1, 2).reshape(p * lanes, c)[:out_f]


def to_quads(codes: torch.Tensor, group: int, lanes: int) -> torch.Tensor:
    """W8A8's layout: [O, I] int8 codes -> [P, I4, lanes, 4], lane l of quad k holding inputs
    4k .. 4k + 3 of its row (the kernel's integer products sum 4 adjacent inputs a lane)."""
    out_f, in_f = codes.shape
    if group % 4 and group < in_f:
        raise ValueError(f"w8a8 needs groups of a multiple of 4 inputs (or one a row), got group={group}")
    if bool((codes == 128).any()):  # int8 -128: the kernel's sign trick needs codes in [-127, 127]
        raise ValueError("w8a8 codes must lie in [-127, 127]; found -128")
    i4 = cdiv(in_f, 4)
    padded = torch.zeros(out_f, 4 * i4, dtype=torch.uint8)
    padded[:, :in_f] = codes
    panels = to_panels(padded, lanes)  # [P, 4 * I4, lanes]
    return panels.view(-1, i4, 4, lanes).transpose(2, 3).contiguous()


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's dynamic activation quantization, as the kernel does it: x [M, I] float32 -> codes
    [M, G, group] (float32 integers in [-127, 127], zero past I) and scales [M, G], per row and group
    symmetric: s = amax / 127, code = round-half-even(x / s), a group of zeros all codes 0."""
    m, in_f = x.shape
    g = cdiv(in_f, group)
    padded = torch.zeros(m, g * group, dtype=torch.float32)
    padded[:, :in_f] = x
    blocks = padded.view(m, g, group)
    amax = blocks.abs().amax(-1)
    s = amax / 127.0
    codes = torch.where(amax[..., None] > 0, torch.round(blocks / s[..., None]), torch.zeros_like(blocks))
    return codes, s


def to_octs(codes: torch.Tensor, group: int, lanes: int) -> torch.Tensor:
    """W4A8's layout: [O, I] uint4 codes -> [P, I8, lanes, 4] bytes, byte t of lane l in step k
    holding input 8k + t in its low nibble and 8k + 4 + t in its high one."""
    out_f, in_f = codes.shape
    if group % 8 and group < in_f:
        raise ValueError(f"w4a8 needs groups of a multiple of 8 inputs (or one a row), got group={group}")
    i8 = cdiv(in_f, 8)
    padded = torch.zeros(out_f, 8 * i8, dtype=torch.uint8)
    padded[:, :in_f] = codes
    panels = to_panels(padded, lanes).view(-1, i8, 2, 4, lanes).permute(0, 1, 4, 2, 3)  # [P, I8, lanes, 2, 4]
    return (panels[..., 0, :] | (panels[..., 1, :] << 4)).contiguous()


def from_octs(codes: torch.Tensor) -> torch.Tensor:
    """[P, I8, lanes, 4] nibbles -> [P, 8 * I8, lanes] codes."""
    p, i8, lanes, _ = codes.shape
    halves = torch.stack((codes & 15, codes >> 4), dim=3)  # [P, I8, lanes, 2, 4]
    return halves.permute(0, 1, 3, 4, 2).reshape(p, 8 * i8, lanes)


def from_quads(codes: torch.Tensor) -> torch.Tensor:
    """[P, I4, lanes, 4] -> [P, 4 * I4, lanes]."""
    p, i4, lanes, _ = codes.shape
    return codes.transpose(2, 3).reshape(p, 4 * i4, lanes)
