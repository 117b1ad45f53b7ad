"""compressed-tensors checkpoints (llm-compressor's format, issue 14), written by the
compressed-tensors package's own compressors from a tiny Qwen3-MoE (its published config): greedy
tokens equal transformers on the same weights dequantized to fp32 by the package (the divergence
rule of test_quantization.py), TP 2 equals one process, and every unsupported scheme is an error
naming it and listing what is supported."""

import json

import pytest
from checkpoints import prompts_of_lengths
from compressed_tensors.quantization import QuantizationArgs
from quantized_checkpoints import to_compressed_tensors
from real_checkpoints import Sizes
from test_quantization import LENGTHS, _greedy, assert_greedy_matches
from transformers import AutoModelForCausalLM

from expertmesh import LLM

IGNORE = ["lm_head", "re:.*mlp.gate$"]  # as llm-compressor's MoE recipes write it: head and routers


def _args(bits: int, strategy: str, symmetric: bool = True, group: int | None = None) -> QuantizationArgs:
    return QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group
    )


CASES = {
    # W4A16 as llm-compressor's preset: int4 symmetric, groups (of 16 here: the tiny widths)
    "w4a16-group": ({"group_0": (["Linear"], _args(4, "group", True, 16))}, "pack-quantized"),
    # two config groups by regex: attention int8 per channel asymmetric, experts int4 asymmetric
    "mixed-regex": (
        {
            "attn": (["re:.*self_attn\\.(q|k|v|o)_proj$"], _args(8, "channel", False)),
            "experts": (["re:.*mlp\\.experts\\..*"], _args(4, "group", False, 32)),
        },
        "pack-quantized",
    ),
    # int8 stored unpacked (naive / int-quantized format), one scale per tensor
    "w8-naive-tensor": ({"group_0": (["Linear"], _args(8, "tensor", True))}, "naive-quantized"),
    # W8A8 int (dynamic per-token activations), as llm-compressor's preset: run weight-only
    "w8a8-int-dynamic": (
        {
            "group_0": (
                ["Linear"],
                _args(8, "channel", True),
                QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True, symmetric=True),
            )
        },
        "int-quantized",
    ),  # fmt: skip
}


def _qwen3(real_checkpoint) -> str:
    return real_checkpoint("qwen3-30b-a3b")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_compressed_tensors_match_the_same_weights_dequantized(real_checkpoint, tmp_path, engine_log, case):
    groups, fmt = CASES[case]
    ref_path = str(tmp_path / "ref")
    path = to_compressed_tensors(_qwen3(real_checkpoint), str(tmp_path / "ct"), ref_path, groups, fmt, IGNORE)
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    assert "weights: compressed-tensors (" in engine_log.text
    assert "held compressed as stored: 16 parameters" in engine_log.text  # 4 layers: qkv, o, w13, w2
    ref = AutoModelForCausalLM.from_pretrained(ref_path).eval()
    prompts = prompts_of_lengths(LENGTHS, seed=9)
    assert assert_greedy_matches(_greedy(llm, prompts), ref, prompts) <= 1


@pytest.mark.timeout(240)
def test_tp2_and_ep_layouts_equal_one_process_on_compressed_tensors(real_checkpoint, tmp_path):
    """TP 2 slices each packed weight by rows (its output) or by columns (row-parallel, the experts'
    down projection under TP) through whole packed rows and the zero points packed by rows."""
    from distributed_utils import run_distributed
    from test_quantization import _layouts_main

    groups, fmt = CASES["mixed-regex"]
    path = to_compressed_tensors(
        _qwen3(real_checkpoint), str(tmp_path / "ct"), str(tmp_path / "ref"), groups, fmt, IGNORE
    )
    prompts = prompts_of_lengths([3, 17, 1, 40], seed=6)
    expected = _greedy(LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22), prompts)
    for rank, results in enumerate(run_distributed(_layouts_main, 2, path, None, prompts, timeout=220)):
        for layout, tokens in results:
            assert tokens == expected, f"rank {rank}, (TP, EP)={layout}"


@pytest.mark.parametrize("bits,per_weight", [(8, 1 + 8 / 128), (4, 0.5 + 8 / 128)])
def test_resident_bytes_of_compressed_tensors_held_as_stored(real_checkpoint, tmp_path, bits, per_weight):
    """int8 / int4 in groups of 128 held at 1.0625 / 0.5625 bytes a weight (codes, a float32 scale
    and offset per group), the unquantized rest (embeddings, norms, routers, head) at float32."""
    from compressed_tensors.quantization import preset_name_to_scheme

    from expertmesh.models.build import log_weight_bytes

    path = real_checkpoint("qwen3-30b-a3b", sizes=Sizes(hidden=256, expert_inter=128, heads=4))
    args = preset_name_to_scheme(f"W{bits}A16", ["Linear"]).weights  # groups of 128, symmetric
    ct = to_compressed_tensors(
        path, str(tmp_path / "ct"), str(tmp_path / "ref"), {"g": (["Linear"], args)}, "pack-quantized", IGNORE
    )
    model = LLM(ct, max_model_len=64, kv_cache_memory_bytes=1 << 20).llm_engine.runner.model
    dense = LLM(path, max_model_len=64, kv_cache_memory_bytes=1 << 20).llm_engine.runner.model
    held = _held_weights(model)  # weights held compressed (panel rows past out_features included)
    assert len(model.held_weights.params) == 16 and held > 0
    counts, dense_counts = log_weight_bytes(model, model.cfg), log_weight_bytes(dense, dense.cfg)
    assert counts["quantized"] == pytest.approx(per_weight * held, rel=1e-9)
    assert counts["dense"] == pytest.approx(dense_counts["total"] - 4 * held, rel=0.02)


def _held_weights(model) -> int:
    from expertmesh.cpu.expert_forms import QuantizedStacks
    from expertmesh.layers.expert_weights import PerExpertWeights
    from expertmesh.layers.quantization.packed import QuantizedWeight

    n = 0
    for m in model.modules():
        form, experts = getattr(m, "weight_form", None), getattr(m, "experts_form", None)
        held = [form] if isinstance(form, QuantizedWeight) else []
        held += [w for pair in experts.pairs for w in pair] if isinstance(experts, PerExpertWeights) else []
        held += [experts.w13, experts.w2] if isinstance(experts, QuantizedStacks) else []
        n += sum(w.codes.numel() * (2 if w.kind == "int4" else 1) for w in held)
    return n


def _cut_groups_main(rank, world, path, prompts):
    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="external_launcher",
              max_model_len=128, kv_cache_memory_bytes=1 << 22)  # fmt: skip
    return _greedy(llm, prompts), sorted(llm.llm_engine.runner.model.held_weights.params)


@pytest.mark.timeout(120)
def test_tp2_slices_that_cut_groups_are_dequantized_and_equal_one_process(real_checkpoint, tmp_path):
    """Experts of 48 split over TP 2 hold 24 inputs of the down projection, which cuts int4 groups
    of 16: those experts are dequantized at load instead (the rest still held), same tokens."""
    from distributed_utils import run_distributed

    src = real_checkpoint("qwen3-30b-a3b", sizes=Sizes(expert_inter=48))
    groups = {"g": (["Linear"], _args(4, "group", False, 16))}
    path = to_compressed_tensors(
        src, str(tmp_path / "ct"), str(tmp_path / "ref"), groups, "pack-quantized", IGNORE
    )
    prompts = prompts_of_lengths([3, 17, 1, 40], seed=6)
    expected = _greedy(LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22), prompts)
    for rank, (tokens, held) in enumerate(run_distributed(_cut_groups_main, 2, path, prompts, timeout=100)):
        assert tokens == expected, f"rank {rank}"
        assert len(held) == 8 and not any(".experts." in n for n in held), held  # qkv and o of 4 layers


# ---- errors ----------------------------------------------------------------------------------------
def _with_quantization_config(path: str, edit) -> None:
    config_path = f"{path}/config.json"
    config = json.load(open(config_path))
    edit(config["quantization_config"])
    json.dump(config, open(config_path, "w"))


def _preset(name: str) -> dict:
    from compressed_tensors.quantization import preset_name_to_scheme

    return {"group_0": preset_name_to_scheme(name, ["Linear"]).model_dump()}


UNSUPPORTED = {
    "fp8-static": (
        lambda q: q.update(config_groups=_preset("FP8"), format="float-quantized"),
        r"config_groups\['group_0'\] \(float8 weights \(tensor, symmetric\), input activations float8 tensor "
        r"static, format 'float-quantized'\) is not supported; supported: int weights of 4 or 8 bits",
    ),
    "nvfp4": (
        lambda q: q.update(config_groups=_preset("NVFP4"), format="nvfp4-pack-quantized"),
        r"\(float4 weights \(tensor_group, symmetric\).*format 'nvfp4-pack-quantized'\) is not supported",
    ),
    "int4-in-naive": (
        lambda q: q.update(format="naive-quantized"),
        r"\(int4 weights \(group 16, symmetric\), input activations none, format 'naive-quantized'\)",
    ),
    "2:4 sparse": (
        lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
        r"compressed-tensors sparsity_config=\{'format': 'sparse-24-bitmask'.* is not supported",
    ),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_compressed_tensors_schemes_name_the_scheme_and_the_supported_ones(
    real_checkpoint, tmp_path, case
):
    edit, message = UNSUPPORTED[case]
    groups, fmt = CASES["w4a16-group"]
    path = to_compressed_tensors(
        _qwen3(real_checkpoint), str(tmp_path / "ct"), str(tmp_path / "ref"), groups, fmt, IGNORE
    )
    _with_quantization_config(path, edit)
    with pytest.raises(ValueError, match=message):
        LLM(path, max_model_len=32, kv_cache_memory_bytes=1 << 20)


def test_compressed_tensors_parts_that_do_not_fit_are_errors_naming_them(real_checkpoint, tmp_path):
    groups, fmt = CASES["w4a16-group"]
    path = to_compressed_tensors(
        _qwen3(real_checkpoint), str(tmp_path / "ct"), str(tmp_path / "ref"), groups, fmt, IGNORE
    )
    _with_quantization_config(path, lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=32))
    with pytest.raises(
        ValueError, match=r"compressed-tensors model\.layers\.0\..*: parts .* do not fit a weight of shape"
    ):
        LLM(path, max_model_len=32, kv_cache_memory_bytes=1 << 20)
    _with_quantization_config(
        path, lambda q: q["config_groups"]["group_0"].update(targets=["re:.*self_attn.*"])
    )
    with pytest.raises(
        ValueError, match=r"is quantized, but no config_groups target \(\['re:\.\*self_attn\.\*'\]\) names"
    ):
        LLM(path, max_model_len=32, kv_cache_memory_bytes=1 << 20)
    _with_quantization_config(path, lambda q: q.update(ignore=["lm_head", "re:.*mlp.*"]))
    with pytest.raises(
        ValueError, match=r"is quantized, but 'model\.layers\.0\.mlp\..*' is in the config's ignore list"
    ):
        LLM(path, max_model_len=32, kv_cache_memory_bytes=1 << 20)


@pytest.mark.timeout(60)
def test_eplb_moves_experts_held_compressed_and_keeps_every_token(real_checkpoint, tmp_path):
    """W4A16 groups of 16 held as stored (codes, scales and offsets from the zero points): an online
    rebalance moves them between 2 EP ranks, tokens those of one process."""
    from test_eplb_quantized import _check_eplb

    groups, fmt = CASES["w4a16-group"]
    src = real_checkpoint("qwen3-30b-a3b", sizes=Sizes(layers=2))
    path = to_compressed_tensors(src, str(tmp_path / "ct"), str(tmp_path / "ref"), groups, fmt, IGNORE)
    _check_eplb(path, None, "QuantizedExperts")
