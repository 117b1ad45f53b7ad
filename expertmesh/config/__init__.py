"""Frozen, typed configs built once from the HF config and the user's arguments.

Layers never see a raw HF config or an environment variable: everything they need is here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from expertmesh.config.model_config import ModelConfig, RopeConfig, resolve_dtype  # noqa: F401 -- re-exported
from expertmesh.distributed.layout import ParallelLayout
from expertmesh.spec_decode.config import SpeculativeConfig

ALL2ALL_BACKEND_NAMES = ("allgather_reducescatter", "naive", "alltoall")
EXECUTOR_BACKENDS = (None, "external_launcher", "mp", "uni")


@dataclass(frozen=True)
class EPLBConfig:
    """Expert-parallel load balancing, vLLM's `eplb_config` (docs/expert_parallel.md).

    num_redundant_experts: physical expert slots beyond the logical experts (replicas of the
    hottest). step_interval: rebalance online every this many forward passes (vLLM's default,
    3000; 0 = never, ours). window_size: a rebalance places the experts by the load of the last
    this many forward passes (vLLM's key; its default is 1000); None (ours): the load counted
    since the previous rebalance. load_path: an `--expert-stats` JSON file whose per-layer counts
    place the experts at start-up. log_balancedness: log each EP rank's share every
    log_balancedness_interval forward passes (a collective, as in vLLM). use_async and policy
    are vLLM's keys too: moves here are always synchronous (use_async=True logs that), and the
    policy is "default" (the placement rule in docs/expert_parallel.md).
    """

    num_redundant_experts: int = 0
    step_interval: int = 3000
    load_path: str | None = None
    window_size: int | None = None
    log_balancedness: bool = False
    log_balancedness_interval: int = 1
    use_async: bool = False
    policy: str = "default"

    def __post_init__(self) -> None:
        if not isinstance(self.num_redundant_experts, int) or self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts={self.num_redundant_experts!r} must be an int >= 0")
        if not isinstance(self.step_interval, int) or self.step_interval < 0:
            raise ValueError(f"eplb step_interval={self.step_interval!r} must be an int >= 0 (0 = never)")
        if self.window_size is not None and (not isinstance(self.window_size, int) or self.window_size < 1):
            raise ValueError(f"eplb window_size={self.window_size!r} must be an int >= 1 (or None)")
        if not isinstance(self.log_balancedness_interval, int) or self.log_balancedness_interval < 1:
            raise ValueError(
                f"eplb log_balancedness_interval={self.log_balancedness_interval!r} must be an int >= 1"
            )
        for name in ("log_balancedness", "use_async"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"eplb {name}={getattr(self, name)!r} must be true or false")
        if self.policy != "default":
            raise ValueError(f"eplb policy={self.policy!r} is not supported; supported: ['default']")

    @staticmethod
    def of(value: EPLBConfig | dict | None, num_redundant_experts: int | None = None) -> EPLBConfig:
        """From vLLM's `eplb_config` dict (or one of these); `num_redundant_experts` (vLLM's older
        top-level argument) overrides the dict's."""
        if value is None:
            value = {}
        if isinstance(value, dict):
            known = {f.name for f in fields(EPLBConfig)}
            bad = sorted(set(value) - known)
            if bad:
                raise ValueError(f"unknown eplb_config keys {bad}; valid: {sorted(known)}")
            value = EPLBConfig(**value)
        if not isinstance(value, EPLBConfig):
            raise TypeError(f"eplb_config must be a dict or an EPLBConfig, got {type(value).__name__}")
        if num_redundant_experts is not None:
            value = replace(value, num_redundant_experts=num_redundant_experts)
        return value


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
    enable_eplb: bool = False
    eplb_config: EPLBConfig = field(default_factory=EPLBConfig)
    # Filled in by the launcher once the process knows where it sits.
    rank: int = 0
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        self.layout  # noqa: B018 -- builds the ParallelLayout, which validates the sizes
        if self.all2all_backend not in ALL2ALL_BACKEND_NAMES:
            raise ValueError(
                f"all2all_backend={self.all2all_backend!r} is unknown; valid: {list(ALL2ALL_BACKEND_NAMES)}"
            )
        if self.all2all_backend == "alltoall" and not self.enable_expert_parallel:
            raise ValueError(
                "all2all_backend='alltoall' requires enable_expert_parallel=True (it sends each "
                "token to the ranks owning its experts; without expert parallelism every rank holds "
                "a slice of every expert); use 'allgather_reducescatter' or 'naive'"
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
        eplb = self.eplb_config
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb=True needs enable_expert_parallel=True (EPLB places whole experts)")
        if not self.enable_eplb and eplb != EPLBConfig():
            raise ValueError(f"eplb_config {eplb} is set but enable_eplb=False; pass enable_eplb=True")

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
    # vLLM's speculative_config (spec_decode/config.py); None: no speculation.
    speculative_config: SpeculativeConfig | None = None
