"""W8A8 and W4A8 (issue 14): int8 or int4 weights with activations quantized to int8 at run time,
per token and group (`quantization="w8a8"`, `"w4a8"`), against a torch reference of the same
arithmetic written here from the scheme's description (layers/quantization/online.py): per row and
group of `group` inputs, sx = amax / 127 and xq = round-half-even(x / sx); per group the integer
sum of code * xq, scaled by weight scale * sx (plus, for int4's offsets, offset * sx * sum(xq)),
groups added in order.

End to end, transformers runs the same weights dequantized to fp32 with every quantized product's
input quantized and dequantized the same way (a patched F.linear), so only float32 summation order
differs; a greedy divergence is allowed only where the reference's top-2 margin is below MARGIN.
"""

import platform

import pytest
import torch
import torch.nn.functional as F
from checkpoints import prompts_of_lengths
from expect import assert_length, first_difference, no_kernels
from quantized_checkpoints import fake_quantized
from test_quantization import LENGTHS, _greedy, _online_quantized_key, _qwen3, assert_greedy_matches
from transformers import AutoModelForCausalLM

from expertmesh import LLM, SamplingParams
from expertmesh.cpu import cpu_features, cpu_kernels, kernel_library
from expertmesh.cpu.ops import ops_for
from expertmesh.cpu.quantized import QuantizedMoE
from expertmesh.layers.quantization.online import OnlineScheme
from expertmesh.layers.quantization.packed import QuantizedExperts, QuantizedWeight
from expertmesh.layers.torch_ops import TORCH_OPS


def quantize_dequantize_input(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., I] -> each row's groups of `group` inputs rounded to int8 steps of amax / 127."""
    i = x.shape[-1]
    out = torch.empty_like(x, dtype=torch.float32)
    for g0 in range(0, i, group or i):
        part = x[..., g0 : g0 + (group or i)].float()
        amax = part.abs().amax(-1, keepdim=True)
        s = amax / 127.0
        codes = torch.where(amax > 0, torch.round(part / s), torch.zeros_like(part))
        out[..., g0 : g0 + (group or i)] = codes * s
    return out


def reference(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[m, o] = sum over groups of int_sum(code, xq) * (ws * sx), in float64 (exact sums)."""
    group = w.group
    wd = w.dequantize().double()
    y = torch.zeros(x.shape[0], w.out_features, dtype=torch.float64)
    for g0 in range(0, w.in_features, group):
        part = x[:, g0 : g0 + group].double()
        y += quantize_dequantize_input(part, 0).double() @ wd[:, g0 : g0 + group].T
    return (y if bias is None else y + bias.double()).float()


# (200, 200, 1) and (75, 72, 1): one row over whole spans of the one-row kernels and a tail of panels
# the tiles take (8 lanes: 3 spans + 1 panel, 1 span + 2; 16 lanes: 1 span + 1, tail only)
SHAPES = [(37, 200, 1), (10, 33, 7), (96, 256, 33), (8, 16, 0), (130, 64, 4), (200, 200, 1), (75, 72, 1)]


WEIGHT_ONLY = {"w8a8": "int8", "w4a8": "int4"}  # the same weight codes, activations unrounded
STEP = {"w8a8": 4, "w4a8": 8}  # inputs a lane's integer product takes at once


@pytest.mark.parametrize(
    "kind,group",
    [("w8a8", 128), ("w8a8", 0), ("w8a8", 16), ("w8a8", 32), ("w4a8", 128), ("w4a8", 0), ("w4a8", 16)],
)
def test_activation_quantized_gemm_kernel_equals_the_same_arithmetic_in_torch(kind, group):
    kernels = cpu_kernels.load()
    if kernels is None:
        no_kernels()
    torch.manual_seed(11)
    for out_f, in_f, rows in SHAPES:
        w, x, b = torch.randn(out_f, in_f), torch.randn(rows, in_f) * 3, torch.randn(out_f)
        if rows > 2:
            x[1, : min(16, in_f)] = 0  # a group (or part of one) of zeros: codes 0, no division by 0
            x[2] = 0
        if out_f == 75:
            x[0, :16] = 0  # the one-row kernels' zero group
        qk = QuantizedWeight.quantize(w, kind, group, ops_for(kernels))
        qt = QuantizedWeight.quantize(w, kind, group, TORCH_OPS)  # the torch fallback
        qi = QuantizedWeight.quantize(w, WEIGHT_ONLY[kind], group, TORCH_OPS)  # the same weights, weight-only
        torch.testing.assert_close(qk.dequantize(), qi.dequantize(), rtol=0, atol=0)
        # panels of the kernels' lanes (8 on AVX2, 16 on AVX-512; qi, built without kernels, has 8)
        assert qk.codes.shape == (-(-out_f // qk.lanes), -(-in_f // STEP[kind]), qk.lanes, 4)
        ref = reference(x, qi, b)
        torch.testing.assert_close(qk(x, b), ref, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(qt(x, b), ref, rtol=1e-5, atol=1e-4)
        if rows:  # not the weight-only product: the activations were rounded
            assert not torch.allclose(
                qk(x, b), (x.double() @ qi.dequantize().double().T + b).float(), atol=1e-5
            )


@pytest.mark.parametrize("kind", ["w8a8", "w4a8"])
@pytest.mark.parametrize(
    "e,hidden,inter,n",
    [
        (6, 52, 20, 9),  # uneven: 52 inputs in groups of 16, 20 in groups of 8; experts of many rows
        (6, 72, 40, 1),  # a decode step: experts of one row, one span of the one-row kernels + a tail
        (6, 72, 40, 2),
    ],
)
def test_activation_quantized_moe_kernel_equals_per_expert_products(kind, e, hidden, inter, n):
    kernels = cpu_kernels.load()
    if kernels is None:
        no_kernels()
    torch.manual_seed(12)
    k = 2
    w13 = [
        QuantizedWeight.quantize(torch.randn(2 * inter, hidden), kind, 16, ops_for(kernels)) for _ in range(e)
    ]
    w2 = [QuantizedWeight.quantize(torch.randn(hidden, inter), kind, 8, ops_for(kernels)) for _ in range(e)]
    x = torch.randn(n, hidden)
    slot = torch.randint(-1, e - 1, (n, k), dtype=torch.int32)  # -1: another rank's; expert e-1 none
    if n > 2:
        slot[0] = -1  # a token none of whose experts is here
    else:
        slot[0] = torch.tensor([3, 1])  # two experts of one row each
        if n == 2:
            slot[1] = torch.tensor([-1, 3])  # expert 3 with two rows, expert 1 with one
    weights = torch.rand(n, k)
    moe = QuantizedMoE(kernels)
    out = moe.moe(x, slot, weights, QuantizedExperts.stack(w13), QuantizedExperts.stack(w2), inter, "silu")
    ref = torch.zeros(n, hidden, dtype=torch.float64)
    for t in range(n):
        for j in range(k):
            s = int(slot[t, j])
            if s >= 0:
                h = reference(x[t : t + 1], w13[s]).double()
                a = (F.silu(h[:, :inter]) * h[:, inter:]).float()
                ref[t] += weights[t, j].double() * reference(a, w2[s])[0].double()
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-4)
    empty = moe.moe(x[:0], slot[:0], weights[:0], QuantizedExperts.stack(w13), QuantizedExperts.stack(w2),
                    inter, "silu")  # fmt: skip
    assert empty.shape == (0, hidden)


def test_activation_quantized_scheme_names_and_errors():
    assert OnlineScheme.parse("w8a8").name == "w8a8-g128"
    assert (
        "int4 weights, per output channel; activations int8 per token"
        in OnlineScheme.parse("w4a8-ch").describe()
    )
    with pytest.raises(ValueError, match=r"quantization='w8a8-g6': w8a8 needs groups of a multiple of 4"):
        OnlineScheme.parse("w8a8-g6")
    with pytest.raises(ValueError, match=r"quantization='w4a8-g4': w4a8 needs groups of a multiple of 8"):
        OnlineScheme.parse("w4a8-g4")
    with pytest.raises(ValueError, match=r"w8a8 needs groups of a multiple of 4 inputs .*group=6"):
        QuantizedWeight.quantize(torch.randn(8, 12), "w8a8", 6, TORCH_OPS)
    with pytest.raises(ValueError, match=r"w4a8 needs groups of a multiple of 8 inputs .*group=12"):
        QuantizedWeight.quantize(torch.randn(8, 24), "w4a8", 12, TORCH_OPS)
    codes = torch.full((8, 4), 128, dtype=torch.uint8)  # int8 -128: outside the symmetric range
    with pytest.raises(ValueError, match=r"w8a8 codes must lie in \[-127, 127\]; found -128"):
        QuantizedWeight.from_rows(codes, torch.ones(8, 1), torch.zeros(8, 1), "w8a8", 4, TORCH_OPS)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_online_activation_quantization_matches_the_same_arithmetic_in_transformers(
    real_checkpoint, tmp_path, monkeypatch, scheme
):
    path = _qwen3(real_checkpoint)
    ref_path = fake_quantized(path, str(tmp_path / "ref"), WEIGHT_ONLY[scheme], 128, _online_quantized_key)
    llm = LLM(path, quantization=scheme, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    ref = AutoModelForCausalLM.from_pretrained(ref_path, experts_implementation="eager").eval()
    quantized = {
        p.untyped_storage().data_ptr()
        for name, p in ref.named_parameters()
        if (
            name.endswith("_proj.weight")
            or name.endswith("experts.gate_up_proj")
            or name.endswith("experts.down_proj")
        )
    }
    assert len(quantized) > 4
    linear = F.linear

    def w8a8_linear(x, weight, bias=None):
        if weight.untyped_storage().data_ptr() in quantized:
            x = quantize_dequantize_input(x, 128).to(x.dtype)
        return linear(x, weight, bias)

    monkeypatch.setattr(F, "linear", w8a8_linear)
    prompts = prompts_of_lengths(LENGTHS, seed=5)
    assert assert_greedy_matches(_greedy(llm, prompts), ref, prompts) <= 1


def _activation_rounding_noise(path: str, prompts: list[list[int]], expected) -> float:
    """The largest change that rounding every activation to int8 makes to a log-probability of
    this model on the reference's own tokens (w8a8 against weight-only int8: the same weight
    codes, activations unrounded; teacher-forced through prompt logprobs, top 2 at each step)."""
    seqs = [{"prompt_token_ids": p + list(ref.token_ids)} for p, ref in zip(prompts, expected, strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    runs = []
    for quantization in ("w8a8-g16", "int8-g16"):
        llm = LLM(path, quantization=quantization, max_model_len=128, kv_cache_memory_bytes=1 << 22)
        runs.append([o.prompt_logprobs for o in llm.generate(seqs, params)])
        del llm
    noise = 0.0
    for rounded, exact, prompt in zip(*runs, prompts, strict=True):
        for a, b in zip(rounded[len(prompt) :], exact[len(prompt) :], strict=True):
            noise = max([noise] + [abs(a[t].logprob - b[t].logprob) for t in a.keys() & b.keys()])
    assert noise > 0, "rounding the activations changed nothing: the comparison is not w8a8"
    return noise


@pytest.mark.timeout(300)
def test_w8a8_tp2_and_ep_layouts_equal_one_process_up_to_rounding_ties(real_checkpoint):
    from distributed_utils import run_distributed
    from test_quantization import _layouts_main

    path = _qwen3(real_checkpoint)
    prompts = prompts_of_lengths([3, 17, 1, 40], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    one = LLM(path, quantization="w8a8-g16", max_model_len=128, kv_cache_memory_bytes=1 << 22)
    expected = [o.outputs[0] for o in one.generate([{"prompt_token_ids": p} for p in prompts], params)]
    del one
    # Layouts that sum partial products in another order (TP's all-reduce) differ by float32
    # rounding, and where an activation lies on a rounding tie that flips its int8 code: one code
    # step in one activation, a perturbation inside the one that rounding every activation makes.
    # That full rounding moves each log-probability by at most `noise` (measured here, on this
    # model and these tokens), so it moves the gap between the top two by at most 2 * noise: a
    # layout may pick the other token only where the one-process gap is below that. A wrong
    # layout diverges where the gap is wide. How many prompts diverge is not bounded: each
    # divergence must be a near-tie of its own.
    margin = 2 * _activation_rounding_noise(path, prompts, expected)
    for rank, results in enumerate(run_distributed(_layouts_main, 2, path, "w8a8-g16", prompts, timeout=220)):
        for layout, tokens in results:
            for ours, ref in zip(tokens, expected, strict=True):
                assert_length(ours, 16, f"rank {rank}, (TP, EP)={layout}")
                assert_length(ref.token_ids, 16, "one process")
                step = first_difference(ours, ref.token_ids)
                if step is None:
                    continue
                top = sorted((v.logprob for v in ref.logprobs[step].values()), reverse=True)
                assert top[0] - top[1] < margin, (
                    f"rank {rank}, (TP, EP)={layout}, step {step}: {top}, bound {margin:.3g}"
                )


def _build_equals_the_reference(kernels) -> None:
    torch.manual_seed(13)
    for kind, group in [("w8a8", 16), ("w8a8", 0), ("w4a8", 16), ("w4a8", 0), ("int8", 32), ("int4", 16)]:
        for out_f, in_f, rows in SHAPES:
            w, x = torch.randn(out_f, in_f), torch.randn(rows, in_f)
            q = QuantizedWeight.quantize(w, kind, group, ops_for(kernels))
            ref = reference(x, q) if kind in WEIGHT_ONLY else (x.double() @ q.dequantize().double().T).float()
            torch.testing.assert_close(q(x), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.slow  # a second build of the kernels: ~30 s on the shared cores
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx2 is an x86 flag")
def test_generic_build_without_avx2_equals_the_reference(tmp_path):
    """The portable loops (CPUs without AVX2) compute the same integer sums and scaled folds as
    AVX2's and AVX-512's."""
    compiler = kernel_library.compiler()
    if compiler is None:
        no_kernels()
    _build_equals_the_reference(cpu_kernels.build(tmp_path / "generic.so", compiler, ("-mno-avx2",)))


def test_avx2_build_equals_the_reference(generic_kernels):
    """The 8-lane (AVX2) build, which CPUs without AVX-512 take: its maddubs tiles and one-row
    kernels (W4A8's shared with AVX-512's) against the exact reference, on an AVX-512 CPU too."""
    assert generic_kernels.lanes == 8
    _build_equals_the_reference(generic_kernels)


@pytest.mark.skipif(
    not {"avx512f", "avx512bw"} <= cpu_features.cpu_flags(), reason="runs the 16-lane build: needs AVX-512"
)
def test_avx512_build_without_vnni_equals_the_reference(tmp_path):
    """AVX-512 CPUs without VNNI (Skylake-SP/X) take maddubs for W8A8 (|w| times x with w's sign)
    and W4A8; with VNNI (the tests above, on such a CPU) vpdpbusd on x + 128. -O1: a quicker build,
    the same arithmetic."""
    compiler = kernel_library.compiler()
    assert compiler is not None, "this machine image has a C compiler"
    built = cpu_kernels.build(tmp_path / "no-vnni.so", compiler, ("-mno-avx512vnni", "-O1"))
    assert built.lanes == 16
    _build_equals_the_reference(built)
