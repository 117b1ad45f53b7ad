"""expertmesh's compiled CPU kernels against torch's own ops, and the engine with and without them.

The kernels are compiled here from cpu/csrc/cpu_kernels.c; this machine image has a C compiler, so
a failed build is a test failure, not a skip.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from expertmesh import LLM, SamplingParams
from expertmesh.config import RopeConfig
from expertmesh.cpu import cpu_gemm, cpu_kernels
from expertmesh.cpu.expert_forms import PanelStacks
from expertmesh.cpu.ops import ops_for
from expertmesh.layers.fused_moe import FusedExperts
from expertmesh.layers.norm import RMSNorm
from expertmesh.layers.rotary import RotaryEmbedding


def _key_mask(lens: list[int], max_len: int, window: int | None) -> torch.Tensor:
    """[B, 1, 1, max_len]: the newest token (position len - 1) sees key j when j <= len - 1 and,
    with a sliding window, when it is fewer than `window` positions back. Written here, element
    by element, as the reference (not the engine's decode_key_mask)."""
    mask = torch.zeros(len(lens), 1, 1, max_len, dtype=torch.bool)
    for b, n in enumerate(lens):
        for j in range(max_len):
            mask[b, 0, 0, j] = j <= n - 1 and (window is None or (n - 1) - j < window)
    return mask


def _tolerance(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


# ---- matmul ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features", [(64, 32), (37, 24), (3, 8), (130, 200)])
def test_linear_matches_torch(kernels, dtype, out_features, in_features):
    """Every row count the tiles special-case (0..9, 13, 17, 33, 300, 513), out_features not a multiple of
    the panel width, odd in_features, with and without bias, 2-D and 3-D inputs."""
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype)
    packed = kernels.pack(w)
    assert packed.data.shape == kernels.panel_shape(out_features, in_features, dtype)
    for m in [*range(10), 13, 17, 33, 300, 513]:  # 300, 513: several row blocks of 256
        x = torch.randn(m, in_features, generator=g).to(dtype)
        want = F.linear(x.float(), w.float()).to(dtype)
        torch.testing.assert_close(kernels.linear(x, packed), want, **_tolerance(dtype))
        want_b = F.linear(x.float(), w.float(), b.float()).to(dtype)
        torch.testing.assert_close(kernels.linear(x, packed, b), want_b, **_tolerance(dtype))
    x3 = torch.randn(2, 5, in_features, generator=g).to(dtype)
    torch.testing.assert_close(
        kernels.linear(x3, packed), F.linear(x3.float(), w.float()).to(dtype), **_tolerance(dtype)
    )
    # A non-contiguous input (a column slice) is read correctly.
    wide = torch.randn(7, in_features * 2, generator=g).to(dtype)
    x = wide[:, ::2]
    torch.testing.assert_close(
        kernels.linear(x, packed), F.linear(x.float(), w.float()).to(dtype), **_tolerance(dtype)
    )


def test_linear_rejects_mismatched_input(kernels):
    packed = kernels.pack(torch.randn(16, 8))
    with pytest.raises(ValueError, match=r"does not fit weight \[16, 8\]"):
        kernels.linear(torch.randn(2, 9), packed)
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.linear(torch.randn(2, 8, dtype=torch.bfloat16), packed)


def test_pack_choice(kernels):
    """float32 weights go to our panels, bfloat16 too where the CPU has pair products (else oneDNN,
    and where oneDNN has no bf16 path either, as on AVX2-only CPUs, our widening kernel); without
    our kernels everything goes to oneDNN (bf16 to F.linear where oneDNN cannot take it)."""
    assert isinstance(cpu_gemm.pack(torch.randn(8, 8), kernels), cpu_kernels.PanelWeight)
    bf16 = cpu_gemm.pack(torch.randn(8, 8, dtype=torch.bfloat16), kernels)
    onednn_bf16 = cpu_gemm.onednn_bf16()
    want = cpu_kernels.PanelWeight if kernels.bf16_pairs or not onednn_bf16 else cpu_gemm.OneDnnWeight
    assert isinstance(bf16, want)
    no_kernels = cpu_gemm.pack(torch.randn(8, 8, dtype=torch.bfloat16), None)
    assert isinstance(no_kernels, cpu_gemm.OneDnnWeight) if onednn_bf16 else no_kernels is None
    assert isinstance(cpu_gemm.pack(torch.randn(8, 8), None), cpu_gemm.OneDnnWeight)
    assert cpu_gemm.pack(torch.randn(8, 8, dtype=torch.float64), kernels) is None


# ---- paged decode attention -------------------------------------------------------------------
def _paged_case(dtype, lens, heads, kv_heads, head_dim, block_size=16, seed=0):
    """A cache with each sequence's blocks scattered in random order, plus the dense K/V per sequence."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    width = max(need)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)])
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def _reference_decode(q, k_cache, v_cache, tables, lens, scale, window):
    """torch SDPA over K/V gathered densely, with the key mask written in this test."""
    b, _, d = q.shape
    _, bs, hk, _ = k_cache.shape
    blocks = tables.long().flatten()
    k = k_cache[blocks].view(b, -1, hk, d).transpose(1, 2).float()
    v = v_cache[blocks].view(b, -1, hk, d).transpose(1, 2).float()
    mask = _key_mask(lens.tolist(), tables.shape[1] * bs, window)
    y = F.scaled_dot_product_attention(
        q.float().unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return y.squeeze(2).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lens,heads,kv_heads,head_dim,window",
    [
        ([1, 17, 16, 100, 3], 8, 4, 64, None),  # uneven lengths, block edges, GQA 2
        ([40], 4, 4, 128, None),  # batch 1 (heads split over threads), MHA, D=128
        ([33, 5, 64], 6, 2, 24, None),  # a head size the kernel does not specialise
        ([50, 10, 200], 8, 1, 64, 16),  # sliding window shorter and longer than contexts
        ([5, 40, 17, 33], 32, 4, 64, None),  # 32 query heads in one task (the AVX-512 bf16 task's most)
        ([20, 3], 64, 4, 128, None),  # more than it holds: the generic task
    ],
)
def test_paged_decode_matches_sdpa(kernels, dtype, lens, heads, kv_heads, head_dim, window):
    q, kc, vc, tables, lt = _paged_case(dtype, lens, heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    got = kernels.paged_decode(q, kc, vc, tables, lt, scale, window)
    want = _reference_decode(q, kc, vc, tables, lt, scale, window)
    torch.testing.assert_close(got, want, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lens,heads,rank,rope",
    [
        ([1, 17, 16, 100, 3], 16, 512, 64),  # DeepSeek's 576-wide row (the specialised path)
        ([40], 8, 32, 8),  # batch 1: query heads split over threads, one shared row
        ([33, 5, 64], 3, 24, 6),  # odd head count and widths
    ],
)
def test_paged_decode_latent_row_matches_sdpa(kernels, dtype, lens, heads, rank, rope):
    """The multi-head latent attention path: one cache row per token shared by every query head
    (Hk = 1, v_cache = k_cache); keys are the whole row, values its first `rank` entries."""
    q, cache, _, tables, lt = _paged_case(dtype, lens, heads, 1, rank + rope, seed=3)
    scale = 0.1
    got = kernels.paged_decode(q, cache, cache, tables, lt, scale, None, value_dim=rank)
    assert got.shape == (len(lens), heads, rank)
    blocks = tables.long().flatten()
    rows = cache[blocks].view(len(lens), 1, -1, rank + rope).float()
    mask = _key_mask(lt.tolist(), tables.shape[1] * 16, None)
    want = F.scaled_dot_product_attention(
        q.float().unsqueeze(2), rows, rows[..., :rank], attn_mask=mask, scale=scale, enable_gqa=True
    )
    torch.testing.assert_close(got, want.squeeze(2).to(dtype), **_tolerance(dtype))


def test_paged_decode_rejects_bad_inputs(kernels):
    q, kc, vc, tables, lt = _paged_case(torch.float32, [5], 2, 2, 8)
    with pytest.raises(ValueError, match="int32"):
        kernels.paged_decode(q, kc, vc, tables.long(), lt, 1.0, None)
    with pytest.raises(ValueError, match="v_cache must be contiguous"):
        kernels.paged_decode(q, kc, vc.to(torch.bfloat16), tables, lt, 1.0, None)
    with pytest.raises(ValueError, match="value_dim 9 do not fit"):
        kernels.paged_decode(q, kc, vc, tables, lt, 1.0, None, value_dim=9)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.paged_decode(q, kc, vc[..., :4].contiguous(), tables, lt, 1.0, None)


# ---- the engine with and without kernels ------------------------------------------------------
def test_engine_same_tokens_without_kernels(checkpoint, monkeypatch):
    """Greedy tokens with our kernels equal those of the torch/oneDNN path they replace."""
    path = checkpoint("mixtral")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 100) for _ in range(n)]} for n in (1, 7, 33, 70)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run():
        llm = LLM(model=path, max_model_len=128, kv_cache_memory_bytes=1 << 22, max_num_seqs=4)
        kernels = llm.llm_engine.runner.kernels
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], kernels

    with_kernels, used = run()
    assert used is not None
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    without, unused = run()
    assert unused is None
    assert with_kernels == without


# ---- routed experts in one call ---------------------------------------------------------------
def _experts(expert_ids, act, seed=0, hidden=41, inter=23, num_experts=6, dtype=torch.float32):
    torch.manual_seed(seed)
    fe = FusedExperts(num_experts, expert_ids, hidden, inter, 0, 1, act, dtype)
    fe.w13.data.normal_(0, 0.3)
    fe.w2.data.normal_(0, 0.3)
    return fe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("expert_ids", [[0, 1, 2, 3, 4, 5], [1, 3, 4]])  # all, or some (EP: -1 slots)
def test_fused_moe_matches_torch_path(kernels, dtype, act, expert_ids, monkeypatch):
    """Uneven routing (one expert gets most tokens, some none), 0, 1 and many tokens, top-1..3;
    odd hidden and intermediate sizes (bf16 pairs pad them); 37 tokens span three chunks."""
    if not kernels.moe_supports(dtype, act):
        pytest.skip(f"no fused {dtype} experts on this CPU (bf16 needs AVX512-BF16)")
    monkeypatch.setattr(kernels, "MOE_CHUNK", 16)
    torch_path = _experts(expert_ids, act, dtype=dtype)
    fused = _experts(expert_ids, act, dtype=dtype)
    exact = _experts(expert_ids, act, dtype=torch.float32)  # the same (bf16-rounded) weights in fp32
    exact.w13.data.copy_(torch_path.w13.float())
    exact.w2.data.copy_(torch_path.w2.float())
    fused.use_ops(ops_for(kernels))
    assert isinstance(fused.experts_form, PanelStacks) and fused.w13.numel() == 0  # dense copy dropped
    g = torch.Generator().manual_seed(1)
    for n, k in [(0, 2), (1, 2), (2, 1), (9, 2), (37, 3)]:
        x = torch.randn(n, 41, generator=g).to(dtype)
        ids = torch.randint(0, 6, (n, k), generator=g)
        ids[: n // 2, 0] = 4  # skew: expert 4 takes half the first choices
        ids[:, 1:] = torch.where(ids[:, 1:] == ids[:, :1], (ids[:, 1:] + 1) % 6, ids[:, 1:])
        w = torch.rand(n, k, generator=g)
        got = fused(x, ids, w)
        # A partial sum over this rank's experts: float32, rounded once by whoever adds the
        # ranks' partials (layers/moe.py), for both the kernel and the torch path.
        assert got.dtype == torch.float32 and torch_path(x, ids, w).dtype == torch.float32
        if dtype == torch.float32:
            torch.testing.assert_close(got, torch_path(x, ids, w), atol=1e-5, rtol=1e-5)
            continue
        # bf16: both paths against float32 arithmetic on the same inputs. The fused kernel keeps
        # float32 between its products; torch's path rounds to bf16 after each op. Ours must be
        # within bf16 rounding of the exact result and no further from it than torch's path.
        truth = exact(x.float(), ids, w)
        ours_err = (got.float() - truth).abs().max().item() if n else 0.0
        torch_err = (torch_path(x, ids, w).float() - truth).abs().max().item() if n else 0.0
        scale = truth.abs().max().item() if n else 1.0
        assert ours_err <= 2**-7 * scale + 1e-3, (n, ours_err, scale)
        assert ours_err <= torch_err + 2**-8 * scale, (n, ours_err, torch_err)


def test_fused_moe_dtype_choice(kernels):
    fe = FusedExperts(4, [0, 1, 2, 3], 16, 8, 0, 1, "silu", torch.bfloat16)
    fe.use_ops(ops_for(kernels))
    # bf16 experts: one fused call, on pair products (AVX512-BF16) or widening bf16 to float32
    # in registers (AVX2).
    assert isinstance(fe.experts_form, PanelStacks)
    assert fe.experts_form.w13.shape == (4, *kernels.panel_shape(16, 16, torch.bfloat16))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "phimoe"])
def test_engine_bf16_logprobs_close_to_transformers(checkpoint, family):
    """bfloat16 end to end (our bf16 kernels where the CPU has them): every generated position's
    full-vocabulary logprobs against transformers' bf16 forward over the same tokens (teacher
    forcing, so a bf16 near-tie cannot make the comparison diverge), prefill and decode steps.
    Mixtral: plain attention; Qwen2-MoE: qkv bias and a shared expert; PhiMoE: biases everywhere,
    LayerNorm and sparsemixer routing."""
    from checkpoints import prompts_of_lengths
    from transformers import AutoModelForCausalLM

    path = checkpoint(family)
    prompts = prompts_of_lengths([1, 9, 30, 17], seed=3)
    llm = LLM(path, dtype="bfloat16", max_model_len=128, kv_cache_memory_bytes=1 << 22)
    vocab = llm.llm_engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=vocab)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    errors = []
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0].float()
        ref = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].log_softmax(-1)
        for step, lps in enumerate(out.outputs[0].logprobs):
            ours = torch.tensor([lps[t].logprob for t in range(vocab)])
            errors.append((ours - ref[step]).abs().max().item())
    # bf16 keeps 8 bits of mantissa: two engines rounding in different places differ by a few
    # hundredths in logprob here (measured 0.01-0.04); a wrong kernel (a lost head, a stale
    # block, a dropped bias) differs by whole units at most positions.
    if family != "phimoe":
        assert max(errors) < 0.1, f"{family}: |logprob difference| per position {errors}"
    else:
        # sparsemixer's band test is a hard threshold on the router logits: one bf16 ulp there can
        # move an expert in or out of the softmax. Measured over 8 prompt sets (288 positions):
        # 11-12% of positions above 0.1 (32 with float32 attention probabilities, 35 with the bf16
        # ones paged_prefill_bf16 multiplies on AVX512-BF16, as torch's CPU flash kernel does),
        # medians 0.028; these prompts: 2 positions, at 0.16 and 0.59 (1 with float32 ones).
        assert sorted(errors)[-3] < 0.1 and max(errors) < 1.0, f"phimoe: per position {errors}"


# ---- RMSNorm and rotary + cache store -----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 5, 40])
def test_rms_norm_matches_reference(kernels, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    ref = RMSNorm(72, 1e-5, dtype)
    ref.weight.data = torch.randn(72, generator=g).to(dtype)
    x = (3 * torch.randn(rows, 72, generator=g)).to(dtype)
    want = ref(x)
    ref.use_ops(ops_for(kernels))
    got = ref(x)
    assert got.dtype == dtype and got.shape == x.shape
    # float32: same operations, summation order may differ; bf16: at most one rounding step apart
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 1, 3, 33])
def test_rope_cache_matches_torch(kernels, dtype, tokens):
    """Rotated q, k and the cache contents equal torch's rotary + index_copy, from strided views."""
    g = torch.Generator().manual_seed(tokens)
    h, hk, d, bs, blocks = 4, 2, 16, 4, 12
    rotary = RotaryEmbedding(RopeConfig(head_dim=d, max_position_embeddings=64))
    positions = torch.randint(0, 64, (tokens,), generator=g)
    tables = rotary.lookup(positions, dtype)
    cos, sin = tables.cos, tables.sin
    qkv = torch.randn(tokens, (h + 2 * hk) * d, generator=g).to(dtype)
    q, k, v = qkv.split([h * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(-1, h, d), k.view(-1, hk, d), v.view(-1, hk, d)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    caches = [torch.zeros(blocks, bs, hk, d, dtype=dtype) for _ in range(4)]
    q_ref, k_ref = tables.apply(q, k)
    caches[0].view(-1, hk, d).index_copy_(0, slots, k_ref)
    caches[1].view(-1, hk, d).index_copy_(0, slots, v.contiguous())
    q_got, k_got, v_got = kernels.rope_cache(q, k, v, cos, sin, slots, caches[2], caches[3])
    assert torch.equal(q_got, q_ref) and torch.equal(k_got, k_ref) and torch.equal(v_got, v)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


# ---- the generic vector path (CPUs without AVX-512) --------------------------------------------
def test_generic_path_without_avx512(generic_kernels):
    """The same source built with -mno-avx512f takes the 8-lane tiles and, for bf16, the widening
    GEMM and widening fused experts (no pair products): checked against torch like the native build."""
    generic = generic_kernels
    assert generic.lanes == 8 and not generic.bf16_pairs
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(37, 24, generator=g).to(dtype)
        b = torch.randn(37, generator=g).to(dtype)
        packed = generic.pack(w)
        assert packed.data.shape == (5, 24, 8)
        for m in (0, 1, 3, 5, 9, 300):
            x = torch.randn(m, 24, generator=g).to(dtype)
            want = F.linear(x.float(), w.float(), b.float()).to(dtype)
            torch.testing.assert_close(generic.linear(x, packed, b), want, **_tolerance(dtype))
    assert generic.moe_supports(torch.float32, "silu") and generic.moe_supports(torch.bfloat16, "silu")
    for dtype in (torch.float32, torch.bfloat16):
        ref, fused = _experts([1, 3, 4], "silu", dtype=dtype), _experts([1, 3, 4], "silu", dtype=dtype)
        fused.use_ops(ops_for(generic))
        assert isinstance(fused.experts_form, PanelStacks)
        for n in (0, 1, 21):
            x, ids, wt = (
                torch.randn(n, 41, generator=g).to(dtype),
                torch.randint(0, 6, (n, 2), generator=g),
                torch.rand(n, 2, generator=g),
            )
            # bf16: the torch path rounds after every op, the kernel keeps float32 between products
            tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
            torch.testing.assert_close(fused(x, ids, wt), ref(x, ids, wt), **tol)
    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, tables, lt = _paged_case(dtype, [1, 17, 40], 8, 4, 64)
        got = generic.paged_decode(q, kc, vc, tables, lt, 0.125, None)
        torch.testing.assert_close(
            got, _reference_decode(q, kc, vc, tables, lt, 0.125, None), **_tolerance(dtype)
        )
    # prefill attention's 8-lane vectors (a head dim of 9 of them, a tail block of keys) and rotary
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(45, n, 72, generator=g).to(dtype) for n in (4, 2, 2))
        want = F.scaled_dot_product_attention(
            *(t.float().transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, enable_gqa=True
        )[0].transpose(0, 1)
        tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)
        torch.testing.assert_close(generic.paged_prefill(q, k, v, 72**-0.5).float(), want, **tol)
        rotary = RotaryEmbedding(RopeConfig(head_dim=64, max_position_embeddings=64))
        tables = rotary.lookup(torch.arange(37) % 64, dtype)
        q, k = (torch.randn(37, n, 64, generator=g).to(dtype) for n in (4, 2))
        no_cache = torch.empty(0, dtype=torch.long), torch.empty(0), torch.empty(0)
        q_got, k_got, _ = generic.rope_cache(q, k, k, tables.cos, tables.sin, *no_cache)
        assert all(torch.equal(a, b) for a, b in zip((q_got, k_got), tables.apply(q, k), strict=True))


# ---- per-head products (multi-head latent attention's absorbed projections) -----------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 1, 5, 37])
@pytest.mark.parametrize("transposed", [False, True])
def test_head_matmul_matches_torch(kernels, dtype, tokens, transposed):
    """x [B, H, K] (a strided view, as the query's nope part is) times w[h] or w[h]^T."""
    g = torch.Generator().manual_seed(tokens)
    h, k, n = 3, 24, 40
    q = torch.randn(tokens, h, k + 8, generator=g).to(dtype)
    x = q[..., :k]  # row strides of the wider query
    w = (
        torch.randn(h, n, k, generator=g).to(dtype)
        if transposed
        else torch.randn(h, k, n, generator=g).to(dtype)
    )
    wk = w.transpose(1, 2) if transposed else w
    want = torch.einsum("bhk,hkn->bhn", x.float(), wk.float()).to(dtype)
    got = kernels.head_matmul(x, w, transposed)
    assert got.shape == (tokens, h, n)
    torch.testing.assert_close(got, want, **_tolerance(dtype))
    with pytest.raises(ValueError, match="does not fit"):
        kernels.head_matmul(x, w[:2], transposed)
