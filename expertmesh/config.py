"""Frozen, typed configs built once from the HF config and the user's arguments.

Layers never see a raw HF config or an environment variable: everything they need is here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from expertmesh.distributed.layout import ParallelLayout
from expertmesh.model_config import ModelConfig, RopeConfig, resolve_dtype  # noqa: F401 -- re-exported

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
    # Full blocks keyed by their prefix and reused across requests (engine/block_manager.py).
    enable_prefix_caching: bool = True

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
    # Tokens one step computes, over all its sequences (engine/scheduler.py).
    max_num_batched_tokens: int = 8192
    # Split prompts longer than what is left of a step's budget over several steps.
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_num_seqs={self.max_num_seqs}: a step could not hold one decode of every "
                "running sequence; raise it or lower max_num_seqs"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len} with enable_chunked_prefill=False: a "
                "full-length prompt could never be scheduled; raise it, lower max_model_len or "
                "enable chunked prefill"
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
