"""GGUF metadata -> an HF config dict, per family.

The older families (qwen3moe, qwen2moe, llama / Mixtral) are branches of `hf_config`; the rest are
declarations: FAMILY_CONFIG[arch] (HF architecture, model_type, {metadata key under the
architecture's prefix: config key}, fixed values), DERIVED[arch] (values computed from several
keys), TENSOR_FLAGS[arch] (config flags read off the tensors present). Values are what llama.cpp's
converter writes (convert_hf_to_gguf.py) and its runtime assumes (llama-model.cpp).
"""

from __future__ import annotations

from typing import Any

from expertmesh.models.gguf.reader import GGUFError


def hf_config(meta: dict[str, Any]) -> dict[str, Any]:
    """An HF config dict for the architectures llama.cpp's converter writes that we run."""
    arch = meta.get("general.architecture")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    cfg: dict[str, Any] = {
        "vocab_size": get("vocab_size") or meta.get("tokenizer.ggml.vocab_size"),
        "hidden_size": get("embedding_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_parameters": {"rope_theta": get("rope.freq_base", 10000.0), "rope_type": "default"},
        "intermediate_size": get("feed_forward_length"),
        "tie_word_embeddings": False,  # set by the tensors present (gguf_model_dir)
    }
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            cfg[hf] = meta[f"tokenizer.ggml.{key}"]
    if get("attention.key_length"):
        cfg["head_dim"] = get("attention.key_length")
    if arch in ("qwen3moe", "qwen2moe"):
        cfg.update(
            num_experts=get("expert_count"),
            num_local_experts=get("expert_count"),
            num_experts_per_tok=get("expert_used_count"),
            moe_intermediate_size=get("expert_feed_forward_length"),
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        if arch == "qwen3moe":
            # llama.cpp's qwen3moe always renormalises the top-k weights (as transformers notes)
            cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", norm_topk_prob=True)
            cfg["intermediate_size"] = cfg["intermediate_size"] or cfg["moe_intermediate_size"]
        else:
            cfg.update(
                architectures=["Qwen2MoeForCausalLM"],
                model_type="qwen2_moe",
                shared_expert_intermediate_size=get("expert_shared_feed_forward_length"),
                norm_topk_prob=False,
                qkv_bias=True,
            )
    elif arch == "llama" and get("expert_count"):  # Mixtral: llama.cpp writes it as llama
        cfg.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_local_experts=get("expert_count"),
            num_experts_per_tok=get("expert_used_count"),
        )
    elif arch == "llama":
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    elif arch in FAMILY_CONFIG:  # the families declared below: metadata key -> config key
        hf_arch, model_type, keys, fixed = FAMILY_CONFIG[arch]
        cfg.update(architectures=[hf_arch], model_type=model_type, **fixed)
        cfg.update({hf: get(key) for key, hf in keys.items() if get(key) is not None})
        if arch in DERIVED:
            DERIVED[arch](cfg, get)
    else:
        raise GGUFError(
            f"GGUF architecture {arch!r} is not supported yet (supported: qwen3moe, qwen2moe, "
            f"llama/mixtral, {', '.join(FAMILY_CONFIG)})"
        )
    return cfg


# More families, each a declaration: (HF architecture, model_type, {metadata key under the
# architecture's prefix: config key}, fixed config values), with their tensor names in _PIECES.
# Values are what llama.cpp's converter writes (convert_hf_to_gguf.py) and its runtime assumes
# (llama-model.cpp: OLMoE's top-k weights are not renormalised).
FAMILY_CONFIG: dict[str, tuple[str, str, dict[str, str], dict[str, Any]]] = {
    "olmoe": (
        "OlmoeForCausalLM", "olmoe",
        {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok"},
        {"norm_topk_prob": False, "clip_qkv": None, "attention_bias": False},
    ),
    "granitemoe": (
        "GraniteMoeForCausalLM", "granitemoe",
        {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok",
         "attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
         "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"},
        {"attention_bias": False},
    ),
    # DeepSeek-V2 / V2-Lite / V3 (MLA). The converter writes MLA as MQA (head_count_kv 1,
    # key_length kv_lora_rank + rope dims); the per-head sizes are in key_length_mla /
    # value_length_mla and rope.dimension_count (_deepseek2 derives the rest)
    "deepseek2": (
        "DeepseekV2ForCausalLM", "deepseek_v2",
        {"expert_count": "n_routed_experts", "expert_used_count": "num_experts_per_tok",
         "expert_feed_forward_length": "moe_intermediate_size", "expert_shared_count": "n_shared_experts",
         "leading_dense_block_count": "first_k_dense_replace", "attention.q_lora_rank": "q_lora_rank",
         "attention.kv_lora_rank": "kv_lora_rank", "attention.value_length_mla": "v_head_dim",
         "rope.dimension_count": "qk_rope_head_dim", "expert_group_count": "n_group",
         "expert_group_used_count": "topk_group", "expert_weights_scale": "routed_scaling_factor",
         "expert_weights_norm": "norm_topk_prob"},
        {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
         "norm_topk_prob": False, "moe_layer_freq": 1, "attention_bias": False, "first_k_dense_replace": 0,
         "n_shared_experts": 0, "hidden_act": "silu"},
    ),
    # DeepSeek-V3.2 / V3.2-Exp: deepseek2's keys with the sparse-attention indexer's, the MTP block
    # kept last as glm4moe's (_deepseek32)
    "deepseek32": (
        "DeepseekV32ForCausalLM", "deepseek_v32",
        {"attention.indexer.head_count": "index_n_heads", "attention.indexer.key_length": "index_head_dim",
         "attention.indexer.top_k": "index_topk"},
        {},
    ),
    # Phi-3.5-MoE / Phi-mini-MoE (convert_hf_to_gguf's PhiMoeModel, a Phi3MiniModel): LayerNorm with
    # biases (its eps written as the rms eps), q/k/v/o biases; LongRoPE's factors are tensors
    # (rope_factors_long / _short, read by model_dir: rope_config). The file has no router keys:
    # sparsemixer's jitter_eps (router_jitter_noise) is 0.01 in both published configs
    # (llama.cpp routes PhiMoE with a plain softmax top-2 instead)
    "phimoe": (
        "PhimoeForCausalLM", "phimoe",
        {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok",
         "rope.scaling.original_context_length": "original_max_position_embeddings",
         "attention.sliding_window": "sliding_window"},
        {"attention_bias": True, "hidden_act": "silu", "router_jitter_noise": 0.01,
         "input_jitter_noise": 0.0},
    ),
    # GLM-4.5 / 4.6 / 4.5-Air. The converter keeps the MTP layer as the last block (block_count
    # counts it, nextn_predict_layers says how many): _glm4moe takes it off, the loader skips it
    "glm4moe": (
        "Glm4MoeForCausalLM", "glm4_moe",
        {"expert_count": "n_routed_experts", "expert_used_count": "num_experts_per_tok",
         "expert_feed_forward_length": "moe_intermediate_size", "expert_shared_count": "n_shared_experts",
         "leading_dense_block_count": "first_k_dense_replace", "expert_group_count": "n_group",
         "expert_group_used_count": "topk_group", "expert_weights_scale": "routed_scaling_factor",
         "expert_weights_norm": "norm_topk_prob"},
        {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
         "first_k_dense_replace": 0, "n_shared_experts": 0, "hidden_act": "silu"},
    ),
    # gpt-oss (conversion/gpt_oss.py; llama.cpp's LLM_ARCH_OPENAI_MOE): the file has no layer
    # types, swiglu limit or YaRN truncation: _gpt_oss sets what llama.cpp assumes and the
    # published config says
    "gpt-oss": (
        "GptOssForCausalLM", "gpt_oss",
        {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok",
         "expert_feed_forward_length": "intermediate_size", "attention.sliding_window": "sliding_window"},
        {"attention_bias": True, "hidden_act": "silu", "swiglu_limit": 7.0, "router_aux_loss_coef": 0.9},
    ),
    # Llama 4 text (Scout, Maverick; conversion/llama.py's Llama4Model): what llama.cpp hard-codes
    # for it and the published configs say (chunks of 8192, temperature tuning with floor 8192
    # and scale 0.1) is fixed here; _llama4 derives the layer pattern, the q/k norm and the MoE layers
    "llama4": (
        "Llama4ForCausalLM", "llama4_text",
        {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok",
         "expert_feed_forward_length": "intermediate_size", "feed_forward_length": "intermediate_size_mlp",
         "interleave_moe_layer_step": "interleave_moe_layer_step"},
        {"attention_bias": False, "hidden_act": "silu", "attention_chunk_size": 8192,
         "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1, "router_jitter_noise": 0.0,
         "interleave_moe_layer_step": 1},
    ),
}  # fmt: skip
FAMILY_CONFIG["deepseek32"][2].update(FAMILY_CONFIG["deepseek2"][2])
FAMILY_CONFIG["deepseek32"][3].update(FAMILY_CONFIG["deepseek2"][3])
# config flags read off the tensors present (gguf_model_dir): config key -> a tensor's name
TENSOR_FLAGS = {
    "glm4moe": {"attention_bias": "blk.0.attn_q.bias", "use_qk_norm": "blk.0.attn_q_norm.weight"},
    "phimoe": {"lm_head_bias": "output.bias"},
}
# tensors that are config, not weights: the loader skips them (LongRoPE's factors: rope_config)
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")


def rope_config(meta: dict[str, Any], factors: dict[str, list[float]]) -> dict[str, Any] | None:
    """LongRoPE from the converter's rope_factors_long / _short tensors: one attention factor for
    both lengths (`rope.scaling.attn_factor`; the converter computes sqrt(1 + ln s / ln original),
    which is not every published config's mscale: Phi-3.5-MoE's says 1.243 where this gives 1.190;
    llama.cpp runs the file with the factor it holds, and so do we)."""
    if "rope_freqs.weight" in factors:  # llama3's scaling as llama.cpp's per-frequency divisors
        return rope_freqs(meta, factors["rope_freqs.weight"])
    if "rope_factors_long.weight" not in factors:
        return None
    arch = meta["general.architecture"]
    attn = meta.get(f"{arch}.rope.scaling.attn_factor", 1.0)
    return {
        "type": "longrope",
        "long_factor": factors["rope_factors_long.weight"],
        "short_factor": factors["rope_factors_short.weight"],
        "original_max_position_embeddings": meta.get(f"{arch}.rope.scaling.original_context_length"),
        "long_mscale": attn,
        "short_mscale": attn,
    }


def rope_freqs(meta: dict[str, Any], freqs: list[float]) -> dict[str, Any]:
    """llama.cpp's `rope_freqs` tensor (the converter writes it for llama3-style scaling: each
    frequency's divisor, 1 for the short wavelengths, `factor` for the long, a blend between) as
    the frequencies llama.cpp computes, base^(-2i/d) / freqs[i], with no attention scaling: a
    LongRoPE of one factor list (the file keeps neither the llama3 parameters nor the original
    context length, only these divisors in float32)."""
    ctx = meta.get(f"{meta['general.architecture']}.context_length")
    return {"rope_type": "longrope", "long_factor": freqs, "short_factor": freqs,
            "original_max_position_embeddings": ctx, "long_mscale": 1.0, "short_mscale": 1.0}  # fmt: skip


def _glm4moe(cfg: dict[str, Any], get: Any) -> None:
    """glm4moe's derived values: the main layers (block_count less the MTP blocks), the partial
    rotary factor (rope.dimension_count of key_length), the published style's rope keys."""
    cfg["num_hidden_layers"] -= get("nextn_predict_layers") or 0
    cfg["num_nextn_predict_layers"] = 0  # the MTP blocks are not loaded from GGUF
    cfg["partial_rotary_factor"] = get("rope.dimension_count") / get("attention.key_length")
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = None


def _deepseek2(cfg: dict[str, Any], get: Any) -> None:
    """deepseek2's derived values: MHA heads, the nope width, the router (expert_gating_func 2 =
    sigmoid: V3, with its exp_probs_b correction bias; else V2's softmax), YaRN from rope.scaling.*
    (llama.cpp keeps mscale_all_dim as yarn_log_multiplier = 0.1 * mscale_all_dim, and one mscale:
    both published configs have mscale equal to mscale_all_dim)."""
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    cfg.pop("head_dim", None)  # key_length is the MQA view's kv_lora_rank + rope dims
    # files from before the k_b / v_b split (attn_kv_b) wrote MHA sizes: key_length is nope + rope,
    # value_length v_head_dim, and no *_mla keys
    old = get("attention.key_length_mla") is None
    cfg["qk_nope_head_dim"] = (
        get("attention.key_length" if old else "attention.key_length_mla") - cfg["qk_rope_head_dim"]
    )
    if old:
        cfg["v_head_dim"] = get("attention.value_length")
    if get("expert_gating_func") == 2:
        cfg.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", scoring_func="sigmoid",
                   topk_method="noaux_tc")  # fmt: skip
    else:
        grouped = cfg["n_group"] > 1
        cfg.update(scoring_func="softmax", topk_method="group_limited_greedy" if grouped else "greedy")
    cfg.pop("rope_parameters", None)  # the published style: rope_theta beside rope_scaling
    if get("rope.scaling.type") == "yarn":
        # a float32 in the file: rounded back to the config's decimals (0.707, 1.0)
        mscale = round((get("rope.scaling.yarn_log_multiplier") or 0.0) / 0.1, 6)
        cfg["rope_scaling"] = {
            "type": "yarn", "factor": get("rope.scaling.factor"),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
            "beta_fast": get("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": get("rope.scaling.yarn_beta_slow", 1.0),
            "mscale": mscale, "mscale_all_dim": mscale,
        }  # fmt: skip


def _deepseek32(cfg: dict[str, Any], get: Any) -> None:
    _deepseek2(cfg, get)
    cfg.update(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32")
    cfg["num_hidden_layers"] -= get("nextn_predict_layers") or 0
    cfg["num_nextn_predict_layers"] = 0  # the MTP blocks are not loaded from GGUF


def _gpt_oss(cfg: dict[str, Any], get: Any) -> None:
    """gpt-oss's derived values. Layer types: llama.cpp's sliding-window pattern (an array of
    flags, or a period n: layer il slides when il % n < n - 1; absent: 2, the published
    alternation sliding / full). YaRN from rope.scaling.*, untruncated as the published config
    (`truncate: false`, OpenAI's reference): llama.cpp's YaRN floors / ceils the correction range."""
    layers = cfg["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern", 2)
    if hasattr(pattern, "__len__"):  # an array of flags (a numpy array from the reader)
        slides = [bool(x) for x in pattern][:layers]
    else:
        slides = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in slides]
    cfg["experts_per_token"] = cfg["num_experts_per_tok"]
    cfg.pop("rope_parameters", None)  # the published style: rope_theta beside rope_scaling
    if get("rope.scaling.type") == "yarn":
        cfg["rope_scaling"] = {
            "rope_type": "yarn", "factor": get("rope.scaling.factor"),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
            "beta_fast": get("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": get("rope.scaling.yarn_beta_slow", 1.0), "truncate": False,
        }  # fmt: skip
        cfg["initial_context_length"] = get("rope.scaling.original_context_length")


def _llama4(cfg: dict[str, Any], get: Any) -> None:
    """Llama 4's derived values, as llama.cpp's llama4 loader sets them: MoE layers every
    interleave_moe_layer_step-th ((i + 1) % step == 0); a file with attention.sliding_window 0
    (MobileLLM) has neither chunks nor NoPE layers; otherwise the chunked layers follow
    attention.sliding_window_pattern (absent: 4, three chunked then one global) and the NoPE layers
    are every fourth (n_no_rope_layer_step); the weightless q/k L2 norm is on unless the model has
    128 experts (Maverick's published config says use_qk_norm false, Scout's true). The llama3 RoPE
    scaling is a tensor, rope_freqs (rope_config)."""
    layers, step = cfg["num_hidden_layers"], cfg["interleave_moe_layer_step"]
    cfg["moe_layers"] = [i for i in range(layers) if step > 0 and (i + 1) % step == 0]
    if get("attention.sliding_window") == 0:
        chunked, rope = [False] * layers, [1] * layers
        cfg["attention_chunk_size"] = None
    else:
        pattern = get("attention.sliding_window_pattern", 4)
        if hasattr(pattern, "__len__"):  # an array of flags (a numpy array from the reader)
            chunked = [bool(x) for x in pattern][:layers]
        else:
            chunked = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
        rope = [int((i + 1) % 4 != 0) for i in range(layers)]
    cfg["layer_types"] = ["chunked_attention" if c else "full_attention" for c in chunked]
    cfg["no_rope_layers"] = rope
    cfg["use_qk_norm"] = cfg["num_local_experts"] != 128


DERIVED = {
    "llama4": _llama4,
    "deepseek2": _deepseek2,
    "deepseek32": _deepseek32,
    "glm4moe": _glm4moe,
    "gpt-oss": _gpt_oss,
}
