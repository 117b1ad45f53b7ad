"""vLLM's offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence as Seq
from typing import Any

import torch

from expertmesh.config import EPLBConfig
from expertmesh.config.engine_args import EngineArgs
from expertmesh.config.model_source import resolve_model
from expertmesh.distributed import watchdog
from expertmesh.distributed.watchdog import DEFAULT_TIMEOUT_S
from expertmesh.engine import offline
from expertmesh.engine.builder import build_engine, check_request, load_tokenizer
from expertmesh.engine.client import EngineClient, EngineStepper
from expertmesh.outputs import RequestOutput
from expertmesh.sampling_params import SamplingParams

log = logging.getLogger("expertmesh")
PromptType = offline.PromptType


class LLM:
    """vLLM's offline entry point. The keywords are EngineArgs' fields (config/engine_args.py: each one's
    default and help text); tests/test_engine_args.py checks that this signature equals them."""

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        all2all_backend: str | None = None,
        expert_placement: str = "contiguous",
        enable_eplb: bool = False,
        num_redundant_experts: int | None = None,
        eplb_config: dict | EPLBConfig | None = None,
        distributed_executor_backend: str | None = None,
        dtype: str | torch.dtype = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = True,
        revision: str | None = None,
        device: str | None = None,
        pipeline_split: list[int] | None = None,
        debug_nan_recv_buffers: bool = False,
        distributed_timeout_seconds: float = DEFAULT_TIMEOUT_S,
        allow_nonfinite_weights: bool = False,
        quantization: str | None = None,
        native_decode: bool = True,
        # Offline, off by default: measured (benchmarks/bench_serving.py --offline-nowarmup), the first
        # generate ran as fast without it; `expertmesh serve` turns it on (its first requests).
        warmup: bool = False,
        speculative_config: dict | None = None,
        deterministic: bool = False,
    ) -> None:
        self._executor = None
        kwargs = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        args = EngineArgs.from_kwargs(kwargs)
        if distributed_executor_backend == "mp":
            # Every rank runs in a spawned worker; this process only hands out prompts.
            from expertmesh.executor.mp_executor import MPExecutor  # only this backend needs it

            model_dir = resolve_model(model, revision)  # a bad path fails here, before any spawn
            hf = check_request(args, model_dir)
            self._executor = MPExecutor({**kwargs, "model": model_dir})
            hf = None if tokenizer else hf  # another tokenizer directory has its own config.json
            self._tokenizer = load_tokenizer(tokenizer or model_dir, trust_remote_code, hf)
            return
        self.llm_engine, self.model_env = build_engine(args)
        self._ids = itertools.count()
        watchdog.set_doing("outside generate (in the user's script)")

    def is_replica_leader(self) -> bool:
        """The rank that speaks for its DP replica (first pipeline stage, TP rank 0)."""
        if self._executor is not None:
            return True  # the caller of an mp executor gets every replica's outputs
        return offline.is_replica_leader(self.llm_engine)

    def get_tokenizer(self):
        return self._tokenizer if self._executor is not None else self.llm_engine.tokenizer

    def engine_client(self) -> EngineClient:
        """The step-by-step interface the server drives (this process's engine, or the mp workers)."""
        if self._executor is not None:
            # the mp executor's side: loaded only with distributed_executor_backend="mp"
            from expertmesh.executor.driver_client import DriverClient

            return DriverClient(self._executor, self._tokenizer)
        return EngineStepper(self.llm_engine)

    @property
    def worker_pids(self) -> list[int]:
        """The mp executor's worker process ids, by rank (empty without one)."""
        return self._executor.pids if self._executor is not None else []

    def shutdown(self) -> None:
        """Stop the mp executor's workers now (otherwise: when this LLM is collected, or at exit)."""
        if self._executor is not None:
            self._executor.shutdown()

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = _per_prompt_params(sampling_params, len(prompts))
        # structured outputs hook: a schema, regex or grammar that does not compile is a ValueError now
        if any(getattr(p, "structured_outputs", None) is not None for p in params):
            from expertmesh.structured_outputs.runtime import check_params  # only for constrained prompts

            engine_vocab = (
                None if self._executor is not None else self.llm_engine.config.model_config.vocab_size
            )
            check_params(params, self.get_tokenizer(), engine_vocab or len(self._tokenizer))
        if self._executor is not None:
            return self._executor.generate(prompts, params)
        return offline.generate(self.llm_engine, prompts, params, self._ids, use_tqdm)

    @property
    def is_moe(self) -> bool:
        if self._executor is not None:
            return self._executor.is_moe
        return self.llm_engine.expert_load is not None

    def expert_load(self) -> dict[str, Any]:
        """Expert load statistics (engine/expert_load.py documents the dict): pairs routed to each
        expert per MoE layer (cumulative and last step), pairs each EP rank computed, imbalance
        (max / mean over EP ranks). The same on every rank; under torchrun every rank must call it."""
        if self._executor is not None:
            return self._executor.expert_load()
        if self.llm_engine.expert_load is None:
            raise ValueError(f"{self.llm_engine.config.model_config.architecture} has no MoE layers to count")
        return self.llm_engine.expert_load.snapshot()

    def all2all_stats(self, per_layer: bool = False) -> dict[str, Any]:
        """Bytes the MoE token exchange sent and received on this rank: totals over all MoE
        layers, the last engine step's totals, and (per_layer=True) one entry per MoE layer."""
        layers = [dict(b.stats) for b in self.model_env.dispatchers]
        total = {
            key: sum(int(s.get(key, 0)) for s in layers) for key in ("bytes_sent", "bytes_received", "calls")
        }
        total["last_step"] = dict(self.llm_engine.last_step_traffic)
        if per_layer:
            total["layers"] = layers
        return total


def _per_prompt_params(sp: Any, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts; pass one, or one per prompt")
    return sp
