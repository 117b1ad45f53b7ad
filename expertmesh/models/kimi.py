"""Kimi-K2.5 (KimiK25ForConditionalGeneration): its text tower is DeepSeek-V3's (MLA, sigmoid
router with a correction bias, a plain shared expert, one dense leading layer, YaRN x64), stored
under `language_model.`; the MoonViT vision tower and its projector are skipped by a named rule
(expertmesh serves text). Kimi-K2's own config (`model_type: "kimi_k2"`) is read as DeepSeek-V3
(config/hf_config.py) and served by DeepseekV3ForCausalLM."""

from dataclasses import replace

from expertmesh.models.decoder import CausalLM
from expertmesh.models.deepseek import DeepseekV3ForCausalLM

V3 = DeepseekV3ForCausalLM.family


class KimiK25ForConditionalGeneration(CausalLM):
    family = replace(
        V3,
        names=replace(
            V3.names,
            prefix="language_model.",
            skip=(
                (
                    "vision tower and projector (expertmesh serves text)",
                    r"^(vision_tower|mm_projector)\.",
                ),
            ),
        ),
    )
