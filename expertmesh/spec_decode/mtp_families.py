"""The families whose MTP layer spec_decode/mtp.py builds (tested in tests/test_spec_mtp.py and
tests/test_spec_mtp_2026.py), and how their checkpoints name it; kept apart so the config check
needs no model code."""

# Hybrids whose MTP layer (stored as mtp.*) is a full-attention decoder layer over fc([embed; hidden]).
QWEN_MTP = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
# LongCat-Flash (model.mtp.*, vLLM's longcat_flash_mtp.py): one MLA block and one dense MLP (not the
# target's two-attention shortcut-MoE layer), its own embedding copy, the target's head.
LONGCAT_MTP = ("LongcatFlashForCausalLM",)
# DeepSeek-V4 (mtp.0.*, DeepSeek's inference/model.py MTPBlock): spec_decode/mtp_v4.py.
V4_MTP = ("DeepseekV4ForCausalLM",)
# MTP layers that predict through the target's lm_head and end in their own norm, which a chained
# draft step reads (DeepSeek's and GLM's carry shared_head.head and chain the un-normed output).
TARGET_HEAD_MTP = (*QWEN_MTP, *LONGCAT_MTP)

MTP_ARCHITECTURES = (
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
    "DeepseekV32ForCausalLM",  # MLA with DSA's indexer: the MTP layer caches both
    "GlmMoeDsaForCausalLM",  # GLM-5: DeepSeek-V3.2's blocks
    *QWEN_MTP,
    *LONGCAT_MTP,
    *V4_MTP,
)
# MTP layers whose checkpoint has no copy of the embedding: on a later pipeline stage (no target
# embedding there) the layer loads the target's.
NO_EMBEDDING_COPY = (*QWEN_MTP, *V4_MTP)

# Why a family that ships MTP layers has none built (named in the refusal).
MTP_NOT_BUILT = {
    "MiniMaxM2ForCausalLM": (
        "no public reference fixes its MTP modules' tensor names or data flow: transformers and vLLM "
        "skip them, and the one third-party reader assumes DeepSeek's layout without a published head "
        "to check it against"
    ),
}

# Qwen3-Next's MTP names (vLLM's qwen3_next_mtp.py) -> DeepSeek's (model.layers.{n}.*: the loader's
# canonical form of an MTP layer); its head is the target's lm_head, its output normed.
QWEN_MTP_NAMES = (
    ("mtp.fc.", "eh_proj."),
    ("mtp.pre_fc_norm_embedding.", "enorm."),
    ("mtp.pre_fc_norm_hidden.", "hnorm."),
    ("mtp.norm.", "shared_head.norm."),
)
# LongCat-Flash's (vLLM's longcat_flash_mtp.py name map), first match wins.
LONGCAT_MTP_NAMES = (
    ("model.mtp.layers.0.enorm.m.", "enorm."),
    ("model.mtp.layers.0.hnorm.m.", "hnorm."),
    ("model.mtp.layers.0.transformer_layer.mlp.", "mlp."),
    ("model.mtp.layers.0.", ""),
    ("model.mtp.norm.", "shared_head.norm."),
    ("model.mtp.embed_tokens.", "embed_tokens."),
)

# DeepSeek-V4's published names (mtp.0.*; vLLM's deepseek_v4_mtp.py reads the same), first match wins;
# the block's own names (attn.*, ffn.*, hc_attn_fn, ...) are the family's layer names.
V4_MTP_NAMES = (
    ("mtp.0.norm.", "shared_head.norm."),
    ("mtp.0.hc_head_fn", "hc_head.hc_fn"),
    ("mtp.0.hc_head_base", "hc_head.hc_base"),
    ("mtp.0.hc_head_scale", "hc_head.hc_scale"),
    ("mtp.0.", ""),
)


def qwen_mtp_key(key: str, num_layers: int) -> str | None:
    """A Qwen3-Next / Qwen3.5 `mtp.*` key as `model.layers.{num_layers + i}.*`; None for any other."""
    for old, new in QWEN_MTP_NAMES:
        if key.startswith(old):
            return f"model.layers.{num_layers}.{new}{key[len(old) :]}"
    if key.startswith("mtp.layers."):
        index, _, rest = key[len("mtp.layers.") :].partition(".")
        if index.isdigit():
            return f"model.layers.{num_layers + int(index)}.{rest}"
    return None


def mtp_checkpoint_key(architecture: str, key: str, num_layers: int) -> str | None:
    """A family's own MTP key (Qwen's `mtp.*`, LongCat's `model.mtp.*`, DeepSeek-V4's `mtp.0.*`) as
    DeepSeek-V3's `model.layers.{num_layers}.*`; None where the family stores its MTP layer that way
    already, or `key` is not an MTP key."""
    if architecture in QWEN_MTP:
        return qwen_mtp_key(key, num_layers)
    names = (
        LONGCAT_MTP_NAMES if architecture in LONGCAT_MTP else V4_MTP_NAMES if architecture in V4_MTP else ()
    )
    for old, new in names:
        if key.startswith(old):
            return f"model.layers.{num_layers}.{new}{key[len(old) :]}"
    return None
