"""gpt-oss and Llama 4 GGUF files.

gpt-oss (llama.cpp's `gpt-oss` architecture, MXFP4 experts): ggml's MXFP4 blocks
dequantize and hold bit for bit like gguf's dequantizer; a file written from a tiny MXFP4 checkpoint
of the published gpt-oss-20b config serves the checkpoint's tensors, makes its config, holds the
experts as fp4 and runs exactly like the checkpoint (tokens and logprobs), and like transformers on
the dequantized weights; dequantized, it runs exactly like the checkpoint dequantized; TP2 and
DP2 + EP equal one process; llama.cpp's own converter (opt-in) writes the same bytes.

Llama 4 text (`llama4`; transformers maps no config for it from GGUF): Scout's published layout and
Maverick's interleaved dense / MoE layers, from tiny checkpoints, against our run of the checkpoint
(config through transformers' own Llama4TextConfig, every tensor, the RoPE frequencies from the
file's rope_freqs, tokens and logprobs); Q8_0 held; llama.cpp's fixed values (128 experts: no q/k
norm; sliding_window 0: no chunks, no NoPE layers) from metadata alone."""

import json
import logging
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from checkpoints import one_thread, prompts_of_lengths
from distributed_utils import run_distributed
from gguf_checkpoints import dequantized_state, write_gpt_oss_gguf, write_llama4_gguf
from quantized_checkpoints import to_mxfp4
from real_checkpoints import Sizes, published
from safetensors.torch import load_file
from test_gguf import LLAMA_CPP_GREEDY, LLAMA_CPP_PYTHON  # llama.cpp's greedy decoding script

from expertmesh import LLM, SamplingParams
from expertmesh.config.rope_config import RopeConfig
from expertmesh.layers.quantization.mxfp4_blocks import int16_of
from expertmesh.layers.rotary import ROPE_TYPES
from expertmesh.models.build import log_weight_bytes
from expertmesh.models.gguf import GGUFTensor, GGUFTensorFile, gguf_model_dir
from expertmesh.models.gguf.families import hf_config

PROMPTS = prompts_of_lengths([5, 11, 3, 40], seed=37)  # 40 > the tiny config's sliding window 32
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
SIZES = Sizes(expert_inter=64)  # TP 2 keeps whole 32-blocks of the down projection's inputs
# e2m1, spelled out here (the reference side): code -> value
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
MX = gguf.GGMLQuantizationType.MXFP4


@pytest.fixture(autouse=True)
def _gguf_cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EXPERTMESH_GGUF_DIR", str(tmp_path_factory.getbasetemp() / "gguf-models"))


@pytest.fixture(scope="module")
def gpt_oss(real_checkpoint, tmp_path_factory):
    """(the tiny MXFP4 checkpoint of gpt-oss-20b's published config, its GGUF file: F32 besides
    the MXFP4 experts, as the converter's --outtype f32 writes it)."""
    d = tmp_path_factory.mktemp("gpt-oss-gguf")
    hf = to_mxfp4(real_checkpoint("gpt-oss-20b", sizes=SIZES), str(d / "mxfp4"))
    return hf, write_gpt_oss_gguf(hf, str(d / "gpt-oss-mxfp4.gguf"))


def _run(path: str, **kw) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their logprobs."""
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**GREEDY), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [
        [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
        for o in outs
    ]
    return tokens, logprobs


def _model(path: str):
    return LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22).llm_engine.runner.model


def _run_logged(path: str, **kw) -> tuple:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    log = logging.getLogger("expertmesh")
    log.addHandler(handler)
    level, log.level = log.level, logging.INFO
    try:
        return _run(path, **kw), "\n".join(records)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _mxfp4_blocks(rng: np.random.Generator, shape: tuple[int, ...], exps: tuple[int, int]) -> np.ndarray:
    """Random ggml MXFP4 blocks [..., cols / 32 * 17] with e8m0 scales drawn from `exps`."""
    *lead, cols = shape
    raw = rng.integers(0, 256, (*lead, cols // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(*exps, raw[..., 0].shape)
    return raw.reshape(*lead, -1)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # gguf's 12 * 2^127
def test_mxfp4_blocks_dequantize_and_hold_like_gguf():
    """Random ggml MXFP4 blocks (scales from subnormal 2^-127 to 2^60): any row / column region of
    an expert dequantizes to gguf.quants.dequantize's float32 bits, and held as our fp4 kind (codes,
    a scale per 32, offset 0) gives the same values (the same bits but e2m1's -0, which ggml's
    integer table makes +0: equal in any product and sum); a block scale of 255 (e8m0 NaN, which gguf
    reads as 2^127) is refused when held, naming the tensor, and dequantizes like gguf."""
    rng = np.random.default_rng(5)
    experts, rows, cols = 3, 6, 128
    raw = _mxfp4_blocks(rng, (experts, rows, cols), (0, 188))
    raw.reshape(experts, rows, -1, 17)[0, 0, :3, 0] = (0, 1, 2)  # ggml's two subnormal scale cases
    want = torch.from_numpy(gguf.quants.dequantize(raw, MX))
    for e in range(experts):
        src = GGUFTensor(raw[e], MX, (rows, cols), f"blk.0.ffn_up_exps.weight[{e}]")
        assert src.held_kind == ("fp4", 32) and src.unheld_reason is None
        assert torch.equal(src[:].view(torch.int32), want[e].view(torch.int32))
        assert torch.equal(src[1:4, 32:96], want[e, 1:4, 32:96])
        for (o0, o1), (i0, i1) in (((0, rows), (0, cols)), ((2, 5), (32, 96)), ((0, 1), (96, 128))):
            codes, scales, offsets = src.quantized((o0, o1), (i0, i1), 32, i0 // 32)
            assert codes.dtype == torch.uint8 and int(codes.max()) < 16 and not offsets.any()
            values = torch.from_numpy(E2M1[codes.numpy()]) * scales.repeat_interleave(32, 1)
            ref = want[e, o0:o1, i0:i1]
            assert torch.equal(values, ref)
            # bits too, but for e2m1's -0 (code 8), which ggml's integer table reads as +0
            signed_zero = codes == 8
            assert signed_zero.any() and torch.equal(
                values[~signed_zero].view(torch.int32), ref[~signed_zero].view(torch.int32)
            )
        # loaded as a safetensors MXFP4 checkpoint is: int16 code | exponent << 4 per weight (whole
        # blocks travel as their bytes, written as int16 where they land: test_mxfp4_blocks.py)
        assert src.held_storage == torch.int16
        for (i0, i1), region in (((32, 96), src.held_region([(2, 5), (32, 96)])), ((40, 90), None)):
            if region is None:
                packed = src.held_region([(2, 5), (i0, i1)])
            else:
                packed = torch.from_numpy(int16_of(region.held_region.raw, 0, i1 - i0))
            scale = torch.ldexp(torch.ones(packed.shape), (packed >> 4).to(torch.int32) - 127)
            assert torch.equal(torch.from_numpy(E2M1)[(packed & 15).long()] * scale, want[e, 2:5, i0:i1])
    raw.reshape(experts, rows, -1, 17)[1, 2, 3, 0] = 255
    src = GGUFTensor(raw[1], MX, (rows, cols), "blk.0.ffn_up_exps.weight[1]")
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up_exps\.weight\[1\]: GGUF MXFP4 block scale 255"):
        src.quantized((0, rows), (0, cols), 32, 0)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up_exps\.weight\[1\]: GGUF MXFP4 block scale 255"):
        src.held_region([(0, rows), (0, cols)])
    assert torch.equal(src[:], torch.from_numpy(gguf.quants.dequantize(raw[1], MX)))


def _checkpoint(hf: str) -> dict[str, torch.Tensor]:
    """The MXFP4 checkpoint's tensors, the experts decoded here ([E, out, in] float32)."""
    sd = load_file(os.path.join(hf, "model.safetensors"))
    out = {}
    for key, t in sd.items():
        if key.endswith("_scales"):
            continue
        if key.endswith("_blocks"):
            b = t.numpy()
            codes = np.stack([b & 15, b >> 4], -1).reshape(*b.shape[:-1], 32)  # byte k: values 2k, 2k + 1
            scale = np.ldexp(np.float32(1), sd[key[:-7] + "_scales"].numpy().astype(np.int32) - 127)
            out[key[:-7]] = torch.from_numpy((E2M1[codes] * scale[..., None]).reshape(*b.shape[:-2], -1))
        else:
            out[key] = t.float()
    return out


def _transformers_agrees(hf: str, tokens: list[list[int]], logprobs: list[list[float]]) -> None:
    """transformers on the checkpoint's weights dequantized (float32): each of our tokens is its
    argmax (or second within a near-tie) and our logprob its log-softmax at that step."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    ref = AutoModelForCausalLM.from_pretrained(
        hf, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    with torch.no_grad(), one_thread():
        for prompt, toks, lps in zip(PROMPTS, tokens, logprobs, strict=True):
            logits = ref(torch.tensor([prompt + toks[:-1]])).logits[0, len(prompt) - 1 :].float()
            ref_lp = torch.log_softmax(logits, -1)
            for step, token in enumerate(toks):
                top2 = logits[step].topk(2)
                if token != int(top2.indices[0]):
                    assert float(top2.values[0] - top2.values[1]) < 1e-4, (prompt, step)
                    break  # a near-tie: the runs part here
                assert abs(lps[step] - float(ref_lp[step, token])) < 2e-4, (len(prompt), step)


def test_gpt_oss_gguf_serves_the_checkpoint_and_runs_like_it(gpt_oss):
    """The config from the metadata equals the checkpoint's (layer types, sliding window, YaRN
    untruncated, swiglu limit, biases); every served tensor equals gguf's dequantization of the file,
    which equals the checkpoint (experts: its interleaved gate / up rows split, the biases put back
    interleaved); the experts are held as fp4 (nothing dequantized); greedy tokens and logprobs equal
    the checkpoint's run exactly (held: both as fp4; dequantized: both in float), and agree with
    transformers on the dequantized checkpoint (transformers 5.x's own GGUF reader fails on the
    converter's gpt-oss file: its rope.scaling parsing reads a field's length, not its value)."""
    hf, path = gpt_oss
    cfg = json.load(open(os.path.join(gguf_model_dir(path), "config.json")))
    source = json.load(open(os.path.join(hf, "config.json")))
    assert cfg["rms_norm_eps"] == pytest.approx(source["rms_norm_eps"], rel=1e-6)
    not_carried = {"rms_norm_eps", "eos_token_id", "pad_token_id", "torch_dtype", "quantization_config"}
    same = set(source) & set(cfg) - not_carried
    assert {k: cfg[k] for k in same} == {k: source[k] for k in same}
    for key in (
        "layer_types",
        "sliding_window",
        "swiglu_limit",
        "rope_scaling",
        "head_dim",
        "attention_bias",
    ):
        assert key in same, key
    assert cfg["quantization_config"] == {"quant_method": "gguf", "held_types": ["MXFP4"]}

    ckpt = _checkpoint(hf)
    ggml = dequantized_state([path])
    info = json.load(open(os.path.join(gguf_model_dir(path), "gguf.json")))
    f = GGUFTensorFile(path, info)
    served = {k: f.get_slice(k).materialize([(0, d) for d in f.get_slice(k).shape]) for k in f.keys()}
    experts = 8
    for layer in range(source["num_hidden_layers"]):
        p, b = f"model.layers.{layer}.mlp.experts.", f"blk.{layer}."
        gate_up, down = ckpt.pop(p + "gate_up_proj"), ckpt.pop(p + "down_proj")  # [E, out, in]
        assert torch.equal(ggml[b + "ffn_gate_exps.weight"], gate_up[:, ::2])
        assert torch.equal(ggml[b + "ffn_up_exps.weight"], gate_up[:, 1::2])
        assert torch.equal(ggml[b + "ffn_down_exps.weight"], down)
        for e in range(experts):
            for proj, piece in (
                ("gate_proj", "ffn_gate_exps"),
                ("up_proj", "ffn_up_exps"),
                ("down_proj", "ffn_down_exps"),
            ):
                got = served.pop(f"{p}{e}.{proj}.weight")
                assert torch.equal(got.view(torch.int32), ggml[b + piece + ".weight"][e].view(torch.int32))
        for bias in ("gate_up_proj_bias", "down_proj_bias"):
            assert torch.equal(served.pop(p + bias), ckpt.pop(p + bias)), bias
    assert served.keys() == ckpt.keys()
    for key, want in ckpt.items():
        assert torch.equal(served[key], want), key

    (want, want_lp), _ = _run_logged(hf)
    (got, got_lp), text = _run_logged(path)
    assert "weights held compressed as stored: 8 parameters" in text  # w13 and w2 of 4 layers
    assert "not held compressed" not in text and "dequantized to float at load" not in text
    assert got == want and got_lp == want_lp
    # held alike: the same bytes resident as the checkpoint's (fp4 codes, a scale per 32, one zero
    # offsets tensor shared by the experts)
    counts = [log_weight_bytes(m, m.cfg) for m in (_model(hf), _model(path))]
    assert counts[0]["quantized"] == counts[1]["quantized"] > 0 and counts[0] == counts[1]
    dense = _run(path, quantization="dequantize")  # float experts: another product, the same weights
    assert dense == _run(hf, quantization="dequantize")
    _transformers_agrees(hf, got, got_lp)
    _transformers_agrees(hf, *dense)


def test_gpt_oss_gguf_with_q8_0_experts_and_attention(real_checkpoint, tmp_path):
    """A float gpt-oss checkpoint written with Q8_0 experts and attention (the converter writes float
    experts as its outtype): held as int8 codes, the run equals an F32 file of gguf's dequantized
    values of the same file (tokens; logprobs within 1e-4)."""
    hf = real_checkpoint("gpt-oss-20b", sizes=SIZES)
    q8 = write_gpt_oss_gguf(hf, str(tmp_path / "q8.gguf"), "Q8_0")
    ggml = dequantized_state([q8])
    f32 = str(tmp_path / "q8-values.gguf")
    real_add = gguf.GGUFWriter.add_tensor

    def add_values(self, name, tensor, *args, raw_dtype=None, **kw):  # every tensor as gguf dequantizes it
        return real_add(self, name, ggml[name].numpy().reshape(ggml[name].shape))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", add_values)
        write_gpt_oss_gguf(hf, f32, "Q8_0")
    (got, got_lp), text = _run_logged(q8)
    assert "weights held compressed as stored: 16 parameters" in text  # qkv, o, w13, w2 of 4 layers
    want, want_lp = _run(f32)
    assert got == want  # int8 codes in our kernels against float products: the logprobs' last bits differ
    assert np.allclose(got_lp, want_lp, atol=1e-4, rtol=0)


def test_gpt_oss_gguf_missing_expert_bias_fails_naming_it(gpt_oss, tmp_path):
    """A file without one layer's ffn_up_exps.bias fails at load naming the fused bias and what the
    file has; the next load works."""
    hf, good = gpt_oss
    bad = str(tmp_path / "no-up-bias.gguf")
    real_add = gguf.GGUFWriter.add_tensor

    def drop(self, name, *args, **kw):
        if name != "blk.1.ffn_up_exps.bias":
            return real_add(self, name, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", drop)
        write_gpt_oss_gguf(hf, bad)
    message = (
        r"model\.layers\.1\.mlp\.experts\.gate_up_proj_bias needs ffn_gate_exps\.bias and "
        r"ffn_up_exps\.bias; the file has \['ffn_gate_exps'\]"
    )
    with pytest.raises(Exception, match=message):
        LLM(bad, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    assert len(_run(good)[0][0]) == GREEDY["max_tokens"]


def _gpt_oss_rank(rank, world, runs):
    return [_run(path, **kw, distributed_executor_backend="external_launcher") for path, kw in runs]


@pytest.mark.timeout(200)
def test_gpt_oss_and_llama4_gguf_tp2_and_ep2_equal_one_process(gpt_oss, llama4, tmp_path):
    """The gpt-oss MXFP4 file under TP2 (each rank's gate / up rows, its half of the down
    projection's inputs: whole 32-blocks, held as fp4) and DP2 + EP (each rank's experts' bytes),
    and a Q8_0 Llama 4 file with Maverick's interleaved dense / MoE layers under TP2 and DP2 + EP:
    tokens and logprobs equal one process."""
    _, path = gpt_oss
    l4 = write_llama4_gguf(llama4("interleaved"), str(tmp_path / "llama4-q8.gguf"), "Q8_0")
    runs = [
        (path, dict(tensor_parallel_size=2)),
        (path, dict(data_parallel_size=2, enable_expert_parallel=True)),
        (l4, dict(tensor_parallel_size=2)),
        (l4, dict(data_parallel_size=2, enable_expert_parallel=True)),
    ]
    want = [_run(p) for p, _ in runs]
    results = run_distributed(_gpt_oss_rank, 2, runs, timeout=190)
    for per_rank in results:
        for got, ref in zip(per_rank, want, strict=True):
            assert got[0] == ref[0]
            assert np.allclose(got[1], ref[1], atol=1e-5, rtol=0)  # TP: sums in another order


# ---- Llama 4 ------------------------------------------------------------------------------------
# Llama 4's text config as a Llama4ForCausalLM, with the chunk size and temperature floor the file
# cannot carry at llama.cpp's fixed (and the published) 8192; "interleaved": Maverick's dense / MoE
# alternation (interleave_moe_layer_step 2) on Scout's sizes
LLAMA4_VARIANTS = {"scout": {}, "interleaved": {"interleave_moe_layer_step": 2, "moe_layers": None}}


@pytest.fixture(scope="module")
def llama4(real_checkpoint):
    def make(variant: str) -> str:
        text = {**published("llama-4-scout-17b-16e")["text_config"], "architectures": ["Llama4ForCausalLM"]}
        text.update(LLAMA4_VARIANTS[variant])
        return real_checkpoint(text, attention_chunk_size=8192, floor_scale=8192)

    return make


def _frequencies(cfg) -> torch.Tensor:
    rope = RopeConfig.from_hf(cfg, cfg.head_dim)
    return ROPE_TYPES[rope.rope_type](rope, None)[0]


@pytest.mark.parametrize("variant", list(LLAMA4_VARIANTS))
def test_llama4_gguf_runs_like_its_checkpoint(llama4, tmp_path, variant):
    """An F32 file: transformers' Llama4TextConfig of the config made from the metadata equals the
    checkpoint's on every attribute but the RoPE block (layer types, NoPE layers, MoE layers,
    chunk size, temperature tuning, q/k norm, both widths); the RoPE frequencies from the file's
    rope_freqs equal llama3's from the checkpoint's config within float32 rounding; every tensor is
    served as the checkpoint has it (the fused experts split per expert); tokens equal our run of
    the checkpoint, logprobs within 1e-5. A Q8_0 file holds its matrices and runs like an F32 file
    of gguf's values of it (tokens)."""
    from transformers import AutoConfig

    hf = llama4(variant)
    path = write_llama4_gguf(hf, str(tmp_path / "llama4.gguf"))
    ours, ref = AutoConfig.from_pretrained(gguf_model_dir(path)), AutoConfig.from_pretrained(hf)
    skip = {"rope_scaling", "rope_parameters", "eos_token_id", "bos_token_id", "pad_token_id", "dtype"}
    skip |= {"torch_dtype", "rms_norm_eps", "transformers_version", "_name_or_path", "architectures"}
    skip |= {"initializer_range", "for_llm_compressor"}  # training-only: not in a GGUF file
    keys = (set(ref.to_dict()) | set(ours.to_dict())) - skip
    assert {k: getattr(ours, k, None) for k in keys} == {k: getattr(ref, k, None) for k in keys}
    assert ours.layer_types == ["chunked_attention"] * 3 + ["full_attention"]  # what llama.cpp assumes
    assert ours.moe_layers == ([0, 1, 2, 3] if variant == "scout" else [1, 3])
    assert torch.allclose(_frequencies(ours), _frequencies(ref), rtol=2e-7, atol=0)

    sd = load_file(os.path.join(hf, "model.safetensors"))
    info = json.load(open(os.path.join(gguf_model_dir(path), "gguf.json")))
    f = GGUFTensorFile(path, info)
    served = {k: f.get_slice(k).materialize([(0, d) for d in f.get_slice(k).shape]) for k in f.keys()}
    for layer in range(ref.num_hidden_layers):
        e = f"model.layers.{layer}.feed_forward.experts."
        if e + "gate_up_proj" not in sd:
            continue
        gate_up, down = (
            sd.pop(e + "gate_up_proj").float(),
            sd.pop(e + "down_proj").float(),
        )  # [E, H, 2I], [E, I, H]
        inter = gate_up.shape[-1] // 2
        for x in range(ref.num_local_experts):
            assert torch.equal(served.pop(f"{e}{x}.gate_proj.weight"), gate_up[x, :, :inter].T)
            assert torch.equal(served.pop(f"{e}{x}.up_proj.weight"), gate_up[x, :, inter:].T)
            assert torch.equal(served.pop(f"{e}{x}.down_proj.weight"), down[x].T)
    assert served.keys() == sd.keys()
    assert all(torch.equal(served[k], v.float()) for k, v in sd.items())

    got, got_lp = _run(path)
    want, want_lp = _run(hf)
    assert got == want and np.allclose(got_lp, want_lp, atol=1e-5, rtol=0)
    q8 = write_llama4_gguf(hf, str(tmp_path / "llama4-q8.gguf"), "Q8_0")
    ggml = dequantized_state([q8])
    f32 = str(tmp_path / "llama4-q8-values.gguf")
    real_add = gguf.GGUFWriter.add_tensor

    def add_values(self, name, tensor, *args, raw_dtype=None, **kw):
        return real_add(self, name, ggml[name].numpy())

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", add_values)
        write_llama4_gguf(hf, f32, "Q8_0")
    (held, _), text = _run_logged(q8)
    assert "weights held compressed as stored" in text
    assert held == _run(f32)[0]


def test_llama4_fixed_values_from_metadata():
    """What llama.cpp's llama4 loader fixes, from metadata alone: 128 experts (Maverick) turn the
    q/k norm off; attention.sliding_window 0 (MobileLLM) means no chunks and RoPE on every layer;
    a sliding_window_pattern array names the chunked layers; interleave_moe_layer_step 0: no MoE."""
    meta = {"general.architecture": "llama4", "llama4.block_count": 8, "llama4.expert_count": 128,
            "llama4.attention.head_count": 4, "llama4.interleave_moe_layer_step": 2}  # fmt: skip
    cfg = hf_config(meta)
    assert cfg["use_qk_norm"] is False and cfg["moe_layers"] == [1, 3, 5, 7]
    assert cfg["no_rope_layers"] == [1, 1, 1, 0, 1, 1, 1, 0] and cfg["attention_chunk_size"] == 8192
    assert cfg["layer_types"] == (["chunked_attention"] * 3 + ["full_attention"]) * 2
    cfg = hf_config({**meta, "llama4.expert_count": 16, "llama4.attention.sliding_window": 0,
                     "llama4.interleave_moe_layer_step": 0})  # fmt: skip
    assert cfg["use_qk_norm"] is True and cfg["moe_layers"] == [] and cfg["attention_chunk_size"] is None
    assert cfg["no_rope_layers"] == [1] * 8 and cfg["layer_types"] == ["full_attention"] * 8
    pattern = np.array([1, 0] * 4, np.bool_)
    cfg = hf_config({**meta, "llama4.attention.sliding_window_pattern": pattern})
    assert cfg["layer_types"] == ["chunked_attention", "full_attention"] * 4


LLAMA_CPP = os.environ.get("EXPERTMESH_LLAMA_CPP")  # llama.cpp's sources: convert_hf_to_gguf.py, gguf-py


@pytest.mark.skipif(not LLAMA_CPP, reason="EXPERTMESH_LLAMA_CPP (llama.cpp's source dir) is not set")
@pytest.mark.timeout(300)
def test_gpt_oss_file_written_by_llama_cpps_converter(gpt_oss, tmp_path):
    """llama.cpp's convert_hf_to_gguf.py on the MXFP4 checkpoint: with --outtype f32 every tensor is
    byte for byte the test writer's (its MXFP4 nibble order, the gate / up split) and every metadata
    value ours sets is the converter's; it runs like the checkpoint (tokens and logprobs). Its
    default file (F16 attention) loads and holds the experts."""
    hf, ours = gpt_oss
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, os.path.join(root, "benchmarks", "gguf_convert.py"), "--converter", LLAMA_CPP, hf]
    out = str(tmp_path / "converted-f32.gguf")
    subprocess.run([*cmd, "--outtype", "f32", "--outfile", out], check=True, capture_output=True)
    theirs, mine = gguf.GGUFReader(out), gguf.GGUFReader(ours)
    tensors = {t.name: t for t in mine.tensors}
    assert tensors.keys() == {t.name for t in theirs.tensors}
    for t in theirs.tensors:
        assert t.tensor_type == tensors[t.name].tensor_type, t.name
        assert np.array_equal(np.asarray(t.data), np.asarray(tensors[t.name].data)), t.name
    for key, field in mine.fields.items():
        if key.startswith(("gpt-oss.", "tokenizer.ggml.model")):
            assert field.contents() == theirs.fields[key].contents(), key
    assert _run(out) == _run(hf)
    f16 = str(tmp_path / "converted.gguf")
    subprocess.run([*cmd, "--outfile", f16], check=True, capture_output=True)
    (tokens, _), text = _run_logged(f16)
    assert (
        "weights held compressed as stored: 8 parameters" in text and len(tokens[0]) == GREEDY["max_tokens"]
    )


@pytest.mark.skipif(not LLAMA_CPP, reason="EXPERTMESH_LLAMA_CPP (llama.cpp's source dir) is not set")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(LLAMA4_VARIANTS))
def test_llama4_file_written_by_llama_cpps_converter(llama4, tmp_path, variant):
    """llama.cpp's converter on the Llama 4 checkpoints (--outtype f32): every tensor (rope_freqs
    included) byte for byte the test writer's, the same llama4.* metadata; runs like the checkpoint."""
    hf = llama4(variant)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path / "converted.gguf")
    cmd = [sys.executable, os.path.join(root, "benchmarks", "gguf_convert.py"), "--converter", LLAMA_CPP, hf]
    subprocess.run([*cmd, "--outtype", "f32", "--outfile", out], check=True, capture_output=True)
    theirs = gguf.GGUFReader(out)
    mine = gguf.GGUFReader(write_llama4_gguf(hf, str(tmp_path / "ours.gguf")))
    tensors = {t.name: t for t in mine.tensors}
    assert tensors.keys() == {t.name for t in theirs.tensors}
    for t in theirs.tensors:
        assert t.tensor_type == tensors[t.name].tensor_type, t.name
        assert np.array_equal(np.asarray(t.data), np.asarray(tensors[t.name].data)), t.name
    keys = {k for k in theirs.fields if k.startswith("llama4.")}
    assert keys == {k for k in mine.fields if k.startswith("llama4.")}
    assert all(mine.fields[k].contents() == theirs.fields[k].contents() for k in keys)
    got, want = _run(out), _run(hf)
    assert got[0] == want[0] and np.allclose(got[1], want[1], atol=1e-5, rtol=0)


@pytest.mark.skipif(not LLAMA_CPP_PYTHON, reason="EXPERTMESH_LLAMA_CPP_PYTHON (llama-cpp-python) is not set")
@pytest.mark.parametrize("variant", list(LLAMA4_VARIANTS))
def test_llama_cpp_runs_the_llama4_file_like_we_do(llama4, tmp_path, variant):
    """llama.cpp itself (llama-cpp-python) on the F32 Llama 4 file (the converter's bytes, see above):
    the same greedy tokens as ours, chunked / NoPE layers, shared expert and rope_freqs included.
    (gpt-oss is not compared: llama.cpp's YaRN truncates the correction range where the published
    config says not to, and its tokens part from ours and the checkpoint's on the tiny model.)"""
    path = write_llama4_gguf(llama4(variant), str(tmp_path / "llama4.gguf"))
    args = [path, json.dumps(PROMPTS), str(GREEDY["max_tokens"])]
    run = subprocess.run(
        [LLAMA_CPP_PYTHON, "-c", LLAMA_CPP_GREEDY, *args], check=True, capture_output=True, text=True
    )
    assert json.loads(run.stdout.strip().splitlines()[-1]) == _run(path)[0]


def test_placeholder_vocabulary_loads_without_a_tokenizer(gpt_oss, tmp_path):
    """A file whose vocabulary is placeholders with a merge the tokenizers library panics on (a Rust
    panic, not an Exception: the benchmarks' published-size files) loads with a warning naming the
    file, no tokenizer, and runs token ids."""
    from expertmesh.models.gguf.tokenizer import write_tokenizer

    path = str(tmp_path / "placeholders.gguf")
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(16)])
    w.add_token_types([1] * 16)
    w.add_token_merges(["<t1> <t2>"])
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("expertmesh").addHandler(handler)
    try:
        assert write_tokenizer(path, str(tmp_path / "tok")) is False
    finally:
        logging.getLogger("expertmesh").removeHandler(handler)
    assert any(f"GGUF {path}: no tokenizer from its metadata" in r for r in records), records
