"""Build a model for one rank: its groups, MoE plan, pipeline stage and all2all backend."""

from __future__ import annotations

import logging

import torch

from expertmesh.config import ModelConfig
from expertmesh.cpu.ops import cpu_ops
from expertmesh.distributed.model_env import ModelEnv
from expertmesh.layers.ops import Ops
from expertmesh.layers.quantization.accounting import resident_weight_bytes
from expertmesh.layers.quantization.held import hold
from expertmesh.layers.torch_ops import TORCH_OPS
from expertmesh.models.loader import load_weights
from expertmesh.models.registry import model_class

log = logging.getLogger("expertmesh")


def stage_layers(num_layers: int, pp_size: int, pp_rank: int, split: list[int] | None = None) -> range:
    """Decoder layers of one pipeline stage: an even split (earlier stages one more), or `split`."""
    if num_layers < pp_size:
        raise ValueError(
            f"the model has {num_layers} decoder layers, fewer than pipeline_parallel_size={pp_size}"
        )
    if split is None:
        base, extra = divmod(num_layers, pp_size)
        split = [base + (1 if r < extra else 0) for r in range(pp_size)]
    if len(split) != pp_size or sum(split) != num_layers or min(split) < 1:
        raise ValueError(
            f"pipeline split {split} must give each of {pp_size} stages >= 1 of {num_layers} layers"
        )
    start = sum(split[:pp_rank])
    return range(start, start + split[pp_rank])


def build_model(
    cfg: ModelConfig,
    env: ModelEnv,
    model_dir: str,
    device: str = "cpu",
    allow_nonfinite_weights: bool = False,
    mtp: bool = False,
) -> torch.nn.Module:
    """`mtp`: also build and load the checkpoint's MTP layer (`model.mtp`, spec_decode/mtp.py)."""
    cls = model_class(cfg.architecture)
    with torch.device(device):
        model = cls(cfg, env)
        if mtp and env.is_last_stage:  # beside the final hidden states and the head
            from expertmesh.spec_decode.mtp_v4 import mtp_layer_class

            model.mtp = mtp_layer_class(cfg.architecture)(cfg, model.family, env, model.lm_head)
            model.mtp.attach(model)
    ops = select_ops(device, cfg.dtype, bool(env.groups.world.fixed_chunks))
    model.cpu_kernels = ops.library  # the runner lays out decode metadata for it (or not: None)
    # Compressed weights are quantized or packed as they load (one pass); the rest after.
    streamed = load_weights(model, model_dir, allow_nonfinite=allow_nonfinite_weights, ops=ops)
    # Modules that lay out loaded weights another way (MLA splits kv_b_proj per head) do it once,
    # before any weight is packed for a kernel.
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    scheme = cfg.quantization if cfg.quantization is not None and cfg.quantization.online else None
    held = _hold_quantized(model, ops) | streamed
    for module in model.modules():
        if id(module) in held:
            continue  # a quantized checkpoint's codes, held compressed as stored
        if scheme is not None and getattr(module, "quantizable", False):
            module.use_quantized(scheme, ops)  # compressed from here on, on any device
        elif hasattr(module, "use_ops"):
            module.use_ops(ops)
    counts = log_weight_bytes(model, cfg)
    slow = per_call_dequantize_warning(device, ops, cfg, counts)
    if slow is not None:
        log.warning(slow)
    return model.eval()


def select_ops(device: str, dtype: torch.dtype, deterministic: bool) -> Ops:
    """The one place that decides what computes this model's layers (layers/ops.py): on the CPU our
    compiled kernels where they build and serve the dtype (matmuls and routed experts, packed below
    or compressed while loading, RMSNorm, rotary + KV store, attention, native decode), else torch;
    torch on any other device."""
    return cpu_ops(dtype, deterministic) if device == "cpu" else TORCH_OPS


def per_call_dequantize_warning(
    device: str, ops: Ops, cfg: ModelConfig, counts: dict[str, int]
) -> str | None:
    """What to say when compressed weights have no kernel of ours to run them (a device other than
    the CPU, or no C compiler): QuantizedWeight's torch fallback dequantizes each weight per product."""
    if ops.runs_codes or not counts.get("quantized"):
        return None
    where = f"on {device}" if device != "cpu" else "without expertmesh's CPU kernels (no C compiler, or off)"
    q = cfg.quantization
    fix = (
        f"drop quantization={q.method!r} for dense weights"
        if getattr(q, "online", False)
        else "quantization='dequantize' dequantizes the checkpoint once at load instead"
    )
    return (
        f"{counts['quantized'] / 1e6:.1f} MB of quantized weights {where}: expertmesh's kernels for "
        f"their codes run on the CPU only, so each product dequantizes its weight per call (the memory "
        f"of the codes, slower than dense weights); {fix}"
    )


def _hold_quantized(model: torch.nn.Module, ops: Ops) -> set[int]:
    """Modules whose checkpoint codes were loaded as stored (layers/quantization/held.py) take them."""
    if getattr(model, "held_weights", None) is None:
        return set()
    return hold(model, model.held_weights, ops)


def _held_note(model: torch.nn.Module) -> str:
    held = getattr(model, "held_weights", None)
    if held is None or not held.params:
        return ""
    return f", held compressed as stored: {len(held.params)} parameters"


def log_weight_bytes(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, int]:
    """This rank's resident weight bytes, quantized and not (layers/quantization/accounting.py)."""
    counts = resident_weight_bytes(model)
    q = cfg.quantization
    log.info(
        "resident weights on this rank: %.1f MB (%.1f MB quantized%s, %.1f MB in %s)",
        counts["total"] / 1e6,
        counts["quantized"] / 1e6,
        f", {q.describe()}{_held_note(model)}" if q is not None else "",
        counts["dense"] / 1e6,
        str(cfg.dtype).replace("torch.", ""),
    )
    return counts
