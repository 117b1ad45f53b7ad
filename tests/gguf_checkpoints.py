"""Tiny GGUF files written from tiny HF checkpoints with `gguf.GGUFWriter`, named and laid out the
way llama.cpp's convert_hf_to_gguf.py writes them (experts stacked as ffn_*_exps [E, I, H], llama's
Q/K rows permuted), matrices quantized with `gguf.quants.quantize`."""

from __future__ import annotations

import json
import math
import os

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

ATTN = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}  # fmt: skip
EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
          "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}  # fmt: skip
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe",
        "granitemoe": "granitemoe"}  # fmt: skip
ATTN["block_sparse_moe.router.layer"] = "ffn_gate_inp"  # Granite's router
ARCH["phimoe"] = "phimoe"
ARCH.update(deepseek_v2="deepseek2", deepseek_v3="deepseek2", deepseek_v32="deepseek32", glm4_moe="glm4moe")
DEEPSEEK = ("deepseek2", "deepseek32")
# GLM-4.5's MTP block, which its converter keeps as the last block (blk.<n>.nextn.*)
ATTN.update({
    "eh_proj": "nextn.eh_proj", "embed_tokens": "nextn.embed_tokens", "enorm": "nextn.enorm",
    "hnorm": "nextn.hnorm", "shared_head.head": "nextn.shared_head_head",
    "shared_head.norm": "nextn.shared_head_norm", "self_attn.indexer.wq_b": "indexer.attn_q_b",
    "self_attn.indexer.wk": "indexer.attn_k", "self_attn.indexer.k_norm": "indexer.k_norm",
    "self_attn.indexer.weights_proj": "indexer.proj",
})  # fmt: skip
# DeepSeek (convert_hf_to_gguf.py's DeepseekV2Model): MLA pieces, dense leading layers' MLP, shared
# experts, V3's correction bias (written as exp_probs_b.bias); kv_b_proj split into k_b / v_b
ATTN.update({
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
})  # fmt: skip


def gpt_oss_metadata(w: gguf.GGUFWriter, cfg: dict, n_layers: int) -> None:
    """The `gpt-oss.*` keys llama.cpp's converter writes, from a config.json (YaRN as published)."""
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    yarn = cfg["rope_scaling"]
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(yarn["factor"]))
    w.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(float(yarn["beta_fast"]))
    w.add_rope_scaling_yarn_beta_slow(float(yarn["beta_slow"]))
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])


def _deepseek_tensors(
    piece: str, kind: str, w: np.ndarray, cfg: dict, legacy: bool = False
) -> list[tuple[str, str, np.ndarray]]:
    """(GGUF piece, kind, array) for DeepSeek's pieces the converter rewrites: kv_b_proj split per
    head into k_b [H, rank, nope] (transposed) and v_b [H, v, rank]; the correction bias."""
    if piece == "self_attn.kv_b_proj" and legacy:  # converters before the split: kv_b as it is
        return [("attn_kv_b", kind, w)]
    if piece == "self_attn.kv_b_proj":
        heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        kv_b = w.reshape(heads, nope + v, w.shape[-1])
        return [("attn_k_b", kind, np.ascontiguousarray(kv_b[:, :nope].swapaxes(1, 2))),
                ("attn_v_b", kind, np.ascontiguousarray(kv_b[:, nope:]))]  # fmt: skip
    if piece == "mlp.gate" and kind == "e_score_correction_bias":
        return [("exp_probs_b", "bias", w)]
    return []


def _load_state(hf_dir: str) -> dict[str, np.ndarray]:
    names = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    return {k: v.float().numpy() for n in names for k, v in load_file(os.path.join(hf_dir, n)).items()}


def _split_granite(sd: dict[str, np.ndarray], layers: int) -> None:
    """Granite's fused experts (input_linear [E, 2I, H], gate rows first; output_linear) as the
    converter writes them: per-projection stacks, here first as per-expert keys."""
    for layer in range(layers):
        p = f"model.layers.{layer}.block_sparse_moe."
        gate_up, down = sd.pop(p + "input_linear.weight"), sd.pop(p + "output_linear.weight")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            sd[f"{p}experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
            sd[f"{p}experts.{e}.up_proj.weight"] = gate_up[e, inter:]
            sd[f"{p}experts.{e}.down_proj.weight"] = down[e]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's `LlamaModel.permute`."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    hf_dir: str,
    out: str,
    qtype: str = "F32",
    split: int = 1,
    values: dict[str, torch.Tensor] | None = None,
    legacy_mla: bool = False,
) -> list[str]:
    """The checkpoint in hf_dir as GGUF; matrices (2-D and expert stacks) in `qtype`, vectors F32.
    `split` > 1 writes llama.cpp's split set (`-0000k-of-0000n.gguf`, tensors dealt in order).
    `values` ({GGUF name: tensor}, e.g. dequantized_state of another file) replaces the weights.
    `legacy_mla`: DeepSeek as converters before the k_b / v_b split wrote it (attn_kv_b, MHA sizes)."""
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    arch = ARCH[cfg["model_type"]]
    sd = _load_state(hf_dir)
    if arch == "granitemoe":
        _split_granite(sd, cfg["num_hidden_layers"])
    tensors: list[tuple[str, np.ndarray]] = [("token_embd.weight", sd.pop("model.embed_tokens.weight"))]
    tensors.append(("output_norm.weight", sd.pop("model.norm.weight")))
    if "lm_head.weight" in sd:
        tensors.append(("output.weight", sd.pop("lm_head.weight")))
    for hf, name in (("model.norm.bias", "output_norm.bias"), ("lm_head.bias", "output.bias")):  # PhiMoE
        if hf in sd:
            tensors.append((name, sd.pop(hf)))
    longrope = cfg.get("rope_scaling") or {}
    if arch == "phimoe" and longrope.get("long_factor"):  # the converter's LongRoPE factors (Phi3MiniModel)
        tensors.append(("rope_factors_long.weight", np.array(longrope["long_factor"], np.float32)))
        tensors.append(("rope_factors_short.weight", np.array(longrope["short_factor"], np.float32)))
    n_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    mtp = cfg.get("num_nextn_predict_layers", 0) if arch in ("glm4moe", "deepseek32") else 0  # kept last
    for layer in range(cfg["num_hidden_layers"] + mtp):
        p = f"model.layers.{layer}."
        for key in sorted(k for k in sd if k.startswith(p) and ".experts." not in k):
            piece, kind = key[len(p) :].rsplit(".", 1)
            w = sd[key]
            if arch in (*DEEPSEEK, "glm4moe") and (
                rewritten := _deepseek_tensors(piece, kind, w, cfg, legacy_mla)
            ):
                tensors += [(f"blk.{layer}.{name}.{k}", a) for name, k, a in rewritten]
                continue
            if arch == "llama" and piece in ("self_attn.q_proj", "self_attn.k_proj") and kind == "weight":
                heads = cfg["num_attention_heads"] if "q_proj" in piece else cfg["num_key_value_heads"]
                w = _permute(w, heads)
            if piece == "mlp.shared_expert_gate":
                w = w.reshape(-1)  # llama.cpp holds it as a vector [H]
            name = (
                "post_attention_norm"
                if (arch, piece) == ("glm4moe", "post_attention_layernorm")
                else ATTN[piece]
            )
            tensors.append((f"blk.{layer}.{name}.{kind}", w))
        block = "block_sparse_moe" if arch in ("llama", "granitemoe", "phimoe") else "mlp"
        for proj, name in EXPERT.items():
            keys = [f"{p}{block}.experts.{e}.{proj}.weight" for e in range(n_experts)]
            if keys[0] in sd:
                tensors.append((f"blk.{layer}.{name}.weight", np.stack([sd[k] for k in keys])))

    def add_meta(w: gguf.GGUFWriter) -> None:
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_embedding_length(cfg["hidden_size"])
        w.add_block_count(cfg["num_hidden_layers"] + mtp)
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(
            1 if arch in DEEPSEEK and not legacy_mla else cfg["num_key_value_heads"]
        )  # MLA as MQA
        w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-5))  # OLMoE: 1e-5 by default
        rope = cfg.get("rope_parameters") or {}
        w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
        w.add_expert_count(n_experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_vocab_size(cfg["vocab_size"])
        if arch == "qwen2moe":
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        if arch in DEEPSEEK:
            _deepseek_meta(w, cfg, legacy_mla)
        if arch == "deepseek32":
            w.add_nextn_predict_layers(mtp)
            w.add_indexer_head_count(cfg["index_n_heads"])
            w.add_indexer_key_length(cfg["index_head_dim"])
            w.add_indexer_top_k(cfg["index_topk"])
        if arch == "glm4moe":
            _glm4moe_meta(w, cfg, mtp)
        if arch == "phimoe":  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
            head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
            w.add_rope_dimension_count(head_dim)
            w.add_sliding_window(cfg.get("sliding_window") or 0)
            orig = longrope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
            w.add_rope_scaling_orig_ctx_len(orig)
            if longrope.get("long_factor"):
                w.add_rope_scaling_attn_factors(phimoe_attn_factor(cfg))
        if arch == "granitemoe":
            for key, hf in (
                ("attention.scale", "attention_multiplier"),
                ("embedding_scale", "embedding_multiplier"),
                ("residual_scale", "residual_multiplier"),
                ("logit_scale", "logits_scaling"),
            ):
                w.add_float32(f"{arch}.{key}", float(cfg[hf]))  # fmt: skip
        _add_tokenizer(w, hf_dir)

    paths = []
    chunks = np.array_split(np.arange(len(tensors)), split)
    for i, idx in enumerate(chunks):
        path = out if split == 1 else f"{out[: -len('.gguf')]}-{i + 1:05d}-of-{split:05d}.gguf"
        w = gguf.GGUFWriter(path, arch)
        if i == 0:
            add_meta(w)
        if split > 1:
            w.add_uint16("split.no", i)
            w.add_uint16("split.count", split)
            w.add_int32("split.tensors.count", len(tensors))
        for j in idx:
            name, arr = tensors[j]
            if values is not None:
                arr = values[name].numpy().reshape(arr.shape)
            _add_tensor(w, name, arr, qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(path)
    return paths


# Q4_K_M as llama.cpp's quantizer mixes it (llama-quant.cpp): Q4_K, with attn_v, ffn_down and the
# head in Q6_K (it does so in some layers; here in every one, so both mixes are exercised)
MIXES = {"Q4_K_M": ("Q4_K", ("attn_v.", "ffn_down", "output.", "ffn_down_exps"), "Q6_K")}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def _add_tensor(w: gguf.GGUFWriter, name: str, arr: np.ndarray, qtype: str) -> None:
    if qtype in MIXES:
        base, pieces, more = MIXES[qtype]
        qtype = more if any(p in name for p in pieces) else base
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if ".ffn_gate_inp" in name:  # llama.cpp never quantizes the router
        qtype = "F32"
    if qtype in K_QUANTS and arr.ndim > 1:
        if arr.shape[-1] % 256:  # llama.cpp falls back for rows that are not whole super-blocks
            qtype = "Q8_0"
        else:
            raw = quantize_k(arr.reshape(-1, arr.shape[-1]), qtype)
            w.add_tensor(name, raw.reshape(*arr.shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType[qtype])
            return
    t = gguf.GGMLQuantizationType[qtype]
    if arr.shape[-1] % gguf.GGML_QUANT_SIZES[t][0]:  # rows of part blocks: llama.cpp falls back too
        t = gguf.GGMLQuantizationType.F32
    if arr.ndim == 1 or t == gguf.GGMLQuantizationType.F32:
        w.add_tensor(name, arr)
    elif t == gguf.GGMLQuantizationType.F16:
        w.add_tensor(name, arr.astype(np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(arr, t), raw_dtype=t)


def _deepseek_meta(w: gguf.GGUFWriter, cfg: dict, legacy: bool = False) -> None:
    """deepseek2's keys as DeepseekV2Model.set_gguf_parameters writes them (and the base class's
    expert groups, gating function and YaRN keys)."""
    rank, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    w.add_leading_dense_block_count(cfg.get("first_k_dense_replace") or 0)
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    if legacy:  # MHA sizes, no *_mla keys
        w.add_key_length(cfg["qk_nope_head_dim"] + rope)
        w.add_value_length(cfg["v_head_dim"])
    else:
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope)
        w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg.get("n_shared_experts") or 0)
    w.add_expert_weights_scale(float(cfg["routed_scaling_factor"]))
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_expert_group_count(cfg.get("n_group") or 1)
    w.add_expert_group_used_count(cfg.get("topk_group") or 1)
    func = {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID, "softmax": gguf.ExpertGatingFuncType.SOFTMAX}
    w.add_expert_gating_func(func[cfg.get("scoring_func", "softmax")])
    w.add_rope_dimension_count(rope)
    yarn = cfg.get("rope_scaling") or {}
    if yarn.get("type", yarn.get("rope_type")) == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(yarn["factor"]))
        w.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(float(yarn["beta_fast"]))
        w.add_rope_scaling_yarn_beta_slow(float(yarn["beta_slow"]))
        w.add_rope_scaling_yarn_log_mul(0.1 * yarn["mscale_all_dim"])


def _glm4moe_meta(w: gguf.GGUFWriter, cfg: dict, mtp: int) -> None:
    """glm4moe's keys as Glm4MoeModel.set_gguf_parameters writes them."""
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 0.5)))
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_group_count(cfg.get("n_group") or 1)
    w.add_expert_group_used_count(cfg.get("topk_group") or 1)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(float(cfg["routed_scaling_factor"]))
    w.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
    w.add_nextn_predict_layers(mtp)


def phimoe_attn_factor(cfg: dict) -> float:
    """The attention factor llama.cpp's converter writes for LongRoPE (Phi3MiniModel)."""
    rope = cfg["rope_scaling"]
    orig = rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
    scale = cfg["max_position_embeddings"] / orig
    return math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0


def _add_tokenizer(w: gguf.GGUFWriter, hf_dir: str) -> None:
    """The byte-level BPE as llama.cpp's gpt2 tokenizer model (tokens, types, merges)."""
    tok = json.load(open(os.path.join(hf_dir, "tokenizer.json")))
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_unk_token_id(vocab["<unk>"])


def dequantized_state(paths: list[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF files dequantized by gguf's own library (the reference)."""
    out = {}
    for path in paths:
        for t in gguf.GGUFReader(path).tensors:
            out[t.name] = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    return out


def quantize_k(arr: np.ndarray, qtype: str) -> np.ndarray:
    """[rows, cols] float32 -> Q4_K / Q5_K / Q6_K blocks [rows, cols / 256 * bytes] uint8, in llama.cpp's
    field layout (the inverse of gguf/quants.py's dequantizers; gguf has no K-quant quantizer). A plain
    min/max rounding, not llama.cpp's search: the codes are valid, their choice is ours."""
    rows, cols = arr.shape
    x = arr.reshape(-1, 256).astype(np.float32)
    n = x.shape[0]

    def ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.divide(a, b, out=np.zeros_like(a), where=b != 0)

    if qtype in ("Q4_K", "Q5_K"):
        top = 15 if qtype == "Q4_K" else 31
        sub = x.reshape(n, 8, 32)
        lo, hi = np.minimum(sub.min(-1), 0), sub.max(-1)
        d = ((hi - lo) / top).max(-1, keepdims=True) / 63
        dmin = (-lo).max(-1, keepdims=True) / 63
        d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
        sc = np.clip(np.round(ratio((hi - lo) / top, d16.astype(np.float32))), 0, 63).astype(np.uint8)
        m = np.clip(np.round(ratio(-lo, dmin16.astype(np.float32))), 0, 63).astype(np.uint8)
        s = d16.astype(np.float32) * sc
        off = dmin16.astype(np.float32) * m
        q = np.clip(np.round(ratio(sub + off[..., None], s[..., None])), 0, top).astype(np.uint8)
        hi_sc, hi_m = sc[:, 4:], m[:, 4:]  # sub-blocks 4-7: low 4 bits packed, top 2 beside 0-3's
        scales = np.concatenate(
            [
                sc[:, :4] | ((hi_sc >> 4) << 6),
                m[:, :4] | ((hi_m >> 4) << 6),
                (hi_sc & 15) | ((hi_m & 15) << 4),
            ],
            axis=-1,
        )
        low = (q & 15).reshape(n, 4, 2, 32)
        qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
        parts = [d16.view(np.uint8), dmin16.view(np.uint8), scales]
        if qtype == "Q5_K":
            high = (q >> 4).reshape(n, 8, 32)
            parts.append(sum((high[:, j] << j) for j in range(8)).astype(np.uint8))
        return np.concatenate([*parts, qs], axis=-1).reshape(rows, -1)
    assert qtype == "Q6_K", qtype
    sub = x.reshape(n, 16, 16)
    s = np.abs(sub).max(-1) / 31
    d16 = (s.max(-1, keepdims=True) / 127).astype(np.float16)
    sc = np.clip(np.round(ratio(s, d16.astype(np.float32))), -128, 127).astype(np.int8)
    step = d16.astype(np.float32) * sc
    q = (np.clip(np.round(ratio(sub, step[..., None])), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    low, high = (q & 15).reshape(n, 2, 2, 64), (q >> 4).reshape(n, 2, 4, 32)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d16.view(np.uint8)], axis=-1).reshape(rows, -1)


# gpt-oss (conversion/gpt_oss.py, GptOssModel): the checkpoint's names -> llama.cpp's
GPT_OSS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp",
}  # fmt: skip


def mxfp4_to_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The checkpoint's MXFP4 blocks [..., G, 16] (byte k: value 2k in the low nibble, 2k + 1 in the
    high) and e8m0 scales [..., G] -> ggml's MXFP4 blocks [..., G * 17]: the scale byte, then byte
    j holding value j (low nibble) and value j + 16 (high), Q4_0's order. Written from the two
    layouts' definitions, not from the converter's bit shuffle (the opt-in test compares the two)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None], packed], axis=-1).astype(np.uint8)
    return out.reshape(*out.shape[:-2], -1)


def write_gpt_oss_gguf(hf_dir: str, out: str, qtype: str = "F32", experts: str | None = None) -> str:
    """A gpt-oss checkpoint (MXFP4 `*_blocks` / `*_scales` experts, or float `gate_up_proj`) as the
    converter writes it: gate_up split into ffn_gate_exps / ffn_up_exps (the even rows / columns are
    gate), MXFP4 experts repacked as ggml's MXFP4 (float ones in `experts`, default `qtype`), biases
    and sinks F32, attention matrices in `qtype`, the router F32; the converter's metadata."""
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    raw = {}
    for n in sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors")):
        raw.update(load_file(os.path.join(hf_dir, n)))
    w = gguf.GGUFWriter(out, "gpt-oss")
    gpt_oss_metadata(w, cfg, cfg["num_hidden_layers"])
    _add_tokenizer(w, hf_dir)

    def f32(name: str, t: torch.Tensor) -> None:
        _add_tensor(w, name, t.float().numpy(), "F32")

    _add_tensor(w, "token_embd.weight", raw.pop("model.embed_tokens.weight").float().numpy(), qtype)
    _add_tensor(w, "output_norm.weight", raw.pop("model.norm.weight").float().numpy(), "F32")
    _add_tensor(w, "output.weight", raw.pop("lm_head.weight").float().numpy(), qtype)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for piece, name in GPT_OSS.items():
            for kind in ("weight", "bias"):
                if p + f"{piece}.{kind}" in raw:
                    t = raw.pop(p + f"{piece}.{kind}").float().numpy()
                    _add_tensor(w, f"blk.{layer}.{name}.{kind}", t, qtype if t.ndim == 2 else "F32")
        f32(f"blk.{layer}.attn_sinks.weight", raw.pop(p + "self_attn.sinks"))
        e = p + "mlp.experts."
        gate_up_bias, down_bias = raw.pop(e + "gate_up_proj_bias"), raw.pop(e + "down_proj_bias")
        f32(f"blk.{layer}.ffn_gate_exps.bias", gate_up_bias[..., ::2])
        f32(f"blk.{layer}.ffn_up_exps.bias", gate_up_bias[..., 1::2])
        f32(f"blk.{layer}.ffn_down_exps.bias", down_bias)
        if e + "down_proj_blocks" in raw:  # MXFP4: [E, out, G, 16], gate_up's rows interleaved
            mx = gguf.GGMLQuantizationType.MXFP4
            for which, rows in (
                ("gate", slice(0, None, 2)),
                ("up", slice(1, None, 2)),
                ("down", slice(None)),
            ):
                stem = e + ("down_proj" if which == "down" else "gate_up_proj")
                b, s = raw[stem + "_blocks"][:, rows].numpy(), raw[stem + "_scales"][:, rows].numpy()
                w.add_tensor(f"blk.{layer}.ffn_{which}_exps.weight", mxfp4_to_ggml(b, s), raw_dtype=mx)
            for stem in ("gate_up_proj", "down_proj"):
                raw.pop(e + stem + "_blocks"), raw.pop(e + stem + "_scales")
        else:  # float experts [E, in, out]
            gate_up, down = raw.pop(e + "gate_up_proj").float(), raw.pop(e + "down_proj").float()
            for which, t in (("gate", gate_up[..., ::2]), ("up", gate_up[..., 1::2]), ("down", down)):
                arr = t.transpose(1, 2).contiguous().numpy()
                _add_tensor(w, f"blk.{layer}.ffn_{which}_exps.weight", arr, experts or qtype)
    assert not raw, f"tensors not written: {sorted(raw)}"
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# Llama 4 text (conversion/llama.py, Llama4Model): the checkpoint's names -> llama.cpp's
LLAMA4 = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "feed_forward.router": "ffn_gate_inp", "feed_forward.gate_proj": "ffn_gate",
    "feed_forward.up_proj": "ffn_up", "feed_forward.down_proj": "ffn_down",
    "feed_forward.shared_expert.gate_proj": "ffn_gate_shexp",
    "feed_forward.shared_expert.up_proj": "ffn_up_shexp",
    "feed_forward.shared_expert.down_proj": "ffn_down_shexp",
}  # fmt: skip


def llama3_rope_freqs(cfg: dict) -> np.ndarray:
    """The converter's rope_freqs for llama3 scaling (LlamaModel.generate_extra_tensors)."""
    rope, dim = cfg["rope_scaling"], cfg["head_dim"]
    freqs = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def write_llama4_gguf(hf_dir: str, out: str, qtype: str = "F32") -> str:
    """A Llama 4 text checkpoint as the converter writes it: fused experts [E, H, 2I] split into
    ffn_gate_exps / ffn_up_exps (gate the first half) and down [E, I, H] transposed, Q/K as they
    are, llama3 RoPE as the rope_freqs tensor, matrices in `qtype` (the router F32)."""
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    sd = _load_state(hf_dir)
    w = gguf.GGUFWriter(out, "llama4")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size_mlp"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_interleave_moe_layer_step(cfg["interleave_moe_layer_step"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    _add_tokenizer(w, hf_dir)
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg))
    _add_tensor(w, "token_embd.weight", sd.pop("model.embed_tokens.weight"), qtype)
    _add_tensor(w, "output_norm.weight", sd.pop("model.norm.weight"), "F32")
    if "lm_head.weight" in sd:
        _add_tensor(w, "output.weight", sd.pop("lm_head.weight"), qtype)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for piece, name in LLAMA4.items():
            if p + piece + ".weight" in sd:
                t = sd.pop(p + piece + ".weight")
                _add_tensor(w, f"blk.{layer}.{name}.weight", t, qtype if t.ndim == 2 else "F32")
        e = p + "feed_forward.experts."
        if e + "gate_up_proj" in sd:
            gate_up = sd.pop(e + "gate_up_proj").swapaxes(1, 2)  # [E, 2I, H]
            inter = gate_up.shape[1] // 2
            _add_tensor(w, f"blk.{layer}.ffn_gate_exps.weight", gate_up[:, :inter], qtype)
            _add_tensor(w, f"blk.{layer}.ffn_up_exps.weight", gate_up[:, inter:], qtype)
            _add_tensor(w, f"blk.{layer}.ffn_down_exps.weight", sd.pop(e + "down_proj").swapaxes(1, 2), qtype)
    assert not sd, f"tensors not written: {sorted(sd)}"
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
