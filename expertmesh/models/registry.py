"""Models by HF `architectures[0]`, imported lazily; an unknown name lists the known ones."""

from __future__ import annotations

import importlib

_MODELS: dict[str, tuple[str, str]] = {
    "PhimoeForCausalLM": ("phimoe", "PhimoeForCausalLM"),
    "PhiMoEForCausalLM": ("phimoe", "PhimoeForCausalLM"),  # spelling of Microsoft's own configs
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM"),
    "GraniteMoeForCausalLM": ("granitemoe", "GraniteMoeForCausalLM"),
    "GraniteMoeSharedForCausalLM": ("granitemoe", "GraniteMoeSharedForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granitemoe", "GraniteMoeHybridForCausalLM"),
    "Llama4ForCausalLM": ("llama4", "Llama4ForCausalLM"),
    "Llama4ForConditionalGeneration": ("llama4", "Llama4ForConditionalGeneration"),  # its text tower
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("deepseek", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("glm_moe_dsa", "GlmMoeDsaForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_next", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_next", "Qwen3_5MoeForConditionalGeneration"),  # its text
    "KimiK25ForConditionalGeneration": ("kimi", "KimiK25ForConditionalGeneration"),  # its text tower
    "MiniMaxM2ForCausalLM": ("minimax_m2", "MiniMaxM2ForCausalLM"),
    "NemotronHForCausalLM": ("nemotron_h", "NemotronHForCausalLM"),
    "LongcatFlashForCausalLM": ("longcat_flash", "LongcatFlashForCausalLM"),
    "DeepseekV4ForCausalLM": ("deepseek_v4", "DeepseekV4ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: {supported_architectures()}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(f"expertmesh.models.{module}"), name)
