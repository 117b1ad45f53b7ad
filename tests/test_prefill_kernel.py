"""The prefill attention kernel (cpu/csrc/prefill*.c paged_prefill) against the torch path it replaces
(SDPA with a causal / window / chunk mask, `_sink_attention` with sinks) at uneven shapes: fresh
prompts read from the new rows, chunks over a cached context read from blocks in no particular
order, GQA, head dims that are and are not whole vectors (odd ones too: bf16 pairs end in a
zero), float32 and bfloat16; the same cases on the builds other CPUs take (AVX-512 without
AVX512-BF16, 8 lanes); bf16's error against float32 next to its output's own rounding; then a
layer's forward over a mixed step (decodes, a fresh prompt, a chunk over a context) on both paths."""

import pytest
import torch

from expertmesh.cpu import cpu_kernels, kernel_library
from expertmesh.cpu.ops import ops_for
from expertmesh.layers.attention import Attention, AttentionMetadata, DecodeGroup, PrefillChunk

BS = 4  # block size: positions run across many blocks


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels.load()
    assert k is not None, "the CPU kernels must build here"
    return k


def _layer(heads, kv_heads, d, window, chunk, sinks, g):
    attn = Attention(heads, kv_heads, d, d**-0.5, window, chunk=chunk, sinks=sinks)
    if sinks:
        attn.sinks.data.copy_(torch.randn(heads, generator=g) * 2)
    return attn


def _paged(k_all, v_all, g):
    """k_all / v_all [S, Hk, D] into caches of shuffled blocks (plus spare ones) -> caches, table."""
    s, hk, d = k_all.shape
    blocks = -(-s // BS)
    table = torch.randperm(blocks + 3, generator=g)[:blocks]
    kc = torch.randn(blocks + 3, BS, hk, d, generator=g).to(k_all.dtype)
    vc = torch.randn(blocks + 3, BS, hk, d, generator=g).to(k_all.dtype)
    for p in range(s):
        kc[table[p // BS], p % BS], vc[table[p // BS], p % BS] = k_all[p], v_all[p]
    return kc, vc, table


def _reference(attn, q, k_all, v_all, ctx):
    """The torch path in float32 over the same (possibly bf16-valued) inputs."""
    chunk = PrefillChunk(0, q.shape[0], ctx, torch.zeros(1, dtype=torch.long)) if ctx else None
    return attn._prefill(q.float(), k_all.float(), v_all.float(), chunk)


CASES = [  # (L, context, heads, kv heads, head dim, window, chunk, sinks)
    (1, 0, 4, 4, 64, None, None, False),
    (2, 0, 4, 1, 64, None, None, False),  # GQA 4
    (17, 0, 8, 2, 128, None, None, False),
    (130, 0, 4, 1, 64, None, None, False),  # several row blocks and key blocks, GQA 4
    (130, 0, 2, 2, 72, 37, None, False),  # a head dim of 9 lanes; window
    (17, 0, 4, 1, 20, None, 8, True),  # a head dim under one vector; chunk; sinks
    (1, 40, 4, 1, 64, None, None, False),  # one row over a cached context
    (17, 70, 4, 4, 128, 25, None, False),  # window reaching back into the context
    (130, 45, 8, 2, 64, None, 48, True),  # chunk starts inside the context and the rows
    (2, 9, 4, 1, 72, 5, None, True),
    (130, 200, 4, 1, 64, 40, 64, True),  # window and chunk together (each one cutting)
    # odd head dims: bf16 pairs end in (x, 0); keys not in whole groups of 16 (the K transposes)
    (45, 0, 6, 2, 33, None, None, False),  # GQA 3
    (70, 19, 4, 2, 9, None, 16, True),  # under one 16-pair transpose; through the table
    (150, 0, 3, 1, 130, 50, None, False),  # 65 pairs: whole transposes and a masked one
    (33, 100, 2, 1, 1, 70, None, False),  # a head dim of 1: no whole pair at all
]


@pytest.fixture(scope="module")
def no_bf16_kernels(kernels, tmp_path_factory):
    """AVX-512 without AVX512-BF16 (Skylake-X, Ice Lake): 16 lanes, bf16 widened to float32."""
    if kernels.lanes != 16:
        pytest.skip("this CPU has no AVX-512")
    compiler = kernel_library.compiler()
    out = tmp_path_factory.mktemp("no-bf16") / "no-bf16.so"
    return cpu_kernels.build(out, compiler, ("-mno-avx512bf16", "-O1"))  # -O1: a quicker build


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length,ctx,heads,kv_heads,d,window,chunk,sinks", CASES)
def test_prefill_kernel_equals_torch_path(
    kernels, dtype, length, ctx, heads, kv_heads, d, window, chunk, sinks
):
    _check(kernels, dtype, length, ctx, heads, kv_heads, d, window, chunk, sinks)


@pytest.mark.parametrize("build", ["no_bf16_kernels", "generic_kernels"])
def test_prefill_kernel_other_builds(request, build):
    """Every case on the builds without pair products: AVX-512 without AVX512-BF16 (16 lanes) and
    -mno-avx512f (8 lanes; torch keeps fresh prompts there, chunks over a context come here)."""
    other = request.getfixturevalue(build)
    assert not other.bf16_pairs
    for case in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            _check(other, dtype, *case)


def test_bf16_error_next_to_output_rounding(kernels):
    """bf16 on AVX512-BF16 multiplies pairs of bf16: q . k exactly (products of bf16 are exact in
    float32), p . v with the probabilities rounded to bf16. Against the float32 torch path its
    error stays near the bf16 output's own rounding (measured 1.1-1.25x; 1.0x with float32
    probabilities), far inside the elementwise tolerance above: a long prompt, GQA 2, and an odd
    head dim over a cached context."""
    for length, ctx, heads, kv_heads, d in [(300, 0, 8, 4, 64), (150, 60, 6, 2, 33)]:
        g = torch.Generator().manual_seed(d)
        attn = _layer(heads, kv_heads, d, None, None, False, g)
        q = (torch.randn(length, heads, d, generator=g) * 2).bfloat16()
        k_all, v_all = (torch.randn(ctx + length, kv_heads, d, generator=g).bfloat16() for _ in range(2))
        want = _reference(attn, q, k_all, v_all, ctx)
        kc, vc, table = _paged(k_all, v_all, g)
        got = kernels.paged_prefill(q, kc, vc, attn.scale, block_table=table.int(), context=ctx).float()
        rounding = (want.bfloat16().float() - want).pow(2).mean().sqrt()
        assert (got - want).pow(2).mean().sqrt() < 1.5 * rounding


def _check(kernels, dtype, length, ctx, heads, kv_heads, d, window, chunk, sinks):
    g = torch.Generator().manual_seed(length * 1000 + ctx + d)
    attn = _layer(heads, kv_heads, d, window, chunk, sinks, g)
    s = ctx + length
    q = (torch.randn(length, heads, d, generator=g) * 2).to(dtype)
    k_all, v_all = (torch.randn(s, kv_heads, d, generator=g).to(dtype) for _ in range(2))
    want = _reference(attn, q, k_all, v_all, ctx)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)
    if not ctx:  # the new rows themselves, and the same rows read through a block table
        got = kernels.paged_prefill(q, k_all, v_all, attn.scale, window, chunk, attn.sinks)
        torch.testing.assert_close(got.float(), want, **tol)
        assert got.dtype == dtype
    kc, vc, table = _paged(k_all, v_all, g)
    got = kernels.paged_prefill(q, kc, vc, attn.scale, window, chunk, attn.sinks, table.int(), ctx)
    torch.testing.assert_close(got.float(), want, **tol)
    if sinks:  # the sinks took probability mass: without them the result differs
        plain = kernels.paged_prefill(q, kc, vc, attn.scale, window, chunk, None, table.int(), ctx)
        assert not torch.allclose(plain.float(), want, atol=1e-3)


def test_prefill_kernel_reads_token_strided_rows(kernels):
    """q, k and v as views of one fused qkv output, as a layer without rotary passes them."""
    g = torch.Generator().manual_seed(5)
    length, heads, kv_heads, d = 33, 4, 2, 64
    qkv = torch.randn(length, (heads + 2 * kv_heads) * d, generator=g)
    q = qkv[:, : heads * d].view(length, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(length, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(length, kv_heads, d)
    attn = _layer(heads, kv_heads, d, None, None, False, g)
    got = kernels.paged_prefill(q, k, v, attn.scale)
    torch.testing.assert_close(got, attn._prefill(q, k, v), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_forward_mixed_step_both_paths(kernels, dtype):
    """Two decodes, a fresh prompt and a chunk over a cached context in one step: the layer with
    our kernels (paged decode and prefill) equals the torch path (gathers, SDPA)."""
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, d, blocks = 8, 2, 64, 40
    lens = [9, 23]  # the decodes' lengths, the new token included
    fresh, ctx, new = 19, 30, 13
    tables = torch.randperm(blocks, generator=g)
    seq_tables = [tables[0:3], tables[3:9], tables[9:14], tables[14:25]]  # decodes, fresh, chunk
    t = len(lens) + fresh + new
    q, k, v = (torch.randn(t, n, d, generator=g).to(dtype) for n in (heads, kv_heads, kv_heads))
    caches = [torch.randn(2, blocks, BS, kv_heads, d, generator=g).to(dtype) for _ in range(2)]
    caches[1].copy_(caches[0])
    positions = [n - 1 for n in lens] + list(range(fresh)) + list(range(ctx, ctx + new))
    owner = [0, 1] + [2] * fresh + [3] * new
    slots = torch.tensor(
        [int(seq_tables[o][p // BS]) * BS + p % BS for o, p in zip(owner, positions, strict=True)]
    )
    out = []
    for use_kernels, cache in zip((True, False), caches, strict=True):
        attn = _layer(heads, kv_heads, d, 21, None, True, torch.Generator().manual_seed(2))
        attn.bind_kv_cache(cache)
        attn.use_ops(ops_for(kernels if use_kernels else None))
        prefills = [
            PrefillChunk(len(lens), fresh),
            PrefillChunk(len(lens) + fresh, new, ctx, seq_tables[3]),
        ]
        meta = AttentionMetadata(slots, len(lens), [], prefills)
        if use_kernels:
            width = max(len(seq_tables[0]), len(seq_tables[1]))
            padded = [torch.cat((s, s.new_zeros(width - len(s)))) for s in seq_tables[:2]]
            meta.decode_block_tables = torch.stack(padded).int()
            meta.decode_context_lens = torch.tensor(lens, dtype=torch.int32)
        else:
            width = max(len(seq_tables[0]), len(seq_tables[1]))
            padded = torch.stack([torch.cat((s, s.new_zeros(width - len(s)))) for s in seq_tables[:2]])
            meta.decode_groups = [DecodeGroup(0, 2, padded, torch.tensor(lens), BS)]
        out.append(attn(q, k, v, meta))
    torch.testing.assert_close(caches[0], caches[1], atol=0, rtol=0)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(out[0].float(), out[1].float(), **tol)


def test_prefill_kernel_rejects_bad_inputs(kernels):
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    kc = torch.randn(3, BS, 2, 16)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.paged_prefill(q, k[:4], k[:4], 1.0)  # 4 rows of keys for 5 queries
    with pytest.raises(ValueError, match="do not fit"):
        kernels.paged_prefill(torch.randn(5, 3, 16), k, k, 1.0)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="int32"):
        kernels.paged_prefill(q, kc, kc, 1.0, block_table=torch.tensor([0, 1]), context=3)
    with pytest.raises(ValueError, match="covering 8"):
        kernels.paged_prefill(q, kc, kc, 1.0, block_table=torch.tensor([0], dtype=torch.int32), context=3)
    with pytest.raises(ValueError, match="sinks"):
        kernels.paged_prefill(q, k, k, 1.0, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="dtype"):
        kernels.paged_prefill(q, k.bfloat16(), k.bfloat16(), 1.0)
