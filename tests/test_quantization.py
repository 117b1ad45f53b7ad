"""Quantized weights (issue 14): FP8 block-scaled (DeepSeek-V3) and MXFP4 (gpt-oss) checkpoints
against transformers' own CPU dequantization, online int8 / int4 / fp8 against the same weights
dequantized to fp32, the kernels against their dequantized reference, resident bytes per
weight, and every error path.

Greedy tokens must equal the reference's; a divergence is allowed only at a step where the
reference's top-2 logit margin is below MARGIN (float32 summation order against dequantized
weights that are equal: the kernel forms code * scale + offset with one FMA, the reference as
two roundings), and the test then stops comparing that prompt.
"""

import json
import re
import shutil

import pytest
import torch
from checkpoints import one_thread, prompts_of_lengths
from expect import assert_length, no_kernels
from quantized_checkpoints import fake_quantized, from_fp8, to_fp8, to_int4_packed, to_mxfp4
from reachable import reachable_tensors
from real_checkpoints import Sizes
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

from expertmesh import LLM, SamplingParams
from expertmesh.cpu import cpu_kernels
from expertmesh.cpu.expert_forms import QuantizedStacks
from expertmesh.cpu.ops import ops_for
from expertmesh.cpu.quantized import QuantizedMoE
from expertmesh.layers.expert_weights import PerExpertWeights
from expertmesh.layers.fused_moe import FusedExperts
from expertmesh.layers.quantization.fp8 import Fp8Tensor, quantize_blocks
from expertmesh.layers.quantization.packed import QuantizedExperts, QuantizedWeight, decode_codes
from expertmesh.layers.quantization.permuted import PermutedInputs
from expertmesh.layers.rotary import RotaryEmbedding
from expertmesh.layers.torch_ops import TORCH_OPS
from expertmesh.models.build import log_weight_bytes

LENGTHS = [1, 5, 12, 33]
NEW_TOKENS = 16
MARGIN = 1e-3  # logits; float32 rounding of equal weights is ~1e-6 here
V3 = ("deepseek-v3", Sizes(layers=5, experts=32, max_top_k=8))
FP8_BLOCK = (8, 16)  # divides every dim of the shrunk V3 (transformers splits a partial block wrongly)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(outs) == len(prompts)
    for o in outs:  # ignore_eos: exactly NEW_TOKENS each, so equal lists cannot both be short
        assert_length(o.outputs[0].token_ids, NEW_TOKENS, f"prompt of {len(o.prompt_token_ids)} tokens")
    return [o.outputs[0].token_ids for o in outs]


def assert_greedy_matches(ours: list[list[int]], ref_model, prompts: list[list[int]]) -> int:
    """Our tokens against the reference model's, step by step; returns the allowed divergences."""
    allowed = 0
    with torch.no_grad(), one_thread():
        for prompt, tokens in zip(prompts, ours, strict=True):
            # every call site asks for NEW_TOKENS with ignore_eos: a short or empty output fails here
            assert_length(tokens, NEW_TOKENS, f"prompt of {len(prompt)} tokens")
            ids = list(prompt)
            for step, token in enumerate(tokens):
                logits = ref_model(torch.tensor([ids])).logits[0, -1].float()
                top2 = logits.topk(2)
                if token != int(top2.indices[0]):
                    margin = float(top2.values[0] - top2.values[1])
                    assert margin < MARGIN and token == int(top2.indices[1]), (
                        f"prompt of {len(prompt)} tokens, step {step}: ours {token}, reference "
                        f"{int(top2.indices[0])} by a margin of {margin:.2e}"
                    )
                    allowed += 1
                    break
                ids.append(token)
    return allowed


# ---- the formats' arithmetic -----------------------------------------------------------------------
def test_fp8_partial_blocks_and_rank_slices_follow_the_format(tmp_path):
    """A last partial block covers the remainder; a TP slice that cuts a block uses its one scale."""
    torch.manual_seed(0)
    w = torch.randn(20, 40)
    q, s = quantize_blocks(w, (8, 16))  # 3 x 3 blocks, the last of each dim partial
    save_file({"w": q, "w_scale_inv": s}, str(tmp_path / "t.safetensors"))
    ref = torch.empty(20, 40)
    for o in range(20):
        for i in range(40):
            ref[o, i] = q[o, i].float() * s[o // 8, i // 16]
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        t = Fp8Tensor("w", f.get_slice("w"), f.get_slice("w_scale_inv"), (8, 16))
        assert t.get_shape() == [20, 40]
        torch.testing.assert_close(t[:], ref, rtol=0, atol=0)
        torch.testing.assert_close(t[5:15], ref[5:15], rtol=0, atol=0)  # rows cut mid-block (TP 2)
        torch.testing.assert_close(t[:, 10:30], ref[:, 10:30], rtol=0, atol=0)
        with pytest.raises(
            ValueError, match=r"w_scale_inv has shape \(3, 3\); weight \(20, 40\) in blocks of \[8, 8\]"
        ):
            Fp8Tensor("w", f.get_slice("w"), f.get_slice("w_scale_inv"), (8, 8))


KINDS = [("int8", 128), ("int8", 0), ("int4", 128), ("int4", 32), ("fp8", 0), ("fp8", 16)]


@pytest.mark.parametrize("kind,group", KINDS)
def test_quantized_gemm_kernel_equals_its_dequantized_weight(kind, group):
    kernels = cpu_kernels.load()
    if kernels is None:
        no_kernels()
    torch.manual_seed(1)
    # (200, 200, 1), (75, 72, 1): one row over spans of the one-row kernels and a tail the tiles take
    for out_f, in_f, rows in [
        (37, 200, 1),
        (10, 33, 7),
        (96, 256, 33),
        (8, 16, 0),
        (200, 200, 1),
        (75, 72, 1),
    ]:
        w, x, b = torch.randn(out_f, in_f), torch.randn(rows, in_f), torch.randn(out_f)
        qk = QuantizedWeight.quantize(w, kind, group, ops_for(kernels))
        qt = QuantizedWeight.quantize(w, kind, group, TORCH_OPS)
        torch.testing.assert_close(qk.dequantize(), qt.dequantize(), rtol=0, atol=0)
        ref = (x.double() @ qt.dequantize().double().T + b.double()).float()
        torch.testing.assert_close(qk(x, b), ref, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(qt(x, b), ref, rtol=1e-5, atol=1e-4)
        assert qk(x.bfloat16(), None, out_dtype=torch.float32).dtype == torch.float32


def test_fp4_gemm_kernel_equals_its_dequantized_weight():
    """MXFP4 held as fp4 (e2m1 codes, scales 2^k per 32 inputs, offsets 0) through gemm_q at uneven
    shapes, a partial last group and 0 rows, against the same weights dequantized."""
    kernels = cpu_kernels.load()
    if kernels is None:
        no_kernels()
    torch.manual_seed(9)
    for out_f, in_f, rows in [(37, 96, 1), (10, 40, 7), (64, 256, 33), (8, 32, 0)]:
        g = -(-in_f // 32)
        codes = torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8)
        scales = torch.exp2(torch.randint(-8, 4, (out_f, g)).float())
        x, b = torch.randn(rows, in_f), torch.randn(out_f)
        qk = QuantizedWeight.from_rows(codes, scales, torch.zeros(out_f, g), "fp4", 32, ops_for(kernels))
        qt = QuantizedWeight.from_rows(codes, scales, torch.zeros(out_f, g), "fp4", 32, TORCH_OPS)
        dense = decode_codes(codes, "fp4") * scales.repeat_interleave(32, 1)[:, :in_f]
        torch.testing.assert_close(qk.dequantize(), dense, rtol=0, atol=0)
        ref = (x.double() @ dense.double().T + b.double()).float()
        torch.testing.assert_close(qk(x, b), ref, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(qt(x, b), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("e,hidden,inter,n", [(5, 48, 24, 9), (5, 72, 40, 1), (5, 72, 40, 2)])
def test_quantized_moe_kernel_equals_per_expert_products(kind, e, hidden, inter, n):
    """Experts of many rows (9 tokens), and a decode step's experts of one row (1-2 tokens: the
    one-row kernels over whole spans of panels and a tail), experts with no tokens among them."""
    kernels = cpu_kernels.load()
    if kernels is None:
        no_kernels()
    torch.manual_seed(2)
    k = 2
    w13 = [
        QuantizedWeight.quantize(torch.randn(2 * inter, hidden), kind, 16, ops_for(kernels)) for _ in range(e)
    ]
    w2 = [QuantizedWeight.quantize(torch.randn(hidden, inter), kind, 8, ops_for(kernels)) for _ in range(e)]
    x = torch.randn(n, hidden)
    slot = torch.randint(-1, e, (n, k), dtype=torch.int32)  # -1: another rank's expert
    if n > 2:
        slot[0] = -1  # a token none of whose experts is here
    else:
        slot[0] = torch.tensor([3, 1])
        if n == 2:
            slot[1] = torch.tensor([-1, 3])
    weights = torch.rand(n, k)
    out = QuantizedMoE(kernels).moe(
        x, slot, weights, QuantizedExperts.stack(w13), QuantizedExperts.stack(w2), inter, "silu"
    )
    torch.testing.assert_close(out, moe_reference(x, slot, weights, w13, w2, inter), rtol=1e-4, atol=1e-4)


def moe_reference(x, slot, weights, w13, w2, inter: int) -> torch.Tensor:
    """The routed experts block in float64 over the dequantized weights (slot -1: not held here)."""
    ref = torch.zeros(x.shape[0], w2[0].out_features, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(slot.shape[1]):
            s = int(slot[t, j])
            if s >= 0:
                h = x[t].double() @ w13[s].dequantize().double().T
                a = torch.nn.functional.silu(h[:inter]) * h[inter:]
                ref[t] += weights[t, j].double() * (a @ w2[s].dequantize().double().T)
    return ref.float()


# ---- checkpoints in quantized formats against transformers' dequantization -------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "quantization,logged",
    [
        (None, "held as fp8: e4m3 codes and block scales as stored"),
        ("dequantize", "dequantized to the model dtype at load (quantization='dequantize')"),
    ],
)
def test_fp8_deepseek_v3_matches_transformers_dequantized(
    real_checkpoint, tmp_path, engine_log, quantization, logged
):
    """Held as stored (the default: MLA's kv_b_proj, which the attention lays out anew, dequantized)
    and dequantized at load, both against transformers' own dequantization."""
    path = to_fp8(real_checkpoint(V3[0], sizes=V3[1]), str(tmp_path / "fp8"), FP8_BLOCK)
    llm = LLM(path, quantization=quantization, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    assert f"weights: fp8 e4m3 (8x16 blocks), {logged}" in engine_log.text
    if quantization is None:
        assert "weights held compressed as stored: 34 parameters" in engine_log.text
        assert (
            "not held compressed: 5 tensors (a module that does not take quantized weights)"
            in engine_log.text
        )
    ref = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=FP8_BLOCK)
    ).eval()
    prompts = prompts_of_lengths(LENGTHS, seed=3)
    assert assert_greedy_matches(_greedy(llm, prompts), ref, prompts) <= 1


GPT_OSS_HELD = Sizes(expert_inter=64)  # TP 2 keeps whole 32-blocks of the down projection's inputs


def _held_fp4(model) -> list[QuantizedExperts]:
    """The routed experts' weights held as fp4, stacked for moe_q_ex (gpt-oss's biased experts and
    clamped SwiGLU in one call, not per-expert pairs on the torch path)."""
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(isinstance(m.experts_form, QuantizedStacks) for m in experts)
    return [w for m in experts for w in (m.experts_form.w13, m.experts_form.w2)]


@pytest.mark.timeout(180)
def test_mxfp4_gpt_oss_matches_transformers_dequantized(real_checkpoint, tmp_path, engine_log):
    """The experts held as fp4 codes and e8m0 scales (no float copy), run by gemm_q per expert with
    the biases and the clamped SwiGLU in torch: greedy tokens equal transformers' dequantization,
    and every expert weight is held at 0.625 bytes (offsets: one zero tensor a shape)."""
    path = to_mxfp4(real_checkpoint("gpt-oss-20b", sizes=GPT_OSS_HELD), str(tmp_path / "mxfp4"))
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    assert "mxfp4 (e2m1, e8m0 scale per 32), experts held as fp4" in engine_log.text
    model = llm.llm_engine.runner.model
    cfg = model.cfg
    assert f"held compressed as stored: {2 * cfg.num_layers} parameters" in engine_log.text
    held = _held_fp4(model)
    assert len(held) == 2 * cfg.num_layers and {w.kind for w in held} == {"fp4"}
    assert {w.codes.shape[0] for w in held} == {cfg.num_experts}
    weights = sum(w.codes.numel() * 2 for w in held)  # nibbles (panel rows past O included)
    expected = cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * 64
    assert weights == expected  # 64 = the intermediate: rows fill whole panels
    offsets = {w.offsets.data_ptr(): w.offsets.numel() * 4 for w in held}
    assert len(offsets) == 2  # one zero stack for every layer's w13, one for every w2
    counts = log_weight_bytes(model, cfg)
    assert counts["quantized"] == weights * (0.5 + 4 / 32) + sum(offsets.values())
    assert (counts["quantized"] - sum(offsets.values())) / weights == 0.625
    ref = AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True)).eval()
    prompts = prompts_of_lengths(LENGTHS, seed=4)
    assert assert_greedy_matches(_greedy(llm, prompts), ref, prompts) <= 1
    dense = LLM(path, quantization="dequantize", max_model_len=128, kv_cache_memory_bytes=1 << 22)
    assert "mxfp4 (e2m1, e8m0 scale per 32), dequantized to the model dtype at load" in engine_log.text
    assert log_weight_bytes(dense.llm_engine.runner.model, cfg)["quantized"] == 0
    assert assert_greedy_matches(_greedy(dense, prompts), ref, prompts) <= 1


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "method,desc_act", [("gptq", False), ("gptq", True), ("gptq", "independent"), ("awq", False)]
)
def test_gptq_and_awq_match_the_same_weights_dequantized(
    real_checkpoint, tmp_path, engine_log, method, desc_act
):
    """Asymmetric int4 in groups of 16 (GPTQ with and without desc_act's scattered groups, AWQ's
    GEMM packing order) against transformers on the same weights dequantized to fp32."""
    ref_path = str(tmp_path / "ref")
    path = to_int4_packed(_qwen3(real_checkpoint), str(tmp_path / method), ref_path, method, 16, desc_act)
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    assert f"weights: {method} int4 (groups of 16" in engine_log.text
    # desc_act's scattered groups: held with the inputs sorted by group (the activation gathered);
    # q / k / v or gate / up in orders of their own cannot share one fused parameter's columns
    if desc_act == "independent":
        assert "held compressed as stored: 4 parameters" in engine_log.text  # o_proj
        assert "(parts of one parameter in different input orders (desc_act))" in engine_log.text
    else:
        assert "held compressed as stored: 16 parameters" in engine_log.text
    if desc_act is True:
        model = llm.llm_engine.runner.model
        permuted = [w for m in model.modules() for w in _held_weights(m) if isinstance(w, PermutedInputs)]
        cfg = model.cfg
        assert len(permuted) == cfg.num_layers * (2 + 2 * cfg.num_experts)  # qkv, o and every expert's pair
    ref = AutoModelForCausalLM.from_pretrained(ref_path).eval()
    prompts = prompts_of_lengths(LENGTHS, seed=8)
    assert assert_greedy_matches(_greedy(llm, prompts), ref, prompts) <= 1


def _held_weights(m) -> list:
    """A module's weights held compressed: a linear's, or its experts' per-expert pairs."""
    experts = getattr(m, "experts_form", None)
    if isinstance(experts, PerExpertWeights):
        return [w for pair in experts.pairs for w in pair]
    form = getattr(m, "weight_form", None)
    return [form] if isinstance(form, (QuantizedWeight, PermutedInputs)) else []


def _qwen3(real_checkpoint) -> str:
    return real_checkpoint("qwen3-30b-a3b")


def _online_quantized_key(key: str, t: torch.Tensor) -> bool:
    """What expertmesh's online schemes quantize in Qwen3-MoE: every projection, not the router."""
    return key.endswith("_proj.weight") and t.dim() == 2


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "scheme,kind,group",
    [("int8", "int8", 128), ("int4-g32", "int4", 32), ("fp8", "fp8", 128), ("int8-g32+head", "int8", 32)],
)
def test_online_quantization_matches_the_same_weights_dequantized(
    real_checkpoint, tmp_path, scheme, kind, group
):
    """ "+head" quantizes the LM head too (its reference dequantizes it); w8a8's activation rounding
    stays within the divergence rule at this size (its kernels' arithmetic: test_quantization_w8a8)."""
    path = _qwen3(real_checkpoint)
    head = scheme.endswith("+head")

    def quantized(key: str, t: torch.Tensor) -> bool:
        return _online_quantized_key(key, t) or (head and key == "lm_head.weight")

    ref_path = fake_quantized(path, str(tmp_path / "ref"), kind, group, quantized)
    llm = LLM(path, quantization=scheme, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    ref = AutoModelForCausalLM.from_pretrained(ref_path).eval()
    prompts = prompts_of_lengths(LENGTHS, seed=5)
    assert assert_greedy_matches(_greedy(llm, prompts), ref, prompts) <= 1


@pytest.mark.parametrize(
    "scheme,per_weight", [("int8", 1 + 8 / 128), ("int4", 0.5 + 8 / 128), ("int8+head", 1 + 8 / 128)]
)
def test_resident_bytes_per_quantized_weight(real_checkpoint, scheme, per_weight):
    """Quantized weights at 1.0625 (int8) and 0.5625 (int4) bytes each with groups of 128 (a
    hidden of 256 so rows hold whole groups), plus the unquantized parts at 4 (float32); the LM
    head among the quantized ones only with "+head"."""
    path = real_checkpoint("qwen3-30b-a3b", sizes=Sizes(hidden=256, expert_inter=128, heads=4))
    dense = LLM(path, max_model_len=64, kv_cache_memory_bytes=1 << 20)
    quant = LLM(path, quantization=scheme, max_model_len=64, kv_cache_memory_bytes=1 << 20)
    model = quant.llm_engine.runner.model
    assert isinstance(model.lm_head.weight_form, QuantizedWeight) == scheme.endswith("+head")
    quantized_params = 0  # weights held compressed (panel rows past out_features included)
    for m in model.modules():
        form, experts = getattr(m, "weight_form", None), getattr(m, "experts_form", None)
        held = [form] if isinstance(form, QuantizedWeight) else []
        held += [w for pair in experts.pairs for w in pair] if isinstance(experts, PerExpertWeights) else []
        held += [experts.w13, experts.w2] if isinstance(experts, QuantizedStacks) else []
        quantized_params += sum(w.codes.numel() * (2 if w.kind == "int4" else 1) for w in held)
    assert quantized_params > 0
    counts = log_weight_bytes(model, model.cfg)
    assert counts["quantized"] == pytest.approx(per_weight * quantized_params, rel=1e-9)
    dense_counts = log_weight_bytes(dense.llm_engine.runner.model, model.cfg)
    unquantized = dense_counts["total"] - 4 * quantized_params
    assert counts["dense"] == pytest.approx(unquantized, rel=0.02)
    assert counts["total"] < dense_counts["total"] * (0.4 if scheme.startswith("int8") else 0.25)
    # Counted from outside the bookkeeping: every tensor reachable from the model (attributes at
    # any depth, tests/reachable.py) but the KV cache and the rope tables (not weights). What the
    # accounting misses must be the same small buffers (expert indices, ...) as in the dense model:
    # a float copy of a quantized weight kept anywhere is 4 bytes a weight more.
    extra = [_unaccounted(llm) - c["total"] for llm, c in ((dense, dense_counts), (quant, counts))]
    assert 0 <= extra[1] <= max(extra[0], 0) + 1024 and extra[0] < 1 << 14, extra


def _unaccounted(llm: LLM) -> int:
    """Bytes of every tensor reachable from the model, less the KV cache's and the rope tables'."""
    runner = llm.llm_engine.runner
    found = reachable_tensors(runner.model)
    skip = reachable_tensors(runner.kv).keys() | {
        key
        for m in runner.model.modules()
        if isinstance(m, RotaryEmbedding)
        for key in reachable_tensors(m._table)
    }
    return sum(nbytes for key, (_, nbytes) in found.items() if key not in skip)


def test_fp8_checkpoint_requantized_online_is_held_compressed(real_checkpoint, tmp_path, engine_log):
    """quantization="fp8" over an fp8 checkpoint: dequantized at load, re-quantized to fp8 with a
    scale per 128 inputs of a row (compressed); the same as quantizing its dequantized copy."""
    fp8 = to_fp8(_qwen3(real_checkpoint), str(tmp_path / "fp8"), FP8_BLOCK)
    plain = from_fp8(fp8, str(tmp_path / "plain"), FP8_BLOCK)
    prompts = prompts_of_lengths(LENGTHS, seed=7)
    runs = [
        LLM(p, quantization="fp8", max_model_len=128, kv_cache_memory_bytes=1 << 22) for p in (fp8, plain)
    ]
    assert "then re-quantized: online fp8 weight-only (groups of 128), held compressed" in engine_log.text
    assert _greedy(runs[0], prompts) == _greedy(runs[1], prompts)
    counts = log_weight_bytes(runs[0].llm_engine.runner.model, runs[0].llm_engine.runner.model.cfg)
    as_float32 = counts["dense"] + counts["quantized"] * 4 / (1 + 8 / 128)  # the same model unquantized
    assert counts["quantized"] > 0 and counts["total"] < 0.5 * as_float32


@pytest.mark.timeout(180)
def test_fp8_checkpoint_asked_as_fp8_holds_its_blocks_as_stored(real_checkpoint, tmp_path, engine_log):
    """quantization="fp8-g16" over 8 x 16 blocks: the e4m3 bytes and each row's block scale per 16
    inputs held as stored (no re-rounding): greedy tokens equal transformers on the checkpoint
    dequantized to fp32 by the format's definition."""
    fp8 = to_fp8(_qwen3(real_checkpoint), str(tmp_path / "fp8"), FP8_BLOCK)
    llm = LLM(fp8, quantization="fp8-g16", max_model_len=128, kv_cache_memory_bytes=1 << 22)
    assert "fp8 e4m3 (8x16 blocks), held as fp8: e4m3 codes and block scales as stored" in engine_log.text
    assert "held compressed as stored: 16 parameters" in engine_log.text
    ref = AutoModelForCausalLM.from_pretrained(from_fp8(fp8, str(tmp_path / "plain"), FP8_BLOCK)).eval()
    prompts = prompts_of_lengths(LENGTHS, seed=3)
    assert assert_greedy_matches(_greedy(llm, prompts), ref, prompts) <= 1


@pytest.mark.timeout(180)
def test_held_codes_without_our_kernels_run_the_torch_fallback_and_say_so(
    real_checkpoint, tmp_path, engine_log, monkeypatch
):
    """No kernel of ours for the codes (another device, no compiler: cpu_kernels.load() gives None):
    held fp8 runs QuantizedWeight's per-call dequantization, equals transformers, and a warning says
    what it costs and the way out; dequantized at load, nothing to warn of."""
    fp8 = to_fp8(_qwen3(real_checkpoint), str(tmp_path / "fp8"), FP8_BLOCK)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    held = LLM(fp8, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    warned = [r.getMessage() for r in engine_log.records if r.levelname == "WARNING"]
    assert any(
        "MB of quantized weights without expertmesh's CPU kernels" in m
        and "each product dequantizes its weight per call" in m
        and "quantization='dequantize' dequantizes the checkpoint once at load" in m
        for m in warned
    ), warned
    ref = AutoModelForCausalLM.from_pretrained(from_fp8(fp8, str(tmp_path / "plain"), FP8_BLOCK)).eval()
    prompts = prompts_of_lengths(LENGTHS, seed=5)
    assert assert_greedy_matches(_greedy(held, prompts), ref, prompts) <= 1
    engine_log.clear()
    LLM(fp8, quantization="dequantize", max_model_len=128, kv_cache_memory_bytes=1 << 22)
    assert not [r for r in engine_log.records if "per call" in r.getMessage()]
    LLM(str(tmp_path / "plain"), quantization="int8", max_model_len=128, kv_cache_memory_bytes=1 << 22)
    assert "drop quantization='int8' for dense weights" in engine_log.text


# ---- errors ----------------------------------------------------------------------------------------
def test_unsupported_quant_method_names_it_and_the_supported_ones(real_checkpoint, tmp_path):
    path = tmp_path / "q"
    shutil.copytree(_qwen3(real_checkpoint), path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"quant_method='bitsandbytes'.*supported: "
        r"\['awq', 'compressed-tensors', 'fp8', 'gptq', 'modelopt', 'mxfp4'\]",
    ):
        LLM(str(path), max_model_len=32, kv_cache_memory_bytes=1 << 20)


def test_online_scheme_errors_name_the_bad_value(real_checkpoint, tmp_path):
    path = _qwen3(real_checkpoint)
    with pytest.raises(
        ValueError,
        match=r"quantization='int3' is not known; known: \['fp8', 'int4', 'int8', 'w4a8', 'w8a8'\]",
    ):
        LLM(path, quantization="int3", max_model_len=32, kv_cache_memory_bytes=1 << 20)
    fp8 = to_fp8(path, str(tmp_path / "fp8"), (8, 16))
    with pytest.raises(
        ValueError,
        match=r"quantization='int8' was asked for, but the checkpoint is already quantized "
        r"\(quant_method='fp8'\); pass quantization=None \(its codes held as stored\), 'dequantize' "
        r"\(dequantized at load\) or 'fp8'",
    ):
        LLM(fp8, quantization="int8", max_model_len=32, kv_cache_memory_bytes=1 << 20)
    with pytest.raises(
        ValueError,
        match=r"quantization='dequantize' dequantizes a quantized checkpoint at load, but this checkpoint's "
        r"config.json has no quantization_config",
    ):
        LLM(path, quantization="dequantize", max_model_len=32, kv_cache_memory_bytes=1 << 20)


def test_fp8_config_and_tensor_errors(real_checkpoint, tmp_path):
    path = to_fp8(_qwen3(real_checkpoint), str(tmp_path / "fp8"), (8, 16))
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    bad = dict(config, quantization_config={**config["quantization_config"], "activation_scheme": "static"})
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(
        ValueError, match=r"activation_scheme='static' is not supported; supported: \['dynamic'\]"
    ):
        LLM(path, max_model_len=32, kv_cache_memory_bytes=1 << 20)
    wrong_block = dict(
        config, quantization_config={**config["quantization_config"], "weight_block_size": [8, 8]}
    )
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(wrong_block))
    with pytest.raises(
        ValueError,
        match=r"_scale_inv has shape \(\d+, \d+\); weight \(\d+, \d+\) in blocks of \[8, 8\] needs",
    ):
        LLM(path, max_model_len=32, kv_cache_memory_bytes=1 << 20)


def test_a_split_that_cuts_a_quantization_group_names_the_sizes():
    from expertmesh.layers.quantization.online import OnlineScheme

    with pytest.raises(
        ValueError,
        match=r"quantization='int8-g128' \(groups of 128\): o_proj splits its input dim 64 over 2 ranks, "
        r"32 a rank.*'int8-g32'",
    ):
        OnlineScheme.parse("int8").check_split("o_proj", 32, 2)
    OnlineScheme.parse("int8-g32").check_split("o_proj", 32, 2)  # whole groups: fine
    with pytest.raises(ValueError, match=r"one scale per output channel"):
        OnlineScheme.parse("int4-ch").check_split("down", 16, 2)


# ---- parallel layouts on quantized weights ---------------------------------------------------------
LAYOUTS = [(2, False), (2, True)]  # (TP, expert parallel) over 2 ranks


def _layouts_main(rank, world, path, quantization, prompts):
    out = []
    for tp, ep in LAYOUTS:
        llm = LLM(
            path, tensor_parallel_size=tp, enable_expert_parallel=ep, quantization=quantization,
            distributed_executor_backend="external_launcher", max_model_len=128,
            kv_cache_memory_bytes=1 << 22,
        )  # fmt: skip
        out.append(((tp, ep), _greedy(llm, prompts)))
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "case", ["int8-g16+head", "int4-g16", "fp8-checkpoint", "fp8-checkpoint-held"]
)  # GPTQ desc_act under TP 2 / EP: tests/test_quantization_held.py; "+head": each TP rank's vocab block
def test_tp2_and_ep_layouts_equal_one_process_on_quantized_weights(real_checkpoint, tmp_path, case):
    """Groups of 16 keep whole groups on each rank of a split input dim (TP 2 halves the experts'
    32-wide intermediate); the fp8 checkpoint's 128 x 128 blocks are cut by every TP slice."""
    from distributed_utils import run_distributed

    path, quantization = _qwen3(real_checkpoint), case
    if case.startswith("fp8-checkpoint"):  # held: its e4m3 bytes and block scales as stored
        path = to_fp8(path, str(tmp_path / "fp8"), (128, 128))
        quantization = "fp8" if case.endswith("held") else "dequantize"
    prompts = prompts_of_lengths([3, 17, 1, 40], seed=6)
    expected = _greedy(
        LLM(path, quantization=quantization, max_model_len=128, kv_cache_memory_bytes=1 << 22), prompts
    )
    for rank, results in enumerate(
        run_distributed(_layouts_main, 2, path, quantization, prompts, timeout=220)
    ):
        for layout, tokens in results:
            assert tokens == expected, f"{case}: rank {rank}, (TP, EP)={layout}"


def _cut_group_main(rank, world, path):
    try:
        LLM(path, tensor_parallel_size=2, quantization="int8",
            distributed_executor_backend="external_launcher", max_model_len=32,
            kv_cache_memory_bytes=1 << 20)  # fmt: skip
    except ValueError as exc:
        return str(exc)
    return None


def test_tp2_with_groups_a_rank_would_cut_is_an_error_naming_the_sizes(real_checkpoint):
    from distributed_utils import run_distributed

    for message in run_distributed(_cut_group_main, 2, _qwen3(real_checkpoint), timeout=60):
        assert message is not None and re.search(
            r"splits its input dim \d+ over 2 ranks, \d+ a rank", message
        )


def test_rounding_to_fp4_codes_is_an_error():
    """fp4 codes come from MXFP4 checkpoints only: rounding a float weight to them is not written, so
    it must not pass silently as another kind's codes."""
    with pytest.raises(ValueError, match="no rounding to 'fp4' codes"):
        QuantizedWeight.quantize(torch.randn(8, 32), "fp4", 32, TORCH_OPS)


def test_rounding_a_block_of_rows_at_a_time_equals_rounding_the_whole_weight(monkeypatch):
    """quantize_rows rounds VALUES_AT_ONCE values a step (one-pass loading keeps its float32
    temporaries small): every kind and group, a partial last group, gives the whole weight's codes."""
    from expertmesh.layers.quantization import codes

    w = torch.randn(301, 70, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    for kind in codes.ROUNDED_KINDS:
        for group in (0, 16, 32):
            whole = codes.quantize_rows(w, kind, group)
            monkeypatch.setattr(codes, "VALUES_AT_ONCE", 6 * 70)  # 6 rows a step, the last one row
            blocks = codes.quantize_rows(w, kind, group)
            monkeypatch.undo()
            assert all(torch.equal(a, b) for a, b in zip(whole, blocks, strict=True)), (kind, group)


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_cli_quantization_takes_every_scheme_and_names_a_bad_one(command, capsys):
    """--quantization takes what LLM(quantization=...) takes, suffixes included, and "dequantize"; a bad
    one exits with the scheme parser's message."""
    from expertmesh.entrypoints.cli import _engine_kwargs, build_parser

    for name in ("int8", "int4-g32", "w8a8-ch", "w4a8+head", "fp8-g64+head", "dequantize"):
        args = build_parser().parse_args([*command, "--quantization", name])
        assert _engine_kwargs(args, None)["quantization"] == name
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--quantization", "int3"])
    assert "quantization='int3' is not known" in capsys.readouterr().err
