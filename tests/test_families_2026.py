"""The 2026 families (tests/real_configs/2026, shrunk with every flag kept) beyond the fp32 /
bf16 comparisons of test_real_families and the layout matrix of test_real_layouts: chunked
prefill gives the tokens of one unchunked run (prefix caching: test_prefix_caching's family
cells), and the published checkpoints' extra tensors (MTP modules) are skipped by a named, logged rule."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from real_checkpoints import published, shrink
from test_chunked_prefill import SHORT, compare
from test_real_families import FAMILIES, hf_logprobs, logprob_errors, prompts_for

from expertmesh import LLM, SamplingParams
from expertmesh.layers.norm import ProjectionRMSNorm

CHUNKED_AND_CACHED = ["minimax-m2.7", "kimi-k2.5"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", CHUNKED_AND_CACHED)
def test_chunked_prefill_equals_unchunked(family, real_checkpoint):
    source, overrides = FAMILIES[family]
    llm = compare(real_checkpoint(source, **overrides), SHORT, 256, family)
    assert llm.llm_engine.stats()["steps"] > 8  # the 150-token prompt took three steps to prefill


def test_minimax_declares_its_blocks_and_skips_its_mtp_modules(real_checkpoint, engine_log):
    """Whole-width q/k norm, partial rotary from the legacy rotary_dim, the corrected sigmoid
    router; the 3 MTP modules the weights carry are consumed by the named rule, and logged."""
    config = shrink(published("2026/minimax-m2.7"))
    assert config["rotary_dim"] * 2 == config["head_dim"] and config["num_mtp_modules"] == 3
    llm = LLM(real_checkpoint("2026/minimax-m2.7"), max_model_len=128, kv_cache_memory_bytes=1 << 22)
    model = llm.llm_engine.runner.model
    cfg = llm.llm_engine.config.model_config
    assert cfg.rope.rotary_dim == config["rotary_dim"] and cfg.num_nextn_predict_layers == 3
    attn = model.model.layers["0"].self_attn
    assert isinstance(attn.q_norm, ProjectionRMSNorm) and isinstance(attn.k_norm, ProjectionRMSNorm)
    router = model.model.layers["0"].block_sparse_moe.gate
    assert router.rule == "sigmoid_grouped" and torch.count_nonzero(router.e_score_correction_bias)
    assert "by rule 'mtp layers (num_nextn_predict_layers / num_mtp_modules" in engine_log.text


@pytest.mark.timeout(120)
def test_kimi_k2_model_type_is_read_as_deepseek_v3(real_checkpoint, engine_log, tmp_path):
    """Kimi-K2-Instruct's published config says model_type "kimi_k2", which transformers reads only
    with remote code: we read it as DeepSeek-V3 (logged). The reference is transformers on the same
    tensors with model_type deepseek_v3 (its auto_map's DeepseekV3Config); greedy tokens and fp32
    logprobs equal at every step."""
    import transformers

    published_config = shrink(published("2026/kimi-k2-instruct"))
    assert published_config["model_type"] == "kimi_k2"
    reference = real_checkpoint("2026/kimi-k2-instruct", model_type="deepseek_v3")
    kimi = tmp_path / "kimi-k2"
    shutil.copytree(reference, kimi)
    (kimi / "config.json").write_text(json.dumps(published_config, indent=2))
    with pytest.raises((ValueError, OSError)):  # what a user of plain transformers meets offline
        transformers.AutoConfig.from_pretrained(kimi, trust_remote_code=False)
    llm = LLM(str(kimi), max_model_len=128, kv_cache_memory_bytes=1 << 23)
    assert "model_type 'kimi_k2' read as 'deepseek_v3'" in engine_log.text
    prompts = prompts_for(512)[2:5]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_logprobs(model, prompt, out.outputs[0].token_ids)
        assert out.outputs[0].token_ids == ref.argmax(-1).tolist(), f"prompt of {len(prompt)} tokens"
        assert logprob_errors(out, ref).max() < 2e-4
    assert Path(kimi, "config.json").read_text() == json.dumps(published_config, indent=2)


def test_kimi_k25_serves_its_text_tower_and_logs_the_vision_skip(real_checkpoint, engine_log):
    path = real_checkpoint("2026/kimi-k2.5")
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    cfg = llm.llm_engine.config.model_config
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 64.0 and cfg.rope.beta_fast == 32.0
    assert cfg.mla is not None and cfg.first_k_dense_replace == 1
    assert "by rule 'vision tower and projector (expertmesh serves text)'" in engine_log.text


@pytest.mark.parametrize("name", ["minimax-m2.5", "minimax-m2.7", "kimi-k2.5", "kimi-k2-instruct"])
def test_published_2026_configs_shrink_with_every_flag_kept(name):
    """Every key survives shrinking; a flag (not a size) keeps its published value; our config
    reading (hf_config.load_hf_config) takes each file, Kimi-K2's kimi_k2 included."""
    from expertmesh.config.hf_config import load_hf_config

    full = published(f"2026/{name}")
    small = shrink(full)
    sizes = {
        "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "moe_intermediate_size", "num_local_experts", "n_routed_experts",
        "num_experts_per_tok", "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id",
        "pad_token_id", "rope_scaling", "initializer_range", "torch_dtype", "dtype", "kv_lora_rank",
        "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace",
        "rotary_dim", "attn_type_list", "quantization_config", "text_config", "vision_config",
    }  # fmt: skip
    pairs = [(full, small)]
    if "text_config" in full:
        pairs.append((full["text_config"], small["text_config"]))
    for old, new in pairs:
        added = {"initializer_range"}  # set by shrink for clear greedy margins
        assert set(new) - added == set(old) - {"quantization_config"} - added, name
        assert all(new[k] == v for k, v in old.items() if k not in sizes), name
    text = small.get("text_config", small)
    if "rotary_dim" in text:
        assert text["rotary_dim"] / text["head_dim"] == full["rotary_dim"] / full["head_dim"]
    assert text.get("attn_type_list", [1] * text["num_hidden_layers"]) == [1] * text["num_hidden_layers"]
    hf = load_hf_config_from(small, load_hf_config)
    assert hf.architectures == full["architectures"]


def load_hf_config_from(config: dict, load) -> object:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(config))
        return load(d)
