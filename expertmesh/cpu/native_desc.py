"""The native decode descriptors: ctypes mirrors of csrc/decode_layers.c's structs, the model
dtypes its C shims serve, and the helpers that fill a descriptor's slots (entry addresses, held
structs, bias copies). Below both the decode driver (native_decode.py) and the weights that put
themselves into a descriptor (quantization/packed.py)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class LayerDesc(ctypes.Structure):
    """Mirror of decode_layer_desc (every field 8 bytes: no padding)."""

    _fields_ = [
        ("hidden", _I), ("eps", _D), ("residual_multiplier", _D), ("input_norm", _P),
        ("qkv_fn", _P), ("qkv_w", _P), ("qkv_bias", _P),
        ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
        ("q_norm", _P), ("k_norm", _P), ("qk_eps", _D), ("use_rope", _I),
        ("k_cache", _P), ("v_cache", _P), ("block_size", _I),
        ("scale", _D), ("window", _I), ("chunk", _I), ("sinks", _P),
        ("o_fn", _P), ("o_w", _P), ("o_bias", _P), ("post_norm", _P),
        ("router_fn", _P), ("router_w", _P), ("router_bias", _P),
        ("experts", _I), ("top_k", _I), ("renormalize", _I),
        ("w13", _P), ("w2", _P), ("inter", _I), ("act", _I), ("load", _P),
        ("experts_fn", _P), ("experts_w", _P),
    ]  # fmt: skip


class QWeightDesc(ctypes.Structure):
    """Mirror of q_weight_desc: a QuantizedWeight in a descriptor's GEMM slot (gemm_q_desc_*)."""

    _fields_ = [("kind", _I), ("codes", _P), ("scales", _P), ("offsets", _P), ("group", _I)]


class QExpertsDesc(ctypes.Structure):
    """Mirror of q_experts_desc: QuantizedExperts w13 and w2 in the experts slot (moe_q_desc_*)."""

    _fields_ = [
        ("kind", _I),
        ("w13_codes", _P), ("w13_scales", _P), ("w13_offsets", _P), ("w13_group", _I),
        ("w2_codes", _P), ("w2_scales", _P), ("w2_offsets", _P), ("w2_group", _I),
        ("limit", _D), ("alpha", _D), ("b13", _P), ("b2", _P),
    ]  # fmt: skip


SHIM_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the model dtypes decode_layers serves


class StepMeta(ctypes.Structure):
    """Mirror of decode_step_meta."""

    _fields_ = [
        ("tokens", _I), ("cos", _P), ("sin", _P), ("rotary", _I), ("interleaved", _I),
        ("slots", _P), ("block_tables", _P), ("context_lens", _P), ("width", _I), ("count_load", _I),
        ("positions", _P),
    ]  # fmt: skip


class ModelDesc(ctypes.Structure):
    """Mirror of decode_model_desc: a whole one-stage model whose every layer is native."""

    _fields_ = [
        ("hidden", _I), ("embed", _P), ("embed_rows", _I), ("embed_multiplier", _D),
        ("layers", _P), ("n_layers", _I), ("norm", _P), ("norm_eps", _D),
        ("head_fn", _P), ("head_w", _P), ("head_bias", _P), ("vocab", _I),
    ]  # fmt: skip


def c_entry(kernels: Any, name: str) -> int | None:
    """The address of a C entry point (a descriptor's function slot), None in builds without it."""
    fn = getattr(kernels.lib, name, None)
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


def held_struct(keep: list, struct: ctypes.Structure) -> int:
    """The address of a descriptor-time struct, held alive by `keep` (as the descriptor's tensors)."""
    keep.append(struct)
    return ctypes.addressof(struct)
