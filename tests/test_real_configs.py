"""The published configs and the shrink helper: sizes shrink, every flag and pattern survives, and
transformers builds (and reloads) the checkpoint with every randomised tensor in it."""

import json

import pytest
import torch
from real_checkpoints import CONFIG_DIR, Sizes, published, shrink
from safetensors import safe_open

NAMES = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
SIZE_KEYS = {
    "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
    "intermediate_size_mlp", "num_local_experts", "num_experts", "n_routed_experts",
    "num_experts_per_tok", "experts_per_token", "vocab_size", "max_position_embeddings",
    "original_max_position_embeddings", "initial_context_length", "sliding_window",
    "attention_chunk_size", "floor_scale", "layer_types", "no_rope_layers", "moe_layers",
    "max_window_layers", "first_k_dense_replace", "bos_token_id", "eos_token_id", "pad_token_id",
    "rope_scaling", "initializer_range", "torch_dtype", "attn_temperature_tuning",
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
}  # fmt: skip


def test_every_published_config_is_here():
    assert len(NAMES) == 12, NAMES


@pytest.mark.parametrize("name", NAMES)
def test_shrink_keeps_every_flag(name):
    full = published(name)
    pairs = [(full, shrink(full))]
    if "text_config" in full:
        pairs.append((full["text_config"], pairs[0][1]["text_config"]))
    for old, new in pairs:
        assert set(new) == set(old) - {"quantization_config"}, name
        for key, value in old.items():
            if key not in SIZE_KEYS and key not in ("text_config", "vision_config", "quantization_config"):
                assert new[key] == value, f"{name}: {key} changed"
    text_old = full.get("text_config", full)
    text = shrink(full).get("text_config", shrink(full))
    n = text["num_hidden_layers"]
    for key in ("layer_types", "no_rope_layers"):
        if key in text_old:
            assert text[key] == text_old[key][:n]
    if text_old.get("sliding_window"):
        small, big = text["sliding_window"], text_old["sliding_window"]
        assert small % 2 == big % 2 or small == text["max_position_embeddings"]
    if text_old.get("first_k_dense_replace"):
        assert 1 <= text["first_k_dense_replace"] < n
    rope, rope_old = text.get("rope_scaling") or {}, text_old.get("rope_scaling") or {}
    assert rope.get("rope_type", rope.get("type")) == rope_old.get("rope_type", rope_old.get("type"))
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    for key in ("short_factor", "long_factor"):
        if key in rope:
            assert len(rope[key]) == head_dim // 2


def test_shrink_keeps_relations():
    gpt = shrink(published("gpt-oss-20b"))
    assert gpt["num_attention_heads"] * gpt["head_dim"] != gpt["hidden_size"]  # q width != hidden
    assert gpt["sliding_window"] < 64 and gpt["sliding_window"] % 2 == 0
    phi = shrink(published("phi-mini-moe"))
    assert phi["sliding_window"] % 2 == 1  # 2047 -> an odd window
    phi35 = shrink(published("phi-3.5-moe"))
    assert phi35["sliding_window"] == phi35["max_position_embeddings"]  # no effect, as published
    granite = shrink(published("granite-3.1-3b-a800m-instruct"))
    assert granite["vocab_size"] % 2 == 1 and granite["tie_word_embeddings"]
    glm = shrink(published("glm-4.5-air"))
    assert glm["num_attention_heads"] * glm["head_dim"] > 2 * glm["hidden_size"]
    scout = shrink(published("llama-4-scout-17b-16e"))["text_config"]
    assert scout["no_rope_layers"] == [1, 1, 1, 0] and scout["moe_layers"] == [0, 1, 2, 3]
    assert scout["attention_chunk_size"] == Sizes().window and scout["attn_temperature_tuning"] is True
    moe = shrink(published("mixtral-8x7b-instruct"), Sizes(experts=7))
    assert moe["num_local_experts"] == 7  # counts that do not divide the EP size, on request


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["gpt-oss-20b", "glm-4.5-air"])
def test_build_randomises_and_keeps_published_config(real_checkpoint, name):
    path = real_checkpoint(name)
    with open(f"{path}/config.json") as f:
        assert json.load(f) == shrink(published(name))  # the published style, not the re-save
    keys = {}
    index = f"{path}/model.safetensors.index.json"
    files = sorted(set(json.load(open(index))["weight_map"].values())) if name == "glm-4.5-air" else []
    for file in files or ["model.safetensors"]:
        with safe_open(f"{path}/{file}", "pt") as f:
            keys.update({k: f.get_tensor(k) for k in f.keys()})
    small = [k for k, t in keys.items() if t.dim() == 1 or k.endswith("bias")]
    assert small
    for k in small:
        assert not (torch.all(keys[k] == 0) or torch.all(keys[k] == 1)), f"{k} was not randomised"
    if name == "gpt-oss-20b":
        assert any(k.endswith("sinks") for k in keys) and any("experts.down_proj_bias" in k for k in keys)
    else:  # the MTP layer after the last decoder layer, as GLM-4.5 ships it
        n = shrink(published(name))["num_hidden_layers"]
        assert f"model.layers.{n}.eh_proj.weight" in keys
        assert f"model.layers.{n - 1}.mlp.gate.e_score_correction_bias" in keys
