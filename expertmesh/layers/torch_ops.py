"""`TorchOps`: the model's ops (layers/ops.py) through torch, on any device, the weights dense
(`pack` serves none). On the CPU, cpu/ops.py extends it: TorchCpuOps packs weights for oneDNN's linear
where it serves them (cpu/cpu_gemm.py), and our compiled kernels' CpuOps fall back to it per op."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from expertmesh.layers.expert_weights import ExpertsWeight, PerExpertWeights
from expertmesh.layers.linear_weight import ChunkedWeight, DenseWeight, LinearWeight, release
from expertmesh.layers.ops import KernelLibrary, NativeDecode, RecurrentSteps
from expertmesh.layers.quantization.packed import QuantizedWeight, torch_product
from expertmesh.layers.quantization.permuted import one_form
from expertmesh.layers.rotary import RotaryTables


class TorchOps:
    """Torch's products and attention; dense weights (packed where a subclass's `pack` serves
    them), dequantized codes."""

    library: KernelLibrary | None = None
    native_decode = False
    runs_codes = False
    quant_lanes = 8  # the codes' panel width when no kernel of ours reads them
    lays_mxfp4_blocks = False  # MXFP4 blocks reach the panels as int16 values (mxfp4_blocks.py)

    def pack(
        self, weight: torch.Tensor, float32_out: bool = False, in_place: bool = False
    ) -> LinearWeight | None:
        """A CPU backend's packed copy of an [out, in] weight (cpu/ops.py), or None: torch's F.linear
        on the dense weight. ``in_place``: the caller releases the weight afterwards."""
        return None

    # ---- weight forms -------------------------------------------------------------------------------
    def linear_form(self, param: nn.Parameter, float32_out: bool = False) -> LinearWeight:
        """Packed for its best kernel (`pack`; the dense storage then released: every weight held
        once), or the parameter itself where none serves it."""
        packed = self.pack(param, float32_out=float32_out, in_place=True)
        if packed is None:
            return DenseWeight(param)
        release(param)
        return packed

    def chunked_linear_form(self, param: nn.Parameter, count: int) -> LinearWeight:
        """One packed weight per fixed chunk (the same shapes in every layout); dense where no
        kernel serves it (F.linear on float32-widened operands). The whole dense weight is released.
        Off the CPU no kernel packs it: slices of the dense parameter, taken at the first product."""
        if param.device.type != "cpu":
            return ChunkedWeight(param, count)
        width = param.shape[1] // count
        chunks = []
        for j in range(count):
            dense = param.data[:, j * width : (j + 1) * width].contiguous()
            chunks.append(self.pack(dense, float32_out=True) or dense)
        release(param)
        return ChunkedWeight(param, count, chunks)

    def quantized_form(self, param: nn.Parameter, kind: str, group: int) -> QuantizedWeight:
        weight = QuantizedWeight.quantize(param.data, kind, group, self)
        release(param)
        return weight

    def experts_form(self, block: nn.Module) -> ExpertsWeight:
        """One packed pair a local expert (`pack`) where a kernel serves every one, else the
        block's form as it is (the dense stacks through torch). Deterministic mode keeps the dense
        stacks (their fixed chunks in pair_sums)."""
        if block.fixed_chunks:
            return block.experts_form
        return self.per_expert_form(block)

    def per_expert_form(self, block: nn.Module) -> ExpertsWeight:
        pairs = [
            (
                self.pack(block.w13[e]),
                self.pack(block.w2[e], float32_out=True),
            )
            for e in range(len(block.expert_ids))
        ]
        if not pairs or not all(a is not None and b is not None for a, b in pairs):
            return block.experts_form
        release(block.w13)
        release(block.w2)
        return PerExpertWeights(pairs)

    def quantized_experts_form(
        self, block: nn.Module, pairs: list[tuple[LinearWeight, LinearWeight]]
    ) -> ExpertsWeight:
        """Each expert's compressed pair on the per-expert path (one form a slot: desc_act's too)."""
        w13s, w2s = (one_form([p[i] for p in pairs]) for i in (0, 1))
        return PerExpertWeights(list(zip(w13s, w2s, strict=True)))

    def latent_expand_forms(
        self, w_uk: torch.Tensor, w_uv: torch.Tensor, rank: int
    ) -> tuple[LinearWeight, LinearWeight] | None:
        return None  # torch's product (deterministic MLA needs our panels)

    # ---- quantized products -----------------------------------------------------------------------
    def gemm_q(
        self, w: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        return torch_product(w, x, bias)

    def gemm_q_native(
        self, w: QuantizedWeight, dtype: torch.dtype, keep: list, float32_out: bool
    ) -> dict | None:
        return None

    def mxfp4_block_panels(
        self, raw: np.ndarray, groups: int, codes: torch.Tensor, scales: torch.Tensor, threads: int
    ) -> None:
        raise NotImplementedError("torch's ops lay no MXFP4 blocks (lays_mxfp4_blocks is False)")

    # ---- per-op compute -----------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

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
        if rope is not None:
            q, k = rope.apply(q, k)
        v = v.contiguous()
        if k_cache.numel():
            k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
            v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)
        return q, k, v

    def serves_prefill(self, dtype: torch.dtype, masked: bool) -> bool:
        return False  # the layer's own torch prefill (SDPA, or the sink attention)

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
        raise NotImplementedError("torch prefill runs in the attention layer (serves_prefill is False)")

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
        raise ValueError(
            "decode block tables are laid out only for the compiled CPU kernels (Ops.library); "
            "the torch path attends over decode groups"
        )

    def head_matmul(self, x: torch.Tensor, w: torch.Tensor, transposed: bool = False) -> torch.Tensor:
        return torch.matmul(x.transpose(0, 1), w.transpose(1, 2) if transposed else w).transpose(0, 1)

    def recurrent_steps(self) -> RecurrentSteps | None:
        return None

    def native_decoder(self, dtype: torch.dtype) -> NativeDecode | None:
        return None


TORCH_OPS = TorchOps()  # every layer's ops until the model's are chosen (models/build.py)
