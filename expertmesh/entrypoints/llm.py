"""vLLM's offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence as Seq
from dataclasses import fields, replace
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from expertmesh.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from expertmesh.distributed import watchdog
from expertmesh.distributed.moe_plan import MoEPlan
from expertmesh.distributed.watchdog import DEFAULT_TIMEOUT_S
from expertmesh.engine.client import EngineClient, EngineStepper
from expertmesh.engine.llm_engine import LLMEngine
from expertmesh.engine.model_runner import ModelRunner
from expertmesh.entrypoints.all2all_choice import choose_all2all_backend
from expertmesh.entrypoints.launcher import (
    check_model_fits,
    check_same_config,
    check_same_inputs,
    place_process,
)
from expertmesh.hf_config import load_hf_config
from expertmesh.logger import setup_logging
from expertmesh.model_source import resolve_model
from expertmesh.models.build import ModelEnv, build_model, stage_layers
from expertmesh.outputs import RequestOutput
from expertmesh.sampling_params import SamplingParams

log = logging.getLogger("expertmesh")
PromptType = str | dict[str, Any]


class LLM:
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
        distributed_executor_backend: str | None = None,
        dtype: str | torch.dtype = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enforce_eager: bool = True,
        revision: str | None = None,
        device: str | None = None,
        pipeline_split: list[int] | None = None,
        debug_nan_recv_buffers: bool = False,
        distributed_timeout_seconds: float = DEFAULT_TIMEOUT_S,
        allow_nonfinite_weights: bool = False,
        quantization: str | None = None,
    ) -> None:
        self._executor = None
        if not isinstance(distributed_timeout_seconds, (int, float)) or not distributed_timeout_seconds > 0:
            raise ValueError(
                f"distributed_timeout_seconds={distributed_timeout_seconds!r} must be a number > 0"
            )
        if distributed_executor_backend == "mp":
            # Every rank runs in a spawned worker; this process only hands out prompts.
            kwargs = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
            model_dir = resolve_model(model, revision)  # a bad path fails here, before any spawn
            self._executor = _start_mp_executor({**kwargs, "model": model_dir})
            self._tokenizer = _load_tokenizer(tokenizer or model_dir, trust_remote_code)
            return
        parallel = ParallelConfig(
            tensor_parallel_size,
            data_parallel_size,
            pipeline_parallel_size,
            enable_expert_parallel,
            choose_all2all_backend(all2all_backend),
            distributed_executor_backend,
            expert_placement,
        )
        model_dir = resolve_model(model, revision)
        model_config = ModelConfig.from_hf(load_hf_config(model_dir, trust_remote_code), dtype, quantization)
        check_model_fits(model_config, parallel)  # before any process group or weight
        placement = place_process(parallel, device, distributed_timeout_seconds)
        setup_logging(placement.rank if parallel.world_size > 1 else None)
        watchdog.set_doing("loading the model")
        dp_rank = placement.groups.layout.coords(placement.rank)[0]
        parallel = _with_rank(parallel, placement.rank, dp_rank)
        config = _engine_config(
            model_dir, model_config, parallel, placement.device, max_model_len,
            CacheConfig(block_size, gpu_memory_utilization, kv_cache_memory_bytes),
            max_num_seqs, max_num_batched_tokens, tokenizer, seed,
        )  # fmt: skip
        check_same_config(placement.groups, _describe(config, distributed_timeout_seconds))
        torch.manual_seed(seed)
        env = _model_env(config, placement, pipeline_split, debug_nan_recv_buffers)
        self.model_env = env
        model_config = config.model_config
        net = build_model(model_config, env, model_dir, placement.device, allow_nonfinite_weights)
        runner = ModelRunner(config, net, placement.groups)
        tok = _load_tokenizer(config.tokenizer, trust_remote_code)
        if placement.groups.world.world_size > 1:  # ranks load at their own pace: wait while they beat
            watchdog.current().barrier("model loaded")
        self.llm_engine = LLMEngine(config, runner, placement.groups, tok, env.dispatchers)
        self._ids = itertools.count()
        watchdog.set_doing("outside generate (in the user's script)")
        log.info(
            "Loaded %s (%s) on rank %d of %d",
            model_config.architecture,
            model_dir,
            placement.rank,
            parallel.world_size,
        )

    def is_replica_leader(self) -> bool:
        """The rank that speaks for its DP replica (first pipeline stage, TP rank 0)."""
        if self._executor is not None:
            return True  # the caller of an mp executor gets every replica's outputs
        groups = self.llm_engine.groups
        return groups.tp.rank_in_group == 0 and groups.pp.rank_in_group == 0

    def get_tokenizer(self):
        return self._tokenizer if self._executor is not None else self.llm_engine.tokenizer

    def engine_client(self) -> EngineClient:
        """The step-by-step interface the server drives (this process's engine, or the mp workers)."""
        if self._executor is not None:
            from expertmesh.executor.mp_client import MPEngineClient

            return MPEngineClient(self._executor, self._tokenizer)
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
        if self._executor is not None:
            return self._executor.generate(prompts, params)
        engine, order = self.llm_engine, []
        done: dict[str, RequestOutput] = {}
        watchdog.set_doing("in generate")
        try:  # whatever stops this call (an error, Ctrl-C) takes its requests out of the engine
            for prompt, sp in zip(prompts, params):
                order.append(self._add(str(next(self._ids)), prompt, sp))
            check_same_inputs(engine.groups, [engine.requests[r] for r in order], params)
            bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
            for out in engine.step_until_none_left():
                done[out.request_id] = out
                bar.update(1)
            bar.close()
        except BaseException:
            for rid in order:
                engine.abort_request(rid)
            raise
        finally:
            watchdog.set_doing("outside generate (in the user's script)")
        return [done[r] for r in order]

    def _add(self, rid: str, prompt: Any, params: SamplingParams) -> str:
        """Tokenize and queue one prompt; one that cannot be tokenized fails alone, with its error."""
        try:
            text, ids = self._tokenize(prompt)
        except Exception as exc:  # a bad prompt (or one the tokenizer chokes on) fails alone
            self.llm_engine.add_failed_request(rid, prompt if isinstance(prompt, str) else None, str(exc))
            return rid
        self.llm_engine.add_request(rid, ids, params, text)
        return rid

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, Any]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), prompt["prompt_token_ids"]  # checked by the engine
            if "prompt" not in prompt:
                raise ValueError(
                    f"a dict prompt needs 'prompt' or 'prompt_token_ids'; got keys {sorted(map(str, prompt))}"
                )
            prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt must be a str or a dict, got {type(prompt).__name__}")
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer; pass prompts as {'prompt_token_ids': [...]}")
        return prompt, tok(prompt)["input_ids"]

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


def _start_mp_executor(kwargs: dict[str, Any]):
    from expertmesh.executor.mp_executor import MPExecutor  # only this backend needs it

    # Check the parallel request here, before any process is spawned.
    parallel = ParallelConfig(
        kwargs["tensor_parallel_size"],
        kwargs["data_parallel_size"],
        kwargs["pipeline_parallel_size"],
        kwargs["enable_expert_parallel"],
        choose_all2all_backend(kwargs["all2all_backend"]),
        "mp",
        kwargs["expert_placement"],
    )
    hf = load_hf_config(kwargs["model"], kwargs["trust_remote_code"])
    check_model_fits(ModelConfig.from_hf(hf, kwargs["dtype"], kwargs.get("quantization")), parallel)
    return MPExecutor(kwargs)


def _engine_config(
    model_dir: str, model_config: ModelConfig, parallel: ParallelConfig, device: str,
    max_model_len: int | None, cache: CacheConfig, max_num_seqs: int, max_num_batched_tokens: int | None,
    tokenizer: str | None, seed: int,
) -> EngineConfig:  # fmt: skip
    """The frozen config of one rank's engine, from the checkpoint's config and the user's arguments."""
    max_len = _max_model_len(max_model_len, model_config)
    return EngineConfig(
        model=model_dir,
        model_config=model_config,
        parallel_config=parallel,
        cache_config=cache,
        scheduler_config=SchedulerConfig(max_len, max_num_seqs, max_num_batched_tokens or max(8192, max_len)),
        tokenizer=tokenizer or model_dir,
        seed=seed,
        device=device,
    )


def _model_env(config: EngineConfig, placement, pipeline_split: list[int] | None, poison: bool) -> ModelEnv:
    """What this rank's layers receive: groups, the MoE plan, its pipeline stage, the backend."""
    pc, groups = config.parallel_config, placement.groups
    return ModelEnv(
        groups,
        MoEPlan.decide(groups.layout, placement.rank),
        pc.all2all_backend,
        stage_layers(
            config.model_config.num_layers, pc.pipeline_parallel_size, groups.pp.rank_in_group, pipeline_split
        ),
        pc.expert_placement,
        poison_recv=poison,  # a wrong source shows at once as NaN
    )


def _with_rank(pc: ParallelConfig, rank: int, dp_rank: int) -> ParallelConfig:
    return replace(pc, rank=rank, data_parallel_rank=dp_rank)


def _max_model_len(requested: int | None, mc: ModelConfig) -> int:
    if requested is None:
        return mc.max_position_embeddings
    if requested > mc.max_position_embeddings:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's "
            f"max_position_embeddings={mc.max_position_embeddings}"
        )
    return requested


def _per_prompt_params(sp: Any, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts; pass one, or one per prompt")
    return sp


def _load_tokenizer(path: str, trust_remote_code: bool):
    kwargs = {}
    if os.path.isfile(os.path.join(path, "config.json")):
        try:  # AutoTokenizer reads config.json too: hand it the fixed one (hf_config.py)
            kwargs["config"] = load_hf_config(path, trust_remote_code)
        except (OSError, ValueError):  # a tokenizer_config.json may name its class without it
            pass
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer loaded from %s (%s); only token-id prompts will work", path, exc)
        return None


def _describe(config: EngineConfig, timeout_s: float) -> dict[str, str]:
    """Every setting all ranks must share, by name (so a mismatch can say which one differs)."""
    pc = config.parallel_config
    settings = {
        f"model_config.{f.name}": repr(getattr(config.model_config, f.name))
        for f in fields(config.model_config)
    }
    for name in ("cache_config", "scheduler_config"):
        part = getattr(config, name)
        settings.update({f.name: repr(getattr(part, f.name)) for f in fields(part)})
    for name in (
        "tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size", "enable_expert_parallel",
        "all2all_backend", "expert_placement",
    ):  # fmt: skip
        settings[name] = repr(getattr(pc, name))
    settings.update(seed=repr(config.seed), distributed_timeout_seconds=repr(timeout_s))
    return settings
