"""The seam through which a layer gets its compute: one `Ops` object per model, never None.

A layer calls ``self.ops.rms_norm(...)``, ``self.ops.store_kv(...)``, ``self.ops.head_matmul(...)``
and takes its weight forms from ``self.ops.linear_form(...)`` / ``self.ops.experts_form(...)``; it
never asks which backend runs it. The backend is chosen in one place, from the device, the dtype
and the deterministic setting (models/build.py `select_ops`):

- `TorchOps` (layers/torch_ops.py): torch on any device, dense weights;
- `TorchCpuOps` (cpu/ops.py): TorchOps with the weights packed for oneDNN's linear where it serves
  them (a CPU model our kernels do not serve);
- `CpuOps` (cpu/ops.py): our compiled CPU kernels, each op falling back to TorchOps where its
  kernel does not serve a dtype, shape or device.

The backend's own objects (its library, recurrent steps, native decoder) appear here only as the
protocols below: layers/ imports nothing of cpu/ (tests/test_import_graph.py).

Layers start on TorchOps (layers/torch_ops.py `TORCH_OPS`) and take the model's with `use_ops`
after loading (models/build.py).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from expertmesh.layers.expert_weights import ExpertsWeight
from expertmesh.layers.linear_weight import LinearWeight
from expertmesh.layers.quantization.packed import QuantizedProducts, QuantizedWeight
from expertmesh.layers.rotary import RotaryTables


class KernelLibrary(Protocol):
    """A backend's compiled library (cpu/cpu_kernels.py CpuKernels), opaque to layers: only the
    engine reads it, to lay out block-table decode metadata for it (engine/model_runner.py)."""


class RecurrentSteps(Protocol):
    """The recurrent mixers' in-place decode steps (cpu/recurrent_kernels.py RecurrentKernels)."""

    def conv_step(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        state: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor: ...

    def ssm_step(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        decay: torch.Tensor,
        d: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        groups: int,
    ) -> torch.Tensor: ...


class NativeDecode(Protocol):
    """Decode-only steps in one native call (cpu/native_decode.py NativeDecoder)."""

    dtype: torch.dtype

    def serves(self, ctx: Any) -> bool: ...

    def run(self, layers: list, positions: torch.Tensor, x: torch.Tensor, ctx: Any) -> torch.Tensor: ...

    def logits(
        self, model: Any, head: Any, ids: torch.Tensor, positions: torch.Tensor, ctx: Any
    ) -> torch.Tensor | None: ...


class Ops(QuantizedProducts, Protocol):
    """Every op and weight-form factory a layer uses; each backend implements all of them."""

    # The compiled library the engine lays out block-table decode metadata for
    # (engine/model_runner.py); None on TorchOps. Layers never read it.
    library: KernelLibrary | None
    # Whether native decode layers (cpu/native_decode.py) run on this backend's forms.
    native_decode: bool
    # Whether compressed weights multiply from their codes (False: dequantized per product).
    runs_codes: bool

    # ---- weight forms, chosen once after loading --------------------------------------------------
    def linear_form(self, param: nn.Parameter, float32_out: bool = False) -> LinearWeight:
        """An [out, in] parameter in its form for this backend (its dense storage released when
        another form holds it). `float32_out`: its products are asked for unrounded."""
        ...

    def chunked_linear_form(self, param: nn.Parameter, count: int) -> LinearWeight:
        """Deterministic mode's row-parallel weight in `count` fixed chunks of its input dim."""
        ...

    def quantized_form(self, param: nn.Parameter, kind: str, group: int) -> QuantizedWeight:
        """Online weight-only quantization of a parameter (its dense storage released)."""
        ...

    def experts_form(self, block: nn.Module) -> ExpertsWeight:
        """A FusedExperts block's float experts in their form for this backend."""
        ...

    def quantized_experts_form(
        self, block: nn.Module, pairs: list[tuple[LinearWeight, LinearWeight]]
    ) -> ExpertsWeight:
        """A FusedExperts block served from compressed (w13, w2) pairs, one a local expert."""
        ...

    def latent_expand_forms(
        self, w_uk: torch.Tensor, w_uv: torch.Tensor, rank: int
    ) -> tuple[LinearWeight, LinearWeight] | None:
        """Deterministic MLA: W_UK / W_UV [H, ., rank] in forms whose row results do not follow the
        thread count or the rank's heads; None: torch's product (not batch-invariant)."""
        ...

    # ---- per-op compute -----------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim in float32, the product with the weight in x's dtype."""
        ...

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
        """q, k rotated by `rope` (when given), k and v stored at `slots` of the caches (when bound)."""
        ...

    def serves_prefill(self, dtype: torch.dtype, masked: bool) -> bool:
        """Whether `paged_prefill` runs a prefill chunk of this dtype (`masked`: a cached context,
        a window or chunk cut, or sinks; else a fresh prompt seen whole)."""
        ...

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
        """A prefill chunk's attention, its cached context read from the blocks in place."""
        ...

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
        """Decode attention over block tables (laid out by the engine for `library` only)."""
        ...

    def head_matmul(self, x: torch.Tensor, w: torch.Tensor, transposed: bool = False) -> torch.Tensor:
        """x [B, H, K] times each head's w[h] ([K, N], or [N, K] transposed) -> [B, H, N]."""
        ...

    def recurrent_steps(self) -> RecurrentSteps | None:
        """The recurrent mixers' in-place decode steps, or None: their torch path."""
        ...

    def native_decoder(self, dtype: torch.dtype) -> NativeDecode | None:
        """Decode-only steps in one native call (cpu/native_decode.py), or None."""
        ...
