"""GGUF files (llama.cpp's format): tensors dequantize bit for bit like gguf's own dequantizer,
greedy tokens equal transformers' run of the same file, split sets and directories load, TP2 and
EP2 equal one process, and bad files fail naming what is wrong."""

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from checkpoints import prompts_of_lengths
from distributed_utils import run_distributed
from gguf_checkpoints import dequantized_state, phimoe_attn_factor, quantize_k, write_gguf
from real_checkpoints import Sizes
from safetensors.torch import load_file

from expertmesh import LLM, SamplingParams
from expertmesh.models.gguf import (
    HELD,
    GGUFError,
    GGUFTensor,
    GGUFTensorFile,
    gguf_files,
    gguf_model_dir,
    held_kinds,
)

PROMPTS = prompts_of_lengths([5, 11, 3], seed=36)
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def _gguf_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EXPERTMESH_GGUF_DIR", str(tmp_path_factory.getbasetemp() / "gguf-models"))


@pytest.fixture(scope="session")
def gguf_model(checkpoint, tmp_path_factory):
    """gguf_model(qtype, split=1) -> the GGUF paths of the tiny Qwen3-MoE checkpoint."""
    made = {}

    def make(qtype: str, split: int = 1, family: str = "qwen3_moe") -> list[str]:
        if (qtype, split, family) not in made:
            d = tmp_path_factory.mktemp(f"gguf-{family}-{qtype}-{split}")
            made[qtype, split, family] = write_gguf(
                checkpoint(family), str(d / f"tiny-{qtype}.gguf"), qtype, split
            )
        return made[qtype, split, family]

    return make


def _hf_name(name: str, arch_experts: int) -> list[tuple[str, int | None]]:
    """Reference side of the name map, spelled out independently of the code under test."""
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}  # fmt: skip
    if name in fixed:
        return [(fixed[name], None)]
    _, layer, piece, kind = name.split(".")
    p = f"model.layers.{layer}."
    exps = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
    if piece in exps:
        return [(f"{p}mlp.experts.{e}.{exps[piece]}.{kind}", e) for e in range(arch_experts)]
    pieces = {
        "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
    }  # fmt: skip
    return [(f"{p}{pieces[piece]}.{kind}", None)]


INFO = {"arch": "qwen3moe", "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_every_tensor_and_slice_dequantizes_like_gguf(gguf_model, qtype):
    (path,) = gguf_model(qtype)
    ref = dequantized_state([path])
    f = GGUFTensorFile(path, INFO)
    seen = set()
    for name, full in ref.items():
        for key, e in _hf_name(name, 8):
            want = full if e is None else full[e]
            src = f.get_slice(key)
            seen.add(key)
            assert tuple(src.get_shape()) == tuple(want.shape), key
            got = src[:]
            assert torch.equal(got.float(), want), key
            assert torch.equal(got.float().view(torch.int32), want.view(torch.int32)), key  # bits
            if want.dim() == 2:  # a TP rank's rows and columns: just that region, the same values
                r0, r1, c0, c1 = 1, want.shape[0] - 3, 32, want.shape[1]
                assert torch.equal(src[r0:r1, c0:c1].float(), want[r0:r1, c0:c1]), key
    assert seen == set(f.keys())


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "BF16"])
def test_k_quants_and_others_dequantize_like_gguf(qtype, monkeypatch):
    """Random blocks of each type (finite fp16 scales): rows cut from a stacked expert tensor give
    gguf.quants.dequantize's values for those rows, bit for bit (dequantized 4 rows a call here,
    as a large embedding is)."""
    from expertmesh.models.gguf import quants

    monkeypatch.setattr(quants, "DEQUANT_ROWS", 4)
    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(0)
    experts, rows, cols = 3, 6, 512
    raw = rng.integers(0, 256, (experts, rows, cols // block * size), dtype=np.uint8)
    if qtype == "BF16":
        raw[..., 1::2] = rng.integers(0x3C, 0x40, raw[..., 1::2].shape)  # moderate exponents
    else:
        # scale fields (fp16): finite values; every K-quant/IQ block's d sits at a fixed place
        b = raw.reshape(experts, rows, cols // block, size)
        d = rng.uniform(-0.1, 0.1, b.shape[:3]).astype(np.float16).view(np.uint8).reshape(*b.shape[:3], 2)
        at = {"Q6_K": size - 2, "Q3_K": size - 2, "Q2_K": size - 4}.get(qtype, 0)
        b[..., at : at + 2] = d
        if qtype in ("Q4_K", "Q5_K", "Q2_K"):
            b[..., at + 2 : at + 4] = d
    want = torch.from_numpy(gguf.quants.dequantize(raw, t).astype(np.float32))
    for e in range(experts):
        src = GGUFTensor(raw[e], t, (rows, cols), f"w{e}")
        assert torch.equal(src[:].float(), want[e])
        if qtype in HELD:  # our block decoding: gguf's float32 bits, zeros' signs included
            assert torch.equal(src[:].view(torch.int32), want[e].view(torch.int32))
        assert torch.equal(src[2:5, 256:].float(), want[e, 2:5, 256:])
        if qtype in HELD:  # held as stored: our kind's code * scale + offset, any whole-group region
            kind, group = HELD[qtype]
            assert src.held_kind == (kind, group) and src.unheld_reason is None
            for (o0, o1), (i0, i1) in (((0, rows), (0, cols)), ((1, 4), (96, 480)), ((2, 6), (256, 512))):
                assert torch.equal(_held_values(src, (o0, o1), (i0, i1), group), want[e, o0:o1, i0:i1])
            # the int8 form with groups of 16 (a fused parameter's parts held alike) gives the same
            wide = GGUFTensor(raw[e], t, (rows, cols), f"w{e}", kind=("int8", 16))
            assert torch.equal(_held_values(wide, (1, 5), (64, 448), 16), want[e, 1:5, 64:448])
        else:  # the reason held.plan logs names the type
            assert src.held_kind is None and qtype in (src.unheld_reason or "BF16")


def _held_values(src: GGUFTensor, rows: tuple, cols: tuple, group: int) -> torch.Tensor:
    codes, s, m = src.quantized(rows, cols, group, cols[0] // group)
    codes = codes.view(torch.int8) if src.held_kind[0] == "int8" else codes
    assert codes.shape == (rows[1] - rows[0], cols[1] - cols[0]) and s.shape[1] == codes.shape[1] // group
    return codes.float() * s.repeat_interleave(group, 1) + m.repeat_interleave(group, 1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_writer_matches_gguf_layout(qtype):
    """The test's K-quant writer (gguf has none) lays fields out as gguf reads them: its blocks
    dequantize (gguf's dequantizer) to the input within the rounding step."""
    x = np.random.default_rng(2).normal(0, 0.1, (4, 512)).astype(np.float32)
    raw = quantize_k(x, qtype)
    y = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    step = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 31}[qtype]
    assert np.abs(y - x).max() <= 1.1 * (2 * np.abs(x).max() / step)
    assert np.abs(y - x).max() > 0  # rounded, not copied


def _greedy(path: str, **kw) -> list[list[int]]:
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**GREEDY), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _transformers_greedy(path: str, hf_dir: str) -> list[list[int]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    # transformers' qwen3moe GGUF mapping drops the expert width: the checkpoint's config (PEERS.md)
    config = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), config=config
    ).eval()
    model.generation_config.eos_token_id = None
    out = []
    for p in PROMPTS:
        y = model.generate(
            torch.tensor([p]), max_new_tokens=GREEDY["max_tokens"], do_sample=False, pad_token_id=0
        )
        out.append(y[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_held_codes_dequantize_like_gguf(gguf_model, qtype):
    """Q8_0 / Q4_0 / Q4_1 served as our int8 / int4 kind: code * scale + offset per 32 inputs gives
    gguf's dequantized values bit for bit, for any whole-block region (a TP rank's columns)."""
    (path,) = gguf_model(qtype)
    ref = dequantized_state([path])
    f = GGUFTensorFile(path, INFO)
    held = 0
    for name, full in ref.items():
        for key, e in _hf_name(name, 8):
            src = f.get_slice(key)
            if src.held_kind is None:
                assert full.dim() == 1 or key.startswith(("lm_head", "model.embed")) or ".gate." in key, key
                continue
            held += 1
            want = full if e is None else full[e]
            assert src.held_kind == HELD[qtype]
            # whole rows; a TP rank's whole blocks; a rank's 16 inputs inside one block (a 32-wide
            # row split in two: held.local_groups then asks for one scale a row)
            regions = (
                ((0, want.shape[0]), (0, want.shape[1]), 32),
                ((2, 7), (32, 64), 32),
                ((1, 4), (48, 64), 16),
            )
            for (o0, o1), (i0, i1), group in regions:
                if i1 > want.shape[1]:
                    continue
                codes, s, m = src.quantized((o0, o1), (i0, i1), group, i0 // group)
                if qtype == "Q8_0":
                    codes = codes.view(torch.int8)
                w = codes.float() * s.repeat_interleave(group, 1) + m.repeat_interleave(group, 1)
                assert torch.equal(w, want[o0:o1, i0:i1]), key
    assert held > 0


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_greedy_tokens_equal_transformers_on_the_gguf_file(gguf_model, checkpoint, qtype):
    (path,) = gguf_model(qtype)
    assert _greedy(path) == _transformers_greedy(path, checkpoint("qwen3_moe"))


@pytest.fixture(scope="session")
def k_quant_model(checkpoint, tmp_path_factory):
    """(Q4_K_M-like file, Q5_K file, F32 files of their values as gguf dequantizes them) of a
    Qwen3-MoE whose rows are whole 256-wide super-blocks."""
    hf = checkpoint("qwen3_moe", hidden_size=256, moe_intermediate_size=256)
    d = tmp_path_factory.mktemp("gguf-k")
    out = {}
    for qtype in ("Q4_K_M", "Q5_K"):
        (path,) = write_gguf(hf, str(d / f"tiny-{qtype}.gguf"), qtype)
        (ref,) = write_gguf(hf, str(d / f"tiny-{qtype}-as-f32.gguf"), "F32", values=dequantized_state([path]))
        out[qtype] = (path, ref)
    return out


def _logged(fn, *args) -> tuple:
    """(fn(*args), the expertmesh log lines written meanwhile: a handler of the test's own)."""
    import io
    import logging

    buf, logger = io.StringIO(), logging.getLogger("expertmesh")
    handler, level = logging.StreamHandler(buf), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        out = fn(*args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return out, buf.getvalue()


def test_k_quant_files_hold_codes_and_run_like_their_dequantized_values(k_quant_model):
    """Q4_K_M (Q4_K with Q6_K attn_v / down: each layer's qkv held in int8 groups of 16, its experts
    in int8 with gate/up in groups of 32 and down in 16) and Q5_K files: every matrix but the
    embedding and head held as stored, and greedy tokens equal our float run of the same values
    (an F32 file of gguf's dequantization)."""
    path, ref = k_quant_model["Q4_K_M"]
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {types["blk.0.ffn_gate_exps.weight"], types["blk.0.ffn_down_exps.weight"]} == {"Q4_K", "Q6_K"}
    widened = held_kinds(types)
    assert widened["blk.1.ffn_up_exps.weight"] == widened["blk.1.ffn_gate_exps.weight"] == ("int8", 32)
    assert widened["blk.1.ffn_down_exps.weight"] == ("int8", 16)  # w2: its own group, w13's kind
    assert widened["blk.0.attn_q.weight"] == widened["blk.0.attn_v.weight"] == ("int8", 16)
    assert "blk.0.attn_output.weight" not in widened  # a parameter of its own keeps Q4_K's int4
    for qtype in ("Q4_K_M", "Q5_K"):
        path, ref = k_quant_model[qtype]
        got, text = _logged(_greedy, path)
        assert "weights held compressed as stored: 8 parameters" in text, text  # qkv, o, w13, w2 a layer
        unheld = [line for line in text.splitlines() if "not held compressed" in line]
        assert unheld and all("embedding / head" in line for line in unheld), unheld
        assert _greedy(ref) == got


def test_q6_k_down_stacks_share_one_zero_offsets_tensor(k_quant_model):
    """A Q6_K down projection has no offsets (W = code * scale): its experts' stacks share one zero
    tensor, every layer alike, where the Q4_K ones hold their own; the tokens are those of our
    float run of the same values."""
    from expertmesh.layers.fused_moe import FusedExperts

    path, ref = k_quant_model["Q4_K_M"]
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    blocks = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedExperts)]
    shared = set()
    for i, m in enumerate(blocks):
        w13, w2 = m.experts_form.w13, m.experts_form.w2
        assert not w13.shared_offsets and bool(w13.offsets.any())  # Q4_K gate / up: dmin * m offsets
        assert w2.shared_offsets == (types[f"blk.{i}.ffn_down_exps.weight"] == "Q6_K"), i
        if w2.shared_offsets:
            assert not w2.offsets.any()
            shared.add(w2.offsets.untyped_storage().data_ptr())
    assert len(shared) == 1  # one zero stack for every Q6_K-down layer
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _greedy(ref)


def test_published_size_estimate_equals_the_resident_weights(k_quant_model):
    """benchmarks/bench_published_size.py's estimate of what expertmesh holds for a GGUF file (it
    decides whether the 48-layer file is loaded at all) against the bytes the loaded model holds:
    codes, scales, offsets of the held experts and attention, the float rest."""
    from expertmesh.layers.quantization.accounting import resident_weight_bytes

    bench = _benchmark("bench_published_size")
    for qtype in ("Q4_K_M", "Q5_K"):
        path, _ = k_quant_model[qtype]
        llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
        model = llm.llm_engine.runner.model
        held = resident_weight_bytes(model)["total"]
        want = bench.estimate_expertmesh(path, dtype_bytes=model.cfg.dtype.itemsize)["weights_gib"] * 2**30
        print(qtype, held, want)
        assert abs(want - held) <= 0.02 * held, (qtype, held, want)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_float_gguf_runs_like_its_checkpoint(gguf_model, checkpoint, family):
    """Families transformers does not read from GGUF here: an F32 file holds the checkpoint's
    values exactly, so its tokens equal our run of the checkpoint. Mixtral is written as llama.cpp's
    `llama` with Q/K rows permuted (undone at load); Qwen2-MoE carries a shared expert and biases."""
    (path,) = gguf_model("F32", family=family)
    assert _greedy(path) == _greedy(checkpoint(family))


@pytest.mark.parametrize("published", ["olmoe-1b-7b-0924", "granite-3.1-3b-a800m-instruct"])
def test_families_from_published_configs(real_checkpoint, tmp_path, published):
    """OLMoE (q/k norm over the whole projection, top-k not renormalised) and Granite-MoE (its
    multipliers from granitemoe.attention.scale / embedding_scale / residual_scale / logit_scale,
    fused experts split by the converter, tied head), tiny checkpoints of the published configs:
    an F32 file runs like the checkpoint; a Q8_0 file, held, like an F32 file of its values."""
    hf = real_checkpoint(published)
    (f32,) = write_gguf(hf, str(tmp_path / "f32.gguf"), "F32")
    assert _greedy(f32) == _greedy(hf)
    (q8,) = write_gguf(hf, str(tmp_path / "q8.gguf"), "Q8_0")
    (ref,) = write_gguf(hf, str(tmp_path / "q8-as-f32.gguf"), "F32", values=dequantized_state([q8]))
    got, text = _logged(_greedy, q8)
    assert "weights held compressed as stored" in text
    assert got == _greedy(ref)


LLAMA_CPP = os.environ.get("EXPERTMESH_LLAMA_CPP")  # llama.cpp's sources: convert_hf_to_gguf.py, gguf-py


@pytest.mark.skipif(not LLAMA_CPP, reason="EXPERTMESH_LLAMA_CPP (llama.cpp's source dir) is not set")
@pytest.mark.parametrize(
    "family,outtype",
    [("qwen3_moe", "f32"), ("qwen3_moe", "q8_0"), ("mixtral", "f32"), ("olmoe-1b-7b-0924", "f32"),
     ("granite-3.1-3b-a800m-instruct", "f32")],
)  # fmt: skip
def test_file_written_by_llama_cpps_converter(checkpoint, real_checkpoint, tmp_path, family, outtype):
    """llama.cpp's own convert_hf_to_gguf.py (from llama-cpp-python's sdist; needs sentencepiece):
    Qwen3-MoE against transformers on the same file; Mixtral (written as llama, Q/K permuted),
    OLMoE and Granite-MoE (published configs) against our run of their checkpoints."""
    source = real_checkpoint(family) if "-" in family else checkpoint(family)
    out = str(tmp_path / f"converted-{outtype}.gguf")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, os.path.join(root, "benchmarks", "gguf_convert.py"), "--converter", LLAMA_CPP]
    subprocess.run([*cmd, source, "--outtype", outtype, "--outfile", out], check=True)
    if family == "qwen3_moe":
        assert _greedy(out) == _transformers_greedy(out, source)
    else:
        assert _greedy(out) == _greedy(source)


# DeepSeek's MLA widths made whole Q8_0 blocks (32) so a Q8_0 file holds every MLA projection
MLA_SIZES = Sizes(qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=64)
# (published config, overrides): V2-Lite, V3, V3.2 (its indexer, MTP block kept last by the
# converter), GLM-4.5-Air and GLM-4.5's per-head q/k norm
DS_GLM = [
    ("deepseek-v2-lite", {}),
    ("deepseek-v3", {}),
    ("2026/deepseek-v3.2", {}),
    ("glm-4.5-air", {}),
    ("glm-4.5-air", {"use_qk_norm": True}),
]
# config keys a GGUF file does not carry as the checkpoint has them: the token ids (GGUF has one
# eos), the MTP layers (not loaded from GGUF), the dtype; rms_norm_eps is a float32 (approx below)
NOT_CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id", "num_nextn_predict_layers", "torch_dtype")


def _checkpoint_state(hf: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (every shard) but the MTP layer, which GGUF files do not serve."""
    layers = json.load(open(os.path.join(hf, "config.json")))["num_hidden_layers"]
    names = [n for n in os.listdir(hf) if n.endswith(".safetensors")]
    sd = {k: v for n in names for k, v in load_file(os.path.join(hf, n)).items()}
    return {k: v for k, v in sd.items() if not k.startswith(f"model.layers.{layers}.")}


def _served(path: str) -> dict[str, torch.Tensor]:
    """Every tensor the GGUF file serves under its HF name, whole, as the loader reads it."""
    info = json.load(open(os.path.join(gguf_model_dir(path), "gguf.json")))
    f = GGUFTensorFile(path, info)
    return {k: f.get_slice(k).materialize([(0, d) for d in f.get_slice(k).shape]) for k in f.keys()}


def _check_config(path: str, hf: str) -> None:
    """The config made from the file's metadata has the checkpoint's values (YaRN's too)."""
    cfg = json.load(open(os.path.join(gguf_model_dir(path), "config.json")))
    source = json.load(open(os.path.join(hf, "config.json")))
    assert cfg["rms_norm_eps"] == pytest.approx(source["rms_norm_eps"], rel=1e-6)
    same = set(source) & set(cfg) - {"rms_norm_eps", "rope_scaling", *NOT_CARRIED}
    assert {k: cfg[k] for k in same} == {k: source[k] for k in same}
    own = ("q_lora_rank", "qk_nope_head_dim", "n_shared_experts", "first_k_dense_replace", "topk_group",
           "routed_scaling_factor", "norm_topk_prob", "partial_rotary_factor", "use_qk_norm")  # fmt: skip
    assert all(key not in source or key in same for key in own)  # the family's own keys are all carried
    if source.get("rope_scaling"):
        yarn = (
            "factor",
            "original_max_position_embeddings",
            "mscale",
            "mscale_all_dim",
            "beta_fast",
            "beta_slow",
        )
        assert {k: cfg["rope_scaling"][k] for k in yarn} == {k: source["rope_scaling"][k] for k in yarn}


def _held_but(text: str, allowed: tuple[str, ...]) -> None:
    assert "weights held compressed as stored" in text, text
    unheld = [line for line in text.splitlines() if "not held compressed" in line]
    assert all(any(a in line for a in allowed) for line in unheld), unheld


@pytest.mark.parametrize("published,overrides", DS_GLM)
def test_deepseek2_and_glm4moe_from_published_configs(real_checkpoint, tmp_path, published, overrides):
    """deepseek2 (MLA; V2-Lite: q_proj, softmax greedy, 2 shared experts, YaRN mscale 0.707; V3: q
    LoRA, sigmoid groups with the exp_probs_b correction bias, renormalised, scaled by 2.5, MTP layer
    skipped) and glm4moe (partial rotary, q/k/v biases, optional per-head q/k norm, sigmoid router
    with its correction bias, the MTP block written last and skipped), tiny checkpoints of the
    published configs (and DeepSeek-V3.2: deepseek32, V3's with the sparse-attention indexer's
    tensors and keys): an F32 file serves every checkpoint tensor exactly under its name (DeepSeek's
    kv_b_proj rebuilt from the split attn_k_b / attn_v_b), its config has the checkpoint's values,
    and it runs like the checkpoint; a Q8_0 file, held, runs like an F32 file of its values."""
    hf = real_checkpoint(published, sizes=MLA_SIZES, **overrides)
    (f32,) = write_gguf(hf, str(tmp_path / "f32.gguf"), "F32")
    want, got = _checkpoint_state(hf), _served(f32)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want), [
        k for k in want if not torch.equal(got[k], want[k])
    ]
    _check_config(f32, hf)
    assert _greedy(f32) == _greedy(hf)
    (q8,) = write_gguf(hf, str(tmp_path / "q8.gguf"), "Q8_0")
    (ref,) = write_gguf(hf, str(tmp_path / "q8-as-f32.gguf"), "F32", values=dequantized_state([q8]))
    got, text = _logged(_greedy, q8)
    _held_but(text, ("embedding / head", "kv_b_proj from attn_k_b / attn_v_b"))
    assert got == _greedy(ref)


# every width a whole 256-wide K-quant super-block, so each matrix is written in Q4_K / Q6_K
K_SIZES = Sizes(hidden=256, expert_inter=256, dense_inter=256, shared_inter=256, qk_nope_head_dim=32,
                v_head_dim=32, q_lora_rank=256, kv_lora_rank=256)  # fmt: skip


@pytest.mark.parametrize("published", ["deepseek-v3", "glm-4.5-air"])
def test_deepseek2_and_glm4moe_k_quants(real_checkpoint, tmp_path, published):
    """A Q4_K_M-like file (Q4_K, Q6_K on attn_v / ffn_down / the head) of DeepSeek-V3 (MLA's q_a,
    q_b, kv_a and o held in Q4_K; k_b / v_b dequantized into kv_b_proj) and GLM-4.5-Air: held, and
    greedy tokens equal our float run of an F32 file of the values gguf dequantizes."""
    hf = real_checkpoint(published, sizes=K_SIZES)
    (path,) = write_gguf(hf, str(tmp_path / "q4km.gguf"), "Q4_K_M")
    (ref,) = write_gguf(hf, str(tmp_path / "q4km-as-f32.gguf"), "F32", values=dequantized_state([path]))
    assert "Q4_K" in {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    got, text = _logged(_greedy, path)
    _held_but(text, ("embedding / head", "kv_b_proj from attn_k_b / attn_v_b"))
    assert got == _greedy(ref)


def test_deepseek2_before_the_kv_b_split(real_checkpoint, tmp_path):
    """Files from converters before kv_b_proj was split (attn_kv_b, MHA key / value lengths, no
    *_mla keys), as many published DeepSeek GGUFs are: served as is, run like the checkpoint."""
    hf = real_checkpoint("deepseek-v2-lite", sizes=MLA_SIZES)
    (f32,) = write_gguf(hf, str(tmp_path / "legacy.gguf"), "F32", legacy_mla=True)
    assert "blk.0.attn_kv_b.weight" in {t.name for t in gguf.GGUFReader(f32).tensors}
    _check_config(f32, hf)
    assert _greedy(f32) == _greedy(hf)


def test_deepseek2_kv_b_needs_both_halves(tmp_path):
    path = str(tmp_path / "half.gguf")
    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_tensor("blk.0.attn_k_b.weight", np.zeros((4, 32, 16), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    info = {"arch": "deepseek2", "num_attention_heads": 4, "num_key_value_heads": 4}
    with pytest.raises(GGUFError, match="kv_b_proj.weight needs attn_k_b and attn_v_b.*only.*attn_k_b"):
        GGUFTensorFile(path, info)


@pytest.mark.skipif(not LLAMA_CPP, reason="EXPERTMESH_LLAMA_CPP (llama.cpp's source dir) is not set")
@pytest.mark.parametrize("published,overrides", DS_GLM[:4])
def test_deepseek2_and_glm4moe_written_by_llama_cpps_converter(
    real_checkpoint, tmp_path, published, overrides
):
    """llama.cpp's own converter on the tiny DeepSeek-V2-Lite / V3 (kv_b_proj split into k_b / v_b,
    MLA written as MQA, the MTP layer skipped) and GLM-4.5-Air (its MTP block kept last): its F32
    file runs like the checkpoint, its Q8_0 file (held) like an F32 file of the values gguf
    dequantizes from it."""
    hf = real_checkpoint(published, sizes=MLA_SIZES, **overrides)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, os.path.join(root, "benchmarks", "gguf_convert.py"), "--converter", LLAMA_CPP]
    f32, q8 = str(tmp_path / "f32.gguf"), str(tmp_path / "q8.gguf")
    subprocess.run([*cmd, hf, "--outtype", "f32", "--outfile", f32], check=True)
    subprocess.run([*cmd, hf, "--outtype", "q8_0", "--outfile", q8], check=True)
    _check_config(f32, hf)
    assert _greedy(f32) == _greedy(hf)
    (ref,) = write_gguf(hf, str(tmp_path / "q8-as-f32.gguf"), "F32", values=dequantized_state([q8]))
    got, text = _logged(_greedy, q8)
    _held_but(text, ("embedding / head", "kv_b_proj from attn_k_b / attn_v_b"))
    assert got == _greedy(ref)


LLAMA_CPP_PYTHON = os.environ.get("EXPERTMESH_LLAMA_CPP_PYTHON")  # a python with llama-cpp-python


# llama.cpp's own greedy decoding of a file, token ids in and out (run under LLAMA_CPP_PYTHON)
LLAMA_CPP_GREEDY = """
import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=128, n_threads=1, verbose=False)
out = []
for prompt in json.loads(sys.argv[2]):
    tokens = []
    for t in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        tokens.append(t)
        if len(tokens) == int(sys.argv[3]):
            break
    out.append(tokens)
print(json.dumps(out))
"""


@pytest.mark.skipif(
    not (LLAMA_CPP and LLAMA_CPP_PYTHON),
    reason="EXPERTMESH_LLAMA_CPP (sources) and EXPERTMESH_LLAMA_CPP_PYTHON (llama-cpp-python) are not set",
)
@pytest.mark.parametrize("published", ["deepseek-v3", "glm-4.5-air"])
def test_llama_cpp_runs_the_converted_file_like_we_do(real_checkpoint, tmp_path, published):
    """llama.cpp itself (llama-cpp-python) on its converter's F32 file of a tiny DeepSeek-V3 / GLM-4.5-Air:
    the same greedy tokens as ours. (llama.cpp takes a deepseek2 file without q_lora_rank for V2-Lite
    only at V2-Lite's 27 layers, so a tiny V2-Lite cannot be run there.)"""
    hf = real_checkpoint(published, sizes=MLA_SIZES)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path / "f32.gguf")
    cmd = [sys.executable, os.path.join(root, "benchmarks", "gguf_convert.py"), "--converter", LLAMA_CPP]
    subprocess.run([*cmd, hf, "--outtype", "f32", "--outfile", out], check=True)
    args = [out, json.dumps(PROMPTS), str(GREEDY["max_tokens"])]
    run = subprocess.run(
        [LLAMA_CPP_PYTHON, "-c", LLAMA_CPP_GREEDY, *args], check=True, capture_output=True, text=True
    )
    assert json.loads(run.stdout.strip().splitlines()[-1]) == _greedy(out)


@pytest.mark.skipif(
    not (LLAMA_CPP and LLAMA_CPP_PYTHON),
    reason="EXPERTMESH_LLAMA_CPP (sources) and EXPERTMESH_LLAMA_CPP_PYTHON (llama-cpp-python) are not set",
)
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q5_K_M", "Q6_K"])
def test_file_quantized_by_llama_cpp(checkpoint, tmp_path, ftype):
    """llama.cpp's own converter (F32) then its own quantizer (llama_model_quantize): every matrix
    but the embedding and head held as stored, and greedy tokens equal our float run of the
    values gguf dequantizes from the same file."""
    hf = checkpoint("qwen3_moe", hidden_size=256, moe_intermediate_size=256)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    f32, out = str(tmp_path / "f32.gguf"), str(tmp_path / f"{ftype}.gguf")
    convert = [sys.executable, os.path.join(root, "benchmarks", "gguf_convert.py"), "--converter", LLAMA_CPP]
    subprocess.run([*convert, hf, "--outtype", "f32", "--outfile", f32], check=True)
    subprocess.run(
        [LLAMA_CPP_PYTHON, os.path.join(root, "benchmarks", "gguf_quantize.py"), f32, out, ftype], check=True
    )
    (ref,) = write_gguf(hf, str(tmp_path / "as-f32.gguf"), "F32", values=dequantized_state([out]))
    got, text = _logged(_greedy, out)
    assert "weights held compressed as stored: 8 parameters" in text, text
    assert got == _greedy(ref)


@pytest.mark.skipif(
    not (LLAMA_CPP and LLAMA_CPP_PYTHON),
    reason="EXPERTMESH_LLAMA_CPP (sources) and EXPERTMESH_LLAMA_CPP_PYTHON (llama-cpp-python) are not set",
)
@pytest.mark.parametrize("published", ["deepseek-v3", "glm-4.5-air"])
def test_deepseek2_and_glm4moe_quantized_by_llama_cpp(real_checkpoint, tmp_path, published):
    """llama.cpp's converter (F32) then its quantizer (Q4_K_M: Q4_K, Q6_K, and Q5_0 where a row is
    not whole super-blocks, e.g. DeepSeek's attn_output and attn_k_b): the K-quant matrices held,
    Q5_0 dequantized with its log line, greedy tokens equal our float run of the file's values."""
    hf = real_checkpoint(published, sizes=K_SIZES)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    f32, out = str(tmp_path / "f32.gguf"), str(tmp_path / "q4km.gguf")
    convert = [sys.executable, os.path.join(root, "benchmarks", "gguf_convert.py"), "--converter", LLAMA_CPP]
    subprocess.run([*convert, hf, "--outtype", "f32", "--outfile", f32], check=True)
    subprocess.run(
        [LLAMA_CPP_PYTHON, os.path.join(root, "benchmarks", "gguf_quantize.py"), f32, out, "Q4_K_M"],
        check=True,
    )
    (ref,) = write_gguf(hf, str(tmp_path / "as-f32.gguf"), "F32", values=dequantized_state([out]))
    got, text = _logged(_greedy, out)
    _held_but(text, ("embedding / head", "kv_b_proj from attn_k_b / attn_v_b", "no kernel holds it"))
    assert got == _greedy(ref)


def test_tokenizer_from_metadata_and_override(gguf_model, checkpoint):
    from transformers import AutoTokenizer

    (path,) = gguf_model("Q8_0")
    text = "The quick brown fox returns a value"
    want = AutoTokenizer.from_pretrained(checkpoint("qwen3_moe"))(text)["input_ids"]
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    assert llm.get_tokenizer()(text)["input_ids"] == want
    out = llm.generate([text, {"prompt_token_ids": want}], SamplingParams(**GREEDY), use_tqdm=False)
    assert out[0].outputs[0].token_ids == out[1].outputs[0].token_ids
    llm2 = LLM(path, tokenizer=checkpoint("qwen3_moe"), max_model_len=128, kv_cache_memory_bytes=1 << 22)
    assert llm2.get_tokenizer()(text)["input_ids"] == want


def test_split_files_and_directory_load_like_one_file(gguf_model):
    parts = gguf_model("Q8_0", split=3)
    assert len(parts) == 3 and parts[1].endswith("-00002-of-00003.gguf")
    (single,) = gguf_model("Q8_0")
    assert gguf_files(parts[2]) == parts  # any part names the set
    want = _greedy(single)
    assert _greedy(os.path.dirname(parts[0])) == want  # the directory holding the set


def test_bad_gguf_files_fail_naming_the_problem(gguf_model, tmp_path):
    parts = gguf_model("Q8_0", split=3)
    lonely = tmp_path / "m-00001-of-00002.gguf"
    lonely.write_bytes(open(parts[0], "rb").read())
    with pytest.raises(GGUFError, match="missing parts.*m-00002-of-00002.gguf"):
        gguf_files(str(lonely))
    junk = tmp_path / "junk" / "x.gguf"
    junk.parent.mkdir()
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="x.gguf: not a readable GGUF file"):
        gguf_model_dir(str(junk))
    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(GGUFError, match="architecture 'bert' is not supported"):
        LLM(str(tmp_path / "bert.gguf"))
    (ok,) = gguf_model("Q8_0")  # a failure leaves nothing behind: the next load works
    assert len(_greedy(ok)[0]) == GREEDY["max_tokens"]


def _rank_main(rank, world, runs):
    return [_greedy(path, **kw, distributed_executor_backend="external_launcher") for path, kw in runs]


@pytest.mark.timeout(200)
def test_tp2_and_ep2_equal_one_process_on_gguf_weights(gguf_model, k_quant_model, real_checkpoint, tmp_path):
    """Q4_0 and Q4_K_M Qwen3-MoE under TP2 and DP2 + EP (a TP rank's half of a 256-wide super-block,
    held in groups of 16), a permuted-Q/K Mixtral file under TP2 (each rank un-permutes, then
    keeps its heads), and a Q8_0 DeepSeek-V3 under TP2 (each rank's heads of the rebuilt kv_b_proj)
    and DP2 + EP."""
    (qwen,) = gguf_model("Q4_0")
    (mixtral,) = gguf_model("Q8_0", family="mixtral")
    k_quant = k_quant_model["Q4_K_M"][0]
    (deepseek,) = write_gguf(
        real_checkpoint("deepseek-v3", sizes=MLA_SIZES), str(tmp_path / "v3.gguf"), "Q8_0"
    )
    runs = [
        (deepseek, dict(tensor_parallel_size=2)),
        (deepseek, dict(data_parallel_size=2, enable_expert_parallel=True)),
        (qwen, dict(tensor_parallel_size=2)),
        (qwen, dict(data_parallel_size=2, enable_expert_parallel=True)),
        (mixtral, dict(tensor_parallel_size=2)),
        (k_quant, dict(tensor_parallel_size=2)),
        (k_quant, dict(data_parallel_size=2, enable_expert_parallel=True)),
    ]
    want = [_greedy(path) for path, _ in runs]
    results = run_distributed(_rank_main, 2, runs, timeout=190)
    for per_rank in results:  # TP: both ranks run every prompt; DP + EP: each rank ran them all
        assert per_rank == want


def test_header_reader_equals_gguf_reader(gguf_model, k_quant_model, tmp_path):
    """Our header reader (models/gguf/reader.py) against gguf's GGUFReader on the same files: every
    metadata value (string arrays kept when asked, else their length), every tensor's name, type,
    shape and bytes, whole, by outer rows and by expert; a truncated file fails naming the tensor."""
    from expertmesh.models.gguf.reader import GGUFFile, open_file
    from expertmesh.models.gguf.tokenizer import STRING_ARRAYS

    (q8,) = gguf_model("Q8_0")
    (f16,) = gguf_model("F16")
    for path in (q8, f16, k_quant_model["Q4_K_M"][0]):
        ref = gguf.GGUFReader(path)
        ours = GGUFFile(path, STRING_ARRAYS)
        for name, field in ref.fields.items():
            if name.startswith("GGUF."):  # gguf's own header fields (version, counts)
                continue
            want, got = field.contents(), ours.metadata[name]
            if isinstance(want, list) and want and isinstance(want[0], str) and name not in STRING_ARRAYS:
                want = len(want)
            got = got.tolist() if isinstance(got, np.ndarray) else got
            assert got == want or np.allclose(got, want), name
        assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
        for t, r in zip(ours.tensors, ref.tensors, strict=True):
            assert t.tensor_type == r.tensor_type and t.shape == tuple(reversed(r.shape.tolist())), t.name
            want = np.asarray(r.data)
            assert np.array_equal(np.asarray(t.data), want), t.name
            if want.ndim >= 2:
                assert np.array_equal(t.data[1:3], want[1:3]), t.name
                assert np.array_equal(np.asarray(t.data[-1]), want[-1]), t.name  # one expert / row
        ours.close()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(q8, "rb").read()[:-1000])
    with pytest.raises(GGUFError, match="runs past the end of the file"):
        open_file(str(cut))


@pytest.mark.parametrize("published", ["olmoe-1b-7b-0924", "deepseek-v3"])
def test_tokenizer_from_metadata_of_families_transformers_does_not_map(real_checkpoint, tmp_path, published):
    """transformers maps no config for olmoe / deepseek2 GGUF files (its AutoTokenizer path failed on
    them): the tokenizer built from the metadata alone encodes and decodes like the checkpoint's."""
    from transformers import AutoTokenizer

    hf = real_checkpoint(published)
    (path,) = write_gguf(hf, str(tmp_path / "f32.gguf"), "F32")
    text = "The quick brown fox returns a value 12345 and </s> then"
    want = AutoTokenizer.from_pretrained(hf)
    got = AutoTokenizer.from_pretrained(gguf_model_dir(path))
    assert got(text)["input_ids"] == want(text)["input_ids"]
    ids = want(text)["input_ids"]
    assert got.decode(ids) == want.decode(ids)


def test_embedding_and_head_dequantized_into_the_model_dtype(k_quant_model):
    """A K-quant embedding / head served for a bf16 model comes out in bf16, rounded once from
    gguf's float32 values (what copying float32 into the parameter would give); a held matrix of
    the same file is unaffected, and float32 stays float32."""
    from expertmesh.models.gguf import gguf_info

    path, _ = k_quant_model["Q4_K_M"]
    info = gguf_info(gguf_model_dir(path))
    ref = dequantized_state([path])
    f32, bf16 = GGUFTensorFile(path, info), GGUFTensorFile(path, info, torch.bfloat16)
    pairs = [("model.embed_tokens.weight", "token_embd.weight"), ("lm_head.weight", "output.weight")]
    for key, name in [(k, n) for k, n in pairs if n in ref]:
        got = bf16.get_slice(key)[:]
        assert got.dtype == torch.bfloat16 and torch.equal(got, ref[name].to(torch.bfloat16)), key
        assert torch.equal(f32.get_slice(key)[3:9], ref[name][3:9]), key
    q = bf16.get_slice("model.layers.0.self_attn.o_proj.weight")
    assert q.held_kind is not None and q[:].dtype == torch.float32


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q3_K"])
def test_rows_decoded_into_the_parameter_equal_gguf_and_are_checked(qtype, monkeypatch):
    """The embedding / head path (weights.copy_rows_into -> GGUFTensor.rows_into): rows decoded a
    few at a time straight into the parameter equal gguf's values rounded once to its dtype; a block
    whose fp16 scale is NaN fails naming the parameter (a warning when allowed); a shard outside the
    tensor fails."""
    from expertmesh.layers import weights
    from expertmesh.models.gguf import quants

    monkeypatch.setattr(quants, "DEQUANT_ROWS", 3)
    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(1)
    rows, cols = 10, 512
    raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    b = raw.reshape(rows, cols // block, size)
    d = rng.uniform(-0.1, 0.1, b.shape[:2]).astype(np.float16).view(np.uint8).reshape(*b.shape[:2], 2)
    at = {"Q4_K": 0}.get(qtype, size - 2)  # d: first in Q4_K, last in Q6_K / Q3_K
    b[..., at : at + 2] = d
    if qtype == "Q4_K":
        b[..., 2:4] = d
    want = torch.from_numpy(gguf.quants.dequantize(raw, t).astype(np.float32)).to(torch.bfloat16)
    src = GGUFTensor(raw, t, (rows, cols), "model.embed_tokens.weight", out_dtype=torch.bfloat16)
    dst = torch.full((7, cols), 5.0, dtype=torch.bfloat16)
    weights.copy_rows_into(dst, src, 2, "vocab shard")
    assert torch.equal(dst, want[2:9])
    with pytest.raises(ValueError, match=r"shard \[4, 11\) is outside dim 0"):
        weights.copy_rows_into(dst, src, 4, "vocab shard")
    b[5, 0, at : at + 2] = np.array([np.nan], np.float16).view(np.uint8)
    with pytest.raises(weights.NonFinite, match="vocab shard: .* values are NaN or infinite"):
        weights.copy_rows_into(dst, src, 2, "vocab shard")
    with weights.nonfinite_allowed(True):
        weights.copy_rows_into(dst, src, 2, "vocab shard")
    assert bool(dst[3].isnan().any()) and torch.equal(dst[:3], want[2:5])


@pytest.mark.parametrize("qtype", ["BF16", "F32"])
def test_float_rows_read_straight_into_the_parameter(qtype, tmp_path):
    """An embedding / head stored in the parameter's dtype is read from the file straight into it
    (reader.FileRows.read_into, as the reader lays out each type): the stored bits, as the
    decoding path gives them; a NaN still fails naming the parameter. FileRows.mapped: the rows'
    bytes as a read gives them."""
    from expertmesh.layers import weights
    from expertmesh.models.gguf.reader import FileRows

    dtype = {"BF16": torch.bfloat16, "F32": torch.float32}[qtype]
    rows, cols = 10, 48
    want = torch.randn(rows, cols, generator=torch.Generator().manual_seed(2)).to(dtype)
    for bad in (False, True):
        stored = want.clone()
        if bad:
            stored[4, 7] = float("nan")
        path = tmp_path / f"rows-{bad}.bin"
        path.write_bytes(b"\0" * 16 + stored.view(torch.uint8).numpy().tobytes())
        fd = os.open(path, os.O_RDONLY)
        try:
            data = (
                FileRows(fd, 16, (rows, cols), np.float32)
                if qtype == "F32"
                else FileRows(fd, 16, (rows, 2 * cols), np.uint8)
            )
            t = gguf.GGMLQuantizationType[qtype]
            src = GGUFTensor(data, t, (rows, cols), "model.embed_tokens.weight", out_dtype=dtype)
            dst = torch.zeros(7, cols, dtype=dtype)
            if bad:
                with pytest.raises(weights.NonFinite, match="vocab shard: 1 of"):
                    weights.copy_rows_into(dst, src, 2, "vocab shard")
                continue
            weights.copy_rows_into(dst, src, 2, "vocab shard")
            assert torch.equal(dst.view(torch.uint8), want[2:9].view(torch.uint8))
            assert torch.equal(src.materialize([(2, 9), (0, cols)]).view(torch.uint8), dst.view(torch.uint8))
            # whole rows on a mapping of their pages (GGUF MXFP4 experts' blocks): the same bytes
            assert np.array_equal(data.mapped(2, 9), data[2:9])
            assert np.array_equal(data.mapped(0, 1), data[0:1])
        finally:
            os.close(fd)


def test_phimoe_from_its_published_config(real_checkpoint, tmp_path):
    """Phi-3.5-MoE as llama.cpp's converter writes it (LayerNorm weights and biases, q/k/v/o and head
    biases, LongRoPE factors as rope_factors_long / _short tensors with one attention factor): the
    config made from the file equals the checkpoint's, an F32 file runs like the checkpoint and a
    Q8_0 file, held, like an F32 file of its values. The converter's attention factor is
    sqrt(1 + ln s / ln original), not the published mscale, so the checkpoint takes that value."""
    probe = json.load(open(os.path.join(real_checkpoint("phi-3.5-moe"), "config.json")))
    rope = dict(probe["rope_scaling"])
    f32 = lambda x: np.float32(x).item()  # the file holds float32: a checkpoint whose values it keeps
    rope["long_mscale"] = rope["short_mscale"] = f32(phimoe_attn_factor(probe))
    rope.update({k: [f32(v) for v in rope[k]] for k in ("long_factor", "short_factor")})
    hf = real_checkpoint("phi-3.5-moe", rope_scaling=rope)
    want = json.load(open(os.path.join(hf, "config.json")))
    (f32,) = write_gguf(hf, str(tmp_path / "f32.gguf"), "F32")
    got = json.load(open(os.path.join(gguf_model_dir(f32), "config.json")))
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "num_local_experts", "num_experts_per_tok", "max_position_embeddings", "sliding_window",
            "original_max_position_embeddings", "lm_head_bias")  # fmt: skip
    for key in keys:
        assert got[key] == want[key], key
    assert got["rope_scaling"]["type"] == "longrope" and got["architectures"] == ["PhimoeForCausalLM"]
    for key in ("long_factor", "short_factor", "long_mscale", "short_mscale"):
        assert got["rope_scaling"][key] == rope[key], key
    assert _greedy(f32) == _greedy(hf)
    (q8,) = write_gguf(hf, str(tmp_path / "q8.gguf"), "Q8_0")
    (ref,) = write_gguf(hf, str(tmp_path / "q8-as-f32.gguf"), "F32", values=dequantized_state([q8]))
    got_tokens, text = _logged(_greedy, q8)
    assert "weights held compressed as stored" in text
    assert got_tokens == _greedy(ref)


def test_tp_rank_columns_read_only_their_bytes(tmp_path, monkeypatch):
    """A TP rank splitting a weight's inputs (o_proj, down_proj) reads, per row, only the blocks of
    its columns where that skips whole pages (rows of more than two pages past its part), else the
    rows whole (the page cache reads whole pages anyway); either way the values are gguf's, float
    and held, and an expert of a stacked tensor reads alike. Counted at os.preadv."""
    import mmap

    from expertmesh.models.gguf.reader import open_file

    rng = np.random.default_rng(9)
    path = str(tmp_path / "wide.gguf")
    w = gguf.GGUFWriter(path, "qwen3moe")
    shapes = {
        "F32": (3, 8192),
        "BF16": (3, 8192),
        "Q8_0": (3, 32768),
        "Q4_K": (3, 32768),
        "MXFP4": (2, 3, 32768),
    }
    shapes["narrow"] = (3, 512)  # Q8_0 rows of 544 bytes: read whole
    for name, shape in shapes.items():
        x = rng.normal(0, 1, shape).astype(np.float32)
        t = gguf.GGMLQuantizationType["Q8_0" if name == "narrow" else name]
        if name in ("F32",):
            w.add_tensor(name, x)
        elif name == "Q4_K":
            w.add_tensor(name, quantize_k(x, "Q4_K"), raw_dtype=t)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reads = []
    real = os.preadv

    def counted(fd, buffers, offset):
        n = real(fd, buffers, offset)
        reads.append(n)
        return n

    monkeypatch.setattr(os, "preadv", counted)
    for t in open_file(path).tensors:
        data, shape = (t.data[1], t.shape[1:]) if len(t.shape) == 3 else (t.data, t.shape)
        want = torch.from_numpy(gguf.quants.dequantize(np.asarray(data), t.tensor_type)).float()
        rows, cols = shape
        row_bytes = data.shape[1] * data.dtype.itemsize
        part = row_bytes // 2  # the second half of the inputs: whole blocks in every type here
        src = GGUFTensor(data, t.tensor_type, shape, t.name)
        reads.clear()
        got = src[:, cols // 2 :]
        assert torch.equal(got.float(), want[:, cols // 2 :]), t.name
        whole = row_bytes - part < 2 * mmap.PAGESIZE
        assert sum(reads) == rows * (row_bytes if whole else part), t.name
        assert len(reads) == (1 if whole else rows), t.name
        if t.tensor_type.name in HELD:
            kind, group = HELD[t.tensor_type.name]
            src.held_kind = (kind, group)
            reads.clear()
            codes, s, m = src.quantized((0, rows), (cols // 2, cols), group, cols // 2 // group)
            assert sum(reads) == rows * (row_bytes if whole else part), t.name
            if kind == "fp4":
                e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
                values = e2m1[codes.long()] * s.repeat_interleave(group, 1)
            else:
                values = _held_values(src, (0, rows), (cols // 2, cols), group)
            assert torch.equal(values, want[:, cols // 2 :]), t.name


def _benchmark(name: str):
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_published_int4_writer_gives_both_formats_the_same_weights(tmp_path):
    """benchmarks/write_qwen3_int4.py (Qwen3-30B-A3B at its published size for expertmesh and
    llama.cpp side by side): its compressed-tensors W4A16 checkpoint and its Q4_0 GGUF, each read
    back by the format's own package (compressed-tensors' unpacking, gguf's dequantizer), hold
    the same values, its `--only` runs write the same bytes, expertmesh loads the checkpoint holding
    the int4 codes, and bench_published_size's estimate of that checkpoint is what it holds."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open

    from expertmesh.layers.quantization.accounting import resident_weight_bytes

    writer, bench = _benchmark("write_qwen3_int4"), _benchmark("bench_published_size")
    cfg = json.load(open(writer.CONFIG))  # the published config, shrunk in size with every flag kept
    cfg.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, vocab_size=512)  # fmt: skip
    out = str(tmp_path / "w4a16")
    writer.write(out, 2, seed=3, cfg=cfg)
    writer.write(str(tmp_path / "ct-only"), 2, seed=3, only="ct", cfg=cfg)
    writer.write(str(tmp_path / "gguf-only"), 2, seed=3, only="gguf", cfg=cfg)
    with open(out + ".gguf", "rb") as a, open(str(tmp_path / "gguf-only.gguf"), "rb") as b:
        assert a.read() == b.read()
    shard = "model-00003-of-00003.safetensors"
    with open(f"{out}/{shard}", "rb") as a, open(str(tmp_path / "ct-only" / shard), "rb") as b:
        assert a.read() == b.read()

    index = json.load(open(f"{out}/model.safetensors.index.json"))["weight_map"]

    def ct(name: str) -> np.ndarray:
        with safe_open(f"{out}/{index[name + '.weight_packed']}", "pt") as f:
            packed, scale = f.get_tensor(name + ".weight_packed"), f.get_tensor(name + ".weight_scale")
            shape = torch.Size(f.get_tensor(name + ".weight_shape").tolist())
        q = unpack_from_int32(packed, 4, shape).float()
        return (q.view(shape[0], -1, 128) * scale.float().unsqueeze(-1)).view(shape).numpy()

    reader = gguf.GGUFReader(out + ".gguf")
    tensors = {t.name: t for t in reader.tensors}

    def gg(name: str) -> np.ndarray:
        return gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type)

    for layer in (0, 1):
        g, m = f"blk.{layer}.", f"model.layers.{layer}."
        for short, proj in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_output", "o_proj")):
            assert np.array_equal(gg(g + short + ".weight"), ct(m + "self_attn." + proj))
        for short, proj in (("ffn_gate_exps", "gate_proj"), ("ffn_down_exps", "down_proj")):
            stack = gg(g + short + ".weight")
            for e in (0, 7):
                assert np.array_equal(stack[e], ct(f"{m}mlp.experts.{e}.{proj}"))
    with safe_open(f"{out}/{index['lm_head.weight']}", "pt") as f:
        assert np.array_equal(
            gg("output.weight").reshape(-1), f.get_tensor("lm_head.weight").float().numpy().reshape(-1)
        )

    llm = LLM(out, max_model_len=64, kv_cache_memory_bytes=1 << 20)
    model = llm.llm_engine.runner.model
    assert len(model.held_weights.params) == 8  # 2 layers: qkv, o, w13, w2 held as int4
    held = resident_weight_bytes(model)["total"]
    want = bench.estimate_checkpoint(out, dtype_bytes=model.cfg.dtype.itemsize)["weights_gib"] * 2**30
    assert abs(want - held) <= 0.02 * held, (held, want)
    out_ids = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out_ids[0].outputs[0].token_ids) == 4
