"""The weights of a stack of routed experts, held in exactly one form that applies itself.

FusedExperts (layers/fused_moe.py) holds one `ExpertsWeight`, chosen once: after loading
(`use_cpu_kernels`), or while loading (`use_quantized` / `hold_quantized`). The block then calls
``experts_form.apply(block, x, topk_ids, topk_weights)`` and never asks which backend runs it.

- `DenseExperts`: the block's own [E, 2I, H] / [E, H, I] parameters, per expert through torch;
- `PerExpertWeights`: one (w13, w2) linear weight form a local expert (layers/linear_weight.py:
  packed panels, oneDNN, quantized codes, desc_act's permuted inputs), per expert;
- `PanelStacks`: every local expert in our fused kernel's stacked panels, the whole block in one
  call (moe_f32 / moe_bf16, or moe_*_ex with biases and the clamped SwiGLU);
- `QuantizedStacks`: the same in QuantizedExperts' codes (moe_q / moe_q_ex);
- `ChunkedStacks`: deterministic mode's per fixed chunk panels (distributed/fixed_sum.py).

The forms read the block's routing state (its slot table, activation, biases, shard) at each
call, so EPLB's moves and copies into the biases are seen.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.cpu import cpu_gemm
from expertmesh.cpu.cpu_kernels import CpuKernels
from expertmesh.distributed.fixed_sum import tree_sum
from expertmesh.layers.identity_experts import lookup_picks
from expertmesh.layers.quantization.packed import QuantizedExperts, QuantizedMoE, experts_native_form


class ExpertsWeight(Protocol):
    """A stack of local experts' weights in one form."""

    def apply(
        self, block: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """x [n, H], topk [n, k] -> [n, H] float32, this rank's partial sum over its experts."""
        ...

    def pair_sums(
        self, block: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Deterministic mode: [n, k, H] float32 unweighted outputs per (token, pick) (FusedExperts)."""
        ...

    def native_form(self, block: Any, keep: list) -> dict | None:
        """Its part of a native decode layer's descriptor (cpu/native_decode.py), or None."""
        ...

    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        """Views of local slot `slot`'s weights as stored: what EPLB copies between ranks in place."""
        ...

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        """The tensors it holds, each with "quantized" or "dense" (quantization/accounting.py)."""
        ...


def _biases(block: Any, e: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Expert e's (gate|up, down) biases; the down bias joins once across the shards of the
    intermediate dim: on shard 0."""
    b13 = None if block.w13_bias is None else block.w13_bias[e]
    b2 = None if block.w2_bias is None or block.shard_rank else block.w2_bias[e]
    return b13, b2


class _ExpertByExpert:
    """Tokens sorted by expert, one pair of matmuls per local expert (`expert`)."""

    def expert(self, block: Any, e: int, x: torch.Tensor) -> torch.Tensor:
        """[m, H] -> [m, H] float32: the down projection's product is not rounded."""
        raise NotImplementedError

    def apply(
        self, block: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if x.shape[0] == 1:
            return self._one_token(block, x, topk_ids, topk_weights)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if x.shape[0] == 0:
            return out
        k = topk_ids.shape[1]
        slot = lookup_picks(block.local_index, topk_ids).flatten()  # [n*k], -1: another rank's, or none
        order = torch.argsort(slot, stable=True)
        counts = torch.bincount(slot + 1, minlength=len(block.expert_ids) + 1).tolist()
        order = order[counts[0] :]  # drop (token, expert) pairs owned elsewhere
        token = order // k  # [m] source token of each sorted pair
        xs = x[token]  # [m, H]
        pair_weights = topk_weights.flatten()[order].unsqueeze(1)  # [m, 1]
        if block.weight_on_input:
            xs = xs * pair_weights.to(xs.dtype)
        ys = torch.empty(xs.shape, dtype=torch.float32, device=x.device)
        start = 0
        for e, count in enumerate(counts[1:]):
            if count:
                ys[start : start + count] = self.expert(block, e, xs[start : start + count])
                start += count
        if not block.weight_on_input:
            ys *= pair_weights.float()
        return out.index_add_(0, token, ys)

    def _one_token(
        self, block: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Decode at batch 1: no sort, gather or scatter, just the chosen local experts in expert order."""
        local = lookup_picks(block.local_index, topk_ids[0]).tolist()
        picks = sorted((slot, j) for j, slot in enumerate(local) if slot >= 0)
        out = None
        for slot, j in picks:
            w = topk_weights[0, j]
            if block.weight_on_input:
                y = self.expert(block, slot, x * w.to(x.dtype))
            else:
                y = self.expert(block, slot, x) * w.float()
            out = y if out is None else out + y
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device) if out is None else out

    def pair_sums(self, block: Any, x, topk_ids, topk_weights) -> torch.Tensor:
        raise ValueError(f"deterministic=True does not serve {type(self).__name__} experts")

    def native_form(self, block: Any, keep: list) -> None:
        return None  # per expert in Python: no native decode experts slot


class DenseExperts(_ExpertByExpert):
    """The block's own dense stacks, per expert through F.linear (no kernel of ours packed them)."""

    def __init__(self, w13: nn.Parameter, w2: nn.Parameter) -> None:
        self.w13, self.w2 = w13, w2  # the Parameters: moves and loads replace their data

    def expert(self, block: Any, e: int, x: torch.Tensor) -> torch.Tensor:
        b13, b2 = _biases(block, e)
        h = F.linear(x, self.w13[e], b13)
        return F.linear(block.act(h).float(), self.w2[e].float(), None if b2 is None else b2.float())

    def _chunk(self, block: Any, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk j's [E, 2c, H] gate|up rows and [E, H, c] down columns."""
        return chunk_dense(self.w13.data, self.w2.data, block.inter, block.fixed_chunks, j)

    def pair_sums(
        self, block: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Per expert and fixed chunk through torch, the chunks added by the fixed tree."""
        chunks = [self._chunk(block, j) for j in range(block.fixed_chunks)]
        return chunk_sums(block, x, topk_ids, topk_weights, lambda e: [(a[e], b[e]) for a, b in chunks])

    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        return [self.w13.data[slot], self.w2.data[slot]]

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return [(self.w13.data, "dense"), (self.w2.data, "dense")]


def chunk_sums(
    block: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, chunks_of: Any
) -> torch.Tensor:
    """Deterministic mode, expert by expert: [n, k, H] float32, each (token, pick)'s unweighted output
    over this rank's fixed chunks (`chunks_of(e)`: local expert e's (w13, w2) per chunk, dense
    tensors or our GEMM's panels) added by the fixed tree; zero for picks held elsewhere."""
    n, k = topk_ids.shape
    out = torch.zeros((n, k, x.shape[1]), dtype=torch.float32, device=x.device)
    if n == 0 or not block.expert_ids:
        return out
    slot = lookup_picks(block.local_index, topk_ids)  # [n, k], -1 elsewhere (or an identity expert)
    c, inter = block.inter // block.fixed_chunks, block.inter
    for e in range(len(block.expert_ids)):
        tok, pick = (slot == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        xs = x[tok]
        if block.weight_on_input:
            xs = xs * topk_weights[tok, pick].unsqueeze(1).to(xs.dtype)
        parts = []
        for j, (w13, w2) in enumerate(chunks_of(e)):
            b13 = None
            if block.w13_bias is not None:
                b = block.w13_bias.data[e]
                b13 = torch.cat([b[j * c : (j + 1) * c], b[inter + j * c : inter + (j + 1) * c]])
            if isinstance(w13, torch.Tensor):
                h = block.act(F.linear(xs, w13, b13))
                parts.append(F.linear(h.float(), w2.float()))
            else:  # our GEMM's panels: a row's product whatever the rows
                h = block.act(w13(xs.contiguous(), b13))
                parts.append(w2(h.contiguous(), None, torch.float32))
        out[tok, pick] = tree_sum(parts)
    return out


class ChunkPanels:
    """Deterministic mode, experts the fused kernel does not run (ungated, biased, weighted on the
    input): per local expert and fixed chunk, (w13, w2) panels of our GEMM, whose row results do not
    depend on the rows (F.linear's do)."""

    def __init__(self, panels: list[list[tuple[Any, Any]]]) -> None:
        self.panels = panels

    @classmethod
    def pack(cls, block: Any, kernels: CpuKernels) -> ChunkPanels:
        chunks = [
            chunk_dense(block.w13.data, block.w2.data, block.inter, block.fixed_chunks, j)
            for j in range(block.fixed_chunks)
        ]
        panels = [
            [(kernels.pack(w13[e]), kernels.pack(w2[e])) for w13, w2 in chunks]
            for e in range(len(block.expert_ids))
        ]
        for param in (block.w13, block.w2):
            cpu_gemm.release(param)
        return cls(panels)

    def apply(self, block: Any, x, topk_ids, topk_weights) -> torch.Tensor:
        raise ValueError("deterministic mode's experts are summed per pick (pair_sums), not in one call")

    def pair_sums(
        self, block: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return chunk_sums(block, x, topk_ids, topk_weights, lambda e: self.panels[e])

    def native_form(self, block: Any, keep: list) -> None:
        return None

    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        return [w.data for pair in self.panels[slot] for w in pair]

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return [(w.data, "dense") for expert in self.panels for pair in expert for w in pair]


def chunk_dense(
    w13: torch.Tensor, w2: torch.Tensor, inter: int, chunks: int, j: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed chunk j of the intermediate dim: [E, 2c, H] gate|up rows and [E, H, c] down columns."""
    c = inter // chunks
    cols = slice(j * c, (j + 1) * c)
    gate_up = torch.cat([w13[:, cols], w13[:, inter + j * c : inter + (j + 1) * c]], 1)
    return gate_up.contiguous(), w2[:, :, cols].contiguous()


class PerExpertWeights(_ExpertByExpert):
    """One (w13, w2) pair of linear weight forms a local expert: packed panels, oneDNN, quantized
    codes or desc_act's permuted inputs (one form a slot, so that EPLB can move any expert anywhere)."""

    def __init__(self, pairs: list[tuple[Any, Any]]) -> None:
        self.pairs = pairs

    def expert(self, block: Any, e: int, x: torch.Tensor) -> torch.Tensor:
        b13, b2 = _biases(block, e)
        w13, w2 = self.pairs[e]
        return w2.apply(block.act(w13.apply(x, b13)), b2, out_dtype=torch.float32)

    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        return [t for w in self.pairs[slot] for t in w.slot_tensors()]

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return [t for pair in self.pairs for w in pair for t in w.resident()]


class _OneCall:
    """Every local expert in one call of a fused kernel over stacked weights [E, ...]."""

    runner: Any  # .moe(x, slot, weights, w13, w2, inter, act) -> [n, H] float32
    w13: Any
    w2: Any
    act: str

    def apply(
        self, block: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if block.all_local:  # every expert here: its slot is its id
            slot = topk_ids.to(torch.int32)
        else:
            slot = lookup_picks(block.local_index, topk_ids).to(torch.int32)
        return self.runner.moe(x, slot, topk_weights, self.w13, self.w2, block.inter, self.act)

    def pair_sums(self, block: Any, x, topk_ids, topk_weights) -> torch.Tensor:
        raise ValueError(f"deterministic=True does not serve {type(self).__name__} experts")


class PanelStacks(_OneCall):
    """Float experts in our fused kernel's stacked panels [E, ...]: moe_f32 / moe_bf16, or with
    biases or the clamped SwiGLU (`extras`) moe_*_ex."""

    def __init__(
        self, kernels: CpuKernels, w13: torch.Tensor, w2: torch.Tensor, act: str, extras: MoeExtras | None
    ) -> None:
        self.kernels, self.w13, self.w2, self.act, self.extras = kernels, w13, w2, act, extras
        self.runner = kernels if extras is None else extras

    @classmethod
    def pack(cls, block: Any, kernels: CpuKernels, act: str, extras: MoeExtras | None) -> PanelStacks:
        """One expert at a time into the stacked panels, over the dense weights' own storage where
        the panels are the same size (cpu_gemm.pack_in_place): one expert's copy at a time while
        packing; otherwise into a new stack (the dense and packed coexist, 2x). The dense
        parameters are released."""
        packed = []
        for param in (block.w13, block.w2):
            shape = (len(block.expert_ids), *kernels.panel_shape(*param.shape[1:], param.dtype))
            same = torch.Size(shape).numel() == param.numel() and param.is_contiguous()
            out = param.data.view(shape) if same else torch.empty(shape, dtype=param.dtype)
            for e in range(len(block.expert_ids)):
                out[e] = kernels.pack(param.data[e]).data  # packs a copy, then overwrites slot e
            cpu_gemm.release(param)
            packed.append(out)
        return cls(kernels, packed[0], packed[1], act, extras)

    def native_form(self, block: Any, keep: list) -> dict | None:
        """The experts slot of a native decode layer: plain gated experts only (the native layer's
        shims take neither biases nor the clamped SwiGLU)."""
        if self.extras is not None or not block.all_local or block.w13_bias is not None:
            return None
        if self.act not in CpuKernels.MOE_ACTIVATIONS:
            return None
        act = self.kernels.MOE_ACTIVATIONS[self.act]
        return dict(w13=self.w13.data_ptr(), w2=self.w2.data_ptr(), inter=block.inter, act=act)

    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        return [self.w13[slot], self.w2[slot]]

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return [(self.w13, "dense"), (self.w2, "dense")]


class QuantizedStacks(_OneCall):
    """Quantized experts stacked (QuantizedExperts) for moe_q / moe_q_ex (`QuantizedMoE`)."""

    def __init__(self, runner: QuantizedMoE, w13: QuantizedExperts, w2: QuantizedExperts, act: str) -> None:
        self.runner, self.w13, self.w2, self.act = runner, w13, w2, act

    def native_form(self, block: Any, keep: list) -> dict | None:
        """moe_q's shim and descriptor: plain gated experts only, as for PanelStacks."""
        if not block.all_local or block.w13_bias is not None or self.act not in CpuKernels.MOE_ACTIVATIONS:
            return None
        kernels = self.runner.kernels
        form = experts_native_form(kernels, self.w13, self.w2, block.model_dtype, keep)
        act = kernels.MOE_ACTIVATIONS[self.act]
        return None if form is None else dict(form, w13=None, w2=None, inter=block.inter, act=act)

    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        return [*self.w13.slot_tensors(slot), *self.w2.slot_tensors(slot)]

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return [*self.w13.resident(), *self.w2.resident()]


class ChunkedStacks:
    """Deterministic mode: per fixed chunk of the intermediate dim, the fused kernel's stacks
    [E, ...] (one stack a chunk: one slot a chunk and expert in a single stack measured slower,
    many narrow experts for the kernel; docs/benchmarks.md)."""

    def __init__(
        self, kernels: CpuKernels, chunks: list[tuple[torch.Tensor, torch.Tensor]], act: str
    ) -> None:
        self.kernels, self.chunks, self.act = kernels, chunks, act

    @classmethod
    def pack(cls, block: Any, kernels: CpuKernels) -> ChunkedStacks:
        chunks = []
        for j in range(block.fixed_chunks):
            stacks = []
            for w in chunk_dense(block.w13.data, block.w2.data, block.inter, block.fixed_chunks, j):
                shape = (w.shape[0], *kernels.panel_shape(*w.shape[1:], w.dtype))
                out = torch.empty(shape, dtype=w.dtype)
                for e in range(w.shape[0]):
                    out[e] = kernels.pack(w[e]).data
                stacks.append(out)
            chunks.append((stacks[0], stacks[1]))
        for param in (block.w13, block.w2):
            cpu_gemm.release(param)
        return cls(kernels, chunks, block.act_name)

    def apply(self, block: Any, x, topk_ids, topk_weights) -> torch.Tensor:
        raise ValueError("deterministic mode's experts are summed per pick (pair_sums), not in one call")

    def pair_sums(
        self, block: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """One row per (token, pick), each with its one slot and weight 1 (1 * y + 0 is exact): a
        call of the fused kernel per chunk, whose row results do not depend on the rows."""
        n, k = topk_ids.shape
        if n == 0 or not block.expert_ids:
            return torch.zeros((n, k, x.shape[1]), dtype=torch.float32, device=x.device)
        slot = lookup_picks(block.local_index, topk_ids)  # [n, k], -1 elsewhere (or an identity expert)
        rows = x.repeat_interleave(k, dim=0)  # [n * k, H], row t * k + p
        s = slot.reshape(-1, 1).to(torch.int32).contiguous()
        ones = torch.ones((n * k, 1), dtype=torch.float32)
        c = block.inter // block.fixed_chunks
        parts = [self.kernels.moe(rows, s, ones, w13, w2, c, self.act) for w13, w2 in self.chunks]
        return tree_sum(parts).view(n, k, x.shape[1])

    def native_form(self, block: Any, keep: list) -> None:
        return None

    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        return [w[slot] for pair in self.chunks for w in pair]

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return [(w, "dense") for pair in self.chunks for w in pair]


class MoeExtras:
    """The runner of PanelStacks for float experts with biases or the clamped SwiGLU:
    CpuKernels.moe with its extras (the biases read at each call, so copies into them are seen)."""

    def __init__(self, kernels: CpuKernels, b13, b2, limit: float, alpha: float) -> None:
        self.kernels, self.b13, self.b2, self.limit, self.alpha = kernels, b13, b2, limit, alpha

    def moe(self, x, slot, weights, w13, w2, inter: int, act: str) -> torch.Tensor:
        biases = tuple(None if b is None else b.data for b in (self.b13, self.b2))
        return self.kernels.moe(x, slot, weights, w13, w2, inter, act, (*biases, self.limit, self.alpha))
