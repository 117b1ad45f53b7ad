"""GLM-5 / GLM-5.1 (GlmMoeDsaForCausalLM): DeepSeek-V3.2's blocks at GLM's sizes: MLA (value
heads of 256) with DeepSeek Sparse Attention's lightning indexer in every layer (32 heads x 128;
its RoPE in pairs, as the config's indexer_rope_interleave says), a sigmoid router with a
correction bias in one group, a plain shared expert, dense leading layers. GLM's cross-layer
top-k sharing (indexer_types "shared") is refused by name: no published config turns it on."""

from expertmesh.models.decoder import CausalLM
from expertmesh.models.deepseek import DeepseekV32ForCausalLM


class GlmMoeDsaForCausalLM(CausalLM):
    family = DeepseekV32ForCausalLM.family
