"""The model's ops (layers/ops.py): chosen in one place (models/build.py select_ops) from the
device, the dtype and the deterministic setting; CpuOps' ops equal TorchOps' (rotary + KV store
bit for bit, RMSNorm and per-head products within their sums' reordering); TorchOps refuses
block-table decode metadata by name."""

from __future__ import annotations

import pytest
import torch

from expertmesh.config.rope_config import RopeConfig
from expertmesh.cpu.ops import TORCH_CPU_OPS, CpuOps, ops_for
from expertmesh.layers.ops import Ops
from expertmesh.layers.rotary import RotaryEmbedding
from expertmesh.layers.torch_ops import TORCH_OPS, TorchOps
from expertmesh.models.build import select_ops


def test_the_backend_is_chosen_from_device_dtype_and_determinism(kernels, monkeypatch):
    assert select_ops("cuda", torch.bfloat16, False) is TORCH_OPS  # no CUDA needed: nothing is built
    assert select_ops("cpu", torch.float16, False) is TORCH_CPU_OPS  # a dtype our kernels do not serve
    ops = select_ops("cpu", torch.float32, False)
    assert isinstance(ops, CpuOps) and ops.library is not None and ops.runs_codes and ops.native_decode
    assert ops.quant_lanes == kernels.lanes
    # AMX's oneDNN hand-off of many-row products (as on an AMX CPU) stays off in deterministic mode,
    # on a copy: the loaded library (cpu_kernels.load() is cached) keeps it for other models
    monkeypatch.setattr(kernels, "onednn_bf16_rows", 64)
    assert select_ops("cpu", torch.bfloat16, False).library is kernels
    det = select_ops("cpu", torch.bfloat16, True)
    assert isinstance(det, CpuOps) and det.library.onednn_bf16_rows is None
    assert kernels.onednn_bf16_rows == 64
    assert ops_for(None) is TORCH_CPU_OPS and isinstance(ops_for(kernels), CpuOps)  # no library: torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_ops_equal_torch_ops(kernels, dtype):
    cpu: Ops = ops_for(kernels)
    torch_ops: Ops = TorchOps()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 96, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    # float32: the same operations, the sum in another order; bf16: at most one rounding apart
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-6), torch_ops.rms_norm(x, w, 1e-6), **tol)
    # rotary + store: the same q, k, v returned and the same cache rows written
    t, heads, kv, d, slots = 5, 4, 2, 16, torch.tensor([3, 0, 9, 4, 7])
    rope = RotaryEmbedding(RopeConfig(head_dim=d, max_position_embeddings=64)).lookup(torch.arange(t), dtype)
    q, k, v = (torch.randn(t, n, d, generator=g).to(dtype) for n in (heads, kv, kv))
    outs = []
    for ops in (cpu, torch_ops):
        caches = [torch.zeros(3, 4, kv, d, dtype=dtype) for _ in range(2)]
        outs.append((*ops.store_kv(q.clone(), k.clone(), v.clone(), rope, slots, *caches), *caches))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    # per-head products: the same sums in another order
    xh, wh = (
        torch.randn(3, heads, 24, generator=g).to(dtype),
        torch.randn(heads, 24, 40, generator=g).to(dtype),
    )
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(cpu.head_matmul(xh, wh), torch_ops.head_matmul(xh, wh), **tol)
    wt = wh.transpose(1, 2).contiguous()
    torch.testing.assert_close(cpu.head_matmul(xh, wt, True), torch_ops.head_matmul(xh, wt, True), **tol)


def test_torch_ops_refuse_block_table_decodes_by_name():
    q = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="decode block tables are laid out only for the compiled CPU"):
        TORCH_OPS.paged_decode(
            q, q, q, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0, None
        )
    assert not TORCH_OPS.serves_prefill(torch.float32, True) and TORCH_OPS.recurrent_steps() is None
    assert TORCH_OPS.rms_norm(torch.ones(1, 4), torch.ones(4), 0.0).eq(1).all()  # the next call works
