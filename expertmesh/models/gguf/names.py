"""llama.cpp's tensor names -> the HF checkpoint names each family's loader expects.

Per architecture `PIECES[arch]` = ({llama.cpp piece: HF piece}, {stacked expert piece: (HF MoE
block, per-expert projection)}); `blk.N.<piece>.<weight|bias>` becomes
`model.layers.N.<HF piece>.<weight|bias>`, a stacked `[E, out, in]` expert tensor one name per
expert. Names checked against llama.cpp's own convert_hf_to_gguf.py.
"""

from __future__ import annotations

import re

BLOCK = re.compile(r"^blk\.(\d+)\.([\w.]+)\.(weight|bias)$")  # pieces may be dotted: indexer.attn_k
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

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
    "granite": {"ffn_gate_exps": ("block_sparse_moe", "gate_proj"),
                "ffn_up_exps": ("block_sparse_moe", "up_proj"),
                "ffn_down_exps": ("block_sparse_moe", "down_proj")},
}  # fmt: skip
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
PIECES = {
    "deepseek2": ({**_ATTN, **_MLA, **_DS_MOE}, _EXPERTS["qwen"]),
    "deepseek32": ({**_ATTN, **_MLA, **_DS_MOE, **_INDEXER}, _EXPERTS["qwen"]),
    "glm4moe": ({**_ATTN, **_DS_MOE, "post_attention_norm": "post_attention_layernorm"}, _EXPERTS["qwen"]),
    "qwen2moe": ({**_ATTN, **_QWEN}, _EXPERTS["qwen"]),
    "qwen3moe": ({**_ATTN, **_QWEN}, _EXPERTS["qwen"]),
    "olmoe": ({**_ATTN, **_QWEN}, _EXPERTS["qwen"]),
    # the converter splits Granite's fused input_linear into gate and up: served per expert
    "granitemoe": ({**_ATTN, "ffn_gate_inp": "block_sparse_moe.gate"}, _EXPERTS["granite"]),
    # gpt-oss (conversion/gpt_oss.py): the checkpoint's interleaved gate_up_proj split into
    # ffn_gate_exps / ffn_up_exps (weights per expert here; their biases re-interleaved into
    # gate_up_proj_bias: tensors.GateUpBias), the sinks a tensor of their own (no .weight in HF)
    "gpt-oss": (
        {
            **_ATTN,
            "post_attention_norm": "post_attention_layernorm",
            "ffn_gate_inp": "mlp.router",
            "attn_sinks": "self_attn.sinks",
        },
        _EXPERTS["qwen"],
    ),
    # Llama 4 text (conversion/llama.py, Llama4Model): Q/K not permuted (its RoPE already rotates
    # pairs); dense layers' ffn_gate / up / down where interleave_moe_layer_step leaves no MoE
    "llama4": (
        {
            **_ATTN,
            **{k: v.replace("mlp.", "feed_forward.") for k, v in _ATTN.items() if k.startswith("ffn_")},
            "ffn_gate_inp": "feed_forward.router",
            "ffn_gate_shexp": "feed_forward.shared_expert.gate_proj",
            "ffn_up_shexp": "feed_forward.shared_expert.up_proj",
            "ffn_down_shexp": "feed_forward.shared_expert.down_proj",
        },
        {k: ("feed_forward", proj) for k, (_, proj) in _EXPERTS["qwen"].items()},
    ),
}
# gpt-oss's expert biases: llama.cpp piece -> the checkpoint's fused bias (gate and up interleaved)
FUSED_BIAS = {"ffn_gate_exps": "gate_up_proj_bias", "ffn_up_exps": "gate_up_proj_bias",
              "ffn_down_exps": "down_proj_bias"}  # fmt: skip


def pieces_of(arch: str) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """The family's name map; llama (and Mixtral, written as llama) when it has none of its own."""
    return PIECES.get(arch) or ({**_ATTN, "ffn_gate_inp": "block_sparse_moe.gate"}, _EXPERTS["llama"])


def piece_of(name: str) -> str:
    m = BLOCK.match(name)
    return m.group(2) if m else ""


def mtp_block(name: str, layers: int | None) -> bool:
    """A block past the main layers: the MTP block the converter appends (glm4moe, deepseek32)."""
    m = re.match(r"^blk\.(\d+)\.", name)
    return bool(m and layers is not None and int(m.group(1)) >= layers)
