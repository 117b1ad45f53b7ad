"""What the new families do with what they do not load or support: named skip rules, logged; and
clear errors naming the value for what is not supported."""

import json
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from expertmesh import LLM
from expertmesh.config import ModelConfig
from expertmesh.models.decoder_attention import DecoderAttention
from expertmesh.models.family import Family
from expertmesh.models.loader import WeightLoadError


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.timeout(60)
def test_mtp_layers_are_skipped_by_a_named_logged_rule(real_checkpoint, engine_log, tmp_path):
    path = real_checkpoint("glm-4.5-air")
    LLM(path, max_model_len=64, kv_cache_memory_bytes=1 << 22)
    skipped = [r.getMessage() for r in engine_log.records if "by rule" in r.getMessage()]
    assert skipped and "mtp layers" in skipped[0] and "num_nextn_predict_layers" in skipped[0]
    # A layer past the MTP ones is still an error naming the key.
    copy = _copy(path, tmp_path / "glm")
    file = copy / "model-00002-of-00002.safetensors"
    weights = load_file(file)
    n = json.loads((copy / "config.json").read_text())["num_hidden_layers"]
    weights[f"model.layers.{n + 1}.eh_proj.weight"] = weights[f"model.layers.{n}.eh_proj.weight"].clone()
    save_file(weights, file, metadata={"format": "pt"})
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    index["weight_map"][f"model.layers.{n + 1}.eh_proj.weight"] = file.name
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightLoadError, match=f"model.layers.{n + 1}.eh_proj.weight' names layer {n + 1}"):
        LLM(str(copy), max_model_len=64, kv_cache_memory_bytes=1 << 22)


@pytest.mark.timeout(60)
def test_vision_tower_of_a_multimodal_checkpoint_is_skipped_and_logged(real_checkpoint, engine_log):
    LLM(real_checkpoint("llama-4-scout-17b-16e"), max_model_len=64, kv_cache_memory_bytes=1 << 22)
    assert any("by rule 'vision tower" in r.getMessage() for r in engine_log.records)


@pytest.mark.timeout(60)
def test_unsupported_config_values_are_named(real_checkpoint, tmp_path):
    path = _copy(real_checkpoint("olmoe-1b-7b-0924"), tmp_path / "olmoe")
    _edit_config(path, rope_scaling={"rope_type": "mrope", "mrope_section": [2, 2, 4]})
    with pytest.raises(ValueError, match="rope_type='mrope' is not supported; supported: .*longrope"):
        LLM(str(path), kv_cache_memory_bytes=1 << 22)
    _edit_config(path, rope_scaling=None, quantization_config={"quant_method": "bitsandbytes"})
    with pytest.raises(
        ValueError,
        match=r"quant_method='bitsandbytes', which expertmesh does not load; "
        r"supported: \['awq', 'compressed-tensors', 'fp8', 'gptq', 'modelopt', 'mxfp4'\]",
    ):
        LLM(str(path), kv_cache_memory_bytes=1 << 22)
    _edit_config(path, quantization_config=None, layer_types=["linear_attention"] * 4)
    with pytest.raises(ValueError, match=r"layer_types \['linear_attention'\] are not supported"):
        LLM(str(path), kv_cache_memory_bytes=1 << 22)


def test_config_checks_name_the_value():
    base = dict(
        architecture="X", vocab_size=8, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
        intermediate_size=8, max_position_embeddings=32, norm_eps=1e-5,
    )  # fmt: skip
    with pytest.raises(ValueError, match="layer_types has 1 entries for num_hidden_layers=2"):
        ModelConfig(**base, layer_types=("full_attention",))
    with pytest.raises(ValueError, match="sliding_attention layers but the config has no sliding_window"):
        ModelConfig(**base, layer_types=("sliding_attention",) * 2)
    with pytest.raises(ValueError, match="chunked_attention layers but no attention_chunk_size"):
        ModelConfig(**base, layer_types=("chunked_attention",) * 2)
    with pytest.raises(ValueError, match="n_group=3 must divide n_routed_experts=8"):
        ModelConfig(**base, num_experts=8, top_k=2, n_group=3)


def test_whole_projection_qk_norm_needs_a_kv_head_per_tp_rank():
    """OLMoE's q/k norm spans the whole projection; with KV heads replicated over TP ranks its
    k part cannot be computed: the error says which sizes to change."""
    cfg = ModelConfig(
        architecture="OlmoeForCausalLM", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=4, intermediate_size=8, max_position_embeddings=32, norm_eps=1e-5,
    )  # fmt: skip
    tp = types.SimpleNamespace(rank_in_group=0, world_size=2)
    with pytest.raises(ValueError, match="num_key_value_heads=1 >= tensor_parallel_size=2"):
        DecoderAttention(cfg, 0, Family(qk_norm="projection"), tp)
    with pytest.raises(ValueError, match="q/k norm 'rms_whole' is not known; known: .*per_head"):
        DecoderAttention(
            cfg, 0, Family(qk_norm="rms_whole"), types.SimpleNamespace(rank_in_group=0, world_size=1)
        )
    assert DecoderAttention(cfg, 0, Family(qk_norm="l2"), tp).attn.num_heads == 1
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.timeout(60)
def test_published_llama4_temperature_tuning_int_loads(real_checkpoint, engine_log, tmp_path):
    """Llama 4's published config.json says `"attn_temperature_tuning": 4`, which transformers 5's
    strict config rejects; the engine reads it as True (logged) and runs as with the bool."""
    from expertmesh import SamplingParams

    path = real_checkpoint("llama-4-scout-17b-16e")
    copy = _copy(path, tmp_path / "scout")
    config = json.loads((copy / "config.json").read_text())
    assert config["text_config"]["attn_temperature_tuning"] is True
    config["text_config"]["attn_temperature_tuning"] = 4
    (copy / "config.json").write_text(json.dumps(config))
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 40))}]
    runs = [
        LLM(str(p), max_model_len=64, kv_cache_memory_bytes=1 << 22).generate(prompts, sp, use_tqdm=False)
        for p in (path, copy)
    ]
    assert runs[0][0].outputs[0].token_ids == runs[1][0].outputs[0].token_ids
    assert any("attn_temperature_tuning 4 read as True" in r.getMessage() for r in engine_log.records)
