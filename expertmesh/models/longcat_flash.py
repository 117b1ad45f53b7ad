"""LongCat-Flash (LongcatFlashForCausalLM): each layer is two (MLA attention, dense MLP)
sublayers with one MoE branch beside them (models/decoder.py "shortcut_moe" layer; two KV cache
slots a layer). MLA with q LoRA, its queries and normed latent scaled by sqrt(hidden / rank)
(mla_scale_q_lora / mla_scale_kv_lora), RoPE in pairs. The MoE: 512 real experts plus
zero_expert_num identity experts (layers/identity_experts.py), a softmax router over all 768 with
a selection-only correction bias, top-12, weights times routed_scaling_factor, not renormalised.
The router is stored as mlp.router.classifier; the MTP module (model.mtp.*) drafts for speculative
decoding (spec_decode/mtp.py, names in mtp_families.py) and is skipped by a named rule otherwise."""

from expertmesh.models.checkpoint import GATE_UP, CheckpointNames
from expertmesh.models.decoder import CausalLM
from expertmesh.models.family import Family


class LongcatFlashForCausalLM(CausalLM):
    family = Family(
        layer="shortcut_moe",
        attention="mla",
        rope_interleaved=True,
        router="softmax_corrected",
        names=CheckpointNames(
            renames=((".mlp.router.classifier.", ".mlp.gate."), (".mlp.router.", ".mlp.gate.")),
            stacked=GATE_UP,
            skip=(("mtp module (loaded for speculative method mtp only)", r"^model\.mtp\."),),
        ),
    )
