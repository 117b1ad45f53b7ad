"""The families whose MTP layer spec_decode/mtp.py builds (tested in tests/test_spec_mtp.py and
tests/test_spec_mtp_2026.py): one declaration each, saying how its checkpoint names the layer and
how the layer runs; kept apart so the config check needs no model code."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class MTPFamily:
    """How one family's checkpoint stores its MTP layer and how the layer runs."""

    # The family's own MTP key -> DeepSeek-V3's `model.layers.{num_layers}.*` (None: not an MTP key);
    # None where the checkpoint stores the layer that way already.
    key_map: Callable[[str, int], str | None] | None = None
    # Predicts through the target's lm_head and ends in its own norm, which a chained draft step reads
    # (DeepSeek's and GLM's layers carry shared_head.head and chain the un-normed output).
    target_head: bool = False
    # A plain decoder layer with one dense MLP and its own embedding copy (LongCat-Flash: vLLM's
    # longcat_flash_mtp.py), not the target's MoE layer over the target's embedding.
    dense_layer: bool = False
    # The checkpoint has a copy of the embedding under the MTP layer; without one, a later pipeline
    # stage (no target embedding there) loads the target's.
    embedding_copy: bool = True
    # The layer class (spec_decode/mtp_v4.py MTP_LAYERS): "decoder" over the final hidden states,
    # "hyper_connections" over DeepSeek-V4's residual streams.
    layer: str = "decoder"


def prefix_map(names: tuple[tuple[str, str], ...]) -> Callable[[str, int], str | None]:
    """A key map from (checkpoint prefix, canonical suffix) pairs, first match wins."""

    def key_map(key: str, num_layers: int) -> str | None:
        for old, new in names:
            if key.startswith(old):
                return f"model.layers.{num_layers}.{new}{key[len(old) :]}"
        return None

    return key_map


_QWEN = MTPFamily(key_map=qwen_mtp_key, target_head=True, embedding_copy=False)

MTP_FAMILIES: dict[str, MTPFamily] = {
    "DeepseekV3ForCausalLM": MTPFamily(),
    "Glm4MoeForCausalLM": MTPFamily(),
    "DeepseekV32ForCausalLM": MTPFamily(),  # MLA with DSA's indexer: the MTP layer caches both
    "GlmMoeDsaForCausalLM": MTPFamily(),  # GLM-5: DeepSeek-V3.2's blocks
    # Hybrids whose MTP layer (stored as mtp.*) is a full-attention decoder layer over fc([embed; hidden]).
    "Qwen3NextForCausalLM": _QWEN,
    "Qwen3_5MoeForCausalLM": _QWEN,
    "Qwen3_5MoeForConditionalGeneration": _QWEN,
    "LongcatFlashForCausalLM": MTPFamily(
        key_map=prefix_map(LONGCAT_MTP_NAMES), target_head=True, dense_layer=True
    ),
    # DeepSeek's inference/model.py MTPBlock: spec_decode/mtp_v4.py.
    "DeepseekV4ForCausalLM": MTPFamily(
        key_map=prefix_map(V4_MTP_NAMES), embedding_copy=False, layer="hyper_connections"
    ),
}
MTP_ARCHITECTURES = tuple(MTP_FAMILIES)

# Why a family that ships MTP layers has none built (named in the refusal).
MTP_NOT_BUILT = {
    "MiniMaxM2ForCausalLM": (
        "no public reference fixes its MTP modules' tensor names or data flow: transformers and vLLM "
        "skip them, and the one third-party reader assumes DeepSeek's layout without a published head "
        "to check it against"
    ),
}


def mtp_family(architecture: str) -> MTPFamily:
    """The declaration of a family whose MTP layer is built (spec_decode/config.py refuses the others
    before any model code runs)."""
    return MTP_FAMILIES[architecture]


def mtp_checkpoint_key(architecture: str, key: str, num_layers: int) -> str | None:
    """A family's own MTP key (Qwen's `mtp.*`, LongCat's `model.mtp.*`, DeepSeek-V4's `mtp.0.*`) as
    DeepSeek-V3's `model.layers.{num_layers}.*`; None where the family stores its MTP layer that way
    already, or `key` is not an MTP key."""
    key_map = MTP_FAMILIES[architecture].key_map if architecture in MTP_FAMILIES else None
    return key_map(key, num_layers) if key_map is not None else None
