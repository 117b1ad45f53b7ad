"""Dense Llama: the sanity model (no experts, gated MLP)."""

from expertmesh.models.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    pass
