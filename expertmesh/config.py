"""Frozen, typed configs built once from the HF config and the user's arguments.

Layers never see a raw HF config or an environment variable: everything they need is here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from expertmesh.distributed.layout import ParallelLayout

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


_ROPE_REQUIRED = {  # rope_type -> RopeConfig fields a published rope block must set
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding of one checkpoint: its rope block, typed (layers/rotary.py)."""

    rope_type: str = "default"
    theta: float = 10000.0
    head_dim: int = 64
    partial_rotary_factor: float = 1.0
    interleaved: bool = False  # GPT-J pairs (Llama 4, DeepSeek) instead of NeoX halves
    max_position_embeddings: int = 2048
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    short_mscale: float | None = None
    long_mscale: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None

    def __post_init__(self) -> None:
        from expertmesh.layers.rotary import ROPE_TYPES  # the registry lives with the code

        if self.rope_type not in ROPE_TYPES:
            known = sorted(ROPE_TYPES)
            raise ValueError(f"rope_type={self.rope_type!r} is not supported; supported: {known}")
        missing = [k for k in _ROPE_REQUIRED.get(self.rope_type, ()) if getattr(self, k) is None]
        if missing:
            raise ValueError(f"rope_type={self.rope_type!r} needs {missing} in the config's rope block")
        for name in ("short_factor", "long_factor"):
            values = getattr(self, name)
            if values is not None and len(values) != self.rotary_dim // 2:
                raise ValueError(
                    f"rope {name} has {len(values)} entries; rotary_dim={self.rotary_dim} needs "
                    f"{self.rotary_dim // 2}"
                )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} gives rotary_dim={self.rotary_dim} "
                f"for head_dim={self.head_dim}; it must be even and in [2, head_dim]"
            )

    @property
    def rotary_dim(self) -> int:
        """Dims rotated per head; `proportional` rotates all of them (some at frequency 0)."""
        if self.rope_type == "proportional":
            return self.head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, hf: Any, head_dim: int) -> RopeConfig:
        params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        original = params.get("original_max_position_embeddings") or getattr(
            hf, "original_max_position_embeddings", None
        )
        partial = params.get("partial_rotary_factor") or getattr(hf, "partial_rotary_factor", None) or 1.0
        lists = ("short_factor", "long_factor")
        factors = {k: tuple(float(v) for v in params[k]) for k in lists if k in params}
        floats = ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
        floats += ("short_mscale", "long_mscale", "low_freq_factor", "high_freq_factor")
        return cls(
            rope_type=str(params.get("rope_type", params.get("type", "default"))),
            theta=float(params.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0)),
            head_dim=head_dim,
            partial_rotary_factor=float(partial),
            interleaved=bool(getattr(hf, "rope_interleave", False)),
            max_position_embeddings=int(getattr(hf, "max_position_embeddings", 2048)),
            original_max_position_embeddings=int(original) if original else None,
            truncate=bool(params.get("truncate", True)),
            **{k: _opt_float(params.get(k)) for k in floats},
            **factors,
        )


def _eos_ids(hf: Any) -> tuple[int, ...]:
    eos = getattr(hf, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


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
    qkv_bias: bool = False
    o_bias: bool = False
    lm_head_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    router_jitter_noise: float = 0.0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, {self.num_experts}]")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % max(self.decoder_sparse_step, 1) == 0
        )

    @classmethod
    def from_hf(cls, hf: Any, dtype: str | torch.dtype = "auto") -> ModelConfig:
        archs = getattr(hf, "architectures", None) or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        num_experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or 0
        attention_bias = bool(getattr(hf, "attention_bias", False))
        sliding = getattr(hf, "sliding_window", None)
        if not getattr(hf, "use_sliding_window", True):
            sliding = None
        checkpoint_dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
        return cls(
            architecture=archs[0],
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=getattr(hf, "intermediate_size", 0) or 0,
            max_position_embeddings=getattr(hf, "max_position_embeddings", 2048),
            norm_eps=float(getattr(hf, "rms_norm_eps", None) or getattr(hf, "layer_norm_eps", 1e-5)),
            dtype=resolve_dtype(dtype, str(checkpoint_dtype) if checkpoint_dtype else None),
            hidden_act=getattr(hf, "hidden_act", "silu"),
            rope=RopeConfig.from_hf(hf, head_dim),
            qkv_bias=bool(getattr(hf, "qkv_bias", attention_bias)),
            o_bias=attention_bias,
            lm_head_bias=bool(getattr(hf, "lm_head_bias", False)),
            qk_norm=getattr(hf, "model_type", "") in ("qwen3_moe", "qwen3"),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            sliding_window=int(sliding) if sliding else None,
            num_experts=int(num_experts),
            top_k=int(getattr(hf, "num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(
                getattr(hf, "moe_intermediate_size", None) or getattr(hf, "intermediate_size", 0) or 0
            ),
            norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)),
            shared_expert_intermediate_size=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0),
            router_jitter_noise=float(getattr(hf, "router_jitter_noise", 0.0) or 0.0),
            decoder_sparse_step=int(getattr(hf, "decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(getattr(hf, "mlp_only_layers", None) or ()),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=_eos_ids(hf),
        )


ALL2ALL_BACKEND_NAMES = ("allgather_reducescatter", "naive", "alltoall")
EXECUTOR_BACKENDS = (None, "external_launcher", "mp", "uni")


@dataclass(frozen=True)
class ParallelConfig:
    """The user's parallel request. The derived rank layout and groups live in distributed/."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    all2all_backend: str = "allgather_reducescatter"
    distributed_executor_backend: str | None = None
    expert_placement: str = "contiguous"
    # Filled in by the launcher once the process knows where it sits.
    rank: int = 0
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        self.layout  # noqa: B018 -- builds the ParallelLayout, which validates the sizes
        if self.all2all_backend not in ALL2ALL_BACKEND_NAMES:
            raise ValueError(
                f"all2all_backend={self.all2all_backend!r} is unknown; valid: {list(ALL2ALL_BACKEND_NAMES)}"
            )
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend={self.distributed_executor_backend!r} is unknown; "
                f"valid: {list(EXECUTOR_BACKENDS)}"
            )
        if self.expert_placement not in ("contiguous", "round_robin"):
            raise ValueError(
                f"expert_placement={self.expert_placement!r} is unknown; valid: ['contiguous', 'round_robin']"
            )

    @property
    def layout(self) -> ParallelLayout:
        """The rank layout these sizes describe; every group is derived from it."""
        return ParallelLayout(
            self.data_parallel_size,
            self.pipeline_parallel_size,
            self.tensor_parallel_size,
            self.enable_expert_parallel,
        )

    @property
    def world_size(self) -> int:
        return self.layout.world_size


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be > 0")


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len}: a full-length prompt could never be scheduled "
                "(prefill is not chunked); raise it or lower max_model_len"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine was built from; `vllm_config` in vLLM's naming."""

    model: str
    model_config: ModelConfig
    parallel_config: ParallelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    tokenizer: str | None = None
    seed: int = 0
    device: str = "cpu"
    extra: dict = field(default_factory=dict)
