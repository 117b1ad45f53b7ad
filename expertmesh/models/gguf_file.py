"""GGUF files (llama.cpp's format) as a model: config, tokenizer and tensors under HF names.

`LLM(model="file.gguf")`, a directory holding one, or the first part of a split set
(`name-00001-of-00003.gguf`) resolves to a small directory beside the cache (`gguf_model_dir`):
config.json made from the file's metadata, the tokenizer transformers builds from it, and
`gguf.json` naming the weight files. The loader (models/loader.py) then opens each GGUF file as a
`GGUFTensorFile`: its tensors renamed from llama.cpp's names to the HF checkpoint names the family
expects (stacked `ffn_*_exps` expert tensors served one expert at a time, so an EP rank reads only
its experts' bytes), llama.cpp's Q/K row permutation undone for llama-style architectures.
Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K matrices are held as stored (codes, with the scales and
offsets our int8 / int4 group kinds take, exactly: HELD, decode_blocks); every other type is
dequantized with `gguf.quants.dequantize` (the format's own dequantizer) for just the rows a rank
asks for. The file is read through gguf's memory map: only touched pages are read. Families are
declarations (FAMILY_CONFIG, DERIVED, TENSOR_FLAGS, _PIECES) beside the older branches of
hf_config; DeepSeek's MLA kv_b_proj is rebuilt from llama.cpp's split attn_k_b / attn_v_b
(KvBTensor), GLM's trailing MTP block skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from expertmesh.layers.quantization.view import LogicalTensor

log = logging.getLogger("expertmesh")

SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")
MARKER = "gguf.json"


class GGUFError(ValueError):
    pass


# ---- which files --------------------------------------------------------------------------------
def is_gguf(model: str | None) -> bool:
    """A .gguf file, or a directory holding one and no config.json."""
    if model is None:
        return False
    if os.path.isfile(model):
        return model.endswith(".gguf")
    if os.path.isdir(model) and not os.path.exists(os.path.join(model, "config.json")):
        return any(n.endswith(".gguf") for n in os.listdir(model))
    return False


def gguf_files(model: str) -> list[str]:
    """Every part of the model: one file, or all parts of a split set (named by any part)."""
    if os.path.isdir(model):
        names = sorted(n for n in os.listdir(model) if n.endswith(".gguf"))
        firsts = [n for n in names if not SPLIT.match(n) or SPLIT.match(n).group(2) == "00001"]
        if len(firsts) != 1:
            raise GGUFError(f"directory {model!r} holds {len(firsts)} GGUF models ({firsts}); name the file")
        model = os.path.join(model, firsts[0])
    m = SPLIT.match(os.path.basename(model))
    if not m:
        return [model]
    base, count = os.path.join(os.path.dirname(model), m.group(1)), int(m.group(3))
    parts = [f"{base}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [p for p in parts if not os.path.exists(p)]
    if missing:
        raise GGUFError(f"split GGUF {model!r}: missing parts {missing}")
    return parts


# ---- config from metadata -----------------------------------------------------------------------
def _fields(reader: Any) -> dict[str, Any]:
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name not in ("tokenizer.ggml.model",):
            continue  # large arrays: the tokenizer is built by transformers
        try:
            out[name] = field.contents()
        except Exception:  # an unreadable field is simply not used
            continue
    return out


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
}  # fmt: skip
FAMILY_CONFIG["deepseek32"][2].update(FAMILY_CONFIG["deepseek2"][2])
FAMILY_CONFIG["deepseek32"][3].update(FAMILY_CONFIG["deepseek2"][3])
# config flags read off the tensors present (gguf_model_dir): config key -> a tensor's name
TENSOR_FLAGS = {"glm4moe": {"attention_bias": "blk.0.attn_q.bias", "use_qk_norm": "blk.0.attn_q_norm.weight"}}


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


DERIVED = {"deepseek2": _deepseek2, "deepseek32": _deepseek32, "glm4moe": _glm4moe}


# ---- names --------------------------------------------------------------------------------------
# llama.cpp's name piece -> the HF checkpoint's piece, per architecture; `{moe}` is the MoE block.
_ATTN = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# stacked expert tensors: llama.cpp piece -> (HF MoE block, per-expert projection name)
_EXPERTS = {
    "qwen": {"ffn_gate_exps": ("mlp", "gate_proj"), "ffn_up_exps": ("mlp", "up_proj"),
             "ffn_down_exps": ("mlp", "down_proj")},
    "llama": {"ffn_gate_exps": ("block_sparse_moe", "w1"), "ffn_up_exps": ("block_sparse_moe", "w3"),
              "ffn_down_exps": ("block_sparse_moe", "w2")},
}  # fmt: skip
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK = re.compile(r"^blk\.(\d+)\.([\w.]+)\.(weight|bias)$")  # pieces may be dotted: indexer.attn_k


_GRANITE_EXPERTS = {"ffn_gate_exps": ("block_sparse_moe", "gate_proj"),
                    "ffn_up_exps": ("block_sparse_moe", "up_proj"),
                    "ffn_down_exps": ("block_sparse_moe", "down_proj")}  # fmt: skip
# DeepSeek's MLA pieces; attn_k_b / attn_v_b (newer converters split kv_b_proj) are recombined into
# kv_b_proj (KV_B); an older file's attn_kv_b is kv_b_proj as is
_MLA = {
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
}  # fmt: skip
# DeepSeek's and GLM's MoE block: the router, V3's / GLM's correction bias, the shared experts
_DS_MOE = {
    "ffn_gate_inp": "mlp.gate", "exp_probs_b": "mlp.gate.e_score_correction",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}  # fmt: skip
KV_B = ("attn_k_b", "attn_v_b")
# DeepSeek-V3.2's lightning indexer
_INDEXER = {
    "indexer.attn_q_b": "self_attn.indexer.wq_b", "indexer.attn_k": "self_attn.indexer.wk",
    "indexer.k_norm": "self_attn.indexer.k_norm", "indexer.proj": "self_attn.indexer.weights_proj",
}  # fmt: skip
# per architecture: (llama.cpp piece -> HF piece, stacked experts)
_PIECES = {
    "deepseek2": ({**_ATTN, **_MLA, **_DS_MOE}, _EXPERTS["qwen"]),
    "deepseek32": ({**_ATTN, **_MLA, **_DS_MOE, **_INDEXER}, _EXPERTS["qwen"]),
    "glm4moe": ({**_ATTN, **_DS_MOE, "post_attention_norm": "post_attention_layernorm"}, _EXPERTS["qwen"]),
    "qwen2moe": ({**_ATTN, **_QWEN}, _EXPERTS["qwen"]),
    "qwen3moe": ({**_ATTN, **_QWEN}, _EXPERTS["qwen"]),
    "olmoe": ({**_ATTN, **_QWEN}, _EXPERTS["qwen"]),
    # the converter splits Granite's fused input_linear into gate and up: served per expert
    "granitemoe": ({**_ATTN, "ffn_gate_inp": "block_sparse_moe.gate"}, _GRANITE_EXPERTS),
}


def _pieces(arch: str) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    return _PIECES.get(arch) or ({**_ATTN, "ffn_gate_inp": "block_sparse_moe.gate"}, _EXPERTS["llama"])


# ---- tensors ------------------------------------------------------------------------------------
def _undo_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of llama.cpp's converter `permute` (rotary halves interleaved per head)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


# Types held as stored in our int8 / int4 group kinds (layers/quantization/held.py): W = code * s + o
# per group, bit for bit gguf's dequantization. Each product code * s is exact in float32 (an fp16
# scale, times a K-quant's 6-bit sub-block scale, times a code of at most 8 bits needs at most 24
# bits), so the one rounding left is the offset's add, the same one gguf makes:
#   Q8_0 = d * q (q int8): int8 codes q, scale d, offset 0, groups of 32
#   Q4_0 = d * (q - 8) (q 0..15): int4 codes q, scale d, offset -8 d (exact: d * (q - 8) is)
#   Q4_1 = d * q + m: int4 codes q, scale d, offset m
#   Q4_K = (d * sc_j) * q - dmin * m_j, 8 sub-blocks of 32 in a super-block of 256: int4 codes q,
#          scale d * sc_j, offset -(dmin * m_j) per 32
#   Q5_K = the same with 5-bit codes: held in the int8 kind (codes 0..31; no 5-bit kernel)
#   Q6_K = (d * sc_j) * (q - 32), 16 sub-blocks of 16 (sc_j int8): int8 codes q - 32, scale
#          d * sc_j, offset 0, groups of 16
HELD = {
    "Q8_0": ("int8", 32), "Q4_0": ("int4", 32), "Q4_1": ("int4", 32),
    "Q4_K": ("int4", 32), "Q5_K": ("int8", 32), "Q6_K": ("int8", 16),
}  # fmt: skip
FLOAT_TYPES = ("F32", "F16", "BF16")
DEQUANT_ROWS = 4096  # rows dequantized per call of gguf's dequantizer
# parameters the model fuses (qkv, gate+up, an expert's gate/up and down pair): their parts must be
# held in one kind and group, so a mix (Q4_K_M's Q4_K gate/up with a Q6_K down) is held as int8
FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), ("ffn_gate_shexp", "ffn_up_shexp"),
         ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))  # fmt: skip


def held_kinds(tensors: dict[str, str]) -> dict[str, tuple[str, int]]:
    """{tensor name: (kind, group)} for the held tensors of a fused parameter whose parts' types map
    onto different kinds or groups: all in int8 with the smallest group (codes and scales exact)."""
    out: dict[str, tuple[str, int]] = {}
    layers: dict[str, dict[str, str]] = {}
    for name, qtype in tensors.items():
        m = BLOCK.match(name)
        if m and m.group(3) == "weight":
            layers.setdefault(m.group(1), {})[m.group(2)] = qtype
    for layer, pieces in layers.items():
        for fused in FUSED:
            types = {p: pieces[p] for p in fused if p in pieces}
            kinds = {HELD.get(t) for t in types.values()}
            if len(kinds) > 1 and None not in kinds:
                widened = ("int8", min(g for _, g in kinds))
                out.update({f"blk.{layer}.{p}.weight": widened for p in types})
    return out


def _half(raw: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of every block, as float32."""
    return np.ascontiguousarray(raw[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[..., n] bytes -> [..., 2n] codes: each run of `width` bytes gives its low nibbles, then its high."""
    lead = qs.shape[:-1]
    q = qs.reshape(*lead, -1, 1, width) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (q & 0x0F).reshape(*lead, -1)


def decode_blocks(qtype: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks [..., n, bytes] of a held type -> codes [..., n * QK] uint8 (int8 kinds: the bytes of
    int8 values) and float32 scales, offsets [..., n * QK / group] with W = code * scale + offset
    exactly gguf.quants.dequantize's W (the field layouts are gguf's own, gguf/quants.py)."""
    from gguf.quants import Q4_K

    lead = raw.shape[:-1]
    flat = (*lead[:-1], -1)
    if qtype == "Q8_0":
        d = _half(raw, 0)
        return raw[..., 2:].reshape(flat), d.reshape(flat), np.zeros_like(d).reshape(flat)
    if qtype in ("Q4_0", "Q4_1"):
        d = _half(raw, 0)
        codes = _nibbles(raw[..., 4 if qtype == "Q4_1" else 2 :], 16)
        offset = _half(raw, 2) if qtype == "Q4_1" else -8 * d
        return codes.reshape(flat), d.reshape(flat), offset.reshape(flat)
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _half(raw, 0)[..., None], _half(raw, 2)[..., None]
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(raw[..., 4:16]).reshape(-1, 12))
        scales = d * sc.reshape(*lead, 8).astype(np.float32)
        offsets = -(dmin * m.reshape(*lead, 8).astype(np.float32))
        if qtype == "Q4_K":
            codes = _nibbles(raw[..., 16:144], 32)
        else:  # the fifth bit of sub-block j is bit j of qh's byte k (k = position in the sub-block)
            qh = raw[..., 16:48].reshape(*lead, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            codes = _nibbles(raw[..., 48:176], 32) | ((qh & 1) << 4).reshape(*lead, 256)
        return codes.reshape(flat), scales.reshape(flat), offsets.reshape(flat)
    if qtype == "Q6_K":
        ql = _nibbles(raw[..., :128], 64)
        qh = raw[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        q = (ql | ((qh & 3).reshape(*lead, 256) << 4)).astype(np.int16) - 32
        scales = _half(raw, 208)[..., None] * raw[..., 192:208].view(np.int8).astype(np.float32)
        return (
            q.astype(np.int8).view(np.uint8).reshape(flat),
            scales.reshape(flat),
            np.zeros_like(scales).reshape(flat),
        )
    raise ValueError(f"GGUF {qtype} is not a held type")


class GGUFTensor(LogicalTensor):
    """One GGUF tensor (or one expert of a stacked one) in HF orientation [out, in]; indexing reads
    and dequantizes only the rows asked for (whole heads for a permuted Q/K weight). Matrices of the
    HELD types say how they map onto our held kinds (`held_kind`, `quantized`); `kind` overrides
    the type's own (a fused parameter's parts held alike: held_kinds)."""

    def __init__(
        self,
        data: np.ndarray,
        qtype: Any,
        shape: tuple[int, ...],
        key: str,
        permute: int = 0,
        kind: tuple[str, int] | None = None,
    ):
        from gguf import GGMLQuantizationType as Q

        self.data, self.qtype, self.shape, self.base, self.permute = data, qtype, shape, key, permute
        self.dtype = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(qtype, torch.float32)
        name = qtype.name
        # why a tensor is not held, for held.plan's log line (None: a float tensor, nothing to say)
        self.unheld_reason = None if name in FLOAT_TYPES else f"GGUF {name}: no kernel holds it, dequantized"
        if name in HELD and len(shape) == 2:
            if key.startswith(("lm_head", "model.embed")):  # the head's kernels are not the held ones
                self.unheld_reason = f"GGUF {name} embedding / head: dequantized"
            elif permute:
                self.unheld_reason = f"GGUF {name} Q/K rows permuted by llama.cpp: dequantized"
            else:
                self.held_kind, self.unheld_reason = tuple(kind or HELD[name]), None

    def quantized(self, rows: tuple[int, int], cols: tuple[int, int], group: int, g0: int) -> tuple:
        """Codes [o, i] uint8, scales and offsets [o, groups] float32 of the region: the blocks that
        cover it decoded (decode_blocks), the scales repeated to the held group, then cut."""
        from gguf import GGML_QUANT_SIZES

        (o0, o1), (i0, i1) = rows, cols
        qk, size = GGML_QUANT_SIZES[self.qtype]
        held = self.held_kind[1]
        b0, b1 = i0 // qk, -(-i1 // qk)
        c0, c1 = i0 - b0 * qk, i1 - b0 * qk
        # whole groups, or (group = the region: a rank's part of a row of one group) inside one
        if (group == held and c0 % held) or (group != held and c0 // held != (c1 - 1) // held):
            raise ValueError(
                f"{self.base}: GGUF {self.qtype.name} is held in groups of {held}; asked {group} at {i0}"
            )
        raw = np.array(np.asarray(self.data[o0:o1]).reshape(o1 - o0, -1, size)[:, b0:b1])  # off the map
        codes, scales, offsets = decode_blocks(self.qtype.name, raw)
        native = HELD[self.qtype.name][1]
        if native != held:  # a fused parameter held in smaller groups than this type's own
            scales, offsets = (np.repeat(t, native // held, axis=-1) for t in (scales, offsets))
        g1 = -(-c1 // held) if group == held else c0 // held + 1
        pick = lambda t: torch.from_numpy(np.ascontiguousarray(t[:, c0 // held : g1]))
        return torch.from_numpy(np.ascontiguousarray(codes[:, c0:c1])), pick(scales), pick(offsets)

    def _rows(self, r0: int, r1: int) -> torch.Tensor:
        from gguf import GGMLQuantizationType as Q
        from gguf.quants import dequantize

        raw = np.asarray(self.data[r0:r1] if self.shape else self.data)
        if self.qtype in (Q.F32, Q.F16):
            return torch.from_numpy(raw.copy())
        if self.qtype == Q.BF16:
            return torch.from_numpy(raw.copy()).view(torch.int16).view(torch.bfloat16)
        if raw.ndim < 2 or len(raw) <= DEQUANT_ROWS:
            return torch.from_numpy(dequantize(raw, self.qtype).astype(np.float32, copy=False))
        # a few thousand rows at a time: gguf's dequantizer makes several float32 temporaries the
        # size of its input's values, which for a 150K-row embedding would be gigabytes
        first = dequantize(raw[:DEQUANT_ROWS], self.qtype)
        out = np.empty((len(raw), *first.shape[1:]), np.float32)
        out[:DEQUANT_ROWS] = first
        for r in range(DEQUANT_ROWS, len(raw), DEQUANT_ROWS):
            out[r : r + DEQUANT_ROWS] = dequantize(raw[r : r + DEQUANT_ROWS], self.qtype)
        return torch.from_numpy(out)

    def materialize(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        if not bounds:
            return self._rows(0, 0).reshape(())
        (r0, r1), rest = bounds[0], bounds[1:]
        if self.permute:  # rows mix within a head: un-permute the whole tensor, then cut
            t = _undo_permute(self._rows(0, self.shape[0]), self.permute)[r0:r1]
        else:
            t = self._rows(r0, r1)
        t = t.reshape(r1 - r0, *self.shape[1:])
        return t[(slice(None), *(slice(a, b) for a, b in rest))].contiguous() if rest else t


_READERS: dict[tuple, Any] = {}


def open_reader(path: str) -> Any:
    """gguf's reader of one file, parsed once a process: the parse walks every metadata field, and a
    150K-token vocabulary makes that tens of seconds (the memory map itself is cheap)."""
    from gguf import GGUFReader

    key = (os.path.abspath(path), os.path.getsize(path), os.path.getmtime(path))
    if key not in _READERS:
        _READERS[key] = GGUFReader(path, "r")
    return _READERS[key]


class GGUFTensorFile:
    """One GGUF file's tensors under HF names (the part of safe_open the loader uses)."""

    def __init__(self, path: str, info: dict[str, Any]) -> None:

        self.path = path
        try:
            self.reader = open_reader(path)
        except Exception as exc:
            raise GGUFError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        self.tensors: dict[str, tuple[Any, int | None, int]] = {}  # key -> (tensor, expert, heads)
        arch, heads, kv = info["arch"], info["num_attention_heads"], info["num_key_value_heads"]
        pieces, experts = _pieces(arch)
        self.kinds = {k: tuple(v) for k, v in info.get("held_kinds", {}).items()}
        unheld: dict[str, int] = {}
        for t in self.reader.tensors:
            if t.tensor_type.name not in (*FLOAT_TYPES, *HELD):
                unheld[t.tensor_type.name] = unheld.get(t.tensor_type.name, 0) + 1
        for qtype, count in sorted(unheld.items()):  # one line a type: what it costs
            log.info(
                "GGUF %s: %d %s tensors dequantized to float at load (no kernel of ours holds %s; "
                "held as stored: %s)", os.path.basename(path), count, qtype, qtype, ", ".join(HELD),
            )  # fmt: skip
        self.kv_b: dict[str, dict[str, Any]] = {}  # kv_b_proj key -> {attn_k_b: t, attn_v_b: t}
        for t in self.reader.tensors:
            name, hf = t.name, None
            top = name.rsplit(".", 1)
            if top[0] in _TOP:
                hf = f"{_TOP[top[0]]}.{top[1]}"
            if _mtp_block(name, info.get("num_hidden_layers")):
                continue  # an MTP block after the main layers (glm4moe): not loaded
            m = BLOCK.match(name)
            if m:
                layer, piece, kind = m.groups()
                if piece in KV_B and arch in _PIECES and "attn_kv_b" in _PIECES[arch][0]:
                    self.kv_b.setdefault(f"model.layers.{layer}.self_attn.kv_b_proj.{kind}", {})[piece] = t
                    continue
                if piece in experts:
                    block, proj = experts[piece]
                    for e in range(int(t.shape[-1])):
                        key = f"model.layers.{layer}.{block}.experts.{e}.{proj}.{kind}"
                        self.tensors[key] = (t, e, 0)
                    continue
                if piece in pieces:
                    # the converter's `e_score_correction.bias` is the checkpoint's `_bias`
                    hf = f"model.layers.{layer}.{pieces[piece]}.{kind}".replace(
                        "correction.bias", "correction_bias"
                    )
            if hf is None:
                raise GGUFError(f"{path}: tensor {name!r} has no HF name for architecture {arch!r}")
            permute = 0
            if arch == "llama" and piece_of(name) in ("attn_q", "attn_k") and name.endswith(".weight"):
                permute = heads if piece_of(name) == "attn_q" else kv
            self.tensors[hf] = (t, None, permute)
        for key, parts in self.kv_b.items():
            if len(parts) != 2:
                raise GGUFError(f"{path}: {key} needs attn_k_b and attn_v_b; the file has only {list(parts)}")
            self.tensors[key] = (parts["attn_k_b"], None, 0)

    def __enter__(self) -> GGUFTensorFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.reader = None

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_slice(self, key: str) -> GGUFTensor:
        if key not in self.tensors:
            raise KeyError(f"{self.path} has no tensor {key!r}")
        t, e, permute = self.tensors[key]
        if key in self.kv_b:
            k_b, v_b = (self.kv_b[key][p] for p in KV_B)
            return KvBTensor(*(GGUFTensor(x.data, x.tensor_type, _shape(x), key) for x in (k_b, v_b)))
        kind = self.kinds.get(t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # numpy order: HF's [out, in]
        data = t.data
        if e is not None:
            shape, data = shape[1:], data[e]
        elif key.endswith("shared_expert_gate.weight") and len(shape) == 1:  # llama.cpp: a vector [H]
            shape, data = (1, *shape), data[None]
        return GGUFTensor(data, t.tensor_type, shape, key, permute, kind)


def _mtp_block(name: str, layers: int | None) -> bool:
    m = re.match(r"^blk\.(\d+)\.", name)
    return bool(m and layers is not None and int(m.group(1)) >= layers)


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))


class KvBTensor(LogicalTensor):
    """kv_b_proj [H * (nope + v), kv_lora_rank] from llama.cpp's split attn_k_b [H, rank, nope] (kv_b's
    k rows transposed for its absorbed attention) and attn_v_b [H, v, rank]: per head the k rows
    (k_b's transpose) then the v rows, as the checkpoint has them. The model keeps kv_b_proj in float
    (MLA relays it into per-head W_UK / W_UV), so both parts are dequantized."""

    def __init__(self, k_b: GGUFTensor, v_b: GGUFTensor) -> None:
        heads, rank, nope = k_b.shape
        v = v_b.shape[1]
        if v_b.shape != (heads, v, rank):
            raise GGUFError(f"{k_b.base}: attn_k_b {k_b.shape} and attn_v_b {v_b.shape} do not pair")
        self.k_b, self.v_b, self.base = k_b, v_b, k_b.base
        self.shape, self.dtype = (heads * (nope + v), rank), k_b.dtype
        self.unheld_reason = "GGUF kv_b_proj from attn_k_b / attn_v_b: dequantized"

    def materialize(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        k = self.k_b.materialize([(0, s) for s in self.k_b.shape]).transpose(1, 2)
        v = self.v_b.materialize([(0, s) for s in self.v_b.shape])
        w = torch.cat([k, v], dim=1).reshape(self.shape)
        return w[tuple(slice(a, b) for a, b in bounds)].contiguous()


def piece_of(name: str) -> str:
    m = BLOCK.match(name)
    return m.group(2) if m else ""


# ---- the weight format --------------------------------------------------------------------------
@dataclass(frozen=True)
class GGUFFormat:
    """quantization_config {"quant_method": "gguf"}: matrices of the HELD types held as int8 / int4
    codes with a scale and offset per group (32, Q6_K 16); every other type dequantized at load."""

    held_types: tuple[str, ...] = ()
    method: str = "gguf"
    online: bool = False
    holds_compressed = True

    @classmethod
    def from_config(cls, cfg: dict) -> GGUFFormat:
        return cls(tuple(cfg.get("held_types", ())))

    def describe(self) -> str:
        return f"gguf, {'/'.join(self.held_types) or 'no'} matrices held as int codes"

    def name(self) -> str:
        return "gguf"

    def view(self, handles: dict[str, Any]) -> Any:
        from expertmesh.layers.quantization.view import CheckpointView

        class GGUFView(CheckpointView):
            def get_slice(self, key: str) -> Any:  # codes where the plan holds the key
                return self.serve(key, self.stored(key))

        return GGUFView(handles)


# ---- the model directory ------------------------------------------------------------------------
def _cache_root() -> str:
    if os.environ.get("EXPERTMESH_GGUF_DIR"):
        return os.environ["EXPERTMESH_GGUF_DIR"]
    root = os.environ.get("EXPERTMESH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "expertmesh"
    )
    return os.path.join(root, "gguf")


def gguf_model_dir(model: str) -> str:
    """A directory the engine loads like a checkpoint: config.json, tokenizer, gguf.json."""

    files = [os.path.abspath(p) for p in gguf_files(model)]
    stamp = json.dumps([(p, os.path.getsize(p), os.path.getmtime(p)) for p in files])
    out = os.path.join(_cache_root(), hashlib.sha256(stamp.encode()).hexdigest()[:16])
    if os.path.exists(os.path.join(out, MARKER)):
        return out
    try:
        reader = open_reader(files[0])
    except Exception as exc:
        raise GGUFError(f"{files[0]}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    meta = _fields(reader)
    cfg = hf_config(meta)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    for p in files[1:]:
        types.update({t.name: t.tensor_type.name for t in open_reader(p).tensors})
    names = set(types)
    cfg["tie_word_embeddings"] = "output.weight" not in names
    if cfg.get("vocab_size") is None:
        emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
        cfg["vocab_size"] = int(emb.shape[-1])
    if cfg["architectures"][0] == "Qwen2MoeForCausalLM":
        cfg["qkv_bias"] = "blk.0.attn_q.bias" in names
    for key, tensor in TENSOR_FLAGS.get(meta["general.architecture"], {}).items():
        cfg[key] = tensor in names
    cfg["torch_dtype"] = "float32"
    held = sorted(set(types.values()) & set(HELD))
    if held:  # the loader holds these codes as stored (GGUFFormat); quantization="dequantize" does not
        cfg["quantization_config"] = {"quant_method": "gguf", "held_types": held}
    os.makedirs(out, exist_ok=True)
    tmp = f"{out}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    _write_tokenizer(files[0], tmp)
    info = {
        "files": files,
        "arch": meta["general.architecture"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "held_kinds": held_kinds(
            {n: t for n, t in types.items() if not _mtp_block(n, cfg["num_hidden_layers"])}
        ),
    }
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(info, f, indent=1)
    for n in sorted(os.listdir(tmp), key=lambda n: n == MARKER):  # the marker last: complete
        os.replace(os.path.join(tmp, n), os.path.join(out, n))
    os.rmdir(tmp)
    log.info("GGUF %s: %s, config and tokenizer in %s", files[0], cfg["architectures"][0], out)
    return out


def _write_tokenizer(path: str, out: str) -> None:
    """transformers' tokenizer from the GGUF metadata, saved as files AutoTokenizer reads."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        tok.save_pretrained(out)
    except Exception as exc:  # a tokenizer transformers cannot build: token ids, or tokenizer=
        log.warning("GGUF %s: no tokenizer from its metadata (%s); pass tokenizer= to use text", path, exc)


def gguf_info(model_dir: str) -> dict[str, Any] | None:
    marker = os.path.join(model_dir, MARKER)
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        return json.load(f)
