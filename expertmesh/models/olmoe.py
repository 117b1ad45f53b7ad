"""OLMoE: q/k RMSNorm over the whole projection (not per head), softmax top-k without
renormalisation (norm_topk_prob false in its config), optional q/k/v clipping (clip_qkv)."""

from expertmesh.models.decoder import CausalLM
from expertmesh.models.family import Family


class OlmoeForCausalLM(CausalLM):
    # transformers' OLMoE masks causally whatever the config says about windows.
    family = Family(router="softmax_topk", qk_norm="projection", sliding_window=False)
