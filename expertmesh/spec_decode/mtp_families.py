"""The families whose MTP layer spec_decode/mtp.py builds (tested in tests/test_spec_mtp.py); kept apart
so the config check needs no model code."""

# Hybrids whose MTP layer (stored as mtp.*) is a full-attention decoder layer over fc([embed; hidden]).
QWEN_MTP = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")

MTP_ARCHITECTURES = (
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
    "DeepseekV32ForCausalLM",  # MLA with DSA's indexer: the MTP layer caches both
    "GlmMoeDsaForCausalLM",  # GLM-5: DeepSeek-V3.2's blocks
    *QWEN_MTP,
)

# Qwen3-Next's MTP names (vLLM's qwen3_next_mtp.py) -> DeepSeek's (model.layers.{n}.*: the loader's
# canonical form of an MTP layer); its head is the target's lm_head, its output normed.
QWEN_MTP_NAMES = (
    ("mtp.fc.", "eh_proj."),
    ("mtp.pre_fc_norm_embedding.", "enorm."),
    ("mtp.pre_fc_norm_hidden.", "hnorm."),
    ("mtp.norm.", "shared_head.norm."),
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
