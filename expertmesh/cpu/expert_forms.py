"""Routed experts in the forms our fused CPU kernels run (layers/expert_weights.py has the
`ExpertsWeight` protocol and torch's forms); cpu/ops.py's CpuOps chooses among them:

- `PanelStacks`: every local expert in our fused kernel's stacked panels, the whole block in one
  call (moe_f32 / moe_bf16, or moe_*_ex with biases and the clamped SwiGLU);
- `QuantizedStacks`: the same in QuantizedExperts' codes (moe_q / moe_q_ex);
- `ChunkedStacks`: deterministic mode's per fixed chunk stacks (distributed/fixed_sum.py);
- `ChunkPanels`: deterministic mode's per expert and fixed chunk panels of our GEMM, for experts
  the fused kernel does not run.

The forms read the block's routing state (its slot table, activation, biases, shard) at each
call, so EPLB's moves and copies into the biases are seen.
"""

from __future__ import annotations

from typing import Any

import torch

from expertmesh.cpu import cpu_gemm
from expertmesh.cpu.cpu_kernels import CpuKernels
from expertmesh.cpu.quantized import QuantizedMoE, experts_native_form
from expertmesh.distributed.fixed_sum import tree_sum
from expertmesh.layers.expert_weights import chunk_dense, chunk_sums
from expertmesh.layers.identity_experts import lookup_picks
from expertmesh.layers.quantization.packed import QuantizedExperts


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
        """moe_q_ex's shim and descriptor, with the runner's biases and clamped activation."""
        if not block.all_local or self.act not in CpuKernels.MOE_Q_ACTIVATIONS:
            return None
        kernels = self.runner.kernels
        form = experts_native_form(kernels, self.w13, self.w2, block.model_dtype, keep, self.runner)
        act = kernels.MOE_Q_ACTIVATIONS[self.act]
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
