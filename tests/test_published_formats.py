"""The 2026 families' published weight formats (issue 39), written in the publishers' layout from the
tiny checkpoints of their published configs (every flag kept) and the quantization_config each
publishes, copied verbatim:

- DeepSeek-V3.2: block FP8 e4m3, 128 x 128, `scale_fmt: ue8m0` (power-of-two scales, stored as
  float32 `weight_scale_inv`); the lightning indexer's wq_b / wk in FP8, its weights_proj, the
  routers, embeddings and head in the float dtype, as its inference code declares them;
- GLM-5: its published config is unquantized; zai-org/GLM-5-FP8's quantization_config is not among
  the stored configs, so the DeepSeek-V3 block FP8 (float32 scales) it is read as by third-party
  readers of that checkpoint (attention, indexer wq_b / wk and experts in FP8);
- MiniMax-M2.5: block FP8 with `fmt: float8_e4m3fn` and `modules_to_not_convert` (router gate, its
  correction bias, lm_head);
- Kimi-K2.5: compressed-tensors int4 W4A16 pack-quantized, group 32, its ignore list (attention,
  shared experts, dense MLPs, lm_head): the routed experts alone are int4.

The hidden width (192) and expert width (160) are not multiples of 128, so FP8 blocks are cut at
the tensors' edges. Each runs held compressed (codes as stored, checked) and gives transformers'
greedy tokens and fp32 logprobs (within 2e-4, top 20 every step) on the same weights dequantized
by the format's definition written here (quantized_checkpoints.to_block_fp8, and the
compressed-tensors package's own decompressor for Kimi)."""

import json
import re
from pathlib import Path

import pytest
import torch
from quantized_checkpoints import to_block_fp8, to_compressed_tensors
from real_checkpoints import Sizes, published
from test_real_families import FAMILIES, hf_logprobs, hf_model, logprob_errors, prompts_for

from expertmesh import LLM, SamplingParams

WIDE = Sizes(hidden=192, expert_inter=160, dense_inter=320, shared_inter=160)
FLOAT_IN_DEEPSEEK = ("embed_tokens", "lm_head", "shared_head.head", ".mlp.gate.", "weights_proj")


def _deepseek_fp8(key: str, t: torch.Tensor) -> bool:
    """DeepSeek-V3.2's FP8 tensors: every linear weight but the embeddings, the head, the routers and
    the indexer's weights_proj (created in the default float dtype by its inference code)."""
    return key.endswith(".weight") and t.dim() == 2 and not any(f in key for f in FLOAT_IN_DEEPSEEK)


def _minimax_fp8(key: str, t: torch.Tensor, not_convert: list[str]) -> bool:
    """Every linear weight except the modules `modules_to_not_convert` names (a name matches a whole
    component of the module's path: block_sparse_moe.gate, not gate_proj) and the embeddings."""
    module = key.removesuffix(".weight")
    parts = module.split(".")
    skipped = any(n in parts for n in not_convert) or "embed_tokens" in parts
    return key.endswith(".weight") and t.dim() == 2 and not skipped


GLM5_FP8 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def _fp8_case(family: str):
    """(published quantization_config, which tensors are FP8) of an FP8 family."""
    if family == "glm-5":
        return GLM5_FP8, _deepseek_fp8
    config = published(FAMILIES[family][0])["quantization_config"]
    if family.startswith("minimax"):
        return config, lambda k, t: _minimax_fp8(k, t, config["modules_to_not_convert"])
    return config, _deepseek_fp8


def _held(llm: LLM) -> int:
    held = llm.llm_engine.runner.model.held_weights
    return 0 if held is None else len(held.params)


def _assert_reference_tokens(path: str, ref_path: str, prompts: list[list[int]], what: str) -> LLM:
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 23)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    model = hf_model(ref_path)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_logprobs(model, prompt, out.outputs[0].token_ids)
        where = f"{what}, prompt of {len(prompt)} tokens"
        assert out.outputs[0].token_ids == ref.argmax(-1).tolist(), where
        assert logprob_errors(out, ref).max() < 2e-4, where
    return llm


def _fp8_checkpoint(family: str, real_checkpoint, out: Path) -> str:
    """The family's tiny checkpoint in its published FP8 (out / "fp8"; its reference: out / "ref")."""
    source, overrides = FAMILIES[family]
    src = real_checkpoint(source, sizes=WIDE, **overrides)
    config, quantized = _fp8_case(family)
    return to_block_fp8(src, str(out / "fp8"), str(out / "ref"), config, quantized)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("family", ["deepseek-v3.2", "glm-5", "minimax-m2.5"])
def test_published_fp8_gives_the_dequantized_reference(family, real_checkpoint, tmp_path, engine_log):
    config, _ = _fp8_case(family)
    path = _fp8_checkpoint(family, real_checkpoint, tmp_path)
    if config.get("scale_fmt") == "ue8m0":  # the scales written are powers of two
        from safetensors.torch import load_file

        scales = [t for k, t in load_file(next(Path(path).glob("*.safetensors"))).items() if "scale_inv" in k]
        assert scales and all(torch.equal(s, torch.exp2(torch.log2(s).round())) for s in scales)
    stored = json.loads(Path(path, "config.json").read_text())["quantization_config"]
    assert stored == config
    llm = _assert_reference_tokens(path, str(tmp_path / "ref"), prompts_for(512)[1:5], family)
    assert _held(llm) > 0
    assert "held as fp8: e4m3 codes and block scales as stored" in engine_log.text


@pytest.mark.timeout(150)
def test_kimi_k25_int4_experts_give_the_dequantized_reference(real_checkpoint, tmp_path, engine_log):
    """Kimi-K2.5's published compressed-tensors block (in its text_config) verbatim: the routed
    experts int4 symmetric in groups of 32, packed 8 a word; everything its ignore list names stays
    float (checked); the experts held as int4 codes."""
    from safetensors import safe_open

    path = _kimi_checkpoint(real_checkpoint, tmp_path)
    with safe_open(next(Path(path).glob("*.safetensors")), "pt") as f:
        packed = {k.removesuffix(".weight_packed") for k in f.keys() if k.endswith(".weight_packed")}
    text = [k for k in packed if k.startswith("language_model.")]
    others = [k for k in text if not re.search(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj$", k)]
    assert text and not others, others
    llm = _assert_reference_tokens(path, str(tmp_path / "ref"), prompts_for(512)[1:5], "kimi-k2.5")
    assert _held(llm) > 0


def _kimi_checkpoint(real_checkpoint, out: Path) -> str:
    """Kimi-K2.5's tiny checkpoint with int4 experts (out / "int4"; its reference: out / "ref")."""
    from compressed_tensors.quantization import QuantizationConfig

    block = published("2026/kimi-k2.5")["text_config"]["quantization_config"]
    parsed = QuantizationConfig.model_validate(block)
    groups = {n: (g.targets, g.weights) for n, g in parsed.config_groups.items()}
    src = real_checkpoint("2026/kimi-k2.5", sizes=WIDE)
    # The router is a parameter of its own module, not a torch Linear: the "Linear" target misses it.
    # The published "lm_head" names the text tower's head (language_model.lm_head, published in
    # bf16); the package's writer matches names whole, so it is said here with its prefix.
    ignore = [*block["ignore"], "re:.*mlp\\.gate$", "re:.*lm_head$"]
    path = to_compressed_tensors(src, str(out / "int4"), str(out / "ref"), groups, block["format"], ignore)
    config_path = Path(path, "config.json")
    config = json.loads(config_path.read_text())
    config.pop("quantization_config")  # the package writes it at the top; Kimi publishes it in text_config
    config["text_config"]["quantization_config"] = block
    config_path.write_text(json.dumps(config, indent=1))
    return path


V4_FP8 = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[123]\.weight$"
)
V4_FP4 = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


@pytest.mark.timeout(150)
def test_deepseek_v4_fp8_and_fp4_experts_give_the_dequantized_reference(
    real_checkpoint, tmp_path, engine_log
):
    """DeepSeek-V4-Flash's published names and formats as transformers' FP8 integration reads them
    (the stored configs say `expert_dtype: fp4` and ue8m0 block FP8, not the tensors' layout):
    attention (wq_a, wq_b, wkv, wo_a, wo_b), the indexer's wq_b and the shared expert in block FP8
    with e8m0 scales named `X.scale`; the compressors' wkv / wgate, the indexer's weights_proj, the
    router, embeddings and head in the float dtype (transformers keeps the first three out of FP8 by
    name); the routed experts FP4: [O, I / 2] int8 of e2m1 pairs, an e8m0 scale per 32 inputs. The
    experts are held as fp4 codes, and the tokens and logprobs are transformers' on the dequantized
    weights, past the window and the indexer's top-k (prompts of 40 and 70 tokens)."""
    path = _v4_checkpoint(real_checkpoint, tmp_path)
    assert json.loads(Path(path, "config.json").read_text())["expert_dtype"] == "fp4"
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 40, 70)]
    llm = _assert_reference_tokens(path, str(tmp_path / "ref"), prompts, "deepseek-v4")
    held = llm.llm_engine.runner.model.held_weights
    kinds = {p.kind for p in held.params.values()} if held is not None else set()
    assert "fp4" in kinds, kinds
    assert "weights in fp4 (e2m1 two a byte" in engine_log.text
    # The FP4 experts run in one moe_q_ex call, its clamped SiLU in the kernel (where it builds).
    from expertmesh.cpu import cpu_kernels

    if cpu_kernels.load() is not None:
        experts = [m for m in llm.llm_engine.runner.model.modules() if hasattr(m, "experts_form")]
        forms = {(type(m.experts_form).__name__, m.experts_form.act) for m in experts}
        assert experts and forms == {("QuantizedStacks", "silu_clamped")}, forms
    # wo_a (grouped) and the indexer's wq_b take their FP8 codes as stored: fewer resident bytes
    # than the same modules loaded from the dequantized checkpoint, nothing dequantized at load.
    assert "dequantized at load" not in engine_log.text
    dense = LLM(str(tmp_path / "ref"), max_model_len=128, kv_cache_memory_bytes=1 << 23)
    held_fp8, dequantized = (_v4_fp8_modules(e) for e in (llm, dense))
    assert len(held_fp8) == len(dequantized) == 5  # four layers' wo_a, the CSA layer's indexer wq_b
    for name, (form, nbytes) in held_fp8.items():
        assert form in ("GroupedWeights", "QuantizedWeight") and nbytes < dequantized[name][1] / 2, name


def _v4_fp8_modules(llm: LLM) -> dict[str, tuple[str, int]]:
    """{module name: (its weight form's class, resident bytes)} of wo_a and the indexer's wq_b."""
    from expertmesh.layers.quantization.accounting import resident_weight_bytes

    return {
        name: (type(m.weight_form).__name__, resident_weight_bytes(m)["total"])
        for name, m in llm.llm_engine.runner.model.named_modules()
        if name.endswith((".wo_a", ".indexer.wq_b"))
    }


def _v4_checkpoint(real_checkpoint, out: Path) -> str:
    """DeepSeek-V4-Flash's tiny checkpoint in its published names and formats (out / "fp8"; its
    reference: out / "ref")."""
    from test_deepseek_v4 import OVERRIDES, SOURCE, published_names

    config = published(SOURCE)["quantization_config"]
    src = published_names(real_checkpoint(SOURCE, sizes=WIDE, **OVERRIDES), out / "published")
    return to_block_fp8(
        src, str(out / "fp8"), str(out / "ref"), config,
        lambda k, t: V4_FP8.search(k) is not None, torch.float8_e8m0fnu, ".scale",
        fp4=lambda k, t: V4_FP4.search(k) is not None,
    )  # fmt: skip


def test_fp8_scales_in_every_stored_form_and_fp4_read_exactly(tmp_path):
    """The same power-of-two block scales stored as float32, e8m0 and exponent bytes (U8) read to
    the same weight, codes x scale; an FP4 weight ([O, I / 2] int8, an e8m0 scale per 32 inputs)
    reads to its e2m1 values x scale, whole and in slices that start on an odd input (a byte's
    high nibble); the format refuses an unknown fmt / scale_fmt and an FP4 scale of the wrong
    shape, naming them."""
    from quantized_checkpoints import E2M1
    from safetensors.torch import save_file

    from expertmesh.layers.quantization.fp8 import Fp8Format
    from expertmesh.models.tensor_file import TensorFile

    g = torch.Generator().manual_seed(0)
    codes = (torch.randn(200, 150, generator=g) * 50).to(torch.float8_e4m3fn)
    exps = torch.randint(120, 134, (2, 2), generator=g, dtype=torch.uint8)
    fp4 = torch.randint(0, 256, (6, 32), generator=g, dtype=torch.uint8)  # [6, 64] e2m1 values
    fp4_exps = torch.randint(120, 134, (6, 2), generator=g, dtype=torch.uint8)
    tensors = {
        "f32.weight": codes, "f32.weight_scale_inv": torch.exp2(exps.float() - 127),
        "e8m0.weight": codes, "e8m0.weight_scale_inv": exps.view(torch.float8_e8m0fnu),
        "u8.weight": codes, "u8.weight_scale_inv": exps,
        "v4.weight": codes, "v4.scale": exps.view(torch.float8_e8m0fnu),
        "fp4.weight": fp4.view(torch.int8), "fp4.scale": fp4_exps.view(torch.float8_e8m0fnu),
        "bad4.weight": fp4.view(torch.int8), "bad4.scale": fp4_exps[:, :1].clone().view(torch.float8_e8m0fnu),
        "unscaled.weight": fp4.view(torch.int8),
    }  # fmt: skip
    save_file({k: t.clone() for k, t in tensors.items()}, tmp_path / "w.safetensors")
    fmt = Fp8Format.from_config(
        {"quant_method": "fp8", "fmt": "float8_e4m3fn", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    )
    with TensorFile(str(tmp_path / "w.safetensors")) as f:
        view = fmt.view({"w": f})
        assert sorted(k for k, _ in view.keys()) == sorted(k for k in tensors if k.endswith(".weight"))
        full = (
            torch.exp2(exps.float() - 127).repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :150]
        )
        for name in ("f32", "e8m0", "u8", "v4"):
            w = view.get_slice(f"{name}.weight")
            assert torch.equal(w[:, :], codes.float() * full), name
            assert torch.equal(w[100:170, 60:140], (codes.float() * full)[100:170, 60:140]), name
        values = E2M1[torch.stack((fp4 & 15, fp4 >> 4), -1).long()].flatten(-2)
        expected = values * torch.exp2(fp4_exps.float() - 127).repeat_interleave(32, 1)
        w = view.get_slice("fp4.weight")
        assert w.get_shape() == [6, 64] and w.held_kind == ("fp4", 32)
        assert torch.equal(w[:, :], expected) and torch.equal(w[1:5, 33:61], expected[1:5, 33:61])
        with pytest.raises(ValueError, match=r"fp4 weight 'bad4.weight' \[6, 32\] with scale \[6, 1\]"):
            view.get_slice("bad4.weight")
        with pytest.raises(ValueError, match=r"fp4 weight 'unscaled.weight' \(I8\) has no 'unscaled.scale'"):
            view.get_slice("unscaled.weight")
    with pytest.raises(ValueError, match=r"scale_fmt='ue4m3' is not supported"):
        Fp8Format.from_config({"quant_method": "fp8", "scale_fmt": "ue4m3"})
    with pytest.raises(
        ValueError, match=r"fmt='e5m2' is not supported; supported: \['e4m3', 'float8_e4m3fn'\]"
    ):
        Fp8Format.from_config({"quant_method": "fp8", "fmt": "e5m2"})


# ---- layouts (slow) ----------------------------------------------------------------------------
PUBLISHED_LAYOUTS = [(1, 2, 2, False, "naive"), (2, 1, 2, True, "alltoall")]  # (DP, PP, TP, EP, backend)
LAYOUT_PROMPT_LENGTHS = [5, 40, 9, 70]


def _layout_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in LAYOUT_PROMPT_LENGTHS]


def _replica_share(dp_rank: int, dp_size: int) -> list[int]:
    """Uneven: the first DP replica takes prompts 0 and 2, the last one the rest."""
    everything = list(range(len(LAYOUT_PROMPT_LENGTHS)))
    return everything if dp_size == 1 else everything[dp_rank::dp_size]


def _replica_tokens(llm: LLM, idx: list[int]) -> list[list[int]]:
    prompts = _layout_prompts()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in idx], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _published_layouts_rank(rank: int, world: int, paths: list[str]) -> list:
    from layout_cases import rank_main

    engine = dict(max_model_len=128, kv_cache_memory_bytes=1 << 22, debug_nan_recv_buffers=True)
    return [
        rank_main(rank, world, p, PUBLISHED_LAYOUTS, engine, _replica_share, _replica_tokens) for p in paths
    ]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_published_formats_pp2_tp2_and_dp2_tp2_ep_equal_one_process(real_checkpoint, tmp_path):
    """The published-format checkpoints of DeepSeek-V3.2, GLM-5 and MiniMax-M2.5 (FP8), Kimi-K2.5
    (int4 experts) and DeepSeek-V4 (FP8 + FP4 experts, its 4-stream residual between stages) under
    PP2 x TP2 and DP2 x TP2 with EP over alltoall: every rank's tokens equal one process on the
    same files (a TP slice of the FP4 experts' 160 inputs cuts their 32-groups: dequantized at
    load there, held under EP)."""
    from distributed_utils import run_distributed

    paths = [
        *(
            _fp8_checkpoint(f, real_checkpoint, tmp_path / f)
            for f in ("deepseek-v3.2", "glm-5", "minimax-m2.5")
        ),
        _kimi_checkpoint(real_checkpoint, tmp_path / "kimi"),
        _v4_checkpoint(real_checkpoint, tmp_path / "v4"),
    ]
    expected = {}
    for path in paths:
        llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
        expected[path] = _replica_tokens(llm, list(range(len(LAYOUT_PROMPT_LENGTHS))))
    for rank, per_path in enumerate(run_distributed(_published_layouts_rank, 4, paths, timeout=380)):
        for path, results in zip(paths, per_path, strict=True):
            for case, idx, tokens in results:
                assert tokens == [expected[path][i] for i in idx], f"rank {rank}, {path}, {case}"


@pytest.mark.parametrize("ops_name", ["torch", "cpu"])
def test_grouped_output_runs_each_group_on_its_rows_of_the_codes(ops_name):
    """DeepSeek-V4's wo_a given a compressed weight (FP8 codes, int8 online) multiplies each group's
    inputs by that group's rows of the codes, as the dense grouped product does on the weight the
    codes stand for; an o_lora_rank that cuts a panel of codes falls back to that weight, dense."""
    from types import SimpleNamespace

    from expertmesh.layers.grouped_output import GroupedOutput, GroupedWeights
    from expertmesh.layers.quantization.packed import QuantizedWeight
    from expertmesh.layers.torch_ops import TORCH_OPS
    from expertmesh.models.build import select_ops

    ops = TORCH_OPS if ops_name == "torch" else select_ops("cpu", torch.float32, False)
    tp = SimpleNamespace(world_size=1, rank_in_group=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4 * 40, generator=g)
    for rank, kind in (
        (2 * ops.quant_lanes, "fp8"),
        (2 * ops.quant_lanes, "int8"),
        (ops.quant_lanes + 4, "fp8"),
    ):
        module = GroupedOutput(4, rank, 40, tp, torch.float32)
        module.weight.data = torch.randn(4 * rank, 40, generator=g)
        codes = QuantizedWeight.quantize(module.weight.data, kind, 32, ops)
        w = codes.dequantize().view(4, rank, 40)
        expected = torch.einsum("tgi,gri->tgr", x.view(5, 4, 40), w).reshape(5, -1)
        if kind == "int8":  # online quantization: use_quantized compresses the loaded weight
            module.use_quantized(SimpleNamespace(kind=kind, group_size=32, check_split=lambda *a: None), ops)
        else:
            module.hold_quantized(codes)
        whole_panels = rank % ops.quant_lanes == 0
        assert isinstance(module.weight_form, GroupedWeights) == whole_panels
        assert (module.weight.numel() == 0) == whole_panels  # the dense weight released
        torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-5)
