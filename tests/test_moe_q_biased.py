"""moe_q_ex: held quantized experts with biases and GPT-OSS's clamped SwiGLU (or DeepSeek-V4's
clamped SiLU) in one kernel call, against the per-expert path (gemm_q per expert, the biases and the
activation in torch) on the same codes: uneven shapes, experts with no rows, one row, top-4, biases
on and off, the clamp hit."""

import pytest
import torch
from expect import no_kernels
from real_checkpoints import Sizes

from expertmesh import LLM, SamplingParams
from expertmesh.cpu import cpu_kernels
from expertmesh.cpu.expert_forms import PanelStacks, QuantizedStacks
from expertmesh.cpu.ops import ops_for
from expertmesh.cpu.quantized import QuantizedMoE
from expertmesh.layers.activation import ClampedGatedActivation, ClampedSwiGLU, GatedActivation
from expertmesh.layers.expert_weights import PerExpertWeights
from expertmesh.layers.fused_moe import FusedExperts
from expertmesh.layers.quantization.packed import QuantizedWeight

LIMIT = 1.5  # small, so that the gate and up products cross it


def _codes(out_f: int, in_f: int, kind: str, kernels) -> QuantizedWeight:
    if kind != "fp4":
        return QuantizedWeight.quantize(torch.randn(out_f, in_f) * 0.5, kind, 16, ops_for(kernels))
    codes = torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8)  # MXFP4: e2m1 codes, 2^k per 32
    scales = torch.exp2(torch.randint(-3, 0, (out_f, -(-in_f // 32))).float())
    return QuantizedWeight.from_rows(codes, scales, torch.zeros_like(scales), "fp4", 32, ops_for(kernels))


def _experts(kind, act, bias, shard_rank, kernels, e=8, local=(0, 2, 3, 5, 6, 7), hidden=72, inter=40):
    """Local experts `local` of e (EP: the others are another rank's), shard `shard_rank` of 2."""
    fe = FusedExperts(e, list(local), hidden, 2 * inter, shard_rank, 2, act, bias=bias)
    if bias:
        fe.w13_bias.data.normal_()
        fe.w2_bias.data.normal_()
    pairs = [(_codes(2 * inter, hidden, kind, kernels), _codes(hidden, inter, kind, kernels)) for _ in local]
    fe.hold_quantized(pairs, ops_for(kernels))
    return fe, pairs


def _both(fe: FusedExperts, pairs, x, ids, weights):
    fused = fe.forward(x, ids, weights)
    saved, fe.experts_form = fe.experts_form, PerExpertWeights(pairs)  # per expert on the same codes
    try:
        return fused, fe.forward(x, ids, weights)
    finally:
        fe.experts_form = saved


CLAMPED = {
    "swiglu_clamped": ClampedSwiGLU(LIMIT, 1.702),
    "silu_clamped": ClampedGatedActivation("silu", LIMIT),
}


@pytest.mark.parametrize("kind", ["fp4", "int4", "int8", "w8a8"])
@pytest.mark.parametrize("bias,shard_rank", [(True, 0), (True, 1), (False, 0)])
@pytest.mark.parametrize("act", sorted(CLAMPED))
def test_biased_clamped_experts_in_one_call_equal_the_per_expert_path(kind, bias, shard_rank, act):
    kernels = cpu_kernels.load()
    if kernels is None:
        no_kernels()
    torch.manual_seed(3)
    fe, pairs = _experts(kind, CLAMPED[act], bias, shard_rank, kernels)
    form = fe.experts_form
    assert isinstance(form, QuantizedStacks) and isinstance(form.runner, QuantizedMoE)
    assert form.act == act and fe.native_form([]) is None  # never native decode
    assert (form.runner.b2 is not None) == (bias and shard_rank == 0)  # the down bias once: shard 0
    # experts 1 and 4 (another rank's) and 6 get no rows; top-4 of 8
    for n in (0, 1, 2, 9):
        x = torch.randn(n, 72) * 2
        ids = torch.tensor([0, 1, 2, 3, 4, 5, 7])[torch.rand(n, 7).argsort(dim=1)[:, :4]]
        if n == 1:
            ids[0] = torch.tensor([7, 1, 4, 3])  # two local experts of one row each
        weights = torch.rand(n, 4)
        fused, ref = _both(fe, pairs, x, ids, weights)
        assert fused.shape == (n, 72) and fused.dtype == torch.float32
        scale = max(1.0, ref.abs().amax().item() if n else 0.0)
        torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-4 * scale)
        if n == 9:  # the clamp is hit on both sides: the gate above, up below -limit
            h = pairs[0][0](x, None if fe.w13_bias is None else fe.w13_bias[0])
            assert (h[:, :40] > LIMIT).any() and (h[:, 40:] < -LIMIT).any() and (h[:, :40] < LIMIT).any()


def test_gated_biased_experts_take_moe_q_ex_and_weight_on_input_stays_per_expert():
    kernels = cpu_kernels.load()
    if kernels is None:
        no_kernels()
    torch.manual_seed(4)
    fe, pairs = _experts("int8", GatedActivation("silu"), True, 0, kernels)
    assert isinstance(fe.experts_form, QuantizedStacks) and fe.experts_form.act == "silu"
    assert fe.native_form([]) is None
    x, ids, weights = torch.randn(5, 72), torch.tensor([[0, 2, 3, 5]] * 5), torch.rand(5, 4)
    fused, ref = _both(fe, pairs, x, ids, weights)
    torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    fe = FusedExperts(8, list(range(8)), 72, 80, 0, 1, ClampedSwiGLU(), bias=True, weight_on_input=True)
    fe.hold_quantized(
        [(_codes(80, 72, "int8", kernels), _codes(72, 40, "int8", kernels))] * 8, ops_for(kernels)
    )
    assert isinstance(fe.experts_form, PerExpertWeights)


def test_moe_q_ex_refuses_biases_it_cannot_read():
    kernels = cpu_kernels.load()
    if kernels is None:
        no_kernels()
    with pytest.raises(ValueError, match=r"contiguous float32 biases, not torch.bfloat16 \(8, 80\)"):
        QuantizedMoE(kernels, torch.zeros(8, 80, dtype=torch.bfloat16))


def _float_pair(dtype, act, bias, shard_rank, e=8, local=(0, 2, 3, 5, 6, 7), hidden=72, inter=40):
    """Two copies of the same float experts: one left on the per-expert torch path (the reference)."""
    made = []
    for _ in range(2):
        torch.manual_seed(5)
        fe = FusedExperts(e, list(local), hidden, 2 * inter, shard_rank, 2, act, dtype=dtype, bias=bias)
        for p in fe.parameters():
            p.data.copy_(torch.randn(p.shape) * 0.2)
        made.append(fe)
    return made


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "act", [ClampedSwiGLU(LIMIT, 1.702), ClampedGatedActivation("silu", LIMIT), GatedActivation("silu")]
)
@pytest.mark.parametrize("bias,shard_rank", [(True, 0), (True, 1), (False, 0)])
def test_float_biased_clamped_experts_in_one_call_equal_the_torch_path(dtype, act, bias, shard_rank):
    kernels = cpu_kernels.load()
    if kernels is None:
        no_kernels()
    fe, ref = _float_pair(dtype, act, bias, shard_rank)
    fe.use_ops(ops_for(kernels))
    if not bias and isinstance(act, GatedActivation):
        form = fe.experts_form
        assert isinstance(form, PanelStacks) and form.runner is kernels  # plain: moe_f32 / moe_bf16
    elif kernels.moe_ex[dtype] is None:  # bf16 on pairs (AVX512-BF16) has no moe_bf16_ex: per expert
        assert isinstance(fe.experts_form, PerExpertWeights)
        return
    else:
        form = fe.experts_form
        assert isinstance(form, PanelStacks) and form.runner is not kernels and fe.native_form([]) is None
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    for n in (0, 1, 2, 9):
        x = (torch.randn(n, 72) * 2).to(dtype)
        ids = torch.tensor([0, 1, 2, 3, 4, 5, 7])[torch.rand(n, 7).argsort(dim=1)[:, :4]]
        if n == 1:
            ids[0] = torch.tensor([7, 1, 4, 3])
        weights = torch.rand(n, 4)
        out, want = fe.forward(x, ids, weights), ref.forward(x, ids, weights)
        assert out.shape == (n, 72) and out.dtype == torch.float32
        scale = max(1.0, want.abs().amax().item() if n else 0.0)
        torch.testing.assert_close(out, want, rtol=tol["rtol"], atol=tol["atol"] * scale)


def test_gpt_oss_float_experts_run_in_one_call_and_never_natively(real_checkpoint):
    """gpt-oss's biased, clamped experts in float (its checkpoint dtype): moe_*_ex, not per expert,
    and no native decode form (the float panels' native form takes neither biases nor the clamp;
    held as MXFP4 they are native: test_native_decode.py)."""
    if cpu_kernels.load() is None:
        no_kernels()
    llm = LLM(
        real_checkpoint("gpt-oss-20b", sizes=Sizes(layers=2)), max_model_len=64, kv_cache_memory_bytes=1 << 21
    )
    experts = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedExperts)]
    assert len(experts) == 2 and all(
        isinstance(m.experts_form, PanelStacks) and m.experts_form.act == "swiglu_clamped" for m in experts
    )
    assert all(m.native_form([]) is None for m in experts)
    out = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 3
