"""The families whose MTP layer spec_decode/mtp.py builds (tested in tests/test_spec_mtp.py); kept apart
so the config check needs no model code."""

MTP_ARCHITECTURES = (
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
    "DeepseekV32ForCausalLM",  # MLA with DSA's indexer: the MTP layer caches both
    "GlmMoeDsaForCausalLM",  # GLM-5: DeepSeek-V3.2's blocks
)
