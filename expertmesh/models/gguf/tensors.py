"""A GGUF file's tensors under HF names, as logical tensors the loader slices (the part of
safe_open it uses): stacked `[E, out, in]` experts served one expert at a time, so an EP rank
reads only its experts' bytes; a TP rank reads only its rows (whole heads of a Q/K weight that
llama.cpp permuted); the HELD types hand out codes + scales + offsets (`quantized`), the rest are
dequantized a few hundred rows at a time into the model dtype where the target is the embedding
or the head (no float32 copy of a 150K-row table)."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch

import expertmesh.models.gguf.quants as quants
from expertmesh.layers.quantization.mxfp4_blocks import BLOCK as MXFP4_BLOCK
from expertmesh.layers.quantization.mxfp4_blocks import BLOCK_BYTES, Mxfp4Blocks, int16_of
from expertmesh.layers.quantization.view import LogicalTensor
from expertmesh.models.gguf.families import CONFIG_TENSORS
from expertmesh.models.gguf.names import BLOCK, FUSED_BIAS, KV_B, PIECES, TOP, mtp_block, piece_of, pieces_of
from expertmesh.models.gguf.quants import FLOAT_TYPES, HELD, ZERO_OFFSETS, decode_blocks
from expertmesh.models.gguf.reader import GGUFError, TensorInfo, open_file

log = logging.getLogger("expertmesh")
FLOAT_TARGETS = ("lm_head", "model.embed_tokens")  # parameters in the model dtype, never held
STORED_AS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # float types' dtypes


def _undo_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of llama.cpp's converter `permute` (rotary halves interleaved per head)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


class GGUFTensor(LogicalTensor):
    """One GGUF tensor (or one expert of a stacked one) in HF orientation [out, in]; indexing reads
    and dequantizes only the rows asked for (whole heads for a permuted Q/K weight). Matrices of the
    HELD types say how they map onto our held kinds (`held_kind`, `quantized`); `kind` overrides
    the type's own (a fused parameter's parts held alike: held_kinds). `out_dtype`: the dtype
    dequantized values come out in (float32 when None; rounding once, as copying into the
    parameter would)."""

    def __init__(
        self,
        data: np.ndarray,
        qtype: Any,
        shape: tuple[int, ...],
        key: str,
        permute: int = 0,
        kind: tuple[str, int] | None = None,
        out_dtype: torch.dtype | None = None,
    ):
        from gguf import GGMLQuantizationType as Q

        self.data, self.qtype, self.shape, self.base, self.permute = data, qtype, shape, key, permute
        self.dtype = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(qtype, torch.float32)
        name = qtype.name
        self.out_dtype = None if name in FLOAT_TYPES else out_dtype
        # why a tensor is not held, for held.plan's log line (None: a float tensor, nothing to say)
        self.unheld_reason = None if name in FLOAT_TYPES else f"GGUF {name}: no kernel holds it, dequantized"
        if name in HELD and len(shape) == 2:
            if key.startswith(FLOAT_TARGETS):  # the head's kernels are not the held ones
                self.unheld_reason = f"GGUF {name} embedding / head: dequantized"
            elif permute:
                self.unheld_reason = f"GGUF {name} Q/K rows permuted by llama.cpp: dequantized"
            else:
                self.held_kind, self.unheld_reason = tuple(kind or HELD[name]), None
                self.held_zero_offsets = name in ZERO_OFFSETS
                if name == "MXFP4":  # as a safetensors MXFP4 checkpoint: int16 code | exponent << 4
                    self.held_storage = torch.int16

    def quantized(self, rows: tuple[int, int], cols: tuple[int, int], group: int, g0: int) -> tuple:
        """Codes [o, i] uint8, scales and offsets [o, groups] float32 of the region: the blocks that
        cover it decoded (decode_blocks), the scales repeated to the held group, then cut."""
        from gguf import GGML_QUANT_SIZES

        (o0, o1), (i0, i1) = rows, cols
        qk, size = GGML_QUANT_SIZES[self.qtype]
        held = self.held_kind[1]
        b0, b1 = i0 // qk, -(-i1 // qk)
        c0, c1 = i0 - b0 * qk, i1 - b0 * qk
        # whole groups, or (group = the region: a rank's part of a row of one group) inside one
        if (group == held and c0 % held) or (group != held and c0 // held != (c1 - 1) // held):
            raise ValueError(
                f"{self.base}: GGUF {self.qtype.name} is held in groups of {held}; asked {group} at {i0}"
            )
        raw = self._columns(o0, o1, b0 * size, b1 * size).reshape(o1 - o0, -1, size)  # only these blocks
        if self.qtype.name == "MXFP4" and bool((raw[..., 0] == 255).any()):
            raise ValueError(
                f"{self.base}: GGUF MXFP4 block scale 255 (e8m0 NaN); load with quantization='dequantize'"
            )
        codes, scales, offsets = decode_blocks(self.qtype.name, raw)
        if offsets is None:
            offsets = np.zeros_like(scales)
        native = HELD[self.qtype.name][1]
        if native != held:  # a fused parameter held in smaller groups than this type's own
            scales, offsets = (np.repeat(t, native // held, axis=-1) for t in (scales, offsets))
        g1 = -(-c1 // held) if group == held else c0 // held + 1
        pick = lambda t: torch.from_numpy(np.ascontiguousarray(t[:, c0 // held : g1]))
        return torch.from_numpy(np.ascontiguousarray(codes[:, c0:c1])), pick(scales), pick(offsets)

    def held_region(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        """MXFP4: the region [o, i] as int16 code | e8m0 exponent << 4 per weight, the held storage of
        layers/quantization/mxfp4.py (split after loading into codes and one scale 2^(e - 127) per
        block, offsets one shared zero tensor), whole blocks as their raw bytes until copy_into gives
        them a destination (mxfp4_blocks.py); the other held types: codes with their scales."""
        if self.qtype.name != "MXFP4":
            return super().held_region(bounds)
        (o0, o1), (i0, i1) = bounds
        b0, b1 = i0 // MXFP4_BLOCK, -(-i1 // MXFP4_BLOCK)
        if (i0, i1) == (0, self.shape[1]) and hasattr(self.data, "mapped"):  # whole rows: mapped, no copy
            raw = self.data.mapped(o0, o1)
        else:
            raw = self._columns(o0, o1, b0 * BLOCK_BYTES, b1 * BLOCK_BYTES)
        raw = raw.reshape(o1 - o0, b1 - b0, BLOCK_BYTES)
        if bool((raw[..., 0] == 255).any()):
            raise ValueError(
                f"{self.base}: GGUF MXFP4 block scale 255 (e8m0 NaN); load with quantization='dequantize'"
            )
        if i0 % MXFP4_BLOCK == 0 and i1 % MXFP4_BLOCK == 0:  # whole blocks: as read (mxfp4_blocks.py)
            return Mxfp4Blocks(self.held, raw).value()
        return torch.from_numpy(int16_of(raw, i0 - b0 * MXFP4_BLOCK, i1 - b0 * MXFP4_BLOCK))

    def _columns(self, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        """Rows [r0, r1), stored entries [c0, c1) (bytes for block types): from the file, only those
        (reader.FileRows.columns); from an array (tests), a cut."""
        if hasattr(self.data, "columns"):
            return self.data.columns(r0, r1, c0, c1)
        return np.array(np.asarray(self.data[r0:r1])[:, c0:c1])  # a copy: the caller's to keep

    def _rows(self, r0: int, r1: int) -> torch.Tensor:
        from gguf import GGMLQuantizationType as Q

        raw = np.asarray(self.data[r0:r1] if self.shape else self.data)
        fresh = raw if raw.flags.writeable and raw.flags.owndata else raw.copy()  # read off the file: ours
        if self.qtype in (Q.F32, Q.F16):
            return torch.from_numpy(fresh)
        if self.qtype == Q.BF16:
            return torch.from_numpy(fresh).view(torch.int16).view(torch.bfloat16)
        name, dtype = self.qtype.name, self.out_dtype or torch.float32
        if raw.ndim < 2:
            return torch.from_numpy(quants.dequantize(raw, name)).to(dtype)
        # a few hundred rows at a time into the output: the float32 temporaries of a 150K-row
        # embedding would otherwise be gigabytes
        out = torch.empty((len(raw), *self.shape[1:]), dtype=dtype)
        step = quants.DEQUANT_ROWS
        for r in range(0, len(raw), step):
            out[r : r + step] = torch.from_numpy(quants.dequantize(raw[r : r + step], name))
        return out

    def rows_into(self, out: torch.Tensor, start: int) -> None:
        """Rows [start, start + len(out)) into `out` (the embedding's or head's parameter), decoded
        a few hundred rows at a time: the same values `materialize` gives, with no temporary of
        the whole table; one stored in out's dtype is read straight into it."""
        same = STORED_AS.get(self.qtype.name) == out.dtype and out.is_contiguous() and out.dim() == 2
        if same and not self.permute and self.held is None and hasattr(self.data, "read_into"):
            self.data.read_into(start, out.view(torch.uint8).numpy())
            return
        if self.permute or len(self.shape) != 2 or self.held is not None or self.qtype.name in FLOAT_TYPES:
            out.copy_(self.materialize([(start, start + len(out)), (0, self.shape[1])]))
            return
        raw = np.asarray(self.data[start : start + len(out)])
        dtype, step = self.out_dtype or torch.float32, quants.DEQUANT_ROWS
        for r in range(0, len(raw), step):
            values = quants.dequantize(raw[r : r + step], self.qtype.name)
            out[r : r + step] = torch.from_numpy(values).to(dtype)  # rounded as materialize rounds

    def _cols(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """Rows [r0, r1), columns [c0, c1): the blocks covering them read and decoded, then cut."""
        from gguf import GGML_QUANT_SIZES
        from gguf import GGMLQuantizationType as Q

        if self.qtype in (Q.F32, Q.F16):
            return torch.from_numpy(self._columns(r0, r1, c0, c1))
        if r1 <= r0 or c1 <= c0:
            return torch.empty((max(r1 - r0, 0), max(c1 - c0, 0)), dtype=self.out_dtype or self.dtype)
        qk, size = GGML_QUANT_SIZES[self.qtype]
        b0, b1 = c0 // qk, -(-c1 // qk)
        raw = self._columns(r0, r1, b0 * size, b1 * size)
        a0, a1 = c0 - b0 * qk, c1 - b0 * qk
        if self.qtype == Q.BF16:
            return torch.from_numpy(raw).view(torch.int16).view(torch.bfloat16)[:, a0:a1].contiguous()
        out = torch.empty((r1 - r0, c1 - c0), dtype=self.out_dtype or torch.float32)
        for r in range(0, r1 - r0, quants.DEQUANT_ROWS):  # bounded float32 temporaries, as _rows
            rows = raw[r : r + quants.DEQUANT_ROWS]
            out[r : r + len(rows)] = torch.from_numpy(quants.dequantize(rows, self.qtype.name)[:, a0:a1])
        return out

    def materialize(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        if not bounds:
            return self._rows(0, 0).reshape(())
        (r0, r1), rest = bounds[0], bounds[1:]
        if self.permute:  # rows mix within a head: un-permute the whole tensor, then cut
            t = _undo_permute(self._rows(0, self.shape[0]), self.permute)[r0:r1]
        elif len(rest) == 1 and rest[0] != (0, self.shape[1]):  # a TP rank's inputs: only its blocks
            return self._cols(r0, r1, *rest[0])
        else:
            t = self._rows(r0, r1)
        t = t.reshape(r1 - r0, *self.shape[1:])
        return t[(slice(None), *(slice(a, b) for a, b in rest))].contiguous() if rest else t


class KvBTensor(LogicalTensor):
    """kv_b_proj [H * (nope + v), kv_lora_rank] from llama.cpp's split attn_k_b [H, rank, nope] (kv_b's
    k rows transposed for its absorbed attention) and attn_v_b [H, v, rank]: per head the k rows
    (k_b's transpose) then the v rows, as the checkpoint has them. The model keeps kv_b_proj in float
    (MLA relays it into per-head W_UK / W_UV), so both parts are dequantized."""

    def __init__(self, k_b: GGUFTensor, v_b: GGUFTensor) -> None:
        heads, rank, nope = k_b.shape
        v = v_b.shape[1]
        if v_b.shape != (heads, v, rank):
            raise GGUFError(f"{k_b.base}: attn_k_b {k_b.shape} and attn_v_b {v_b.shape} do not pair")
        self.k_b, self.v_b, self.base = k_b, v_b, k_b.base
        self.shape, self.dtype = (heads * (nope + v), rank), k_b.dtype
        self.unheld_reason = "GGUF kv_b_proj from attn_k_b / attn_v_b: dequantized"

    def materialize(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        k = self.k_b.materialize([(0, s) for s in self.k_b.shape]).transpose(1, 2)
        v = self.v_b.materialize([(0, s) for s in self.v_b.shape])
        w = torch.cat([k, v], dim=1).reshape(self.shape)
        return w[tuple(slice(a, b) for a, b in bounds)].contiguous()


class GateUpBias(LogicalTensor):
    """gpt-oss's experts.gate_up_proj_bias [E, 2I], gate and up interleaved (gate at even columns) as
    the checkpoint has them, from the converter's ffn_gate_exps.bias and ffn_up_exps.bias [E, I]
    (its split `[..., ::2]` / `[..., 1::2]` undone); the family's loader picks the halves back."""

    def __init__(self, gate: GGUFTensor, up: GGUFTensor) -> None:
        if gate.shape != up.shape or len(gate.shape) != 2:
            raise GGUFError(
                f"{gate.base}: ffn_gate_exps.bias {gate.shape} and ffn_up_exps.bias {up.shape} differ"
            )
        self.gate, self.up, self.base = gate, up, gate.base
        self.shape, self.dtype = (gate.shape[0], 2 * gate.shape[1]), gate.dtype
        self.unheld_reason = None

    def materialize(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        (e0, e1), (c0, c1) = bounds
        parts = [t.materialize([(e0, e1), (0, t.shape[1])]) for t in (self.gate, self.up)]
        return torch.stack(parts, dim=-1).flatten(1)[:, c0:c1].contiguous()


class GGUFTensorFile:
    """One GGUF file's tensors under HF names (the part of safe_open the loader uses). `dtype`: the
    model dtype the embedding and head are dequantized into (None: float32)."""

    def __init__(self, path: str, info: dict[str, Any], dtype: torch.dtype | None = None) -> None:
        self.path, self.dtype = path, dtype
        self.file = open_file(path)
        self.tensors: dict[str, tuple[TensorInfo, int | None, int]] = {}  # key -> (tensor, expert, heads)
        arch, heads, kv = info["arch"], info["num_attention_heads"], info["num_key_value_heads"]
        pieces, experts = pieces_of(arch)
        self.kinds = {k: tuple(v) for k, v in info.get("held_kinds", {}).items()}
        unheld: dict[str, int] = {}
        for t in self.file.tensors:
            if t.tensor_type.name not in (*FLOAT_TYPES, *HELD):
                unheld[t.tensor_type.name] = unheld.get(t.tensor_type.name, 0) + 1
        for qtype, count in sorted(unheld.items()):  # one line a type: what it costs
            log.info(
                "GGUF %s: %d %s tensors dequantized to float at load (no kernel of ours holds %s; "
                "held as stored: %s)", os.path.basename(path), count, qtype, qtype, ", ".join(HELD),
            )  # fmt: skip
        self.kv_b: dict[str, dict[str, TensorInfo]] = {}  # kv_b_proj key -> {attn_k_b: t, attn_v_b: t}
        self.gate_up_bias: dict[str, dict[str, TensorInfo]] = {}  # gpt-oss: key -> {ffn_gate_exps: t, ...}
        for t in self.file.tensors:
            name, hf = t.name, None
            top = name.rsplit(".", 1)
            if top[0] in TOP:
                hf = f"{TOP[top[0]]}.{top[1]}"
            if mtp_block(name, info.get("num_hidden_layers")) or name in CONFIG_TENSORS:
                continue  # an MTP block after the main layers (glm4moe), config in a tensor: not loaded
            m = BLOCK.match(name)
            if m:
                layer, piece, kind = m.groups()
                if piece in KV_B and arch in PIECES and "attn_kv_b" in PIECES[arch][0]:
                    self.kv_b.setdefault(f"model.layers.{layer}.self_attn.kv_b_proj.{kind}", {})[piece] = t
                    continue
                if arch == "gpt-oss" and kind == "bias" and piece in FUSED_BIAS:  # [E, I], [E, H]
                    key = f"model.layers.{layer}.mlp.experts.{FUSED_BIAS[piece]}"
                    if piece == "ffn_down_exps":
                        self.tensors[key] = (t, None, 0)
                    else:
                        self.gate_up_bias.setdefault(key, {})[piece] = t
                    continue
                if piece in experts:
                    block, proj = experts[piece]
                    for e in range(t.shape[0]):
                        key = f"model.layers.{layer}.{block}.experts.{e}.{proj}.{kind}"
                        self.tensors[key] = (t, e, 0)
                    continue
                if piece in pieces:
                    # the converter's `e_score_correction.bias` is the checkpoint's `_bias`
                    hf = f"model.layers.{layer}.{pieces[piece]}.{kind}".replace(
                        "correction.bias", "correction_bias"
                    )
                    if piece == "attn_sinks":  # the checkpoint's self_attn.sinks has no .weight
                        hf = hf[: -len(".weight")]
            if hf is None:
                raise GGUFError(f"{path}: tensor {name!r} has no HF name for architecture {arch!r}")
            permute = 0
            if arch == "llama" and piece_of(name) in ("attn_q", "attn_k") and name.endswith(".weight"):
                permute = heads if piece_of(name) == "attn_q" else kv
            self.tensors[hf] = (t, None, permute)
        for key, parts in self.kv_b.items():
            if len(parts) != 2:
                raise GGUFError(f"{path}: {key} needs attn_k_b and attn_v_b; the file has only {list(parts)}")
            self.tensors[key] = (parts["attn_k_b"], None, 0)
        for key, parts in self.gate_up_bias.items():
            if len(parts) != 2:
                raise GGUFError(
                    f"{path}: {key} needs ffn_gate_exps.bias and ffn_up_exps.bias; the file has {list(parts)}"
                )
            self.tensors[key] = (parts["ffn_gate_exps"], None, 0)

    def __enter__(self) -> GGUFTensorFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass  # the descriptor is shared by the process's readers of this file (reader.open_file)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_slice(self, key: str) -> GGUFTensor | KvBTensor | GateUpBias:
        if key not in self.tensors:
            raise KeyError(f"{self.path} has no tensor {key!r}")
        t, e, permute = self.tensors[key]
        if key in self.gate_up_bias:
            gate, up = (self.gate_up_bias[key][p] for p in ("ffn_gate_exps", "ffn_up_exps"))
            return GateUpBias(*(GGUFTensor(x.data, x.tensor_type, x.shape, key) for x in (gate, up)))
        if key in self.kv_b:
            k_b, v_b = (self.kv_b[key][p] for p in KV_B)
            return KvBTensor(*(GGUFTensor(x.data, x.tensor_type, x.shape, key) for x in (k_b, v_b)))
        kind = self.kinds.get(t.name)
        shape, data = t.shape, t.data  # numpy order: HF's [out, in]
        if e is not None:
            shape, data = shape[1:], data[e]
        elif key.endswith("shared_expert_gate.weight") and len(shape) == 1:  # llama.cpp: a vector [H]
            shape, data = (1, *shape), np.asarray(data)[None]
        dtype = self.dtype if key.startswith(FLOAT_TARGETS) else None
        return GGUFTensor(data, t.tensor_type, shape, key, permute, kind, dtype)
