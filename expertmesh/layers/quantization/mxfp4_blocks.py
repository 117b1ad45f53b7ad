"""GGUF MXFP4 blocks carried from the file to the fp4 kind's panels in one pass.

The general held path gives each MXFP4 weight as int16 `code | e8m0 exponent << 4` (mxfp4.py), which
the loader copies into a staging buffer and splits into codes and scales before laying them into
panels: four passes over two bytes a weight, most of a gpt-oss GGUF load. Here a GGUF tensor's
region (whole 32-blocks of its inputs) travels as its raw 17-byte blocks instead (`Mxfp4Blocks`,
the value a held slice hands the loader: an int16 meta tensor of the region's shape).
`copy_into` gives it its destination (`place_into`): a streamed expert's staging buffer that opted in
(`HeldParam.blocks`) keeps the blocks, and `panels` lays them into the expert's slot of the stacks
with one kernel call (cpu/csrc/mxfp4_panels.c); any other destination gets the int16 values written
as before (`int16_of`), so every other consumer sees what it always did.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

BLOCK, BLOCK_BYTES = 32, 17  # values per block; bytes a block (the e8m0 exponent, 16 of nibbles)


def int16_of(raw: np.ndarray, c0: int, c1: int) -> np.ndarray:
    """Blocks [o, b, 17] -> int16 code | exponent << 4 [o, c1 - c0] of values [c0, c1) of the
    concatenated blocks: value j of a block is byte j's low nibble (j < 16), byte j - 16's high one
    (gguf's dequantize order), each with its block's exponent."""
    out = np.empty((*raw.shape[:-1], BLOCK), np.int16)
    np.bitwise_and(raw[..., 1:], 15, out=out[..., :16], casting="unsafe")
    np.right_shift(raw[..., 1:], 4, out=out[..., 16:], casting="unsafe")
    out |= raw[..., :1].astype(np.int16) << 4
    return np.ascontiguousarray(out.reshape(raw.shape[0], -1)[:, c0:c1])


class Mxfp4Blocks:
    """A held region's raw blocks [o, b, 17] (whole blocks), in place of its int16 values."""

    def __init__(self, held: Any, raw: np.ndarray) -> None:
        self.held, self.raw = held, raw
        self.written = False  # set once place_into wrote the region (copy_into then copies nothing)

    def value(self) -> torch.Tensor:
        """The int16 tensor the loader passes around for this region: its shape on meta (no data, so
        a consumer other than copy_into, which hands this region its destination, fails loudly)."""
        o, b, _ = self.raw.shape
        t = torch.empty(o, b * BLOCK, dtype=torch.int16, device="meta")
        t.held_region = self
        return t

    def place_into(self, h: Any, dst: torch.Tensor) -> None:
        """Into dst (rows of h's storage): kept as blocks where h collects them, else as int16."""
        o, b, _ = self.raw.shape
        whole = dst.dim() == 2 and dst.is_contiguous() and dst.shape[-1] == h.shape[-1] == b * BLOCK
        if h.blocks is not None and whole:
            h.blocks.append((dst.storage_offset() // h.shape[-1], self.raw))
        else:
            dst.copy_(torch.from_numpy(int16_of(self.raw, 0, b * BLOCK)))
        self.written = True


def collects_blocks(ops: Any) -> bool:
    """Whether this model's ops lay blocks straight into panels (QuantizedProducts' declaration)."""
    return ops.lays_mxfp4_blocks


def panels(pieces: list[tuple[int, np.ndarray]], out_f: int, ops: Any, into: Any, threads: int) -> tuple:
    """Blocks of rows [row, row + n) a piece (together rows [0, out_f)) -> codes [P, G * 32, lanes / 2]
    and scales [P, G, lanes], written where `into` (QuantizedWeight.from_rows') puts them: what
    split_exponents and from_rows make of the same weights' int16 values, byte for byte. A piece
    starting at a panel goes straight to the kernel; otherwise they are joined first."""
    lanes, groups = ops.quant_lanes, pieces[0][1].shape[1]
    p = -(-out_f // lanes)
    shapes = {
        "codes": ((p, groups * BLOCK, lanes // 2), torch.uint8),
        "scales": ((p, groups, lanes), torch.float32),
    }  # fmt: skip
    dst = dict(into(shapes)) if into is not None else {}
    for part, (shape, dtype) in shapes.items():
        if part not in dst:
            dst[part] = torch.empty(shape, dtype=dtype)
    codes, scales = dst["codes"], dst["scales"]
    if not (codes.is_contiguous() and scales.is_contiguous()):
        raise RuntimeError("MXFP4 panels asked into non-contiguous storage")
    pieces = sorted(pieces, key=lambda piece: piece[0])
    if any(row % lanes or (row + len(raw) < out_f and len(raw) % lanes) for row, raw in pieces):
        pieces = [(0, np.concatenate([raw for _, raw in pieces]))]
    for row, raw in pieces:
        raw = np.ascontiguousarray(raw)
        first = row // lanes
        ops.mxfp4_block_panels(raw, groups, codes[first:], scales[first:], threads)
    return codes, scales
