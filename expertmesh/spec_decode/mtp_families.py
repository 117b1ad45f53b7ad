"""The families whose MTP layer spec_decode/mtp.py builds (tested in tests/test_spec_mtp.py); kept apart
so the config check needs no model code."""

MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
