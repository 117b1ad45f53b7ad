"""The model's half of the frozen configs: ModelConfig (and its rope block), typed, from config.json.

Family-neutral: every field is a value the published config.json states (or its transformers
class defaults). Which building blocks a family uses (norm kind, router, q/k norm, ...) is the
family's declaration (models/family.py); the decoder combines the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from expertmesh.config.compressed_attention_config import COMPRESSED_KINDS, CompressedAttentionConfig
from expertmesh.config.linear_attention_config import LinearAttentionConfig, Mamba2Config
from expertmesh.config.mla_config import MLAConfig
from expertmesh.config.rope_config import RopeConfig, opt_float

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None) -> torch.dtype:
    """vLLM's rule: "auto" takes the checkpoint's dtype (float32 when it names none)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype={dtype} is not supported; use one of float32, bfloat16, float16")
        return dtype
    if dtype == "auto":
        return _DTYPES.get(str(checkpoint_dtype or "float32").replace("torch.", ""), torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use 'auto' or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _eos_ids(hf: Any) -> tuple[int, ...]:
    eos = getattr(hf, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


# linear_attention: a recurrent layer (hybrid families; ModelConfig.linear_attn / .mamba have its
# sizes); moe and mlp: a layer that is only an MoE block or a dense MLP (Nemotron-H's one block a
# layer, its hybrid_override_pattern's E and -); indexed_attention: full attention through DeepSeek
# Sparse Attention's indexer (MLAConfig.index_topk); compressed_sparse_attention and
# heavily_compressed_attention: DeepSeek-V4's sliding window plus compressed entries
# (CompressedAttentionConfig)
LAYER_TYPES = (
    "full_attention",
    "sliding_attention",
    "chunked_attention",
    "linear_attention",
    "indexed_attention",
    *COMPRESSED_KINDS,
    "moe",
    "mlp",
)


@runtime_checkable
class WeightFormat(Protocol):
    """What ModelConfig.quantization holds: a checkpoint's format (layers/quantization/registry.py
    CHECKPOINT_FORMATS), an online scheme (quantization/online.py), or the two together."""

    method: str  # the quant_method, or the online scheme's name
    online: bool  # dense weights quantized at load (an online scheme)
    holds_compressed: bool  # the checkpoint's codes held as stored (quantization/held.py)

    def describe(self) -> str: ...


def _quantization(hf: Any, text: Any, online: str | None) -> WeightFormat | None:
    """The checkpoint's weight format (its quantization_config, at the top level or in the text
    tower's config, where Kimi-K2.5 publishes its int4 experts' block) or the online scheme asked for."""
    # The weight formats live with the layers, above config/: imported when a config is built, so
    # importing config/ (engine arguments, --help) does not load them and they may import config/.
    from expertmesh.layers.quantization import resolve

    quant = getattr(hf, "quantization_config", None) or getattr(text, "quantization_config", None)
    return resolve(quant, online)


def _first(hf: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(hf, name, None)
        if value is not None:
            return value
    return default


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs to know about one checkpoint, family-neutral."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    dtype: torch.dtype = torch.float32
    hidden_act: str = "silu"
    rope: RopeConfig = field(default_factory=RopeConfig)
    # ---- attention
    qkv_bias: bool = False
    o_bias: bool = False
    lm_head_bias: bool = False
    use_qk_norm: bool = True  # the config's switch for a family's q/k norm (GLM, Llama 4)
    clip_qkv: float | None = None
    layer_types: tuple[str, ...] = ()  # per layer, LAYER_TYPES; () = every layer full attention
    sliding_window: int | None = None  # tokens a sliding layer sees, itself included
    attention_chunk_size: int | None = None  # chunked layers see their chunk only (Llama 4)
    rope_layers: tuple[bool, ...] = ()  # per layer: rotary or not (Llama 4's no_rope_layers); () = all
    attention_multiplier: float | None = None  # replaces head_dim ** -0.5 (Granite)
    attn_temperature: tuple[float, float] | None = None  # (floor_scale, attn_scale), NoPE layers
    mla: MLAConfig | None = None  # multi-head latent attention's sizes (DeepSeek); None: not MLA
    linear_attn: LinearAttentionConfig | None = None  # Gated DeltaNet sizes (Qwen3-Next, Qwen3.5)
    mamba: Mamba2Config | None = None  # Mamba2 sizes (Granite-4.0-H)
    compressed: CompressedAttentionConfig | None = None  # DeepSeek-V4's attention and residual
    # ---- MLP and experts
    num_experts: int = 0
    # zero-compute experts scored after the real ones (LongCat-Flash's zero_expert_num, "identity")
    identity_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    dense_intermediate_size: int = 0  # dense layers' MLP (intermediate_size_mlp for Llama 4)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str | None = None  # DeepSeek's name of its selection rule ("greedy", ...)
    n_group: int = 1
    topk_group: int = 1
    router_jitter_noise: float = 0.0
    shared_expert_intermediate_size: int = 0
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    first_k_dense_replace: int = 0
    moe_layers: tuple[int, ...] | None = None  # explicit MoE layer list (Llama 4)
    moe_layer_freq: int = 1
    # ---- scalars
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0  # logits are divided by it
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers stored after the last one
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # ---- weights: the checkpoint's format (layers/quantization: fp8, mxfp4) or an online scheme
    # (int8, int4, fp8, w8a8, w4a8) from LLM(quantization=...); None: unquantized
    quantization: WeightFormat | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.num_experts and not 1 <= self.top_k <= self.num_experts + self.identity_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be in [1, {self.num_experts + self.identity_experts}]"
            )
        if self.num_experts and (self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group):
            raise ValueError(
                f"n_group={self.n_group} must divide n_routed_experts={self.num_experts} and "
                f"topk_group={self.topk_group} must be in [1, n_group]"
            )
        self._check_per_layer()

    def _check_per_layer(self) -> None:
        for name in ("layer_types", "rope_layers"):
            values = getattr(self, name)
            if values and len(values) != self.num_layers:
                raise ValueError(f"{name} has {len(values)} entries for num_hidden_layers={self.num_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported; supported: {list(LAYER_TYPES)}")
        if "linear_attention" in self.layer_types and self.linear_attn is None and self.mamba is None:
            raise ValueError(
                "layer_types ['linear_attention'] are not supported without a recurrent layer's sizes in "
                "the config (Gated DeltaNet: linear_num_key_heads, ...; Mamba2: mamba_n_heads, ...)"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but the config has no sliding_window")
        if "indexed_attention" in self.layer_types and not (self.mla and self.mla.index_topk):
            raise ValueError("layer_types has indexed_attention layers but the config has no index_topk")
        if set(COMPRESSED_KINDS) & set(self.layer_types) and self.compressed is None:
            raise ValueError("layer_types has compressed attention layers but the config has no hc_mult")
        if "chunked_attention" in self.layer_types and not self.attention_chunk_size:
            raise ValueError("layer_types has chunked_attention layers but no attention_chunk_size")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Every config's rule at once; each key defaults to a no-op."""
        if self.moe_layers is not None and layer not in self.moe_layers:
            return False
        if "moe" in self.layer_types:  # one block a layer: the pattern says which are MoE
            return self.is_moe and self.layer_types[layer] == "moe"
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % max(self.decoder_sparse_step, 1) == 0
            and layer >= self.first_k_dense_replace
            and layer % max(self.moe_layer_freq, 1) == 0
        )

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else "full_attention"

    def uses_rope(self, layer: int) -> bool:
        return self.rope_layers[layer] if self.rope_layers else True

    @classmethod
    def from_hf(
        cls, hf: Any, dtype: str | torch.dtype = "auto", quantization: str | None = None
    ) -> ModelConfig:
        archs = getattr(hf, "architectures", None) or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf  # Llama 4's text tower
        quant = _quantization(hf, text, quantization)
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        checkpoint_dtype = _first(hf, "dtype", "torch_dtype")
        return cls(
            architecture=archs[0],
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            # LongCat-Flash states num_layers; its num_hidden_layers counts attention blocks (2 a layer)
            num_layers=int(_first(text, "num_layers", "num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=getattr(text, "intermediate_size", 0) or 0,
            max_position_embeddings=getattr(text, "max_position_embeddings", 2048),
            norm_eps=float(
                _first(text, "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", default=1e-5)
            ),
            dtype=resolve_dtype(dtype, str(checkpoint_dtype) if checkpoint_dtype else None),
            hidden_act=_first(text, "hidden_act", "mlp_hidden_act", default="silu"),  # Nemotron-H: mlp_
            rope=RopeConfig.from_hf(text, head_dim),
            tie_word_embeddings=bool(_first(text, "tie_word_embeddings", default=False))
            and bool(getattr(hf, "tie_word_embeddings", True)),
            bos_token_id=getattr(text, "bos_token_id", None),
            eos_token_ids=_eos_ids(text),
            quantization=quant,
            **_attention_fields(text),
            **_mlp_fields(text),
        )


def _attention_fields(hf: Any) -> dict:
    attention_bias = bool(getattr(hf, "attention_bias", False))
    sliding = getattr(hf, "sliding_window", None)
    if not getattr(hf, "use_sliding_window", True):
        sliding = None
    layer_types = tuple(getattr(hf, "layer_types", None) or ())
    if not layer_types and sliding:  # one window for every layer (Mixtral, PhiMoE, Qwen3-MoE)
        layer_types = ("sliding_attention",) * hf.num_hidden_layers
    no_rope = getattr(hf, "no_rope_layers", None)  # Llama 4: 1 = this layer uses RoPE
    if getattr(hf, "position_embedding_type", None) == "nope":  # Granite-4.0-H: no layer rotates
        no_rope = [0] * hf.num_hidden_layers
    tuning = None
    if getattr(hf, "attn_temperature_tuning", False):
        tuning = (float(hf.floor_scale), float(hf.attn_scale))
    multiplier = getattr(hf, "attention_multiplier", None)
    return dict(
        qkv_bias=bool(getattr(hf, "qkv_bias", attention_bias)),
        o_bias=attention_bias,
        lm_head_bias=bool(getattr(hf, "lm_head_bias", False)),
        use_qk_norm=bool(getattr(hf, "use_qk_norm", True)),
        clip_qkv=opt_float(getattr(hf, "clip_qkv", None)),
        layer_types=layer_types,
        sliding_window=int(sliding) if sliding else None,
        attention_chunk_size=getattr(hf, "attention_chunk_size", None),
        rope_layers=tuple(bool(x) for x in no_rope) if no_rope else (),
        attention_multiplier=None if multiplier is None else float(multiplier),
        attn_temperature=tuning,
        mla=MLAConfig.from_hf(hf),
        linear_attn=LinearAttentionConfig.from_hf(hf),
        mamba=Mamba2Config.from_hf(hf),
        compressed=CompressedAttentionConfig.from_hf(
            hf, getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        ),
    )


def _identity_experts(hf: Any) -> int:
    """LongCat-Flash's zero_expert_num when its zero_expert_type is "identity" (the only kind its
    reference computes); 0 for every other config."""
    count = int(getattr(hf, "zero_expert_num", 0) or 0)
    kind = getattr(hf, "zero_expert_type", "identity")
    if count and kind != "identity":
        raise ValueError(f"zero_expert_type={kind!r} is not supported; supported: 'identity'")
    return count


def _mlp_fields(hf: Any) -> dict:
    inter = getattr(hf, "intermediate_size", 0) or 0
    moe_inter = int(_first(hf, "moe_intermediate_size", default=inter) or 0)
    shared = _first(
        hf,
        "shared_expert_intermediate_size",
        "shared_intermediate_size",
        "moe_shared_expert_intermediate_size",  # Nemotron-H
        default=0,
    )
    if not shared and getattr(hf, "n_shared_experts", None):  # GLM, DeepSeek: n copies, fused
        shared = hf.n_shared_experts * moe_inter
    moe_layers = getattr(hf, "moe_layers", None)
    return dict(
        identity_experts=_identity_experts(hf),
        num_experts=int(_first(hf, "num_local_experts", "num_experts", "n_routed_experts", default=0)),
        top_k=int(getattr(hf, "num_experts_per_tok", 0) or 0),
        moe_intermediate_size=moe_inter,
        dense_intermediate_size=int(_first(hf, "intermediate_size_mlp", default=inter)),
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)),
        routed_scaling_factor=float(_first(hf, "routed_scaling_factor", default=1.0)),
        topk_method=getattr(hf, "topk_method", None),
        n_group=int(_first(hf, "n_group", default=1)),
        topk_group=int(_first(hf, "topk_group", default=1)),
        router_jitter_noise=float(getattr(hf, "router_jitter_noise", 0.0) or 0.0),
        shared_expert_intermediate_size=int(shared),
        swiglu_limit=float(_first(hf, "swiglu_limit", default=7.0)),
        swiglu_alpha=float(_first(hf, "swiglu_alpha", default=1.702)),
        decoder_sparse_step=int(getattr(hf, "decoder_sparse_step", 1) or 1),
        mlp_only_layers=tuple(getattr(hf, "mlp_only_layers", None) or ()),
        first_k_dense_replace=int(_first(hf, "first_k_dense_replace", default=0)),
        moe_layers=None if moe_layers is None else tuple(moe_layers),
        moe_layer_freq=int(_first(hf, "moe_layer_freq", default=1)),
        embedding_multiplier=float(_first(hf, "embedding_multiplier", default=1.0)),
        residual_multiplier=float(_first(hf, "residual_multiplier", default=1.0)),
        logits_scaling=float(_first(hf, "logits_scaling", default=1.0)),
        num_nextn_predict_layers=int(
            _first(
                hf,
                "num_nextn_predict_layers",
                "num_mtp_layers",
                "num_mtp_modules",
                "mtp_num_hidden_layers",  # Qwen3.5
                # Qwen3-Next's and LongCat-Flash's configs state none; their checkpoints ship one
                # (vLLM's default for both, 1)
                default=1 if getattr(hf, "model_type", None) in ("qwen3_next", "longcat_flash") else 0,
            )
        ),
    )
