"""rope_cache's vectorised rows (cpu/csrc/token_ops.c) bit for bit against torch's rotary (RotaryTables.apply)
at prefill sizes: NeoX halves, GPT-J pairs and partial rotary, head dims 64 and 128, bfloat16 values
at rounding ties, huge, tiny, infinite and NaN, and float32 alike."""

import pytest
import torch

from expertmesh.config import RopeConfig
from expertmesh.cpu import cpu_kernels
from expertmesh.layers.rotary import RotaryEmbedding


def _values(shape, dtype, g):
    """Normal values with every tenth one replaced by a hard case for rounding."""
    x = torch.randn(shape, generator=g)
    special = torch.tensor([1e38, -3e38, 1e-38, 0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    pick = torch.randint(0, len(special), shape, generator=g)
    hard = torch.rand(shape, generator=g) < 0.1
    x = torch.where(hard, special[pick], x)
    if dtype == torch.bfloat16:  # exact bf16 values whose products land on ties and carries
        x = torch.where(torch.rand(shape, generator=g) < 0.2, torch.full(shape, 1.00390625), x)
    return x.to(dtype)


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bit for bit where not NaN (NaN's payload is the conversion's own), NaN at the same places."""
    nan = want.isnan()
    if not torch.equal(got.isnan(), nan):
        return False
    bits = torch.int16 if want.dtype == torch.bfloat16 else torch.int32
    return got.dtype == want.dtype and torch.equal(got[~nan].view(bits), want[~nan].view(bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "d,partial,interleaved",
    [(64, 1.0, False), (128, 1.0, False), (64, 1.0, True), (128, 0.5, False), (64, 0.5, True)],
)
def test_rope_cache_bit_equal_at_prefill_size(dtype, d, partial, interleaved):
    kernels = cpu_kernels.load()
    assert kernels is not None
    g = torch.Generator().manual_seed(d + int(interleaved))
    t, h, hk, bs = 301, 8, 4, 16
    rope = RopeConfig(
        head_dim=d, max_position_embeddings=4096, partial_rotary_factor=partial, interleaved=interleaved
    )
    tables = RotaryEmbedding(rope).lookup(torch.arange(1000, 1000 + t), dtype)
    qkv = _values((t, (h + 2 * hk) * d), dtype, g)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([h * d, hk * d, hk * d], dim=-1))
    slots = torch.randperm(32 * bs, generator=g)[:t]
    caches = [torch.zeros(32, bs, hk, d, dtype=dtype) for _ in range(2)]
    q_got, k_got, v_got = kernels.rope_cache(q, k, v, tables.cos, tables.sin, slots, *caches, interleaved)
    q_ref, k_ref = tables.apply(q, k)
    assert _same_bits(q_got, q_ref) and _same_bits(k_got, k_ref) and _same_bits(v_got, v)
    assert _same_bits(caches[0].view(-1, hk, d)[slots], k_ref)
    assert _same_bits(caches[1].view(-1, hk, d)[slots], v)
