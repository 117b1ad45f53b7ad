"""One rank's engine from the user's arguments: what `LLM`, the mp workers and `serve` under
torchrun all build (the engine layer; nothing here knows the user-facing `LLM`).

`EngineArgs` (config/engine_args.py) holds vLLM's engine keywords; `build_engine` places this process
(one process, or one torchrun / mp-worker rank), loads the model and returns the rank's
`LLMEngine` with the `ModelEnv` its layers received.
"""

from __future__ import annotations

import logging
import os
from dataclasses import fields, replace
from typing import Any, NamedTuple

import torch
from transformers import AutoTokenizer

from expertmesh.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from expertmesh.config.engine_args import EngineArgs
from expertmesh.config.hf_config import load_hf_config
from expertmesh.config.model_source import resolve_model
from expertmesh.cpu.native_decode import set_native_decode
from expertmesh.distributed import watchdog
from expertmesh.distributed.fixed_sum import FIXED_CHUNKS
from expertmesh.distributed.launcher import check_model_fits, check_same_config, place_process
from expertmesh.distributed.model_env import ModelEnv
from expertmesh.distributed.moe_plan import MoEPlan
from expertmesh.engine.expert_load import ExpertLoad, read_initial_load
from expertmesh.engine.llm_engine import LLMEngine
from expertmesh.engine.model_runner import ModelRunner
from expertmesh.logger import setup_logging
from expertmesh.models.build import build_model, stage_layers
from expertmesh.spec_decode.config import SpeculativeConfig

log = logging.getLogger("expertmesh")


class BuiltEngine(NamedTuple):
    engine: LLMEngine
    model_env: ModelEnv


def check_deterministic(args: EngineArgs, model_config: ModelConfig) -> None:
    """deterministic=True (distributed/fixed_sum.py) serves dense weights only: refused by name."""
    q = model_config.quantization
    if args.deterministic and q is not None:
        raise ValueError(
            f"deterministic=True does not serve quantized weights: this model's are {q.describe()} "
            f"(quantization {q.method!r}); its fixed-order sums are written for dense bf16 / float32 "
            "weights. Load the unquantized checkpoint, or drop deterministic=True"
        )


def check_request(args: EngineArgs, model_dir: str) -> Any:
    """The checks that need no process group: sizes, names, heads against TP (before any spawn).
    Returns the transformers config it read (the tokenizer can take it)."""
    parallel = args.parallel_config()
    hf = load_hf_config(model_dir, args.trust_remote_code)
    model_config = ModelConfig.from_hf(hf, args.dtype, args.quantization)
    check_deterministic(args, model_config)
    check_model_fits(model_config, parallel)
    speculative_config(args, model_config, hf)
    return hf


def speculative_config(args: EngineArgs, model_config: ModelConfig, hf: Any) -> SpeculativeConfig | None:
    """args.speculative_config, checked against the model (an MTP method needs MTP layers)."""
    spec = SpeculativeConfig.of(args.speculative_config)
    if spec is not None:
        mtp = max(model_config.num_nextn_predict_layers, int(getattr(hf, "mtp_num_hidden_layers", 0) or 0))
        spec.check_model(model_config.architecture, mtp)
    return spec


def build_engine(args: EngineArgs) -> BuiltEngine:
    """Place this process, load its part of the model, and build its engine (every rank calls this)."""
    parallel = args.parallel_config()
    model_dir = resolve_model(args.model, args.revision)
    hf = load_hf_config(model_dir, args.trust_remote_code)
    model_config = ModelConfig.from_hf(hf, args.dtype, args.quantization)
    check_deterministic(args, model_config)
    check_model_fits(model_config, parallel)  # before any process group or weight
    spec = speculative_config(args, model_config, hf)
    placement = place_process(parallel, args.device, args.distributed_timeout_seconds)
    setup_logging(placement.rank if parallel.world_size > 1 else None)
    watchdog.set_doing("loading the model")
    dp_rank = placement.groups.layout.coords(placement.rank)[0]
    parallel = replace(parallel, rank=placement.rank, data_parallel_rank=dp_rank)
    cache = CacheConfig(
        args.block_size, args.gpu_memory_utilization, args.kv_cache_memory_bytes, args.enable_prefix_caching
    )
    batching = (args.max_num_seqs, args.max_num_batched_tokens, args.enable_chunked_prefill)
    config = _engine_config(
        model_dir, model_config, parallel, placement.device, args.max_model_len, cache, batching,
        args.tokenizer, args.seed,
    )  # fmt: skip
    config = replace(config, speculative_config=spec)
    settings = _describe(config, args.distributed_timeout_seconds)
    check_same_config(placement.groups, {**settings, "deterministic": repr(args.deterministic)})
    placement.groups.set_fixed_chunks(FIXED_CHUNKS if args.deterministic else 0)
    torch.manual_seed(args.seed)
    env = _model_env(config, placement, args.pipeline_split, args.debug_nan_recv_buffers)
    if parallel.enable_eplb:
        env.num_redundant_experts = parallel.eplb_config.num_redundant_experts
        env.initial_load = read_initial_load(parallel.eplb_config.load_path)
    net = build_model(
        config.model_config, env, model_dir, placement.device, args.allow_nonfinite_weights,
        mtp=spec is not None and spec.method == "mtp",
    )  # fmt: skip
    set_native_decode(net, args.native_decode)
    runner = ModelRunner(config, net, placement.groups)
    same_dir = config.tokenizer == model_dir  # then its config.json is the one read above
    tok = load_tokenizer(config.tokenizer, args.trust_remote_code, hf if same_dir else None)
    if placement.groups.world.world_size > 1:  # ranks load at their own pace: wait while they beat
        watchdog.current().barrier("model loaded")
    engine = LLMEngine(config, runner, placement.groups, tok, env.dispatchers)
    mc = config.model_config
    if mc.is_moe:
        load = ExpertLoad(net, env.moe_plan, placement.groups, mc.top_k, mc.num_experts)
        engine.expert_load = load.to(placement.device)
        load.configure(parallel.eplb_config if parallel.enable_eplb else None)
    if args.warmup:
        watchdog.set_doing("warming up")
        engine.warmup()
    log.info(
        "Loaded %s (%s) on rank %d of %d",
        config.model_config.architecture,
        model_dir,
        placement.rank,
        parallel.world_size,
    )
    return BuiltEngine(engine, env)


def _engine_config(
    model_dir: str, model_config: ModelConfig, parallel: ParallelConfig, device: str,
    max_model_len: int | None, cache: CacheConfig, batching: tuple[int, int | None, bool],
    tokenizer: str | None, seed: int,
) -> EngineConfig:  # fmt: skip
    """The frozen config of one rank's engine, from the checkpoint's config and the user's arguments."""
    max_len = _max_model_len(max_model_len, model_config)
    max_num_seqs, max_num_batched_tokens, chunked = batching
    # vLLM's default budget; without chunked prefill it must also hold a full-length prompt.
    budget = max_num_batched_tokens or (8192 if chunked else max(8192, max_len))
    return EngineConfig(
        model=model_dir,
        model_config=model_config,
        parallel_config=parallel,
        cache_config=cache,
        scheduler_config=SchedulerConfig(max_len, max_num_seqs, budget, chunked),
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


def _max_model_len(requested: int | None, mc: ModelConfig) -> int:
    if requested is None:
        return mc.max_position_embeddings
    if requested > mc.max_position_embeddings:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's "
            f"max_position_embeddings={mc.max_position_embeddings}"
        )
    return requested


def load_tokenizer(path: str, trust_remote_code: bool, hf_config: Any = None):
    """`hf_config`: the fixed config of `path` when the caller has read it already."""
    kwargs = {}
    if hf_config is not None:
        kwargs["config"] = hf_config
    elif os.path.isfile(os.path.join(path, "config.json")):
        try:  # AutoTokenizer reads config.json too: hand it the fixed one (config/hf_config.py)
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
        "all2all_backend", "expert_placement", "enable_eplb", "eplb_config",
    ):  # fmt: skip
        settings[name] = repr(getattr(pc, name))
    settings.update(seed=repr(config.seed), distributed_timeout_seconds=repr(timeout_s))
    settings["speculative_config"] = repr(config.speculative_config)
    return settings
