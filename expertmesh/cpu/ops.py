"""`CpuOps`: the model's ops (layers/ops.py) on our compiled CPU kernels (cpu/cpu_kernels.py), each
op falling back to TorchOps (layers/torch_ops.py) where its kernel does not serve the dtype, shape
or device; `TorchCpuOps`, torch's ops with the weights packed for oneDNN's linear where it serves
them (cpu/cpu_gemm.py); and `cpu_ops`, which chooses between them for a CPU model (models/build.py)."""

from __future__ import annotations

import copy
from functools import cached_property

import numpy as np
import torch
from torch import nn

from expertmesh.cpu import cpu_gemm, cpu_kernels
from expertmesh.cpu.cpu_kernels import CpuKernels
from expertmesh.cpu.expert_forms import ChunkedStacks, ChunkPanels, MoeExtras, PanelStacks, QuantizedStacks
from expertmesh.cpu.native_decode import NativeDecoder
from expertmesh.cpu.quantized import QuantizedMoE, gemm_q, gemm_q_native
from expertmesh.cpu.recurrent_kernels import RecurrentKernels
from expertmesh.layers.expert_weights import ExpertsWeight
from expertmesh.layers.linear_weight import LinearWeight
from expertmesh.layers.ops import Ops
from expertmesh.layers.quantization.packed import QuantizedExperts, QuantizedWeight
from expertmesh.layers.rotary import RotaryTables
from expertmesh.layers.torch_ops import TorchOps


class TorchCpuOps(TorchOps):
    """TorchOps on the CPU: weights packed for oneDNN's linear where it serves them (or for our
    panel GEMM where `packer`, CpuOps' kernels, does), else dense."""

    packer: CpuKernels | None = None  # whose panels cpu_gemm.pack may choose (CpuOps: ours)

    def pack(
        self, weight: torch.Tensor, float32_out: bool = False, in_place: bool = False
    ) -> LinearWeight | None:
        return cpu_gemm.pack(weight, self.packer, float32_out=float32_out, in_place=in_place)


TORCH_CPU_OPS = TorchCpuOps()  # a CPU model's ops where our kernels do not build or serve its dtype


class CpuOps(TorchCpuOps):
    """Our kernels: packed panels (or oneDNN where cpu_gemm.pack prefers it), fused experts,
    gemm_q / moe_q over codes, RMSNorm, rotary + KV store, paged attention, native decode."""

    native_decode = True
    runs_codes = True

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = self.library = self.packer = kernels
        self.quant_lanes = kernels.lanes
        # older builds lack the repack; its panels are up to 64 lanes wide
        self.lays_mxfp4_blocks = kernels.lanes <= 64 and hasattr(kernels.lib, "mxfp4_gguf_panels")

    # ---- weight forms -------------------------------------------------------------------------------
    def experts_form(self, block: nn.Module) -> ExpertsWeight:
        """Our fused kernel's stacked panels where it serves the experts (per fixed chunk in
        deterministic mode, else per expert and chunk ChunkPanels), else one packed pair a local
        expert (TorchOps.per_expert_form), else the dense stacks."""
        k = self.kernels
        plain = block.w13_bias is None and not block.weight_on_input and block.act_name is not None
        if block.fixed_chunks:
            if not block.expert_ids:
                return block.experts_form  # the torch path of pair_sums on the dense weights
            if plain and k.moe_supports(block.w13.dtype, block.act_name):
                return ChunkedStacks.pack(block, k)
            return ChunkPanels.pack(block, k)
        form = block.act.moe_q_form  # biases / clamped SwiGLU: moe_*_ex
        extras = not plain and not block.weight_on_input and form is not None
        if (
            block.expert_ids
            and (plain or extras)
            and k.moe_supports(block.w13.dtype, form[0] if extras else block.act_name, extras)
        ):
            if extras:
                ex = MoeExtras(k, *block.float_biases(), *form[1:])
                return PanelStacks.pack(block, k, form[0], ex)
            return PanelStacks.pack(block, k, block.act_name, None)
        return self.per_expert_form(block)

    def quantized_experts_form(
        self, block: nn.Module, pairs: list[tuple[LinearWeight, LinearWeight]]
    ) -> ExpertsWeight:
        """One moe_q(_ex) call for the block (biases and the clamped SwiGLU included) where it
        serves the experts, else torch's per-expert path (input weighting, desc_act)."""
        form = self._moe_q_form(block)
        if form is not None and all(isinstance(w, QuantizedWeight) for p in pairs for w in p):
            stacks = [QuantizedExperts.stack([p[i] for p in pairs]) for i in (0, 1)]
            name, limit, alpha = form
            runner = QuantizedMoE(self.kernels, *block.float_biases(), limit, alpha)
            return QuantizedStacks(runner, stacks[0], stacks[1], name)
        return super().quantized_experts_form(block, pairs)

    def _moe_q_form(self, block: nn.Module) -> tuple[str, float, float] | None:
        """moe_q(_ex)'s activation (name, limit, alpha) for these experts, None: the per-expert path
        (input weighting, an activation it lacks, or biases / clamped SwiGLU on an older build)."""
        form, k = block.act.moe_q_form, self.kernels
        if block.weight_on_input or form is None:
            return None
        if k.moe_q_ex is None:
            plain = block.w13_bias is None and form[0] in k.MOE_ACTIVATIONS
            return form if plain else None
        return form if form[0] in k.MOE_Q_ACTIVATIONS else None

    def latent_expand_forms(
        self, w_uk: torch.Tensor, w_uv: torch.Tensor, rank: int
    ) -> tuple[LinearWeight, LinearWeight] | None:
        forms = tuple(cpu_gemm.pack(w.view(-1, rank), self.kernels) for w in (w_uk, w_uv))
        return forms if None not in forms else None

    # ---- quantized products -----------------------------------------------------------------------
    def gemm_q(
        self, w: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        if x.device.type != "cpu":
            return super().gemm_q(w, x, bias, dtype)
        return gemm_q(self.kernels, w, x, bias, dtype)

    def gemm_q_native(
        self, w: QuantizedWeight, dtype: torch.dtype, keep: list, float32_out: bool
    ) -> dict | None:
        return gemm_q_native(self.kernels, w, dtype, keep, float32_out)

    def mxfp4_block_panels(
        self, raw: np.ndarray, groups: int, codes: torch.Tensor, scales: torch.Tensor, threads: int
    ) -> None:
        rows, stride = raw.shape[0], groups * raw.shape[-1]
        self.kernels.lib.mxfp4_gguf_panels(
            raw.ctypes.data,
            stride,
            rows,
            groups,
            self.quant_lanes,
            codes.data_ptr(),
            scales.data_ptr(),
            threads,
        )

    # ---- per-op compute -----------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x, weight, eps)

    def store_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: RotaryTables | None,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if rope is None:  # rope_cache rotates: a layer without rotary stores through torch
            return super().store_kv(q, k, v, rope, slots, k_cache, v_cache)
        return self.kernels.rope_cache(q, k, v, rope.cos, rope.sin, slots, k_cache, v_cache, rope.interleaved)

    def serves_prefill(self, dtype: torch.dtype, masked: bool) -> bool:
        """Masked prefills, and fresh prompts where ours beats torch's flash kernel on this build
        (CpuKernels.prefill_fresh; docs/benchmarks.md)."""
        return self.kernels.supports(dtype) and (masked or self.kernels.prefill_fresh)

    def paged_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        chunk: int | None,
        sinks: torch.Tensor | None,
        block_table: torch.Tensor | None,
        context: int,
    ) -> torch.Tensor:
        return self.kernels.paged_prefill(q, k, v, scale, sliding_window, chunk, sinks, block_table, context)

    def paged_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        chunk: int | None = None,
        sinks: torch.Tensor | None = None,
        value_dim: int | None = None,
    ) -> torch.Tensor:
        return self.kernels.paged_decode(
            q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, chunk, sinks,
            value_dim=value_dim,
        )  # fmt: skip

    def head_matmul(self, x: torch.Tensor, w: torch.Tensor, transposed: bool = False) -> torch.Tensor:
        return self.kernels.head_matmul(x, w, transposed)

    @cached_property
    def _recurrent(self) -> RecurrentKernels | None:
        return RecurrentKernels.bind(self.kernels)

    def recurrent_steps(self) -> RecurrentKernels | None:
        return self._recurrent

    def native_decoder(self, dtype: torch.dtype) -> NativeDecoder | None:
        return NativeDecoder(self.kernels, dtype) if self.kernels.supports(dtype) else None


def ops_for(kernels: CpuKernels | None) -> Ops:
    """CpuOps over `kernels`, or TorchCpuOps for None (no library: no compiler, or off)."""
    return TORCH_CPU_OPS if kernels is None else CpuOps(kernels)


def cpu_ops(dtype: torch.dtype, deterministic: bool) -> Ops:
    """A CPU model's ops: our kernels where they build and serve its dtype, else torch's (oneDNN's
    packed linear where it serves a weight). deterministic=True keeps products of many rows on our
    kernels, whose row results do not depend on the row count (oneDNN's AMX matmul is not known to
    be batch-invariant)."""
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.supports(dtype):
        return TORCH_CPU_OPS
    if deterministic and kernels.onednn_bf16_rows is not None:
        kernels = copy.copy(kernels)
        kernels.onednn_bf16_rows = None
    return CpuOps(kernels)
