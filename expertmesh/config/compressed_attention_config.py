"""DeepSeek-V4's attention and residual sizes, typed from config.json: part of ModelConfig.

What the config says beside the common fields: the per-layer attention kind (transformers folds
the published `compress_ratios` into `layer_types`: 0 sliding window only, 4 compressed sparse
attention with a lightning indexer, 128 heavily compressed), the compression rate of each
compressed kind (`compress_rates`), the RoPE of the compressed layers (`compress_rope_theta`
with the config's YaRN block; the sliding layers rotate by `rope_theta` unscaled), the q LoRA
rank, the grouped low-rank output projection (`o_groups` x `o_lora_rank`), the indexer
(`index_n_heads` x `index_head_dim`, `index_topk`), the hyper-connection residual (`hc_mult`
streams, `hc_sinkhorn_iters`, `hc_eps`) and the hash-routed leading MoE layers (`mlp_layer_types`
from the legacy `num_hash_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from expertmesh.config.rope_config import RopeConfig, opt_float

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
COMPRESSED_KINDS = (CSA, HCA)
MLP_KINDS = ("moe", "hash_moe")


@dataclass(frozen=True)
class CompressedAttentionConfig:
    q_lora_rank: int
    rope_dim: int  # the trailing dims of every head that rotate (qk_rope_head_dim)
    o_groups: int
    o_lora_rank: int
    compress_rates: tuple[tuple[str, int], ...]  # (layer kind, tokens per compressed entry)
    main_rope: RopeConfig  # sliding layers
    compress_rope: RopeConfig  # compressed layers, their compressors and indexer
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    scoring_func: str = "sqrtsoftplus"

    def __post_init__(self) -> None:
        for kind, rate in self.compress_rates:
            if kind not in COMPRESSED_KINDS or rate < 1:
                raise ValueError(f"compress_rates: {kind}={rate}; kinds {list(COMPRESSED_KINDS)}, rates >= 1")
        unknown = sorted(set(self.mlp_layer_types) - set(MLP_KINDS))
        if unknown:
            raise ValueError(f"mlp_layer_types {unknown} are not supported; supported: {list(MLP_KINDS)}")
        if self.hc_mult < 1 or self.o_groups < 1 or self.rope_dim % 2:
            raise ValueError(
                f"hc_mult={self.hc_mult} and o_groups={self.o_groups} must be >= 1, "
                f"qk_rope_head_dim={self.rope_dim} even"
            )

    def rate(self, kind: str) -> int:
        """Tokens per compressed entry of a layer kind; 0 for a sliding-only layer."""
        return dict(self.compress_rates).get(kind, 0)

    @classmethod
    def from_hf(cls, hf: Any, head_dim: int) -> CompressedAttentionConfig | None:
        if not getattr(hf, "hc_mult", None) or getattr(hf, "compress_rates", None) is None:
            return None
        rope_dim = int(getattr(hf, "qk_rope_head_dim", 0) or round(head_dim * hf.partial_rotary_factor))
        params = getattr(hf, "rope_parameters", None) or {}
        main, compress = params.get("main") or {}, params.get("compress") or {}

        def rope(p: dict, theta: float) -> RopeConfig:
            kind = str(p.get("rope_type", p.get("type", "default")))
            original = p.get("original_max_position_embeddings")
            return RopeConfig(
                rope_type=kind, theta=float(p.get("rope_theta", theta)), head_dim=rope_dim,
                interleaved=True, max_position_embeddings=int(hf.max_position_embeddings),
                factor=opt_float(p.get("factor")), attention_factor=opt_float(p.get("attention_factor")),
                original_max_position_embeddings=int(original) if original else None,
                beta_fast=opt_float(p.get("beta_fast")), beta_slow=opt_float(p.get("beta_slow")),
                truncate=bool(p.get("truncate", True)),
            )  # fmt: skip

        layers = int(hf.num_hidden_layers)
        return cls(
            q_lora_rank=int(hf.q_lora_rank),
            rope_dim=rope_dim,
            o_groups=int(hf.o_groups),
            o_lora_rank=int(hf.o_lora_rank),
            compress_rates=tuple((k, int(v)) for k, v in dict(hf.compress_rates).items()),
            main_rope=rope(main, float(hf.rope_theta)),
            compress_rope=rope(compress, float(getattr(hf, "compress_rope_theta", hf.rope_theta))),
            index_heads=int(getattr(hf, "index_n_heads", 0) or 0),
            index_head_dim=int(getattr(hf, "index_head_dim", 0) or 0),
            index_topk=int(getattr(hf, "index_topk", 0) or 0),
            hc_mult=int(hf.hc_mult),
            hc_sinkhorn_iters=int(hf.hc_sinkhorn_iters),
            hc_eps=float(hf.hc_eps),
            mlp_layer_types=tuple(getattr(hf, "mlp_layer_types", None) or ("moe",) * layers)[:layers],
            scoring_func=str(getattr(hf, "scoring_func", "sqrtsoftplus")),
        )
