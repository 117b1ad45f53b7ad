"""NVIDIA ModelOpt FP8 checkpoints (layers/quantization/modelopt.py) on Nemotron-H, the family NVIDIA
ships that way (NVIDIA-Nemotron-3-Nano-30B-A3B-FP8): a tiny checkpoint written in ModelOpt's layout
(e4m3 `weight`, per-tensor `weight_scale` and static `input_scale`; config.json's flat
`quantization_config` with `quant_method: modelopt`, `quant_algo: FP8`) against transformers on the
same file dequantized by the format's definition (W = W8 * weight_scale)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_hybrid_families import _reference, _source

from expertmesh import LLM
from expertmesh.layers.quantization.fp8 import E4M3_MAX
from expertmesh.layers.quantization.modelopt import ModelOptFormat

CONFIG = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": None,
          "ignore": ["lm_head", "backbone.layers.*.mixer.gate"]}  # fmt: skip


def _quantized(key: str, t: torch.Tensor) -> bool:
    # every projection (Mamba2 in/out, attention q/k/v/o, routed and shared experts' up/down);
    # embeddings, the router (`mixer.gate`), conv, norms and lm_head stay as stored
    return key.endswith("_proj.weight") and t.dim() == 2


def _to_modelopt(src: str, dst: str, config: dict = CONFIG, input_scale_shape: tuple = ()) -> str:
    from quantized_checkpoints import _rewrite

    def convert(key: str, t: torch.Tensor) -> dict:
        if not _quantized(key, t):
            return {key: t}
        scale = (t.float().abs().amax() / E4M3_MAX).clamp(min=1e-12)
        base = key.removesuffix(".weight")
        return {
            key: (t.float() / scale).to(torch.float8_e4m3fn),
            f"{base}.weight_scale": scale.reshape(()),
            f"{base}.input_scale": torch.full(input_scale_shape, 0.05),  # a calibrated amax / 448
        }

    _rewrite(src, dst, convert, config)
    return dst


def _dequantized(src: str, dst: str) -> str:
    """The ModelOpt checkpoint back to float32 by the format's definition, scales dropped."""
    from quantized_checkpoints import _rewrite
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, name)))

    def convert(key: str, t: torch.Tensor) -> dict:
        if key.endswith(("_scale",)):
            return {}
        if t.dtype == torch.float8_e4m3fn:
            return {key: t.float() * tensors[key.removesuffix(".weight") + ".weight_scale"].float()}
        return {key: t}

    _rewrite(src, dst, convert, None)
    config_path = os.path.join(dst, "config.json")
    config = json.load(open(config_path))
    config.pop("quantization_config")
    json.dump(config, open(config_path, "w"), indent=1)
    return dst


@pytest.mark.timeout(240)
def test_nemotron_h_modelopt_fp8_matches_its_dequantized_weights(real_checkpoint, tmp_path, engine_log):
    """Every projection and expert held as its stored e4m3 bytes with the tensor's one scale; greedy
    tokens against transformers on the dequantized file under test_quantization's bound (equal, one
    divergence allowed per prompt at a reference margin below its MARGIN)."""
    from checkpoints import prompts_of_lengths
    from test_quantization import LENGTHS as Q_LENGTHS
    from test_quantization import _greedy, assert_greedy_matches

    path = _to_modelopt(real_checkpoint(_source("nemotron-h")), str(tmp_path / "modelopt"))
    ref = _reference(_dequantized(path, str(tmp_path / "ref")))
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    assert "weights: modelopt fp8 e4m3 (per tensor)" in engine_log.text
    assert "static activation / KV scales read and not applied" in engine_log.text
    assert "not held compressed" not in engine_log.text
    prompts = prompts_of_lengths(Q_LENGTHS, seed=7)
    assert assert_greedy_matches(_greedy(llm, prompts), ref, prompts) <= 1
    # the next load of the same file, asked to dequantize, gives the same tokens as held
    deq = LLM(path, quantization="dequantize", max_model_len=128, kv_cache_memory_bytes=1 << 22)
    assert assert_greedy_matches(_greedy(deq, prompts), ref, prompts) <= 1


def test_modelopt_config_forms_and_refusals():
    """Both config forms (config.json's flat one, hf_quant_config.json's nested one) parse; the
    quant_algos not read are refused by name."""
    flat = ModelOptFormat.from_config(CONFIG)
    nested = ModelOptFormat.from_config(
        {"quant_method": "modelopt", "quantization": {"quant_algo": "fp8", "kv_cache_quant_algo": "FP8"}}
    )
    assert (flat.block, flat.kv_cache, nested.kv_cache) == (None, None, "FP8")
    assert flat.scale_suffix == "_scale" and flat.name() == "modelopt fp8 e4m3 (per tensor)"
    for algo in ("NVFP4", "FP8_PB_WO", None):
        with pytest.raises(ValueError, match=f"modelopt quant_algo={algo!r} is not supported"):
            ModelOptFormat.from_config({"quant_method": "modelopt", "quant_algo": algo})


@pytest.mark.timeout(240)
def test_modelopt_bad_tensors_fail_by_name(real_checkpoint, tmp_path):
    """A static scale that is not one number, and a weight without its weight_scale, fail naming the
    tensor; a good checkpoint then loads."""
    from safetensors.torch import load_file, save_file

    src = real_checkpoint(_source("nemotron-h"))
    bad = _to_modelopt(src, str(tmp_path / "bad_input"), input_scale_shape=(2,))
    with pytest.raises(ValueError, match=r"input_scale' should be one positive scale; it has shape \(2,\)"):
        LLM(bad, max_model_len=64, kv_cache_memory_bytes=1 << 22)
    missing = _to_modelopt(src, str(tmp_path / "missing"))
    (name,) = [n for n in os.listdir(missing) if n.endswith(".safetensors")]
    tensors = load_file(os.path.join(missing, name))
    dropped = next(k for k in sorted(tensors) if k.endswith("in_proj.weight_scale"))
    del tensors[dropped]
    save_file(tensors, os.path.join(missing, name), metadata={"format": "pt"})
    weight = dropped.removesuffix("_scale")
    with pytest.raises(ValueError, match=f"fp8 weight '{weight}' has no '{dropped}'"):
        LLM(missing, max_model_len=64, kv_cache_memory_bytes=1 << 22)
    good = _to_modelopt(src, str(tmp_path / "good"))
    out = LLM(good, max_model_len=64, kv_cache_memory_bytes=1 << 22).generate(
        [{"prompt_token_ids": [5, 6, 7]}]
    )
    assert out[0].error is None and len(out[0].outputs[0].token_ids) > 0


def _modelopt_tp_rank(rank, world, path, prompts):
    from test_quantization import _greedy

    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="external_launcher",
              max_model_len=128, kv_cache_memory_bytes=1 << 22)  # fmt: skip
    return _greedy(llm, prompts)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nemotron_h_modelopt_fp8_under_tp2(real_checkpoint, tmp_path):
    """TP2: each rank holds its rows / columns of the e4m3 bytes with the tensor's one scale (Mamba2
    heads and groups, attention heads, expert widths split); same reference and bound as above."""
    from checkpoints import prompts_of_lengths
    from distributed_utils import run_distributed
    from test_quantization import LENGTHS as Q_LENGTHS
    from test_quantization import assert_greedy_matches

    path = _to_modelopt(real_checkpoint(_source("nemotron-h")), str(tmp_path / "modelopt"))
    ref = _reference(_dequantized(path, str(tmp_path / "ref")))
    prompts = prompts_of_lengths(Q_LENGTHS, seed=7)
    for tokens in run_distributed(_modelopt_tp_rank, 2, path, prompts, timeout=250):
        assert assert_greedy_matches(tokens, ref, prompts) <= 1
