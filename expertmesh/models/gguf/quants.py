"""GGUF's block types: which are held as stored, their blocks decoded to codes + scales, and
dequantization of any type to float32 values.

Types held as stored in our int8 / int4 group kinds (layers/quantization/held.py): W = code * s + o
per group, bit for bit gguf's dequantization. Each product code * s is exact in float32 (an fp16
scale, times a K-quant's 6-bit sub-block scale, times a code of at most 8 bits needs at most 24
bits), so the one rounding left is the offset's add, the same one gguf makes:
  Q8_0 = d * q (q int8): int8 codes q, scale d, offset 0, groups of 32
  Q4_0 = d * (q - 8) (q 0..15): int4 codes q, scale d, offset -8 d (exact: d * (q - 8) is)
  Q4_1 = d * q + m: int4 codes q, scale d, offset m
  Q4_K = (d * sc_j) * q - dmin * m_j, 8 sub-blocks of 32 in a super-block of 256: int4 codes q,
         scale d * sc_j, offset -(dmin * m_j) per 32
  Q5_K = the same with 5-bit codes: held in the int8 kind (codes 0..31; no 5-bit kernel)
  Q6_K = (d * sc_j) * (q - 32), 16 sub-blocks of 16 (sc_j int8): int8 codes q - 32, scale
         d * sc_j, offset 0, groups of 16
  MXFP4 = e2m1(q) * 2^(e - 127), a block of 32: one e8m0 byte e, then 16 bytes of nibbles (the low
         nibbles are values 0-15, the high 16-31, as Q4_0): fp4 codes q (our fp4 kind's e2m1
         order: ggml's kvalues_mxfp4 are the e2m1 values doubled, with its scale halved), scale
         2^(e - 127) (exact in float32, subnormal at e = 0), offset 0; e = 255 (ggml: 2^127, OCP:
         NaN) is refused when held
Every block of a region is decoded at once (numpy over all blocks, no loop per block); the same
decoding dequantizes these types for float parameters (embedding, head), a few hundred rows a
call. Other types go through gguf.quants.dequantize (the format's own dequantizer).
"""

from __future__ import annotations

import numpy as np

from expertmesh.models.gguf.names import BLOCK

HELD = {
    "Q8_0": ("int8", 32), "Q4_0": ("int4", 32), "Q4_1": ("int4", 32),
    "Q4_K": ("int4", 32), "Q5_K": ("int8", 32), "Q6_K": ("int8", 16), "MXFP4": ("fp4", 32),
}  # fmt: skip
FLOAT_TYPES = ("F32", "F16", "BF16")
ZERO_OFFSETS = ("Q8_0", "Q6_K")  # W = code * scale: decode_blocks' offsets None
# rows dequantized per call: a call's float32 temporaries (~2 MB at hidden 2048) stay in the cache
# and the allocator reuses them, where thousands of rows took fresh pages every call
DEQUANT_ROWS = 256
# parameters the model fuses (qkv, gate+up, an expert's gate/up and down pair): their parts must be
# held in one kind and group, so a mix (Q4_K_M's Q4_K gate/up with a Q6_K down) is held as int8
FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), ("ffn_gate_shexp", "ffn_up_shexp"),
         ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))  # fmt: skip
# ... except the experts' down projection: a parameter of its own (w2), which one fused MoE call
# takes in the kind of gate/up (w13) but with its own group
OWN_GROUP = ("ffn_down_exps",)


def held_kinds(tensors: dict[str, str]) -> dict[str, tuple[str, int]]:
    """{tensor name: (kind, group)} for the held tensors of a fused parameter whose parts' types map
    onto different kinds or groups: all in int8 (codes and scales exact), each parameter in the
    smallest group of its parts (Q4_K_M's Q4_K gate/up with a Q6_K down: w13 int8 groups of 32,
    w2 int8 groups of 16)."""
    out: dict[str, tuple[str, int]] = {}
    layers: dict[str, dict[str, str]] = {}
    for name, qtype in tensors.items():
        m = BLOCK.match(name)
        if m and m.group(3) == "weight":
            layers.setdefault(m.group(1), {})[m.group(2)] = qtype
    for layer, pieces in layers.items():
        for fused in FUSED:
            types = {p: pieces[p] for p in fused if p in pieces}
            kinds = {HELD.get(t) for t in types.values()}
            # fp4 codes have no int8 form: a mix with fp4 is left to held.plan (dequantized, logged)
            if len(kinds) > 1 and None not in kinds and "fp4" not in {k for k, _ in kinds}:
                for own in (True, False):
                    part = [p for p in types if (p in OWN_GROUP) == own]
                    if part:
                        widened = ("int8", min(HELD[types[p]][1] for p in part))
                        out.update({f"blk.{layer}.{p}.weight": widened for p in part})
    return out


def _half(raw: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of every block, as float32."""
    return np.ascontiguousarray(raw[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[..., n] bytes -> [..., 2n] codes: each run of `width` bytes gives its low nibbles, then its high.
    Written with `out=` into the halves of one array: two passes, no broadcast temporaries."""
    lead = qs.shape[:-1]
    q = qs.reshape(*lead, -1, 1, width)
    out = np.empty((*q.shape[:-2], 2, width), np.uint8)
    np.bitwise_and(q, 15, out=out[..., 0:1, :])
    np.right_shift(q, 4, out=out[..., 1:2, :])
    return out.reshape(*lead, -1)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes [..., 12] -> 8 six-bit scales and mins [..., 8] (gguf's get_scale_min)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode_blocks(qtype: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Blocks [..., n, bytes] of a held type -> codes [..., n * QK] uint8 (int8 kinds: the bytes of
    int8 values) and float32 scales, offsets [..., n * QK / group] with W = code * scale + offset
    exactly gguf.quants.dequantize's W (the field layouts are gguf's own, gguf/quants.py). The
    offset is None where it is zero (Q8_0, Q6_K): W = code * scale, as gguf computes it."""
    lead = raw.shape[:-1]
    flat = (*lead[:-1], -1)
    if qtype == "Q8_0":
        return raw[..., 2:].reshape(flat), _half(raw, 0).reshape(flat), None
    if qtype in ("Q4_0", "Q4_1"):
        d = _half(raw, 0)
        codes = _nibbles(raw[..., 4 if qtype == "Q4_1" else 2 :], 16)
        offset = _half(raw, 2) if qtype == "Q4_1" else -8 * d
        return codes.reshape(flat), d.reshape(flat), offset.reshape(flat)
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _half(raw, 0)[..., None], _half(raw, 2)[..., None]
        sc, m = _k_scale_min(raw[..., 4:16])
        scales = d * sc.astype(np.float32)
        offsets = -(dmin * m.astype(np.float32))
        if qtype == "Q4_K":
            codes = _nibbles(raw[..., 16:144], 32)
        else:  # the fifth bit of sub-block j is bit j of qh's byte k (k = position in the sub-block)
            qh = raw[..., 16:48].reshape(*lead, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            codes = _nibbles(raw[..., 48:176], 32) | ((qh & 1) << 4).reshape(*lead, 256)
        return codes.reshape(flat), scales.reshape(flat), offsets.reshape(flat)
    if qtype == "Q6_K":
        q = _nibbles(raw[..., :128], 64)
        # the high 2 bits of value 32 s + k of each half (s = 0..3): bits 2 s of qh's byte k, in place
        qh = raw[..., 128:192].reshape(*lead, 2, 1, 32)
        hi = np.empty((*lead, 2, 4, 32), np.uint8)
        for s in range(4):
            np.right_shift(qh, 2 * s, out=hi[..., s : s + 1, :])
        hi &= 3
        hi <<= 4
        q |= hi.reshape(*lead, 256)
        q -= np.uint8(32)  # wraps to q - 32 as int8
        scales = _half(raw, 208)[..., None] * raw[..., 192:208].view(np.int8).astype(np.float32)
        return q.reshape(flat), scales.reshape(flat), None
    if qtype == "MXFP4":
        e = raw[..., 0]
        scales = np.ldexp(np.float32(1.0), e.astype(np.int32) - 127).astype(np.float32)
        return _nibbles(raw[..., 1:17], 16).reshape(flat), scales.reshape(flat), None
    raise ValueError(f"GGUF {qtype} is not a held type")


def dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    """Rows of blocks [..., bytes of a row] -> float32 values [..., cols], bit for bit
    gguf.quants.dequantize: the held types through decode_blocks, the others through gguf."""
    if qtype not in HELD or qtype == "MXFP4":  # MXFP4: gguf's own (its e = 255 is 2^127, not NaN)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        return gguf_dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float32, copy=False)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]
    codes, scales, offsets = decode_blocks(qtype, raw.reshape(*raw.shape[:-1], -1, size))
    group = codes.shape[-1] // scales.shape[-1]
    signed = HELD[qtype][0] == "int8"
    q = (codes.view(np.int8) if signed else codes).reshape(*scales.shape, group)
    if qtype == "Q4_0":  # d * (q - 8) as gguf computes it: the same values, zeros' signs too
        q, offsets = q.view(np.int8) - np.int8(8), None
    w = np.empty(codes.shape, np.float32)  # one output, no float32 temporaries of the codes
    grouped = w.reshape(*scales.shape, group)
    np.multiply(q, scales[..., None], out=grouped)  # the code cast to float32 exactly, then d * q
    if offsets is not None:
        np.add(grouped, offsets[..., None], out=grouped)
    return w
