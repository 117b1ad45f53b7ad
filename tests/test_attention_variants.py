"""Sliding windows, chunked local attention and attention sinks exactly as transformers does them:
our masks against transformers' mask functions; decode attention on both paths (our CPU kernel
reading the paged cache in place, and the torch path gathering blocks) against a dense eager
reference with sinks; prefill with sinks against GPT-OSS's own eager attention."""

import random

import pytest
import torch
from transformers.masking_utils import chunked_causal_mask_function, sliding_window_causal_mask_function
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from expertmesh.cpu import cpu_kernels
from expertmesh.layers.attention import (
    Attention,
    AttentionMetadata,
    DecodeGroup,
    decode_key_mask,
    prefill_mask,
)


def _hf_mask(fn, n: int) -> torch.Tensor:
    zero = torch.zeros((), dtype=torch.long)
    return fn(zero, zero, torch.arange(n)[:, None], torch.arange(n)[None, :]).expand(n, n)


@pytest.mark.parametrize("window,chunk", [(1, None), (5, None), (31, None), (None, 4), (None, 16)])
def test_masks_equal_transformers(window, chunk):
    n = 40
    if window is not None:
        ref = _hf_mask(sliding_window_causal_mask_function(window), n)
    else:
        ref = _hf_mask(chunked_causal_mask_function(chunk, torch.zeros(1, dtype=torch.long)), n)
    pos = torch.arange(n)
    assert torch.equal(prefill_mask(pos, pos, window, chunk), ref)
    # A decode sees what the last row of a prefill of its length sees.
    lens = torch.arange(1, n + 1)
    decode = decode_key_mask(lens, n, window, chunk)[:, 0, 0]
    assert torch.equal(decode, ref)


def _case(lens, heads, kv_heads, d, block_size=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-n // block_size) for n in lens]
    blocks = sum(need) + 2
    k_cache = torch.randn(blocks, block_size, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, d, generator=g).to(dtype)
    free = list(range(blocks))
    rng.shuffle(free)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)])
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    sinks = torch.randn(heads, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), sinks


def _eager_decode(q, k_cache, v_cache, tables, lens, scale, window, chunk, sinks):
    """Dense float64 attention of each newest token over its visible keys, sinks in the denominator."""
    out = torch.empty(q.shape, dtype=torch.float64)
    hk = k_cache.shape[2]
    group = q.shape[1] // hk
    for b, n in enumerate(lens.tolist()):
        k = k_cache[tables[b].long()].reshape(-1, hk, q.shape[2])[:n].double()
        v = v_cache[tables[b].long()].reshape(-1, hk, q.shape[2])[:n].double()
        visible = prefill_mask(torch.tensor([n - 1]), torch.arange(n), window, chunk)[0]
        for h in range(q.shape[1]):
            s = (k[visible, h // group] @ q[b, h].double()) * scale
            if sinks is not None:
                s = torch.cat((s, sinks[h : h + 1].double()))
            p = torch.softmax(s, 0)[: int(visible.sum())]
            out[b, h] = p @ v[visible, h // group]
    return out


def _torch_decode(q, k_cache, v_cache, tables, lens, scale, window, chunk, sinks):
    heads, hk, d = q.shape[1], k_cache.shape[2], q.shape[2]
    attn = Attention(heads, hk, d, scale, window, chunk=chunk, sinks=sinks is not None)
    if sinks is not None:
        attn.sinks.data.copy_(sinks)
    attn.k_cache, attn.v_cache = k_cache, v_cache
    group = DecodeGroup(0, q.shape[0], tables.long(), lens.long(), k_cache.shape[1])
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), q.shape[0], [group], [])
    return attn._decode(q, meta), attn


CASES = [  # (lens, heads, kv heads, head dim, window, chunk, sinks)
    ([1, 9, 40, 17], 4, 2, 16, None, None, True),
    ([1, 9, 40, 17], 4, 2, 16, 5, None, True),  # windows shorter and longer than contexts
    ([30, 33, 64, 2], 4, 4, 24, None, 16, False),  # chunk starts, a token first in its chunk
    ([30, 33, 64, 2], 8, 2, 64, 12, 16, True),  # window and chunk together, sinks, GQA 4
]


@pytest.mark.parametrize("lens,heads,kv_heads,d,window,chunk,sinks", CASES)
def test_decode_both_paths_equal_eager(lens, heads, kv_heads, d, window, chunk, sinks):
    q, kc, vc, tables, lt, s = _case(lens, heads, kv_heads, d)
    s = s if sinks else None
    scale = d**-0.5
    want = _eager_decode(q, kc, vc, tables, lt, scale, window, chunk, s).float()
    got_torch, attn = _torch_decode(q, kc, vc, tables, lt, scale, window, chunk, s)
    torch.testing.assert_close(got_torch, want, atol=1e-5, rtol=1e-5)
    kernels = cpu_kernels.load()
    assert kernels is not None
    got_kernel = kernels.paged_decode(q, kc, vc, tables, lt, scale, window, chunk, s)
    torch.testing.assert_close(got_kernel, want, atol=1e-5, rtol=1e-5)
    if sinks:  # the sink took probability mass: without it the result differs
        plain = kernels.paged_decode(q, kc, vc, tables, lt, scale, window, chunk, None)
        assert not torch.allclose(plain, want, atol=1e-3)


def test_prefill_with_sinks_and_window_equals_gpt_oss_eager():
    g = torch.Generator().manual_seed(3)
    n, heads, kv_heads, d, window = 37, 4, 2, 16, 8
    q = torch.randn(n, heads, d, generator=g)
    k, v = torch.randn(n, kv_heads, d, generator=g), torch.randn(n, kv_heads, d, generator=g)
    attn = Attention(heads, kv_heads, d, d**-0.5, window, sinks=True)
    attn.sinks.data.copy_(torch.randn(heads, generator=g))
    got = attn._prefill(q, k, v)

    class Module:  # what transformers' eager attention reads from its module
        num_key_value_groups, sinks, training = heads // kv_heads, attn.sinks, False

    pos = torch.arange(n)
    mask = torch.zeros(1, 1, n, n).masked_fill(
        ~prefill_mask(pos, pos, window, None), torch.finfo(torch.float32).min
    )
    ref, _ = eager_attention_forward(
        Module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, d**-0.5
    )
    torch.testing.assert_close(got, ref[0], atol=1e-5, rtol=1e-5)


def test_paged_decode_rejects_wrong_sinks():
    q, kc, vc, tables, lt, s = _case([5], 4, 2, 16)
    kernels = cpu_kernels.load()
    with pytest.raises(ValueError, match="sinks must be \\[4\\]"):
        kernels.paged_decode(q, kc, vc, tables, lt, 1.0, None, None, s[:3])
